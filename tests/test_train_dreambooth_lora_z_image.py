"""Smoke tests: the Z-Image DreamBooth LoRA script end to end on the tiny fixtures, through accelerate launch.

That the training step feeds the transformer what the pipeline's sampling loop feeds it is `test_z_image`'s check."""


import pytest
import torch
from diffusers import ZImagePipeline
from PIL import Image
from safetensors.torch import load_file

from helpers import launch, launch_together, usage_error
from training_utils.testing import (assert_latents_cached_per_bucket, assert_lora_changes_pipeline_output,
                                    assert_resumes_exactly, assert_validated_at, checkpoint_names, most_common_bucket,
                                    reported_buckets)

SCRIPT = "dreambooth/train_dreambooth_lora_z_image.py"
LORA = "pytorch_lora_weights.safetensors"
INSTANCE_PROMPT = "a photo of sks triangle"
CLASS_PROMPT = "a photo of a triangle"
MAX_SEQUENCE_LENGTH = 32
BLOCKS = ("noise_refiner.0", "context_refiner.0", "layers.0", "layers.1")
# The instance pictures of mixed shapes (tiny's instance_mixed) in aspect-ratio buckets, each picture twice an epoch
# (12 samples: an epoch of at least 6 batches of 2), 30% of the samples on the empty prompt.
BUCKETED_SAMPLES = 12


def common(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["z_image"], "--instance_data_dir", tiny["instance"],
            "--instance_prompt", INSTANCE_PROMPT, "--output_dir", output_dir, "--resolution", 32,
            "--train_batch_size", 2, "--learning_rate", 1e-3, "--center_crop", "--random_flip", "--use_ema",
            "--ema_decay", 0.9, "--rank", 4, "--seed", 3, "--max_sequence_length", MAX_SEQUENCE_LENGTH, *extra]


@pytest.fixture(scope="module")
def bucketed(tiny):
    """The flags of `BUCKETED_SAMPLES`."""
    return ["--instance_data_dir", tiny["instance_mixed"], "--use_aspect_ratio_buckets", "--repeats", 2,
            "--caption_dropout", 0.3]


