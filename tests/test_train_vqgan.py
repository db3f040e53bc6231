"""Smoke tests: the VQ-GAN script end to end on the tiny fixtures (upstream's test configs of the VQModel and the
discriminator, a tiny VGG in timm's layout), its runs launched together."""

import json

import numpy as np
import pytest
import torch
from diffusers import VQModel
from PIL import Image

from helpers import launch, launch_together, launching, usage_error
from training_utils.data.images import ImageTransform
from training_utils.testing import (assert_checkpoint_is_the_output, assert_model_folder_loads, assert_resumes_exactly,
                                    assert_validated_at, checkpoint_names, checkpoint_weight_files, differing_keys)
from training_utils.vqgan import Discriminator, to_pil

SCRIPT = "vqgan/train_vqgan.py"
WEIGHTS = "diffusion_pytorch_model.safetensors"
CHECKPOINT_FILES = {f"vqmodel/{WEIGHTS}": WEIGHTS, f"ema/vqmodel/{WEIGHTS}": f"ema/{WEIGHTS}",
                    f"discriminator/{WEIGHTS}": f"discriminator/{WEIGHTS}"}
RESOLUTION = 32


def fresh(tiny, output_dir, *extra):
    """A fresh VQModel of upstream's test config and its discriminator, the tiny VGG, on 6 of the shapes, 2 a batch
    (3 steps an epoch), flipped, 4 steps (the VQModel's 1st and 3rd), an EMA, a checkpoint at step 3."""
    return ["--model_config_name_or_path", tiny["vqmodel_config"], "--discriminator_config_name_or_path",
            tiny["vqgan_discriminator_config"], "--timm_model_backend", tiny["vgg_tiny"],
            "--train_data_dir", tiny["shapes"], "--resolution", RESOLUTION, "--max_train_samples", 6,
            "--train_batch_size", 2, "--random_flip", "--output_dir", output_dir, "--max_train_steps", 4,
            "--learning_rate", 1e-3, "--discr_learning_rate", 1e-3, "--lr_warmup_steps", 0, "--use_ema",
            "--ema_decay", 0.5, "--checkpointing_steps", 3, *extra]


