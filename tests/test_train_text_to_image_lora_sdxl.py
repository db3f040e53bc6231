"""Smoke tests: the SDXL text-to-image LoRA script end to end on the tiny fixtures, through ``accelerate launch``."""

import json
import shutil
from functools import partial

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, StableDiffusionXLPipeline
from PIL import Image
from safetensors.torch import load_file

from conftest import (assert_close_files, assert_close_validations, assert_same_files, launch, read_log,
                      runs_with_and_without_cached_latents)
from training_utils.data import ImageTransform, sample_generator

SCRIPT = "text_to_image/train_text_to_image_lora_sdxl.py"
LORA = "pytorch_lora_weights.safetensors"
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]
TEXT_ENCODER_HIDDEN = 32  # the tiny first encoder's width: prompt embeddings are [encoder 1 | encoder 2]
# (width, height) of the non-square pictures: at resolution 32 some center crops have an odd margin, so a flip
# moves the crop corner that SDXL's time ids hold.
NON_SQUARE_SIZES = [(64, 48), (50, 70), (70, 50), (48, 64)]


def common(tiny, output_dir, *extra, data_dir=None):
    return ["--pretrained_model_name_or_path", tiny["sdxl"], "--train_data_dir", data_dir or tiny["shapes"],
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3,
            "--random_flip", "--use_ema", "--ema_decay", 0.9, "--rank", 4, "--seed", 3, *extra]


def validation_flags(steps, prompts=PROMPTS, num_images=2):
    return ["--validation_prompt", *prompts, "--num_validation_images", num_images, "--validation_inference_steps", 2,
            "--validation_steps", steps]


def with_text_encoders(tiny, output_dir, *extra):
    return common(tiny, output_dir, "--train_text_encoder", "--checkpointing_steps", 2, "--checkpoints_total_limit", 2,
                  *extra)


def checkpoints(output_dir):
    return sorted(path.name for path in output_dir.glob("checkpoint-*"))


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory):
    """8 steps of UNet and text-encoder LoRA, validating every 3 steps (and at the final step), checkpoints every 2."""
    output_dir = tmp_path_factory.mktemp("full")
    result = launch(SCRIPT, *with_text_encoders(tiny, output_dir, "--max_train_steps", 8, *validation_flags(3)))
    return output_dir, result


@pytest.fixture(scope="module")
def resumed_run(tiny, tmp_path_factory):
    """The same run without validation, stopped after 6 steps and resumed from the latest checkpoint to 8."""
    output_dir = tmp_path_factory.mktemp("resumed")
    launch(SCRIPT, *with_text_encoders(tiny, output_dir, "--max_train_steps", 6))
    after_six = checkpoints(output_dir)
    result = launch(SCRIPT, *with_text_encoders(tiny, output_dir, "--max_train_steps", 8,
                                                "--resume_from_checkpoint", "latest"))
    return output_dir, after_six, result


@pytest.fixture(scope="module")
def decoder_only_vae(tiny, tmp_path_factory):
    """The tiny SDXL VAE saved on its own with a shifted decoder: it encodes the same latents, decodes other images."""
    path = tmp_path_factory.mktemp("vae")
    vae = AutoencoderKL.from_pretrained(tiny["sdxl"] / "vae")
    with torch.no_grad():
        vae.decoder.conv_out.bias += 0.5
    vae.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def unet_only_runs(tiny, tmp_path_factory, decoder_only_vae):
    """3 UNet-only steps with --ema_decay 0 and a validation at the final step, with the pipeline's VAE and with
    the replacement VAE."""
    root = tmp_path_factory.mktemp("unet_only")
    flags = ["--max_train_steps", 3, "--ema_decay", 0, "--checkpointing_steps", 1000,
             *validation_flags(3, PROMPTS[:1], 1)]
    launch(SCRIPT, *common(tiny, root / "own_vae", *flags))
    result = launch(SCRIPT, *common(tiny, root / "other_vae", *flags,
                                    "--pretrained_vae_model_name_or_path", decoder_only_vae))
    return root / "own_vae", root / "other_vae", result


def test_writes_raw_and_ema_lora_of_the_unet_and_both_text_encoders(full_run):
    output_dir, result = full_run
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and all("lora" in key for key in raw)
    assert {key.split(".")[0] for key in raw} == {"unet", "text_encoder", "text_encoder_2"}
    assert all(raw[key].shape == ema[key].shape and raw[key].dtype == torch.float32 for key in raw)
    for component in ("unet", "text_encoder", "text_encoder_2"):
        assert any(not torch.equal(raw[key], ema[key]) for key in raw if key.startswith(component + "."))
    assert f"raw LoRA: {output_dir / LORA}" in result.stdout
    assert f"ema LoRA: {output_dir / 'ema' / LORA}" in result.stdout


