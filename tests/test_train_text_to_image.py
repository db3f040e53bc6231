"""Smoke tests: the full UNet fine-tune scripts (SD 1.x and SDXL) end to end on the tiny fixtures, through
``accelerate launch``."""

import functools
import json
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL, StableDiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel
from PIL import Image
from safetensors.torch import load_file

from helpers import FSDP2, launch, launching, together, usage_error
from training_utils.testing import (assert_checkpoint_is_the_output, assert_close_files, assert_close_validations,
                                    assert_model_folder_loads, assert_resumes_exactly, assert_same_files,
                                    assert_validated_at, checkpoint_names, most_common_bucket, rendered_images,
                                    reported_buckets)

SCRIPT = "text_to_image/train_text_to_image.py"
SDXL_SCRIPT = "text_to_image/train_text_to_image_sdxl.py"
UNET = "unet/diffusion_pytorch_model.safetensors"
EMA_UNET = "ema/" + UNET
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]
# The mixed-shape pictures (12, with 12 distinct captions) in aspect-ratio buckets, each picture twice an epoch (an
# epoch of 12 batches), 30% of the captions dropped.
BUCKETED = ["--use_aspect_ratio_buckets", "--repeats", 2, "--caption_dropout", 0.3]
MIXED_IMAGES = 12


def common(tiny, output_dir, *extra, data_dir=None, model="sd"):
    return ["--pretrained_model_name_or_path", tiny[model], "--train_data_dir", data_dir or tiny["shapes"],
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3,
            "--random_flip", "--use_ema", "--ema_decay", 0.9, "--seed", 3, *extra]


def bucketed(tiny, output_dir, *extra):
    """`common` on the mixed-shape pictures with `BUCKETED`."""
    return common(tiny, output_dir, *BUCKETED, *extra, data_dir=tiny["shapes_mixed"])


def assert_same(a, b):
    assert a.keys() == b.keys() and len(a) > 0
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[0]}"


def assert_differ(a, b):
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[key], b[key]) for key in a)


def full_flags(tiny, output_dir):
    """8 `bucketed` steps, validating every 3 steps (and at the final step 8), a checkpoint every 2, the newest 2
    kept."""
    return bucketed(tiny, output_dir, "--max_train_steps", 8, "--validation_prompt", *PROMPTS,
                    "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", 3,
                    "--checkpointing_steps", 2, "--checkpoints_total_limit", 2)


def decay_zero_flags(tiny, output_dir, *extra):
    return common(tiny, output_dir, "--max_train_steps", 3, "--ema_decay", 0, "--checkpointing_steps", 1000, *extra)