@pytest.fixture(scope="module")
def runs(tiny, bucketed, tmp_path_factory):
    """``{name: (output_dir, result)}`` of every run here that starts from scratch, launched together:

    - full: 8 `bucketed` steps, validating every 3 steps and at the end, checkpointing every 4 (step 4 falls
      mid-epoch), the VAE off the accelerator between steps (--offload);
    - cached: the same 8 steps with --cache_latents, on disk (--feature_cache_dir ``../features``), neither
      validating nor checkpointing;
    - prior_int8: prior preservation (class images in ``../class``, cropped to each sample's bucket) on the
      `bucketed` pictures (the instance, class and empty prompts in one run, each its own length) on an int8
      transformer under bf16 autocast, an adapter on the feed-forward output layers only, gradient checkpointing,
      3 steps.
    """
    root = tmp_path_factory.mktemp("runs")
    results = launch_together({
        "full": (SCRIPT, *common(tiny, root / "full", *bucketed, "--max_train_steps", 8,
                                 "--validation_prompt", "a sks triangle", "--num_validation_images", 1,
                                 "--validation_inference_steps", 2, "--validation_steps", 3,
                                 "--checkpointing_steps", 4, "--offload")),
        "cached": (SCRIPT, *common(tiny, root / "cached", *bucketed, "--max_train_steps", 8,
                                   "--checkpointing_steps", 1000, "--cache_latents",
                                   "--feature_cache_dir", root / "features")),
        "prior_int8": (SCRIPT, *common(tiny, root / "prior_int8", *bucketed, "--with_prior_preservation",
                                       "--class_data_dir", root / "class", "--class_prompt", CLASS_PROMPT,
                                       "--num_class_images", 2, "--sample_batch_size", 2, "--class_inference_steps", 2,
                                       "--max_train_steps", 3, "--quantize_base", "int8", "--mixed_precision", "bf16",
                                       "--lora_layers", "feed_forward.w2", "--weighting_scheme", "logit_normal",
                                       "--gradient_checkpointing")),
    })
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_raw_and_ema_transformer_lora_on_upstreams_default_layers(runs):
    output_dir, result = runs["full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and all(key.startswith("transformer.") and "lora" in key for key in raw)
    # The attention projections of every block: the noise and caption refiners' and the main ones'.
    adapted = {key.split(".lora")[0] for key in raw}
    assert adapted == {f"transformer.{block}.attention.{layer}" for block in BLOCKS
                       for layer in ("to_q", "to_k", "to_v", "to_out.0")}
    assert all(raw[key].shape == ema[key].shape and raw[key].dtype == torch.float32 for key in raw)
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert f"raw LoRA: {output_dir / LORA}" in result.stdout
    assert f"ema LoRA: {output_dir / 'ema' / LORA}" in result.stdout


def test_trains_in_buckets_and_validates_at_the_due_steps_in_the_most_common_one(runs):
    output_dir, result = runs["full"]
    buckets = reported_buckets(result.stderr)
    assert len(buckets) >= 3 and sum(buckets.values()) == BUCKETED_SAMPLES, result.stderr[-3000:]
    log = assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"), ["a sks triangle"], num_images=1)
    # Rendered at the most common bucket's size (the largest among equals), not the --resolution square.
    height, width = most_common_bucket(buckets)
    assert height != width
    assert {Image.open(output_dir / record["images"][0]).size for record in log} == {(width, height)}
    card = (output_dir / "README.md").read_text()
    assert "ZImagePipeline" in card and "load_lora_weights" in card and log[-1]["progress"] in card
    assert checkpoint_names(output_dir) == ["checkpoint-4", "checkpoint-8"]


def test_resumed_mid_epoch_run_ends_with_the_same_weights(tiny, bucketed, tmp_path, runs):
    # From the full run's checkpoint-4, mid-epoch (of at least 6 bucketed batches), with random flips, empty prompts
    # and repeats, never validating: the uninterrupted run (which validated after steps 3 and 6 and at the end), bit
    # for bit.
    def resumed_flags(output_dir):
        return common(tiny, output_dir, *bucketed, "--max_train_steps", 8, "--checkpointing_steps", 1000)

    assert_resumes_exactly(SCRIPT, resumed_flags, runs["full"][0], tmp_path, 4, [LORA, f"ema/{LORA}"], launch=launch)


def test_cached_latents_train_like_encoding_every_step_and_prompts_embed_as_the_pipeline_does(tiny, runs):
    (cached_dir, result), (encoded_dir, _) = runs["cached"], runs["full"]
    for name in (LORA, f"ema/{LORA}"):
        cached, encoded = load_file(cached_dir / name), load_file(encoded_dir / name)
        assert cached.keys() == encoded.keys()
        for key in cached:  # the VAE ran on other batch sizes: equal up to float rounding
            torch.testing.assert_close(cached[key], encoded[key], rtol=1e-4, atol=1e-5)
    features = cached_dir.parent / "features"
    pipe = ZImagePipeline.from_pretrained(tiny["z_image"])
    assert_latents_cached_per_bucket(features, result.stderr, pipe.vae_scale_factor)
    # What the run trained on, the instance prompt and (for the dropped samples) the empty one, is bitwise what the
    # pipeline's encode_prompt gives for the two: each prompt's own tokens.
    text = load_file(next(features.glob("text_embeddings-*/shard-*")))
    with torch.no_grad():
        expected, _ = pipe.encode_prompt([INSTANCE_PROMPT, ""], max_sequence_length=MAX_SEQUENCE_LENGTH,
                                         do_classifier_free_guidance=False)
    lengths = text["0/1"].tolist()
    assert lengths == [len(embeds) for embeds in expected] and MAX_SEQUENCE_LENGTH > lengths[0] > lengths[1]
    assert all(torch.equal(padded[:length], embeds) for padded, length, embeds in zip(text["0/0"], lengths, expected))


def test_prior_preservation_on_an_int8_base_generates_class_images_and_trains_the_named_layers(runs):
    output_dir, result = runs["prior_int8"]
    class_dir = output_dir.parent / "class"
    assert sorted(path.name for path in class_dir.iterdir()) == ["class-00000.png", "class-00001.png"]
    assert f"generated 2 class images into {class_dir}" in result.stdout
    raw = load_file(output_dir / LORA)
    assert {key.split(".lora")[0] for key in raw} == {f"transformer.{block}.feed_forward.w2" for block in BLOCKS}
    assert all(tensor.dtype == torch.float32 for tensor in raw.values())


def test_outputs_load_into_a_fresh_pipeline_and_change_its_output(tiny, runs):
    full_dir, prior_dir = runs["full"][0], runs["prior_int8"][0]
    assert_lora_changes_pipeline_output(tiny["z_image"], full_dir, full_dir / "ema", prior_dir,
                                        prompt=INSTANCE_PROMPT)


@pytest.mark.parametrize("flags, message", [
    (["--guidance_scale", 1], "--guidance_scale is not supported here: Z-Image's transformer takes no guidance "
                              "embedding (upstream's script ignores the flag); validation and class images use "
                              "ZImagePipeline's own classifier-free guidance"),
    (["--do_fp8_training"], "--do_fp8_training is not supported here: torchao's float8 training is not carried; "
                            "--quantize_base fp8 loads the frozen transformer in float8 instead"),
    (["--optimizer", "prodigy"], "--optimizer is not supported here: AdamW is the only optimizer here "
                                 "(--use_8bit_adam for bitsandbytes' 8-bit AdamW); Prodigy is not carried"),
    (["--caption_column", "text"], "--caption_column is not supported here: the images come from "
                                   "--instance_data_dir, captioned by --instance_prompt; a dataset with captions of "
                                   "its own is not carried yet"),
    (["--max_sequence_length", 0], "--max_sequence_length=0: expected a positive integer"),
    (["--lora_layers", "to_q,,to_k"], "--lora_layers='to_q,,to_k': expected comma-separated layer names"),
    (["--weighting_scheme", "logit_normal", "--logit_std", 0], "--logit_std=0.0: expected a positive number"),
])
def test_bad_flags_fail_in_one_line_before_anything_loads(tiny, tmp_path, flags, message):
    assert usage_error(SCRIPT, *common(tiny, tmp_path / "out", *flags)) == f"error: {message}"
    assert not (tmp_path / "out").exists()
