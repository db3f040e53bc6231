"""`training_utils.sharding.text_encoders` (``--fsdp_text_encoder``): in this process, the flag's refusal without an
FSDP2 launch, the blocks picked, and a sharded encoder left in place; on two CPU processes (gloo, FSDP2), the tiny
FLUX.2 [klein]'s Qwen3 text encoder sharded (`text_encoder_sharding_job`). A whole script run with the flag is
`test_fsdp2`'s."""

import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from helpers import REPO, launch, launching
from training_utils.data.feature_store import encoders_on
from training_utils.errors import UsageError
from training_utils.parser import TrainingArgumentParser
from training_utils.sharding.fsdp2 import sharded_units
from training_utils.sharding.text_encoders import (add_fsdp_text_encoder_arg, is_sharded, repeated_blocks,
                                                   shard_text_encoders)

FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
JOB = REPO / "tests" / "text_encoder_sharding_job.py"


def test_the_flag_is_refused_in_one_line_without_an_fsdp2_launch(monkeypatch):
    parser = TrainingArgumentParser()
    add_fsdp_text_encoder_arg(parser)
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert parser.parse_args([]).fsdp_text_encoder is False
    with pytest.raises(UsageError, match=r"^--fsdp_text_encoder shards the text encoder with FSDP2: launch with "
                                         r"accelerate launch --use_fsdp --fsdp_version 2$"):
        parser.parse_args(["--fsdp_text_encoder"])
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert parser.parse_args(["--fsdp_text_encoder"]).fsdp_text_encoder is True


