"""Smoke tests: the Z-Image and Qwen-Image ControlNet scripts (which upstream does not have) end to end on the tiny
fixtures, through ``accelerate launch``: what they save loads into the family's ControlNet pipeline and changes its
output."""

import numpy as np
import pytest
import torch
from diffusers import (QwenImageControlNetModel, QwenImageControlNetPipeline, QwenImagePipeline,
                       ZImageControlNetModel, ZImageControlNetPipeline, ZImagePipeline)
from PIL import Image
from safetensors.torch import load_file

from helpers import controlnet_flags, launch, launch_together, launching, usage_error
from training_utils.testing import (assert_checkpoint_is_the_output, assert_model_folder_loads, assert_resumes_exactly,
                                    assert_validated_at, checkpoint_names, differing_keys)

SCRIPTS = {"z_image": "controlnet/train_controlnet_z_image.py", "qwen_image": "controlnet/train_controlnet_qwen_image.py"}
WEIGHTS = "diffusion_pytorch_model.safetensors"
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


def conditioning(tiny, index):
    return tiny["shapes_controlnet"] / "conditioning" / f"{index:04d}.png"


def z_image_flags(tiny, output_dir, *extra):
    """4 steps of a ControlNet made from the Z-Image transformer, guiding both its layers, checkpoints every 2."""
    return controlnet_flags(tiny, "z_image", output_dir, "--control_layers_places", "0,1", "--max_train_steps", 4,
                            "--checkpointing_steps", 2, *extra)


def qwen_image_flags(tiny, output_dir, *extra):
    """4 steps from tiny/qwen_image_controlnet with the training latents cached (the VAE then comes to the
    accelerator for the conditioning images in every step), checkpoints every 2."""
    return controlnet_flags(tiny, "qwen_image", output_dir, "--controlnet_model_name_or_path",
                            tiny["qwen_image_controlnet"], "--cache_latents", "--max_train_steps", 4,
                            "--checkpointing_steps", 2, *extra)


