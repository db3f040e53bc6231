"""The LoRA script on two CPU processes (gloo), on images of mixed shapes in aspect-ratio buckets: no hang, one
writer, a consistent EMA, exact resume, the encoding shared; and an adapter in peft's own format (OFT), sharded with
FSDP2, its EMA consistent."""

import json
import re
import shutil

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from helpers import FSDP2, launch_processes, launching, together
from training_utils.testing import rendered_images
from training_utils.testing.tiny.data import MIXED_SIZES, build_shapes

SCRIPT = "text_to_image/train_text_to_image_lora.py"
LORA = "pytorch_lora_weights.safetensors"
DECAY = 0.9


@pytest.fixture(scope="module")
def mixed_shapes(tmp_path_factory):
    """36 captioned images in the six `tiny.MIXED_SIZES`, in five buckets: 18 batches of 2, 9 steps an epoch on each
    process."""
    path = tmp_path_factory.mktemp("mixed_shapes")
    build_shapes(path, num_images=36, sizes=MIXED_SIZES)
    return path


def flags(tiny, data, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["sd"], "--train_data_dir", data, "--use_aspect_ratio_buckets",
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2, "--max_train_steps", 4,
            "--checkpointing_steps", 1, "--learning_rate", 1e-3, "--random_flip", "--use_ema", "--ema_decay", DECAY,
            "--seed", 3, "--report_to", "none", "--validation_prompt", "a red circle", "--num_validation_images", 1,
            "--validation_inference_steps", 2, "--validation_steps", 2, *extra]