def cache_flags(tiny, output_dir, *extra):
    """4 `bucketed`, center-cropped, randomly flipped steps, validating and checkpointing every 2, at a validation
    size of its own.

    Adam moves every UNet weight by up to the learning rate per step however small its gradient, so
    float-level differences (the VAE's results depend on its batch) grow with it: at 1e-3 they reach
    7e-5, at 5e-5 4e-6, while ignoring the flips would still change weights by 2e-4."""
    return bucketed(tiny, output_dir, "--center_crop", "--learning_rate", 5e-5, "--max_train_steps", 4,
                    "--checkpointing_steps", 2, "--validation_prompt", PROMPTS[0], "--num_validation_images", 1,
                    "--validation_inference_steps", 2, "--validation_steps", 2, "--validation_height", 16,
                    "--validation_width", 40, *extra)


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}`` of every run here that starts from scratch, launched together: full
    (`full_flags`, in buckets), decay_zero (3 steps on the square pictures with ``--ema_decay 0``, on two processes,
    sharded, a batch of 1 on each),
    input_perturbation (the same with ``--input_perturbation 0.1``), and uncached and cached (`cache_flags`, in
    buckets, with the VAE in the step, and with its latents cached)."""
    root = tmp_path_factory.mktemp("runs")
    results = together({
        "full": functools.partial(launch, SCRIPT, *full_flags(tiny, root / "full")),
        # This script's sharded launch (FSDP2, two processes, a batch of 1 on each): a full fine-tune written whole as
        # the stock pipeline.
        "decay_zero": functools.partial(launch, SCRIPT, *decay_zero_flags(tiny, root / "decay_zero",
                                                                          "--train_batch_size", 1),
                                        processes=2, env=FSDP2),
        "input_perturbation": functools.partial(launch, SCRIPT, *decay_zero_flags(
            tiny, root / "input_perturbation", "--input_perturbation", 0.1)),
        "uncached": functools.partial(launch, SCRIPT, *cache_flags(tiny, root / "uncached")),
        "cached": functools.partial(launch, SCRIPT, *cache_flags(tiny, root / "cached", "--cache_latents")),
    })
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_a_loadable_pipeline_holding_the_final_in_run_weights(tiny, runs):
    output_dir, result = runs["full"]
    for name in ("model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json",
                 "tokenizer/tokenizer_config.json", "scheduler/scheduler_config.json", "ema/unet/config.json"):
        assert (output_dir / name).is_file(), name
    assert not list(output_dir.rglob(".incomplete-*"))
    # checkpoint-8, the final step's, holds the UNets as the output does (raw and EMA), and nothing else trained.
    assert_checkpoint_is_the_output(output_dir / "checkpoint-8", output_dir, [UNET, EMA_UNET])
    final = load_file(output_dir / "checkpoint-8" / UNET)
    pipe = StableDiffusionPipeline.from_pretrained(output_dir)
    assert_same(pipe.unet.state_dict(), final)
    assert_same(load_file(output_dir / UNET), final)
    assert all(tensor.dtype == torch.float32 for tensor in final.values())
    assert_differ(load_file(Path(tiny["sd"]) / UNET), final)
    assert f"raw UNet: {output_dir / 'unet'}" in result.stdout


def test_writes_the_ema_unet_from_the_final_ema_state(tiny, runs):
    output_dir, result = runs["full"]
    ema_unet = assert_model_folder_loads(UNet2DConditionModel, output_dir / "ema" / "unet",
                                         initial=Path(tiny["sd"]) / "unet").state_dict()
    in_checkpoint = assert_model_folder_loads(UNet2DConditionModel, output_dir / "checkpoint-8" / "ema" / "unet")
    assert_same(ema_unet, in_checkpoint.state_dict())
    assert_differ(ema_unet, load_file(output_dir / UNET))
    assert f"ema UNet: {output_dir / 'ema' / 'unet'}" in result.stdout
    card = (output_dir / "README.md").read_text()
    assert f'StableDiffusionPipeline.from_pretrained("{output_dir}")' in card
    assert f'UNet2DConditionModel.from_pretrained("{output_dir}/ema/unet")' in card


def test_validates_raw_and_ema_at_the_due_steps_and_the_final_step_once(runs):
    output_dir, _ = runs["full"]
    log = assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"), PROMPTS, num_images=1)
    assert len(rendered_images(output_dir)) == 3 * 2 * 2
    assert log[-1]["progress"] in (output_dir / "README.md").read_text()
    assert checkpoint_names(output_dir) == ["checkpoint-6", "checkpoint-8"]


def test_trains_in_several_buckets_and_validates_at_the_most_common(runs):
    output_dir, result = runs["full"]
    buckets = reported_buckets(result.stderr)
    assert len(buckets) >= 3 and sum(buckets.values()) == 2 * MIXED_IMAGES, buckets  # --repeats 2
    # Validation renders at the bucket that most samples train in (of equally common ones, the largest).
    height, width = most_common_bucket(buckets)
    assert (height, width) != (32, 32)
    assert {Image.open(path).size for path in rendered_images(output_dir)} == {(width, height)}
    # --caption_dropout's empty prompt is embedded once, with the captions.
    assert f"text embeddings: {MIXED_IMAGES + 1} items" in result.stderr


def test_resumed_run_that_never_validates_prunes_and_ends_with_the_uninterrupted_weights(tiny, tmp_path, runs):
    # From the full run's checkpoint-6, mid-epoch (of 12 batches), in buckets, with random flips, repeats, dropped
    # captions and an optimizer state for every UNet parameter: bit for bit. The full run validated after writing
    # checkpoint-6 and at the final step, the resumed one never: validation and checkpointing leave the weights, the
    # EMA, the optimizer and the RNG untouched.
    def resumed_flags(output_dir):
        return bucketed(tiny, output_dir, "--max_train_steps", 8, "--checkpointing_steps", 1,
                        "--checkpoints_total_limit", 2)

    assert_resumes_exactly(SCRIPT, resumed_flags, runs["full"][0], tmp_path, 6, [UNET, EMA_UNET], launch=launch)
    assert checkpoint_names(tmp_path) == ["checkpoint-7", "checkpoint-8"]
    assert not (tmp_path / "validation").exists()


def test_ema_decay_zero_equals_the_raw_unet_sharded_too(runs):
    output_dir, result = runs["decay_zero"]
    assert "FSDP2 units: 1 UNet2DConditionModel" in result.stderr, result.stderr[-3000:]
    assert_same(load_file(output_dir / EMA_UNET), load_file(output_dir / UNET))
    assert "ema/unet" in (output_dir / "README.md").read_text()
    # Gathered whole and written as the stock classes, not FSDP's: the stock pipeline loads them.
    assert isinstance(StableDiffusionPipeline.from_pretrained(output_dir).unet, UNet2DConditionModel)
    assert json.loads((output_dir / "ema/unet/config.json").read_text())["_class_name"] == "UNet2DConditionModel"


def test_input_perturbation_changes_the_result(runs):
    (perturbed, _), (unperturbed, _) = runs["input_perturbation"], runs["decay_zero"]
    assert_differ(load_file(perturbed / UNET), load_file(unperturbed / UNET))


def test_bad_input_fails_with_one_line_before_anything_loads(tiny, tmp_path):
    output_dir = tmp_path / "out"
    error = usage_error(SCRIPT, *common(tiny, output_dir, "--input_perturbation", -1))
    assert error == "error: --input_perturbation=-1.0: expected a non-negative number"
    assert not output_dir.exists()


def test_cached_run_matches_the_uncached_one(tiny, runs):
    (uncached, _), (cached, result) = runs["uncached"], runs["cached"]
    assert len(reported_buckets(result.stderr)) >= 3
    for name in (UNET, EMA_UNET):
        assert_close_files(uncached / name, cached / name)
    assert_differ(load_file(Path(tiny["sd"]) / UNET), load_file(cached / UNET))


def test_cached_run_validates_with_the_offloaded_encoders_back(runs):
    (uncached, _), (cached, _) = runs["uncached"], runs["cached"]
    assert_close_validations(uncached, cached, [(2, "raw"), (2, "ema"), (4, "raw"), (4, "ema")])
    assert {Image.open(path).size for path in rendered_images(cached)} == {(40, 16)}  # --validation_width/_height


@pytest.fixture(scope="module")
@launching
def sdxl_run(tiny, tmp_path_factory):
    """``(output_dir, result)`` of the SDXL script's one launch: 4 `common` steps on the tiny SDXL with a replacement
    VAE (the tiny one, its decoder shifted, in ``<root>/vae``), the EMA kept on the CPU, validating every 3 steps (and
    at the final step 4)."""
    root = tmp_path_factory.mktemp("sdxl")
    vae = AutoencoderKL.from_pretrained(tiny["sdxl"] / "vae")
    with torch.no_grad():
        vae.decoder.conv_out.bias += 0.5
    vae.save_pretrained(root / "vae")
    return root / "out", launch(SDXL_SCRIPT, *common(
        tiny, root / "out", "--max_train_steps", 4, "--pretrained_vae_model_name_or_path", root / "vae",
        "--ema_device", "cpu", "--validation_prompt", *PROMPTS, "--num_validation_images", 1,
        "--validation_inference_steps", 2, "--validation_steps", 3, model="sdxl"))


def test_sdxl_writes_a_loadable_pipeline_with_the_trained_unet_and_the_vae_it_trained_with(tiny, sdxl_run):
    output_dir, result = sdxl_run
    final = load_file(output_dir / UNET)
    pipe = StableDiffusionXLPipeline.from_pretrained(output_dir)
    assert_same(pipe.unet.state_dict(), final)
    assert all(tensor.dtype == torch.float32 for tensor in final.values())
    assert_differ(load_file(Path(tiny["sdxl"]) / UNET), final)
    frozen = [path.relative_to(tiny["sdxl"]) for folder in ("text_encoder", "text_encoder_2")
              for path in (Path(tiny["sdxl"]) / folder).glob("*.safetensors")]
    assert len(frozen) == 2
    for name in frozen:
        assert_same_files(Path(tiny["sdxl"]) / name, output_dir / name)
    assert_same_files(output_dir.parent / "vae/diffusion_pytorch_model.safetensors", output_dir / "vae" /
                      "diffusion_pytorch_model.safetensors")
    assert f"raw UNet: {output_dir / 'unet'}" in result.stdout


def test_sdxl_writes_the_ema_unet(tiny, sdxl_run):
    output_dir, _ = sdxl_run
    ema_unet = assert_model_folder_loads(UNet2DConditionModel, output_dir / "ema" / "unet",
                                         initial=Path(tiny["sdxl"]) / "unet").state_dict()
    assert_differ(ema_unet, load_file(output_dir / UNET))
    card = (output_dir / "README.md").read_text()
    assert f'StableDiffusionXLPipeline.from_pretrained("{output_dir}")' in card
    assert f'UNet2DConditionModel.from_pretrained("{output_dir}/ema/unet")' in card


def test_sdxl_validates_raw_and_ema_at_the_due_steps_and_the_final_step(sdxl_run):
    output_dir, _ = sdxl_run
    assert_validated_at(output_dir, [3, 4], ("raw", "ema"), PROMPTS, num_images=1)