def test_unet_only_lora_and_ema_decay_zero_equals_the_raw_weights(unet_only_runs):
    own_vae, _, _ = unet_only_runs
    raw = load_file(own_vae / LORA)
    assert raw and all(key.startswith("unet.") and "lora" in key for key in raw)
    assert_same_files(own_vae / LORA, own_vae / "ema" / LORA)


def test_validates_at_the_due_steps_and_the_final_step_once(full_run):
    output_dir, _ = full_run
    log = read_log(output_dir)
    assert [(r["step"], r["variant"]) for r in log[::2]] == [(3, "raw"), (3, "ema"), (6, "raw"), (6, "ema"),
                                                              (8, "raw"), (8, "ema")]
    assert [r["prompt"] for r in log[:2]] == PROMPTS
    for record in log:
        assert len(record["images"]) == 2
        for path in record["images"]:
            assert Image.open(output_dir / path).size == (32, 32)
    assert len(list((output_dir / "validation").rglob("*.png"))) == 3 * 2 * 2 * 2  # steps x variants x prompts x images
    card = (output_dir / "README.md").read_text()
    assert "StableDiffusionXLPipeline.from_pretrained" in card and "load_lora_weights" in card
    assert "AutoencoderKL" not in card and log[-1]["images"][0] in card
    assert list((output_dir / "logs").rglob("events.out.tfevents.*")), "no tensorboard events written"


def test_prunes_checkpoints_and_resumes_to_the_uninterrupted_weights(full_run, resumed_run):
    output_dir, after_six, result = resumed_run
    assert after_six == ["checkpoint-4", "checkpoint-6"]
    assert f"resumed from {output_dir / 'checkpoint-6'} at step 6" in result.stdout
    assert checkpoints(output_dir) == ["checkpoint-6", "checkpoint-8"]
    assert checkpoints(full_run[0]) == ["checkpoint-6", "checkpoint-8"]
    files = {path.name for path in (output_dir / "checkpoint-8").iterdir()}
    assert {"trained_parameters.safetensors", "ema.safetensors", "training_state.json"} <= files
    # The uninterrupted run validated at steps 3, 6 and 8, the resumed one never: resuming mid-epoch
    # with random flips, and validating, both leave the weights bit for bit as they would be.
    assert not (output_dir / "validation").exists()
    assert_same_files(output_dir / LORA, full_run[0] / LORA)
    assert_same_files(output_dir / "ema" / LORA, full_run[0] / "ema" / LORA)


def test_outputs_load_into_a_fresh_pipeline_and_change_its_output(tiny, full_run):
    output_dir, _ = full_run
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"])
    pipe.set_progress_bar_config(disable=True)

    def render():
        with torch.no_grad():
            prompt_embeds, _, pooled, _ = pipe.encode_prompt(PROMPTS[0], device="cpu",
                                                             do_classifier_free_guidance=False)
        images = pipe(PROMPTS[0], num_inference_steps=2, height=32, width=32, output_type="np",
                      generator=torch.Generator().manual_seed(0)).images
        return prompt_embeds, pooled, images

    base_embeds, base_pooled, base = render()
    pipe.load_lora_weights(output_dir)
    raw_embeds, raw_pooled, with_raw = render()
    pipe.unload_lora_weights()
    pipe.load_lora_weights(output_dir / "ema")
    _, _, with_ema = render()
    # Both text encoders' adapters loaded: each half of the prompt embeddings and the pooled ones changed.
    assert not torch.allclose(raw_embeds[..., :TEXT_ENCODER_HIDDEN], base_embeds[..., :TEXT_ENCODER_HIDDEN], atol=1e-4)
    assert not torch.allclose(raw_embeds[..., TEXT_ENCODER_HIDDEN:], base_embeds[..., TEXT_ENCODER_HIDDEN:], atol=1e-4)
    assert not torch.allclose(raw_pooled, base_pooled, atol=1e-4)
    assert not np.allclose(base, with_raw, atol=1e-4)
    assert not np.allclose(base, with_ema, atol=1e-4)
    assert not np.allclose(with_raw, with_ema, atol=1e-6)


