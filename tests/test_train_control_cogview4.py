"""Smoke tests: the CogView4 Control script end to end on the tiny fixtures, through ``accelerate launch``."""

import json

import numpy as np
import pytest
import torch
from diffusers import CogView4ControlPipeline, CogView4Transformer2DModel, DiffusionPipeline
from PIL import Image

from helpers import controlnet_flags, import_script, launch, launch_together, launching, usage_error
from training_utils.control import widen_input_layer
from training_utils.testing import assert_resumes_exactly, assert_validated_at, differing_keys, reported_buckets

SCRIPT = "cogview4-control/train_control_cogview4.py"
WEIGHTS = "diffusion_pytorch_model.safetensors"
TRANSFORMER, EMA_TRANSFORMER = f"transformer/{WEIGHTS}", f"ema/transformer/{WEIGHTS}"
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


def conditioning(tiny, index):
    return tiny["shapes_controlnet"] / "conditioning" / f"{index:04d}.png"


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}`` of the runs here, launched together:

    - full: 4 steps from tiny/cogview4 (its patch embedding widened), EMA, validating both prompts with their
      conditioning images every 2 steps (2 denoising steps), a checkpoint at step 2;
    - control: 2 steps from tiny/cogview4_control (a Control model already: not widened again), the blocks and the
      patch embedding only (--only_target_transformer_blocks), EMA decay 0, cached latents, pictures of mixed shapes
      in aspect-ratio buckets, no validation.
    """
    root = tmp_path_factory.mktemp("runs")
    results = launch_together({
        "full": (SCRIPT, *full_flags(tiny, root / "full", *validation_flags(tiny))),
        "control": (SCRIPT, *controlnet_flags(tiny, "cogview4_control", root / "control", "--max_train_steps", 2,
                                              "--only_target_transformer_blocks", "--ema_decay", 0,
                                              "--cache_latents", mixed=True)),
    })
    return {name: (root / name, result) for name, result in results.items()}


def full_flags(tiny, output_dir, *extra):
    return controlnet_flags(tiny, "cogview4", output_dir, "--max_train_steps", 4, "--checkpointing_steps", 2, *extra)


def validation_flags(tiny):
    return ["--validation_prompt", *PROMPTS, "--validation_image", conditioning(tiny, 0), conditioning(tiny, 1),
            "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", 2]


def render(pipe, image):
    pipe.set_progress_bar_config(disable=True)
    return pipe(PROMPTS[0], control_image=image, num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


def test_writes_a_control_pipeline_with_the_widened_transformer_raw_and_ema_that_change_its_output(tiny, runs):
    output_dir, _ = runs["full"]
    # From a CogView4 text-to-image base, a CogView4ControlPipeline folder: whatever loads it gets that class.
    assert json.loads((output_dir / "model_index.json").read_text())["_class_name"] == "CogView4ControlPipeline"
    pipe = DiffusionPipeline.from_pretrained(output_dir)
    assert type(pipe) is CogView4ControlPipeline
    raw = pipe.transformer
    ema = CogView4Transformer2DModel.from_pretrained(output_dir / "ema" / "transformer")
    base = CogView4ControlPipeline.from_pretrained(tiny["cogview4"])
    assert (raw.config.in_channels, raw.config.out_channels) == (32, 16)
    assert raw.patch_embed.proj.weight.shape == (base.transformer.patch_embed.proj.out_features, 32 * 4)
    # The conditioning's new columns started at zero and trained; every layer moved; the EMA lags behind.
    assert raw.patch_embed.proj.weight[:, 64:].abs().sum() > 0
    changed = differing_keys(raw.state_dict(), base.transformer.state_dict())
    assert "proj_out.weight" in changed and "transformer_blocks.0.attn1.to_q.weight" in changed
    assert differing_keys(raw.state_dict(), ema.state_dict())
    # Only the transformer is written anew; the VAE's and the text encoder's files are the base's, linked.
    assert (output_dir / TRANSFORMER).stat().st_nlink == 1
    for name in ("vae", "text_encoder"):
        files = sorted((tiny["cogview4"] / name).glob("*.safetensors")) + [tiny["cogview4"] / name / "config.json"]
        assert all((output_dir / name / path.name).samefile(path) for path in files), name
    # The trained pipeline renders differently from a merely widened base, and with the EMA swapped in.
    image = Image.open(conditioning(tiny, 0)).convert("RGB")
    trained = render(pipe, image)
    # The conditioning image steers it: another one renders another picture.
    other = Image.open(conditioning(tiny, 1)).convert("RGB")
    assert not np.allclose(render(pipe, other), trained, atol=1e-4)
    pipe.transformer = ema
    ema_image = render(pipe, image)
    widen_input_layer(base.transformer, "patch_embed.proj")
    initial = render(base, image)
    assert not np.allclose(trained, initial, atol=1e-4) and not np.allclose(trained, ema_image, atol=1e-4)


def test_validates_each_prompt_with_its_conditioning_image_at_the_due_steps(tiny, runs):
    output_dir, _ = runs["full"]
    assert_validated_at(output_dir, [2, 4], ("raw", "ema"), PROMPTS, num_images=1)
    saved = sorted(path.name for path in (output_dir / "validation").glob("conditioning-*.png"))
    assert saved == ["conditioning-p00.png", "conditioning-p01.png"]
    card = (output_dir / "README.md").read_text()
    assert f'pipe = CogView4ControlPipeline.from_pretrained("{output_dir}")' in card
    assert f'pipe.transformer = CogView4Transformer2DModel.from_pretrained("{output_dir}/ema/transformer")' in card
    assert (output_dir / "checkpoint-2").is_dir() and (output_dir / "checkpoint-4").is_dir()


def test_resumes_to_the_uninterrupted_weights(tiny, runs, tmp_path):
    # The uninterrupted run validated at steps 2 and 4, the resumed one never: resuming mid-epoch with random
    # crops, flips and empty prompts, and validating, both leave the weights bit for bit as they would be.
    assert_resumes_exactly(SCRIPT, lambda output_dir: full_flags(tiny, output_dir), runs["full"][0], tmp_path, 2,
                           [TRANSFORMER, EMA_TRANSFORMER], launch=launch)


def test_a_control_model_trains_on_without_widening_and_only_its_blocks_and_patch_embedding(tiny, runs):
    output_dir, result = runs["control"]
    assert len(reported_buckets(result.stderr)) >= 2, result.stderr[-3000:]
    assert json.loads((output_dir / "model_index.json").read_text())["_class_name"] == "CogView4ControlPipeline"
    raw, ema = (CogView4Transformer2DModel.from_pretrained(output_dir / folder)
                for folder in ("transformer", "ema/transformer"))
    initial = CogView4Transformer2DModel.from_pretrained(tiny["cogview4_control"], subfolder="transformer")
    assert raw.config.in_channels == 32
    changed = differing_keys(raw.state_dict(), initial.state_dict())
    assert changed and all(key.startswith(("transformer_blocks.", "patch_embed.proj.")) for key in changed)
    assert "patch_embed.proj.weight" in changed
    assert not differing_keys(raw.state_dict(), ema.state_dict())  # decay 0: the EMA is the raw weights


def test_flags_follow_the_upstream_script(tiny, tmp_path):
    script = import_script(SCRIPT)
    defaults = script.parse_args(["--pretrained_model_name_or_path", str(tiny["cogview4"])])
    assert (defaults.resolution, defaults.learning_rate, defaults.guidance_scale) == (1024, 5e-6, 3.5)
    assert defaults.tracker_project_name == "cogview4_train_control" and defaults.weighting_scheme == "none"
    assert defaults.conditioning_image_column == "conditioning_image"
    error = usage_error(SCRIPT, *controlnet_flags(tiny, "cogview4", tmp_path / "out", "--upcast_before_saving"))
    assert error == ("error: --upcast_before_saving is not supported here: the transformer trains in fp32 and is "
                     "always saved in fp32")
    error = usage_error(SCRIPT, *controlnet_flags(tiny, "cogview4", tmp_path / "out",
                                                  "--only_target_transformer_blocks", "--ema_posthoc_sigma_rels", 0.05,
                                                  0.1))
    assert error.startswith("error: --ema_posthoc_sigma_rels=[0.05, 0.1]: expected none with "
                            "--only_target_transformer_blocks")
    error = usage_error(SCRIPT, *controlnet_flags(tiny, "cogview4", tmp_path / "out", "--resolution", 40))
    assert error.startswith("error: --resolution=40: expected a multiple of 16")
    assert not (tmp_path / "out").exists()
