"""Smoke tests: the SDXL text-to-image LoRA script end to end on the tiny fixtures, through ``accelerate launch``."""

import itertools
import json

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, StableDiffusionXLPipeline
from PIL import Image
from safetensors.torch import load_file

from helpers import launch, launch_together, launching, usage_error
from training_utils.data.buckets import AspectRatioBuckets, BucketBatchSampler, on_the_fly_buckets
from training_utils.data.datasets import TrainDataset, sample_generator
from training_utils.data.images import ImageTransform
from training_utils.testing import (assert_checkpoint_is_the_output, assert_close_files, assert_close_validations,
                                    assert_resumes_exactly, assert_same_files, assert_validated_at, checkpoint_names,
                                    checkpoint_weight_files, most_common_bucket, read_log, rendered_images,
                                    reported_buckets)

SCRIPT = "text_to_image/train_text_to_image_lora_sdxl.py"
LORA = "pytorch_lora_weights.safetensors"
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]
TEXT_ENCODER_HIDDEN = 32  # the tiny first encoder's width: prompt embeddings are [encoder 1 | encoder 2]
# (width, height) of four more pictures, two of each: at resolution 32 their buckets (40 x 24 and 24 x 40, height x
# width) leave them a margin of 5 pixels on the width, so a flip moves the center crop's corner that SDXL's time ids
# hold.
ODD_MARGIN_SIZES = [(50, 70), (75, 40)]
# The cached and uncached runs' seed: their first steps draw a flipped odd-margin picture (checked below).
CACHE_SEED = 7
# Aspect-ratio buckets, each picture twice an epoch, 30% of the captions dropped.
BUCKETED = ["--use_aspect_ratio_buckets", "--repeats", 2, "--caption_dropout", 0.3]


def common(tiny, output_dir, *extra, data_dir=None, seed=3):
    return ["--pretrained_model_name_or_path", tiny["sdxl"], "--train_data_dir", data_dir or tiny["shapes"],
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3,
            "--random_flip", "--use_ema", "--ema_decay", 0.9, "--rank", 4, "--seed", seed, *extra]


def validation_flags(steps, prompts=PROMPTS, num_images=2):
    return ["--validation_prompt", *prompts, "--num_validation_images", num_images, "--validation_inference_steps", 2,
            "--validation_steps", steps]


def bucketed(tiny, data_dir, output_dir, *extra, seed=3):
    return common(tiny, output_dir, *BUCKETED, *extra, data_dir=data_dir, seed=seed)


def with_text_encoders(tiny, data_dir, output_dir, *extra):
    return bucketed(tiny, data_dir, output_dir, "--train_text_encoder", "--checkpointing_steps", 2,
                    "--checkpoints_total_limit", 2, *extra)


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
def mixed_shapes(tiny, tmp_path_factory):
    """The 12 mixed-shape pictures and four more at `ODD_MARGIN_SIZES`, each with two captions (one drawn per
    sample)."""
    path = tmp_path_factory.mktemp("mixed_shapes")
    rows = [json.loads(line) for line in (tiny["shapes_mixed"] / "metadata.jsonl").read_text().splitlines()]
    with open(path / "metadata.jsonl", "w") as metadata:
        for index, row in enumerate(rows + rows[:4]):
            image = Image.open(tiny["shapes_mixed"] / row["file_name"])
            if index >= len(rows):
                image = image.resize(ODD_MARGIN_SIZES[index % len(ODD_MARGIN_SIZES)])
            file_name = f"{index:04d}.png"
            image.save(path / file_name)
            captions = [row["text"], row["text"].replace(" on a ", " on the ")]
            metadata.write(json.dumps({"file_name": file_name, "text": captions}) + "\n")
    return path


def cache_flags(tiny, data_dir, output_dir, *extra):
    return bucketed(tiny, data_dir, output_dir, "--center_crop", "--max_train_steps", 4, "--checkpointing_steps", 2,
                    "--report_to", "none", *validation_flags(4, PROMPTS[:1], 1), *extra, seed=CACHE_SEED)