def test_replacement_vae_goes_into_the_pipeline(unet_only_runs, decoder_only_vae):
    own_vae, other_vae, result = unet_only_runs
    assert f"VAE: {decoder_only_vae}" in result.stdout
    # Its encoder is the pipeline's, so training is the same bit for bit; validation decodes with its decoder.
    assert_same_files(own_vae / LORA, other_vae / LORA)
    [own_record, _], [other_record, _] = read_log(own_vae), read_log(other_vae)
    own_image = np.asarray(Image.open(own_vae / own_record["images"][0]), dtype=np.int64)
    other_image = np.asarray(Image.open(other_vae / other_record["images"][0]), dtype=np.int64)
    assert np.abs(own_image - other_image).mean() > 10
    card = (other_vae / "README.md").read_text()
    assert f'vae=AutoencoderKL.from_pretrained("{decoder_only_vae}")' in card


def test_a_missing_vae_fails_with_one_line_before_anything_loads(tiny, tmp_path):
    output_dir, missing = tmp_path / "out", tmp_path / "no_vae"
    result = launch(SCRIPT, *common(tiny, output_dir, "--pretrained_vae_model_name_or_path", missing),
                    check=False, quiet=True)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "Loading pipeline components" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    expected = f"error: --pretrained_vae_model_name_or_path={str(missing)!r}: expected an AutoencoderKL folder"
    assert len(errors) == 1 and errors[0].startswith(expected), result.stderr[-2000:]
    assert not output_dir.exists()


@pytest.fixture(scope="module")
def non_square_shapes(tiny, tmp_path_factory):
    """Six shapes pictures at the non-square sizes, each with two captions (one drawn per sample)."""
    path = tmp_path_factory.mktemp("non_square_shapes")
    rows = [json.loads(line) for line in (tiny["shapes"] / "metadata.jsonl").read_text().splitlines()[:6]]
    with open(path / "metadata.jsonl", "w") as metadata:
        for index, row in enumerate(rows):
            image = Image.open(tiny["shapes"] / row["file_name"])
            image.resize(NON_SQUARE_SIZES[index % len(NON_SQUARE_SIZES)]).save(path / row["file_name"])
            captions = [row["text"], row["text"].replace(" on a ", " on the ")]
            metadata.write(json.dumps({"file_name": row["file_name"], "text": captions}) + "\n")
    return path


def cache_flags(tiny, data_dir, output_dir, *extra):
    return common(tiny, output_dir, "--center_crop", "--max_train_steps", 4, "--checkpointing_steps", 2,
                  "--report_to", "none", *validation_flags(4, PROMPTS[:1], 1), *extra, data_dir=data_dir)


@pytest.fixture(scope="module")
def cache_runs(tiny, non_square_shapes, tmp_path_factory):
    """``{cache_latents: output_dir}``: 4 UNet-only steps (two epochs of 3 batches) on the non-square pictures with
    center crops and random flips, validating at the final step. Both cache the frozen text encoders' embeddings."""
    return runs_with_and_without_cached_latents(SCRIPT, partial(cache_flags, tiny, non_square_shapes),
                                                tmp_path_factory.mktemp("cache"))


def test_the_non_square_pictures_flip_with_an_odd_margin(non_square_shapes):
    # The first epoch uses all six pictures: a flip there moves a crop corner, so time ids from the
    # unflipped corner would change the weights below.
    transform = ImageTransform(32, center_crop=True, random_flip=True)
    moved = []
    for index, path in enumerate(sorted(non_square_shapes.glob("*.png"))):
        width, height = Image.open(path).size
        layout = transform.draw_layout(width, height, sample_generator(3, 0, index))
        moved.append(layout.flip and layout.crop_top_left != (layout.top, layout.left))
    assert any(moved)


def test_cached_latents_and_text_embeddings_match_the_uncached_run(cache_runs):
    # Equal weights also mean equal time ids: shifting one flipped crop corner by a pixel moves them by ~3e-3.
    for name in (LORA, f"ema/{LORA}"):
        cached = assert_close_files(cache_runs[False] / name, cache_runs[True] / name)
        assert all(key.startswith("unet.") for key in cached)


def test_validation_renders_with_the_offloaded_encoders_back(cache_runs):
    assert_close_validations(cache_runs[False], cache_runs[True], [(4, "raw"), (4, "ema")])


def test_cached_run_resumed_mid_epoch_is_the_uninterrupted_one(tiny, non_square_shapes, cache_runs, tmp_path):
    shutil.copytree(cache_runs[True] / "checkpoint-2", tmp_path / "checkpoint-2")
    result = launch(SCRIPT, *cache_flags(tiny, non_square_shapes, tmp_path, "--cache_latents",
                                         "--resume_from_checkpoint", "latest"))
    assert f"resumed from {tmp_path / 'checkpoint-2'} at step 2" in result.stdout
    assert_same_files(tmp_path / LORA, cache_runs[True] / LORA)
    assert_same_files(tmp_path / "ema" / LORA, cache_runs[True] / "ema" / LORA)