def validation_images(tiny):
    return [str(tiny["shapes"] / name) for name in ("0000.png", "0001.png")]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}``, launched together:

    - fresh: `fresh`, reconstructing two shapes every 3 steps;
    - pretrained: tiny/vqmodel trained on for 2 steps with the L1 loss, two VGG taps, a linear discriminator schedule,
      no EMA, no validation images.
    """
    root = tmp_path_factory.mktemp("runs")
    results = launch_together({
        "fresh": (SCRIPT, *fresh(tiny, root / "fresh", "--validation_images", *validation_images(tiny),
                                 "--validation_steps", 3)),
        "pretrained": (SCRIPT, "--pretrained_model_name_or_path", tiny["vqmodel"], "--timm_model_backend",
                       tiny["vgg_tiny"], "--discriminator_config_name_or_path", tiny["vqgan_discriminator_config"],
                       "--timm_model_layers", "features|head", "--vae_loss", "l1",
                       "--discr_lr_scheduler", "linear", "--train_data_dir", tiny["shapes"], "--resolution",
                       RESOLUTION, "--train_batch_size", 1, "--output_dir", root / "pretrained", "--max_train_steps", 2,
                       "--learning_rate", 1e-3, "--lr_warmup_steps", 0),
    })
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_the_vqmodel_its_ema_and_the_discriminator_loadable(tiny, runs):
    output_dir, result = runs["fresh"]
    raw = assert_model_folder_loads(VQModel, output_dir)
    ema = assert_model_folder_loads(VQModel, output_dir / "ema")
    upstream_config = json.loads(tiny["vqmodel_config"].read_text())
    assert all(raw.config[key] == value for key, value in upstream_config.items() if not key.startswith("_"))
    assert differing_keys(raw.state_dict(), ema.state_dict())
    discriminator = Discriminator.from_pretrained(output_dir / "discriminator")
    assert discriminator.config.hidden_channels == 8 and discriminator.config.depth == 4
    assert f"raw VQModel: {output_dir}" in result.stdout and f"ema VQModel: {output_dir / 'ema'}" in result.stdout
    assert f"discriminator: {output_dir / 'discriminator'}" in result.stdout
    card = (output_dir / "README.md").read_text()
    assert "VQModel.from_pretrained" in card and "Trained from scratch." in card


def test_reconstructs_the_validation_images_raw_and_ema_beside_the_originals_as_the_saved_vqmodel_does(tiny, runs):
    output_dir, _ = runs["fresh"]
    names = validation_images(tiny)
    log = assert_validated_at(output_dir, [3, 4], ("raw", "ema"), names, num_images=1)
    for index in range(len(names)):
        assert (output_dir / f"validation/conditioning-p{index:02d}.png").is_file()
    final = {(record["variant"], record["prompt"]): np.asarray(Image.open(output_dir / record["images"][0]))
             for record in log if record["step"] == 4}
    assert not np.array_equal(final["raw", names[0]], final["ema", names[0]])
    # The files hold the weights the final validation reconstructed with.
    transform = ImageTransform(RESOLUTION, center_crop=True)
    for variant, folder in (("raw", output_dir), ("ema", output_dir / "ema")):
        vqmodel = VQModel.from_pretrained(folder).eval()
        for name in names:
            with torch.no_grad():
                expected = to_pil(vqmodel(transform(name, None).pixels[None]).sample)[0]
            assert np.abs(np.asarray(expected, dtype=np.int16) - final[variant, name]).max() <= 1, (variant, name)


def test_checkpoints_hold_both_networks_and_resume_to_the_uninterrupted_weights(tiny, tmp_path, runs):
    fresh_dir, _ = runs["fresh"]
    assert checkpoint_names(fresh_dir) == ["checkpoint-3"]
    assert checkpoint_weight_files(fresh_dir / "checkpoint-3") == set(CHECKPOINT_FILES)
    assert {path.name for path in (fresh_dir / "checkpoint-3").glob("*.bin")} >= {
        "optimizer.bin", "optimizer_1.bin", "scheduler.bin", "scheduler_1.bin"}
    # Resumed after the VQModel's second step (the discriminator's is next), without validation: bitwise the
    # weights of the run that validated three times.
    resumed = assert_resumes_exactly(SCRIPT, lambda output_dir: fresh(tiny, output_dir), fresh_dir, tmp_path, 3,
                                     list(CHECKPOINT_FILES.values()), launch=launch)
    assert "resumed from" in resumed.stdout
    assert_checkpoint_is_the_output(tmp_path / "checkpoint-3", fresh_dir / "checkpoint-3", list(CHECKPOINT_FILES))


def test_trains_on_a_pretrained_vqmodel(tiny, runs):
    output_dir, _ = runs["pretrained"]
    assert_model_folder_loads(VQModel, output_dir, initial=tiny["vqmodel"])
    assert not (output_dir / "ema").exists() and not (output_dir / "validation").exists()
    assert (output_dir / "discriminator" / WEIGHTS).is_file()
    assert "base_model: " in (output_dir / "README.md").read_text()


def test_refuses_bad_input_before_loading(tiny, tmp_path):
    common = ["--train_data_dir", tiny["shapes"], "--output_dir", tmp_path, "--timm_model_backend", tiny["vgg_tiny"]]
    assert usage_error(SCRIPT, *common, "--pretrained_model_name_or_path", tiny["vqmodel"],
                       "--model_config_name_or_path", tiny["vqmodel_config"]).startswith(
        "error: --model_config_name_or_path=")
    assert "a Discriminator's config, not a VQModel's" in usage_error(SCRIPT, *common, "--discriminator_config_name_or_path",
                                                  tiny["vqmodel_config"])
    assert "a VQModel folder" in usage_error(SCRIPT, *common, "--pretrained_model_name_or_path", tiny["shapes"])
    assert usage_error(SCRIPT, *common, "--timm_model_backend", "resnet50").startswith("error: --timm_model_backend=")
    assert usage_error(SCRIPT, *common, "--timm_model_layers", "fc").startswith("error: --timm_model_layers=")
    assert "reconstructs --validation_images" in usage_error(SCRIPT, *common, "--validation_prompt", "a circle")
    assert "--prediction_type is not supported" in usage_error(SCRIPT, *common, "--prediction_type", "epsilon")
    # The default discriminator halves the picture 6 times.
    assert "at least 128" in usage_error(SCRIPT, *common, "--resolution", 64)
    assert usage_error(SCRIPT, *common, "--discr_learning_rate", 0).startswith("error: --discr_learning_rate=")
    assert usage_error(SCRIPT, *common, "--validation_images", tmp_path / "none.png").startswith(
        "error: --validation_images=")