def validation_flags(tiny):
    return ["--validation_prompt", *PROMPTS, "--validation_image", conditioning(tiny, 0), conditioning(tiny, 1),
            "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", 2]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{family: output_dir}`` of one run of each script, launched together, validating every 2 steps (the final
    step, 4, among them)."""
    root = tmp_path_factory.mktemp("runs")
    launch_together({"z_image": (SCRIPTS["z_image"], *z_image_flags(tiny, root / "z_image", *validation_flags(tiny))),
                     "qwen_image": (SCRIPTS["qwen_image"],
                                    *qwen_image_flags(tiny, root / "qwen_image", *validation_flags(tiny)))})
    return {family: root / family for family in SCRIPTS}


def render(pipe, tiny, **kwargs):
    image = Image.open(conditioning(tiny, 0)).convert("RGB")
    pipe.set_progress_bar_config(disable=True)
    return pipe(PROMPTS[0], control_image=image, num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0), max_sequence_length=32, **kwargs).images


def test_z_image_controlnet_saves_its_own_modules_and_changes_the_pipelines_output(tiny, runs):
    output_dir = runs["z_image"]
    raw, ema = (assert_model_folder_loads(ZImageControlNetModel, folder) for folder in (output_dir, output_dir / "ema"))
    assert raw.config.control_layers_places == [0, 1]
    # Its own modules only, not the transformer's embedders and refiners that it runs.
    names = load_file(output_dir / WEIGHTS).keys()
    assert {name.split(".")[0] for name in names} == {"control_layers", "control_noise_refiner",
                                                      "control_all_x_embedder"}
    assert load_file(output_dir / "ema" / WEIGHTS).keys() == names
    assert differing_keys(raw.state_dict(), ema.state_dict())
    base = ZImagePipeline.from_pretrained(tiny["z_image"])
    untrained = base(PROMPTS[0], num_inference_steps=2, height=32, width=32, output_type="np",
                     generator=torch.Generator().manual_seed(0), max_sequence_length=32).images
    # A new ControlNet changes nothing (zero outputs); the trained ones do, raw and EMA differently.
    images = [render(ZImageControlNetPipeline(**base.components, controlnet=ZImageControlNetModel.from_pretrained(
        folder)), tiny) for folder in (output_dir, output_dir / "ema")]
    assert not np.allclose(images[0], untrained, atol=1e-4) and not np.array_equal(images[0], images[1])
    card = (output_dir / "README.md").read_text()
    assert "ZImageControlNetModel.from_pretrained" in card and "ZImageControlNetPipeline.from_pretrained" in card
    assert "control_image=load_image(" in card


def test_qwen_image_controlnet_trains_from_a_released_layout_and_changes_the_pipelines_output(tiny, runs):
    output_dir = runs["qwen_image"]
    initial = tiny["qwen_image_controlnet"]
    raw, ema = (assert_model_folder_loads(QwenImageControlNetModel, folder, initial=initial)
                for folder in (output_dir, output_dir / "ema"))
    assert raw.config.num_layers == 2 and differing_keys(raw.state_dict(), ema.state_dict())
    # The zero-initialised projections, where a new ControlNet starts learning, trained.
    assert raw.controlnet_x_embedder.weight.any() and all(block.weight.any() for block in raw.controlnet_blocks)
    base = QwenImagePipeline.from_pretrained(tiny["qwen_image"])
    images = [render(QwenImageControlNetPipeline(**base.components, controlnet=QwenImageControlNetModel.from_pretrained(
        folder)), tiny, true_cfg_scale=1.0) for folder in (initial, output_dir, output_dir / "ema")]
    assert not np.allclose(images[0], images[1], atol=1e-4) and not np.array_equal(images[1], images[2])
    assert "QwenImageControlNetModel.from_pretrained" in (output_dir / "README.md").read_text()


@pytest.mark.parametrize("family", SCRIPTS)
def test_validates_with_the_conditioning_at_the_due_and_final_steps_and_checkpoints_the_output(tiny, runs, family):
    output_dir = runs[family]
    assert_validated_at(output_dir, [2, 4], ("raw", "ema"), PROMPTS, num_images=1)
    saved = sorted(path.name for path in (output_dir / "validation").glob("conditioning-*.png"))
    assert saved == ["conditioning-p00.png", "conditioning-p01.png"]
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    assert_checkpoint_is_the_output(output_dir / "checkpoint-4", output_dir, {
        f"controlnet/{WEIGHTS}": WEIGHTS, f"ema/controlnet/{WEIGHTS}": f"ema/{WEIGHTS}"})


def test_z_image_controlnet_resumes_to_the_uninterrupted_weights(tiny, tmp_path, runs):
    # The uninterrupted run validated at steps 2 and 4, the resumed one never.
    assert_resumes_exactly(SCRIPTS["z_image"], lambda output_dir: z_image_flags(tiny, output_dir), runs["z_image"],
                           tmp_path, 2, [WEIGHTS, f"ema/{WEIGHTS}"], launch=launch)


@pytest.mark.parametrize("flags, message", [
    (["--control_layers_places", "1"], "error: --control_layers_places='1': expected distinct indices of the "
                                       "transformer's 2 main layers, 0 among them"),
    (["--control_layers_places", "0,a"], "error: --control_layers_places='0,a': expected comma-separated layer "
                                         "indices"),
    (["--controlnet_model_name_or_path", "{z_image_controlnet}", "--control_layers_places", "0"],
     "error: --control_layers_places='0': expected unset with --controlnet_model_name_or_path, whose ControlNet has "
     "its own"),
    (["--num_extra_conditioning_channels", "1"], "error: --num_extra_conditioning_channels=1: expected 0: "
                                                 "ZImageControlNetPipeline gives the ControlNet the conditioning "
                                                 "image's latents alone"),
])
def test_bad_z_image_controlnet_flags_fail_in_one_line_before_anything_loads(tiny, tmp_path, flags, message):
    output_dir = tmp_path / "out"
    flags = [flag.format(**tiny) for flag in flags]
    assert usage_error(SCRIPTS["z_image"], *controlnet_flags(tiny, "z_image", output_dir, *flags)) == message
    assert not output_dir.exists()


def test_bad_qwen_image_controlnet_flags_fail_in_one_line_before_anything_loads(tiny, tmp_path):
    output_dir = tmp_path / "out"
    error = usage_error(SCRIPTS["qwen_image"], *controlnet_flags(tiny, "qwen_image", output_dir,
                                                                 "--num_double_layers", 0))
    assert error == "error: --num_double_layers=0: expected a positive integer"
    assert not output_dir.exists()