def log_records(output_dir):
    return [json.loads(line) for line in (output_dir / "validation" / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
@launching
def two_process_run(tiny, mixed_shapes, tmp_path_factory):
    """The text embeddings cached on disk, in ``output_dir / "features"``."""
    output_dir, _ = launch_processes(
        SCRIPT, lambda: tmp_path_factory.mktemp("two_processes"),
        lambda output_dir: flags(tiny, mixed_shapes, output_dir, "--feature_cache_dir", output_dir / "features"))
    return output_dir


@pytest.fixture(scope="module")
@launching
def resumed_run(tiny, mixed_shapes, two_process_run, tmp_path_factory):
    """Resumed on two processes from the first run's checkpoint-2, keeping one checkpoint; the text embeddings
    cached in memory."""
    def prepare():
        output_dir = tmp_path_factory.mktemp("resumed")
        shutil.copytree(two_process_run / "checkpoint-2", output_dir / "checkpoint-2")
        return output_dir

    resume = ["--resume_from_checkpoint", "latest", "--checkpoints_total_limit", 1]
    output_dir, result = launch_processes(SCRIPT, prepare,
                                          lambda output_dir: flags(tiny, mixed_shapes, output_dir, *resume))
    return output_dir, result.stdout


# The adapter of the other export than LoRA's, and the file that holds its weights: OFT, in peft's format as LoKr and
# LoHa are, whose tensors DDP treats as it does LoRA's. (DoRA, a LoRA file, was checked so when the adapters came;
# its two-process run is left out of the suite for time.) It trains sharded (FSDP2): this script family's sharded run.
ADAPTER_FILES = {"oft": "unet/adapter_model.safetensors"}


@pytest.fixture(scope="module")
@launching
def adapter_runs(tiny, mixed_shapes, tmp_path_factory):
    """``{adapter: (output_dir, CompletedProcess)}``: 2 steps of each adapter of `ADAPTER_FILES` on two processes,
    sharded, checkpointing each, never validating."""
    def run(adapter):
        extra = ["--adapter", adapter, *(["--oft_block_size", 8] if adapter == "oft" else ["--rank", 4])]

        def args_for(output_dir):
            return flags(tiny, mixed_shapes, output_dir, "--max_train_steps", 2, "--num_validation_images", 0, *extra)

        return launch_processes(SCRIPT, lambda: tmp_path_factory.mktemp(adapter), args_for, env=FSDP2)

    return together({adapter: lambda adapter=adapter: run(adapter) for adapter in ADAPTER_FILES})


@pytest.mark.parametrize("adapter", ADAPTER_FILES)
def test_each_adapters_ema_is_the_single_process_average_of_its_synchronized_weights(adapter_runs, adapter):
    output_dir, result = adapter_runs[adapter]
    assert "FSDP2 units: 1 UNet2DConditionModel" in result.stderr, result.stderr[-3000:]
    assert json.loads((output_dir / "checkpoint-2" / "training_state.json").read_text())["sharded"] is True
    name = ADAPTER_FILES[adapter]
    first, second = (load_file(output_dir / f"checkpoint-{step}" / name) for step in (1, 2))
    assert any(not torch.equal(first[key], second[key]) for key in first), "the weights never changed"
    ema = load_file(output_dir / "checkpoint-2" / "ema" / name)
    assert ema.keys() == first.keys()
    for key in ema:
        torch.testing.assert_close(ema[key], DECAY * first[key] + (1 - DECAY) * second[key], atol=1e-6, rtol=0)
    assert load_file(output_dir / name).keys() == first.keys()


def test_only_the_main_process_writes_validation_and_outputs(two_process_run):
    records = log_records(two_process_run)
    assert [(r["step"], r["variant"]) for r in records] == [(0, "base"), (2, "raw"), (2, "ema"), (4, "raw"),
                                                            (4, "ema")]
    # At the most common bucket, 24x40 (height x width): the 2:1 and the 4:3 landscapes train there.
    assert [Image.open(path).size for path in rendered_images(two_process_run)] == [(40, 24)] * 4
    assert (two_process_run / LORA).is_file() and (two_process_run / "ema" / LORA).is_file()
    assert (two_process_run / "README.md").read_text().count("a red circle") >= 1


def test_every_process_checkpoints_at_every_step(two_process_run):
    assert sorted(p.name for p in two_process_run.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in range(1, 5)]
    assert not list(two_process_run.glob(".checkpoint-*"))
    for step in range(1, 5):
        files = {path.name for path in (two_process_run / f"checkpoint-{step}").iterdir()}
        assert {"random_states_0.pkl", "random_states_1.pkl", "random_state_0.safetensors",
                "random_state_1.safetensors", LORA} <= files


def test_the_ema_is_the_single_process_average_of_the_synchronized_weights(two_process_run):
    expected = None
    for step in range(1, 5):
        weights = load_file(two_process_run / f"checkpoint-{step}" / LORA)
        if expected is None:
            expected = {name: weight.float().clone() for name, weight in weights.items()}
        else:
            for name, weight in weights.items():
                expected[name] = DECAY * expected[name] + (1 - DECAY) * weight.float()
        saved = load_file(two_process_run / f"checkpoint-{step}" / "ema" / LORA)
        assert saved.keys() == expected.keys()
        for name in saved:
            torch.testing.assert_close(saved[name], expected[name], atol=1e-6, rtol=0, msg=f"{name} at step {step}")
    first, last = (load_file(two_process_run / f"checkpoint-{s}" / LORA) for s in (1, 4))
    assert any(not torch.equal(first[name], last[name]) for name in first), "the weights never changed"


def test_resuming_on_two_processes_equals_the_uninterrupted_run(two_process_run, resumed_run):
    output_dir, stdout = resumed_run
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in stdout
    for path in (LORA, f"ema/{LORA}"):
        resumed, uninterrupted = load_file(output_dir / path), load_file(two_process_run / path)
        assert resumed.keys() == uninterrupted.keys()
        assert all(torch.equal(resumed[key], uninterrupted[key]) for key in resumed), path
    assert sorted(p.name for p in output_dir.glob("checkpoint-*")) == ["checkpoint-4"]
    records = log_records(output_dir)
    assert [(r["step"], r["variant"]) for r in records] == [(4, "raw"), (4, "ema")]
    for record, original in zip(records, [r for r in log_records(two_process_run) if r["step"] == 4]):
        for image, original_image in zip(record["images"], original["images"]):
            assert (output_dir / image).read_bytes() == (two_process_run / original_image).read_bytes()


def test_each_process_encodes_its_own_share_of_the_captions(two_process_run):
    """36 captions in chunks of 16: the first process encodes chunks 0 and 2, the second chunk 1, each into its
    own shard."""
    (store,) = (two_process_run / "features").iterdir()
    shards = sorted(store.glob("shard-*.safetensors"))
    held = [sorted(index for name, tensor in load_file(shard).items() if name.endswith("/indices")
                   for index in tensor.tolist()) for shard in shards]
    assert held == [[*range(16), *range(32, 36)], list(range(16, 32))]


@pytest.mark.slow
def test_sdxl_trains_its_text_encoders_on_two_processes_with_an_adapter_only_where_the_loss_reads(tiny, tmp_path):
    """DDP stops a run whose parameters get no gradient: the first CLIP's last layer feeds nothing (SDXL reads its
    penultimate hidden states), so it has no adapter; every layer of the second feeds its pooled output."""
    def args_for(output_dir):
        return ["--pretrained_model_name_or_path", tiny["sdxl"], "--instance_data_dir", tiny["instance"],
                "--instance_prompt", "a photo of sks triangle", "--output_dir", output_dir, "--resolution", 32,
                "--train_batch_size", 1, "--learning_rate", 1e-3, "--rank", 4, "--seed", 3, "--train_text_encoder",
                "--max_train_steps", 2, "--checkpointing_steps", 1000, "--report_to", "none"]

    output_dir, _ = launch_processes("dreambooth/train_dreambooth_lora_sdxl.py", lambda: tmp_path, args_for)
    layers = {re.match(r"(text_encoder\w*)\..*layers\.(\d+)\.", key).groups() for key in load_file(output_dir / LORA)
              if key.startswith("text_encoder")}
    assert layers == {("text_encoder", "0"), ("text_encoder_2", "0"), ("text_encoder_2", "1")}
