"""Smoke tests: the Custom Diffusion script end to end on the tiny SD fixture, through ``accelerate launch``, its
runs launched together:

- kv: 4 steps of the cross-attention K/V and a <new1> token, with prior preservation (2 class images generated), EMA,
  validating and checkpointing every 2 steps;
- all: 2 steps of all the cross-attention projections (--freeze_model crossattn), no modifier token.

The kv run is then resumed from its checkpoint-2 and must end with bitwise the same files."""

import pytest
import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file

from helpers import launch, launch_together, launching
from training_utils.testing import assert_resumes_exactly, assert_validated_at, checkpoint_names

SCRIPT = "custom_diffusion/train_custom_diffusion.py"
TOKEN = "<new1>"
PROMPT = f"a photo of a {TOKEN} dog"
WEIGHTS, TOKEN_FILE = "pytorch_custom_diffusion_weights.safetensors", f"{TOKEN}.safetensors"


def flags(tiny, output_dir, steps, *extra):
    return ["--pretrained_model_name_or_path", tiny["sd"], "--instance_data_dir", tiny["instance"],
            "--instance_prompt", PROMPT, "--resolution", 32, "--train_batch_size", 1, "--max_train_steps", steps,
            "--learning_rate", 5e-2, "--output_dir", output_dir, *extra]


def kv_flags(tiny, output_dir, class_dir):
    return flags(tiny, output_dir, 4, "--modifier_token", TOKEN, "--initializer_token", "a",
                 "--with_prior_preservation", "--class_data_dir", class_dir,
                 "--class_prompt", "a photo of a dog", "--num_class_images", 2, "--class_inference_steps", 2,
                 "--use_ema", "--ema_decay", 0.5, "--validation_prompt", PROMPT, "--num_validation_images", 1,
                 "--validation_inference_steps", 2, "--validation_steps", 2, "--checkpointing_steps", 2)


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    launch_together({
        "kv": (SCRIPT, *kv_flags(tiny, root / "kv", root / "class_images")),
        "all": (SCRIPT, *flags(tiny, root / "all", 2, "--freeze_model", "crossattn")),
    })
    return root


def load(path):
    pipe = StableDiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render(pipe):
    return pipe(PROMPT, num_inference_steps=2, height=32, width=32, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images


def cross_attention(unet):
    return [name for name, _ in unet.named_modules() if name.endswith(".attn2")]


def test_writes_raw_and_ema_weights_and_token_validating_and_checkpointing(runs):
    output_dir = runs / "kv"
    for name in (WEIGHTS, TOKEN_FILE, f"ema/{WEIGHTS}", f"ema/{TOKEN_FILE}", "README.md"):
        assert (output_dir / name).is_file(), name
    assert len(list((runs / "class_images").iterdir())) == 2
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    assert_validated_at(output_dir, [2, 4], variants=("raw", "ema"), prompts=[PROMPT])
    for name in (WEIGHTS, TOKEN_FILE):
        raw, ema = load_file(output_dir / name), load_file(output_dir / "ema" / name)
        assert raw.keys() == ema.keys() and any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert load_file(output_dir / TOKEN_FILE)[TOKEN].shape == (1, 32)
    assert "load_attn_procs(" in (output_dir / "README.md").read_text()


@pytest.mark.parametrize("run, projections", [("kv", ("to_k", "to_v")), ("all", ("to_q", "to_k", "to_v", "to_out"))])
def test_only_the_cross_attention_projections_are_written_each_other_attention_empty(runs, tiny_sd_pipe, run,
                                                                                    projections):
    weights = load_file(runs / run / WEIGHTS)
    unet = tiny_sd_pipe.unet
    trained = {f"{attention}.processor.{projection}_custom_diffusion{'.0' if projection == 'to_out' else ''}.{kind}"
               for attention in cross_attention(unet) for projection in projections
               for kind in (("weight", "bias") if projection == "to_out" else ("weight",))}
    empty = {name for name in unet.attn_processors if ".attn1." in name}
    assert weights.keys() == trained | empty
    assert all(weights[name].numel() == 0 for name in empty)
    base = unet.state_dict()
    for name in trained:
        attention, _, key = name.partition(".processor.")
        assert not torch.equal(weights[name], base[f"{attention}.{key.replace('_custom_diffusion', '')}"]), name
    assert (runs / run / TOKEN_FILE).exists() == (run == "kv")


def test_raw_and_ema_load_into_the_stock_pipeline_change_it_and_leave_every_other_weight_as_it_was(runs, tiny,
                                                                                                tiny_sd_pipe):
    base_unet = {key: value for key, value in tiny_sd_pipe.unet.state_dict().items()}
    base_rows = tiny_sd_pipe.text_encoder.get_input_embeddings().weight
    pictures = [render(tiny_sd_pipe)]
    for folder in (runs / "kv", runs / "kv" / "ema"):
        pipe = load(tiny["sd"])
        pipe.unet.load_attn_procs(folder, weight_name=WEIGHTS, _pipeline=pipe)
        pipe.load_textual_inversion(folder, weight_name=TOKEN_FILE)
        rows = pipe.text_encoder.get_input_embeddings().weight
        assert torch.equal(rows[:-1], base_rows) and torch.equal(rows[-1:], load_file(folder / TOKEN_FILE)[TOKEN])
        # The processors hold the trained projections; the UNet's own weights are the base's.
        unet = pipe.unet.state_dict()
        assert all(torch.equal(unet[key], value) for key, value in base_unet.items())
        weights = load_file(folder / WEIGHTS)
        assert sorted(unet.keys() - base_unet.keys()) == sorted(key for key, value in weights.items() if value.numel())
        assert all(torch.equal(unet[key], weights[key]) for key in unet.keys() - base_unet.keys())
        pictures.append(render(pipe))
    assert not torch.allclose(pictures[0], pictures[1], atol=1e-4)
    assert not torch.allclose(pictures[1], pictures[2], atol=1e-4)


def test_a_resumed_run_ends_with_the_same_weights_and_token(runs, tmp_path, tiny):
    assert_resumes_exactly(SCRIPT, lambda output_dir: kv_flags(tiny, output_dir, runs / "class_images"), runs / "kv",
                           tmp_path, 2,
                           [WEIGHTS, TOKEN_FILE, f"ema/{WEIGHTS}", f"ema/{TOKEN_FILE}"], launch=launch)