@pytest.fixture(scope="module")
@launching
def runs(tiny, decoder_only_vae, mixed_shapes, tmp_path_factory):
    """``{name: (output_dir, result)}`` of every run here that starts from scratch, launched together:

    - full: 8 `bucketed` steps of UNet and text-encoder LoRA on the mixed shapes, validating every 3 steps (and at
      the final step), checkpoints every 2, the newest 2 kept;
    - own_vae, other_vae: 3 UNet-only steps on the square pictures with ``--ema_decay 0`` and a validation at the
      final step, with the pipeline's VAE and with the replacement VAE;
    - uncached, cached: 4 UNet-only `bucketed` steps on the mixed shapes with center crops and random flips,
      validating at the final step, without and with ``--cache_latents``; both cache the frozen text encoders'
      embeddings.
    """
    root = tmp_path_factory.mktemp("runs")
    unet_only = ["--max_train_steps", 3, "--ema_decay", 0, "--checkpointing_steps", 1000,
                 *validation_flags(3, PROMPTS[:1], 1)]
    results = launch_together({
        "full": (SCRIPT, *with_text_encoders(tiny, mixed_shapes, root / "full", "--max_train_steps", 8,
                                             *validation_flags(3))),
        "own_vae": (SCRIPT, *common(tiny, root / "own_vae", *unet_only)),
        "other_vae": (SCRIPT, *common(tiny, root / "other_vae", *unet_only, "--pretrained_vae_model_name_or_path",
                                      decoder_only_vae)),
        "uncached": (SCRIPT, *cache_flags(tiny, mixed_shapes, root / "uncached")),
        "cached": (SCRIPT, *cache_flags(tiny, mixed_shapes, root / "cached", "--cache_latents")),
    })
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_raw_and_ema_lora_of_the_unet_and_both_text_encoders(runs):
    output_dir, result = runs["full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and all("lora" in key for key in raw)
    assert {key.split(".")[0] for key in raw} == {"unet", "text_encoder", "text_encoder_2"}
    assert all(raw[key].shape == ema[key].shape and raw[key].dtype == torch.float32 for key in raw)
    for component in ("unet", "text_encoder", "text_encoder_2"):
        assert any(not torch.equal(raw[key], ema[key]) for key in raw if key.startswith(component + "."))
    assert f"raw LoRA: {output_dir / LORA}" in result.stdout
    assert f"ema LoRA: {output_dir / 'ema' / LORA}" in result.stdout


def test_unet_only_lora_and_ema_decay_zero_equals_the_raw_weights(runs):
    own_vae, _ = runs["own_vae"]
    raw = load_file(own_vae / LORA)
    assert raw and all(key.startswith("unet.") and "lora" in key for key in raw)
    assert_same_files(own_vae / LORA, own_vae / "ema" / LORA)


def test_trains_in_several_buckets_and_validates_at_the_most_common(mixed_shapes, runs):
    output_dir, result = runs["full"]
    buckets = reported_buckets(result.stderr)
    assert len(buckets) >= 3 and sum(buckets.values()) == 2 * len(list(mixed_shapes.glob("*.png"))), buckets
    # Validation renders at the bucket that most samples train in (of equally common ones, the largest).
    height, width = most_common_bucket(buckets)
    assert (height, width) != (32, 32)
    assert {Image.open(path).size for path in rendered_images(output_dir)} == {(width, height)}


def test_validates_at_the_due_steps_and_the_final_step_once(runs):
    output_dir, _ = runs["full"]
    log = assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"), PROMPTS, num_images=2)
    assert len(rendered_images(output_dir)) == 3 * 2 * 2 * 2  # steps x variants x prompts x images
    card = (output_dir / "README.md").read_text()
    assert "StableDiffusionXLPipeline.from_pretrained" in card and "load_lora_weights" in card
    assert "AutoencoderKL" not in card and log[-1]["progress"] in card
    assert list((output_dir / "logs").rglob("events.out.tfevents.*")), "no tensorboard events written"


def test_prunes_checkpoints_and_resumes_to_the_uninterrupted_weights(tiny, mixed_shapes, tmp_path, runs):
    full_dir, _ = runs["full"]
    assert checkpoint_names(full_dir) == ["checkpoint-6", "checkpoint-8"]

    def resumed_flags(output_dir):
        return with_text_encoders(tiny, mixed_shapes, output_dir, "--max_train_steps", 8, "--checkpointing_steps", 1)

    # The uninterrupted run validated at steps 3, 6 (after writing checkpoint-6) and 8, the resumed one never:
    # resuming mid-epoch (of 16 batches) in buckets, with random flips, repeats and dropped captions (the text
    # encoders train: a dropped caption is tokenized as the empty prompt), and validating, both leave the weights
    # bit for bit as they would be.
    assert_resumes_exactly(SCRIPT, resumed_flags, full_dir, tmp_path, 6, [LORA, f"ema/{LORA}"], launch=launch)
    assert checkpoint_names(tmp_path) == ["checkpoint-7", "checkpoint-8"]
    assert checkpoint_weight_files(tmp_path / "checkpoint-8") == {LORA, f"ema/{LORA}"}
    assert not (tmp_path / "validation").exists()


def test_outputs_and_checkpoints_load_into_a_fresh_pipeline_and_change_its_output(tiny, runs):
    output_dir, _ = runs["full"]
    # The final step's checkpoint holds the output's files (UNet and both text encoders): the EMA loads from it.
    checkpoint = output_dir / "checkpoint-8"
    assert_checkpoint_is_the_output(checkpoint, output_dir, [LORA, f"ema/{LORA}"])
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
    pipe.load_lora_weights(checkpoint / "ema")
    _, _, with_ema = render()
    # Both text encoders' adapters loaded: each half of the prompt embeddings and the pooled ones changed.
    assert not torch.allclose(raw_embeds[..., :TEXT_ENCODER_HIDDEN], base_embeds[..., :TEXT_ENCODER_HIDDEN], atol=1e-4)
    assert not torch.allclose(raw_embeds[..., TEXT_ENCODER_HIDDEN:], base_embeds[..., TEXT_ENCODER_HIDDEN:], atol=1e-4)
    assert not torch.allclose(raw_pooled, base_pooled, atol=1e-4)
    assert not np.allclose(base, with_raw, atol=1e-4)
    assert not np.allclose(base, with_ema, atol=1e-4)
    assert not np.allclose(with_raw, with_ema, atol=1e-6)


def test_replacement_vae_goes_into_the_pipeline(runs, decoder_only_vae):
    (own_vae, _), (other_vae, result) = runs["own_vae"], runs["other_vae"]
    assert f"VAE: {decoder_only_vae}" in result.stdout
    # Its encoder is the pipeline's, so training is the same bit for bit; validation decodes with its decoder.
    assert_same_files(own_vae / LORA, other_vae / LORA)
    [_, own_record, _], [_, other_record, _] = read_log(own_vae), read_log(other_vae)
    own_image = np.asarray(Image.open(own_vae / own_record["images"][0]), dtype=np.int64)
    other_image = np.asarray(Image.open(other_vae / other_record["images"][0]), dtype=np.int64)
    assert np.abs(own_image - other_image).mean() > 10
    card = (other_vae / "README.md").read_text()
    assert f'vae=AutoencoderKL.from_pretrained("{decoder_only_vae}")' in card


def test_a_missing_vae_fails_with_one_line_before_anything_loads(tiny, tmp_path):
    output_dir, missing = tmp_path / "out", tmp_path / "no_vae"
    error = usage_error(SCRIPT, *common(tiny, output_dir, "--pretrained_vae_model_name_or_path", missing))
    assert error.startswith(f"error: --pretrained_vae_model_name_or_path={str(missing)!r}: expected an AutoencoderKL "
                            "folder")
    assert not output_dir.exists()


def test_a_picture_of_the_cached_runs_flips_with_an_odd_margin(mixed_shapes):
    # Of the samples of the cached and uncached runs' 4 steps (drawn as the runs draw them: the first 4 batches of
    # the seed's bucket order, each sample's flip from its own generator), one is flipped with an odd margin: it
    # moves a crop corner, so time ids from the unflipped corner would change the weights below.
    transform = ImageTransform(32, center_crop=True, random_flip=True,
                               buckets=AspectRatioBuckets(on_the_fly_buckets(32, 8), 8))  # the tiny SDXL's multiple
    sizes = [Image.open(path).size for path in sorted(mixed_shapes.glob("*.png"))]
    dataset = TrainDataset(sizes, None, CACHE_SEED, repeats=2, shapes=transform.shapes(sizes))
    moved = []
    for index in itertools.chain(*itertools.islice(BucketBatchSampler(dataset, 2, CACHE_SEED), 4)):
        width, height = sizes[index % len(sizes)]
        layout = transform.draw_layout(width, height, sample_generator(CACHE_SEED, 0, index))
        moved.append(layout.flip and layout.crop_top_left != (layout.top, layout.left))
    assert any(moved)


def test_cached_latents_and_text_embeddings_match_the_uncached_run(runs):
    # Equal weights also mean equal time ids: shifting one flipped crop corner by a pixel moves them by ~3e-3.
    (uncached, _), (cached, result) = runs["uncached"], runs["cached"]
    assert len(reported_buckets(result.stderr)) >= 3
    for name in (LORA, f"ema/{LORA}"):
        cached_weights = assert_close_files(uncached / name, cached / name)
        assert all(key.startswith("unet.") for key in cached_weights)


def test_validation_renders_with_the_offloaded_encoders_back(runs):
    (uncached, _), (cached, _) = runs["uncached"], runs["cached"]
    assert_close_validations(uncached, cached, [(4, "raw"), (4, "ema")])


def test_cached_run_resumed_mid_epoch_is_the_uninterrupted_one(tiny, mixed_shapes, runs, tmp_path):
    def resumed_flags(output_dir):
        return cache_flags(tiny, mixed_shapes, output_dir, "--cache_latents")

    assert_resumes_exactly(SCRIPT, resumed_flags, runs["cached"][0], tmp_path, 2, [LORA, f"ema/{LORA}"],
                           launch=launch)
