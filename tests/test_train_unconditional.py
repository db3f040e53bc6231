"""Smoke tests: the unconditional DDPM script end to end on the tiny fixtures (a fresh tiny UNet from its config, and
the tiny DDPM pipeline trained on), its runs launched together."""

import numpy as np
import pytest
import torch
from diffusers import DDPMPipeline, UNet2DModel
from PIL import Image

from helpers import launch, launch_together, launching, usage_error
from training_utils.testing import (assert_checkpoint_is_the_output, assert_model_folder_loads, assert_resumes_exactly,
                                    assert_validated_at, checkpoint_names, checkpoint_weight_files, differing_keys)

SCRIPT = "unconditional_image_generation/train_unconditional.py"
UNET = "unet/diffusion_pytorch_model.safetensors"
RESOLUTION = 16  # the tiny UNet's sample_size


def fresh(tiny, output_dir, *extra):
    """A fresh tiny UNet (tiny/ddpm_unet_config) on 6 of the shapes, 2 a batch (3 steps an epoch), with random
    flips, 4 steps, an EMA, checkpoints every 2 steps."""
    return ["--model_config_name_or_path", tiny["ddpm_unet_config"], "--train_data_dir", tiny["shapes"],
            "--resolution", RESOLUTION, "--max_train_samples", 6, "--train_batch_size", 2, "--random_flip",
            "--output_dir", output_dir, "--max_train_steps", 4, "--learning_rate", 1e-3, "--lr_warmup_steps", 1,
            "--use_ema", "--ema_inv_gamma", 1, "--ema_power", 0.5, "--ema_max_decay", 0.9, "--checkpointing_steps", 2,
            "--save_model_epochs", 1, *extra]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}``, launched together:

    - fresh: `fresh`, validating 2 images every 3 steps in 2 DDPM steps (upstream's flag names);
    - pretrained: tiny/ddpm trained on for 2 steps to predict the clean image, on a 100-step cosine schedule, no EMA,
      validating (1 image, 2 steps) at the final step only.
    """
    root = tmp_path_factory.mktemp("runs")
    results = launch_together({
        "fresh": (SCRIPT, *fresh(tiny, root / "fresh", "--save_images_epochs", 1, "--validation_steps", 100,
                                 "--eval_batch_size", 2, "--ddpm_num_inference_steps", 2)),
        "pretrained": (SCRIPT, "--pretrained_model_name_or_path", tiny["ddpm"], "--train_data_dir", tiny["shapes"],
                       "--resolution", RESOLUTION, "--train_batch_size", 1, "--output_dir", root / "pretrained",
                       "--max_train_steps", 2,
                       "--learning_rate", 1e-3, "--lr_warmup_steps", 0, "--prediction_type", "sample",
                       "--ddpm_num_steps", 100, "--ddpm_beta_schedule", "squaredcos_cap_v2",
                       "--num_validation_images", 1, "--validation_inference_steps", 2),
    })
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_a_ddpm_pipeline_with_the_trained_unet_and_the_ema_beside_it(tiny, runs):
    output_dir, result = runs["fresh"]
    pipe = DDPMPipeline.from_pretrained(output_dir)
    assert pipe.unet.config.sample_size == RESOLUTION and pipe.unet.config.block_out_channels == [8, 16]
    assert pipe.scheduler.config.num_train_timesteps == 1000 and pipe.scheduler.config.beta_schedule == "linear"
    assert pipe.scheduler.config.prediction_type == "epsilon"
    raw = assert_model_folder_loads(UNet2DModel, output_dir / "unet").state_dict()
    ema = assert_model_folder_loads(UNet2DModel, output_dir / "ema" / "unet").state_dict()
    assert differing_keys(raw, ema)
    assert f"raw UNet: {output_dir / 'unet'}" in result.stdout
    assert f"ema UNet: {output_dir / 'ema' / 'unet'}" in result.stdout
    card = (output_dir / "README.md").read_text()
    assert "DDPMPipeline.from_pretrained" in card and "Trained from scratch." in card and "base_model" not in card
    # The pipeline renders as a user would render it.
    image = pipe(batch_size=1, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                 output_type="np").images
    assert image.shape == (1, RESOLUTION, RESOLUTION, 3) and np.isfinite(image).all()


def test_validates_raw_and_ema_at_the_end_of_each_epoch_and_the_final_step(runs):
    output_dir, _ = runs["fresh"]
    # 3 steps an epoch: --save_images_epochs 1 is due at step 3, and the final step 4; --validation_steps 100 never.
    log = assert_validated_at(output_dir, [3, 4], ("raw", "ema"), [""], num_images=2)
    assert {Image.open(output_dir / record["images"][0]).size for record in log} == {(RESOLUTION, RESOLUTION)}
    # Rendered from the same noise: the fresh UNet's (step 0), the trained one's and its EMA's differ.
    first = {(record["step"], record["variant"]): np.asarray(Image.open(output_dir / record["images"][0]))
             for record in log}
    assert not np.array_equal(first[0, "base"], first[4, "raw"])
    assert not np.array_equal(first[4, "raw"], first[4, "ema"])


def test_checkpoints_hold_the_outputs_and_resume_to_the_uninterrupted_weights(tiny, tmp_path, runs):
    fresh_dir, _ = runs["fresh"]
    assert checkpoint_names(fresh_dir) == ["checkpoint-2", "checkpoint-4"]
    assert checkpoint_weight_files(fresh_dir / "checkpoint-4") == {UNET, f"ema/{UNET}"}
    assert_checkpoint_is_the_output(fresh_dir / "checkpoint-4", fresh_dir, [UNET, f"ema/{UNET}"])
    # Resumed mid-epoch (step 2 of 3) without validation: bitwise the weights of the run that validated twice.
    assert_resumes_exactly(SCRIPT, lambda output_dir: fresh(tiny, output_dir, "--num_validation_images", 0),
                           fresh_dir, tmp_path, 2, [UNET, f"ema/{UNET}"], launch=launch)


def test_trains_on_a_pretrained_ddpm_pipeline_with_the_schedule_and_target_asked_for(tiny, runs):
    output_dir, _ = runs["pretrained"]
    pipe = DDPMPipeline.from_pretrained(output_dir)
    assert pipe.scheduler.config.num_train_timesteps == 100
    assert pipe.scheduler.config.beta_schedule == "squaredcos_cap_v2"
    assert pipe.scheduler.config.prediction_type == "sample"
    assert_model_folder_loads(UNet2DModel, output_dir / "unet", initial=tiny["ddpm"] / "unet")
    assert not (output_dir / "ema").exists()
    assert_validated_at(output_dir, [2], ("raw",), [""], num_images=1)
    assert "base_model: " in (output_dir / "README.md").read_text()


def test_refuses_what_an_unconditional_model_has_no_use_for_before_loading(tiny, tmp_path):
    common = ["--train_data_dir", tiny["shapes"], "--output_dir", tmp_path]
    assert usage_error(SCRIPT, *common, "--pretrained_model_name_or_path", tiny["ddpm"],
                       "--model_config_name_or_path", tiny["ddpm_unet_config"]).startswith(
        "error: --model_config_name_or_path=")
    assert "renders and trains without prompts" in usage_error(SCRIPT, *common, "--validation_prompt", "a circle")
    assert "--preserve_input_precision is not supported" in usage_error(SCRIPT, *common, "--preserve_input_precision")
    assert usage_error(SCRIPT, *common, "--model_config_name_or_path", tmp_path / "none").startswith(
        "error: --model_config_name_or_path=")