def test_the_repeated_blocks_are_those_of_no_split_modules_the_encoder_holds():
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=16))
    assert sorted(repeated_blocks(clip)) == ["CLIPEncoderLayer", "CLIPTextEmbeddings"]  # not CLIPVisionEmbeddings
    t5 = T5EncoderModel(T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
    assert repeated_blocks(t5) == ["T5Block"]
    assert repeated_blocks(torch.nn.Linear(2, 2)) == []


def test_an_unsharded_run_leaves_its_text_encoder_whole_and_says_so(caplog):
    encoder = torch.nn.Linear(2, 2)
    shard_text_encoders(type("Accelerator", (), {"is_fsdp2": True})(), [encoder], enabled=False)
    shard_text_encoders(type("Accelerator", (), {"is_fsdp2": False})(), [encoder], enabled=True)
    assert not is_sharded(encoder)
    assert "this run is not sharded (one process), so neither is its text encoder" in caplog.text


@pytest.fixture
def first_of_two():
    """This process as process 0 of 2 (a fake group: no other process, collectives do nothing)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fsdp2_accelerator(first_of_two, monkeypatch):
    """What `shard_text_encoders` reads of an accelerator on an FSDP2 launch, as process 0 of 2 (`first_of_two`)."""
    from training_utils.sharding.fsdp2 import fsdp2_plugin
    for name, value in FSDP2.items():
        monkeypatch.setenv(name, value)
    return type("Accelerator", (), {"is_fsdp2": True, "torch_device_mesh": None,
                                    "state": type("State", (), {"fsdp_plugin": fsdp2_plugin()})()})()


def test_a_sharded_encoder_still_gives_the_hidden_states_it_is_asked_for(fsdp2_accelerator):
    # transformers looks up what a model records by its class's name, which fully_shard changes (Z-Image's and
    # Lumina 2's pipelines read a hidden state of their encoder, a Qwen3Model and a Gemma2Model).
    from transformers import Qwen3Config, Qwen3Model

    encoder = Qwen3Model(Qwen3Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=4)).eval()
    shard_text_encoders(fsdp2_accelerator, [encoder], enabled=True)
    assert sharded_units({"text_encoder": encoder}) == {"Qwen3Model": 1, "Embedding": 1, "Qwen3DecoderLayer": 2}
    with torch.no_grad():
        output = encoder(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert output.hidden_states is not None and len(output.hidden_states) == 3


def test_token_embeddings_shard_as_a_unit_of_their_own_also_tied_to_the_output_layer(fsdp2_accelerator):
    # Ideogram 4's pipeline calls its encoder's token embeddings directly, outside the encoder's forward (its encoder
    # has no output layer), so they are a unit of their own; with the output layer where that shares their weight
    # (Qwen3-4B, FLUX.2 [klein]'s encoder).
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    config = Qwen3Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=4, tie_word_embeddings=True)
    called_whole, called_directly = Qwen3ForCausalLM(config).eval(), Qwen3Model(config).eval()
    assert called_whole.lm_head.weight is called_whole.get_input_embeddings().weight
    shard_text_encoders(fsdp2_accelerator, [called_whole, called_directly], enabled=True)
    # One unit, the embeddings and the output layer: both are FSDP modules.
    assert sharded_units({"text_encoder": called_whole}) == {"Qwen3ForCausalLM": 1, "Embedding": 1, "Linear": 1,
                                                             "Qwen3DecoderLayer": 2}
    with torch.no_grad():
        assert len(called_whole(input_ids=torch.tensor([[1, 2, 3]]), output_hidden_states=True).hidden_states) == 3
        assert called_directly.get_input_embeddings()(torch.tensor([[1, 2, 3]])).shape == (1, 3, 8)


def test_a_sharded_encoder_stays_where_fsdp2_put_it(first_of_two):
    from torch.distributed.fsdp import fully_shard
    sharded, whole = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    fully_shard(sharded, mesh=first_of_two)
    assert is_sharded(sharded) and not is_sharded(whole)
    moves = []
    for name, module in (("sharded", sharded), ("whole", whole)):
        module.to = lambda device, name=name: moves.append((name, device))
    with encoders_on("cuda", [sharded, whole]):
        assert moves == [("whole", "cuda")]
    assert moves == [("whole", "cuda"), ("whole", "cpu")]


@pytest.fixture(scope="module")
@launching
def job(tiny, tmp_path_factory):
    """The job's output folder."""
    output_dir = tmp_path_factory.mktemp("text_encoder_sharding")
    launch(JOB, tiny["flux2_klein"], output_dir, processes=2, env=FSDP2)
    return output_dir


@pytest.fixture(scope="module")
def processes(job):
    """What each of the job's two processes reported, in process order."""
    return [json.loads((job / f"process-{rank}.json").read_text()) for rank in range(2)]


def test_each_process_holds_about_half_of_the_encoder_in_units_of_its_layers(processes):
    for report in processes:
        assert 0 < report["held"] <= 0.55 * report["whole"], report
        assert report["units"] == {"Qwen3ForCausalLM": 1, "Embedding": 1, "Qwen3DecoderLayer": report["layers"]}
    assert sum(report["held"] for report in processes) == processes[0]["whole"]


def test_sharded_embeddings_equal_the_whole_encoders_bitwise_and_key_the_same_cache(processes):
    # The same inputs, the same whole weights gathered, the same kernels on one CPU: bitwise equal.
    for report in processes:
        assert report["described_as_whole"] and report["equal"] and report["equal_cached"], report
        assert report["equal_reused"] and report["calls_reused"] == 0, report


def test_every_process_makes_as_many_encoder_calls_as_the_busiest(processes):
    # Three chunks over two processes: two on process 0, one and a call to keep in step on process 1; each after
    # the one call that sizes an item.
    assert [report["calls"] for report in processes] == [3, 3]
    assert [report["calls_cached"] for report in processes] == [3, 3]
    # Process 0 planned no call, process 1 two: both make two.
    assert [report["lockstep_calls"] for report in processes] == [2, 2]
    assert all(report["lockstep_equal"] for report in processes)


def test_class_images_are_rendered_by_every_process_with_the_sharded_encoder(processes, job):
    assert [report["class_images"] for report in processes] == [2, 2]
    # The main process wrote them, the same images as the whole encoder's.
    whole = sorted((job / "class_whole").iterdir())
    assert [path.name for path in whole] == ["class-00000.png", "class-00001.png"]
    assert [path.read_bytes() for path in whole] == [path.read_bytes() for path in sorted((job / "class").iterdir())]
    # Each image: the prompt and the negative prompt (classifier-free guidance).
    assert [report["class_calls"] for report in processes] == [4, 4]
