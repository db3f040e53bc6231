"""Smoke tests: the SD3 DreamBooth LoRA script end to end on the tiny fixtures, through ``accelerate launch``."""

import importlib.util
import json

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from PIL import Image
from safetensors.torch import load_file

from helpers import EXAMPLES, launch, launch_together, launched_usage_error
from training_utils.errors import UsageError
from training_utils.testing import (assert_latents_cached_per_bucket, assert_resumes_exactly, assert_same_files,
                                    assert_validated_at, checkpoint_names, rendered_images, reported_buckets)

SCRIPT = "dreambooth/train_dreambooth_lora_sd3.py"
LORA = "pytorch_lora_weights.safetensors"
INSTANCE_PROMPT = "a photo of sks triangle"
CLASS_PROMPT = "a photo of a triangle"
# A validation size that is no bucket's (the buckets are made for --resolution 32).
VALIDATION_HEIGHT, VALIDATION_WIDTH = 32, 48


def common(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["sd3"], "--instance_data_dir", tiny["instance"],
            "--instance_prompt", INSTANCE_PROMPT, "--output_dir", output_dir, "--resolution", 32,
            "--train_batch_size", 2, "--learning_rate", 1e-3, "--center_crop", "--random_flip", "--use_ema",
            "--ema_decay", 0.9, "--rank", 4, "--seed", 3, *extra]


def bucketed(tiny):
    """The 6 instance images of mixed shapes in aspect-ratio buckets, one per batch, each seen twice an epoch: 12
    steps an epoch, so step 6 falls mid-epoch. The instance prompt is dropped with probability 0.3."""
    return ["--instance_data_dir", tiny["instance_mixed"], "--train_batch_size", 1, "--use_aspect_ratio_buckets",
            "--caption_dropout", 0.3, "--repeats", 2]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}`` of every run here that starts from scratch, launched together:

    - full: 8 steps on the `bucketed` images, validating every 3 steps and at the end (at `VALIDATION_HEIGHT` x
      `VALIDATION_WIDTH`), checkpointing every 3, the VAE off the accelerator between steps (--offload);
    - cached: the same 8 steps with --cache_latents, on disk (--feature_cache_dir ``../features``), neither
      validating nor checkpointing;
    - blocks: block 0 only, text-encoder adapters, prior preservation (class images in ``../class``) with cached
      latents and caption dropout (the trained encoders embed three prompts in every step), an EMA equal to the raw
      weights; also the velocity loss with cosmap weighting, and gradient checkpointing.
    """
    root = tmp_path_factory.mktemp("runs")
    results = launch_together({
        "full": (SCRIPT, *common(tiny, root / "full", *bucketed(tiny), "--max_train_steps", 8,
                                 "--validation_prompt", "a sks triangle", "--num_validation_images", 1,
                                 "--validation_inference_steps", 2, "--validation_steps", 3,
                                 "--validation_height", VALIDATION_HEIGHT, "--validation_width", VALIDATION_WIDTH,
                                 "--checkpointing_steps", 3, "--offload")),
        "cached": (SCRIPT, *common(tiny, root / "cached", *bucketed(tiny), "--max_train_steps", 8,
                                   "--checkpointing_steps", 1000, "--cache_latents",
                                   "--feature_cache_dir", root / "features")),
        "blocks": (SCRIPT, *common(tiny, root / "blocks", "--lora_blocks", 0, "--train_text_encoder", "--ema_decay", 0,
                                   "--with_prior_preservation", "--class_data_dir", root / "class",
                                   "--class_prompt", CLASS_PROMPT, "--num_class_images", 2, "--sample_batch_size", 2,
                                   "--class_inference_steps", 2, "--cache_latents", "--caption_dropout", 0.3,
                                   "--max_train_steps", 3,
                                   "--precondition_outputs", 0, "--weighting_scheme", "cosmap",
                                   "--gradient_checkpointing")),
    })
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_raw_and_ema_transformer_lora_with_equal_keys_and_different_values(runs):
    output_dir, result = runs["full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and len(raw) > 0
    assert all(key.startswith("transformer.") and "lora" in key for key in raw)
    # The default --lora_layers: the attention projections, in every block.
    adapted = {key.split(".lora")[0] for key in raw}
    assert adapted == {f"transformer.transformer_blocks.{block}.attn.{layer}" for block in (0, 1)
                       for layer in ("to_q", "to_k", "to_v", "to_out.0")}
    assert all(raw[key].shape == ema[key].shape and raw[key].dtype == torch.float32 for key in raw)
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert f"raw LoRA: {output_dir / LORA}" in result.stdout
    assert f"ema LoRA: {output_dir / 'ema' / LORA}" in result.stdout


def test_validates_at_the_due_steps_and_the_final_step_once_at_the_validation_size(runs):
    output_dir, _ = runs["full"]
    log = assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"), ["a sks triangle"], num_images=1)
    images = rendered_images(output_dir)
    assert len(images) == 6
    assert all(Image.open(path).size == (VALIDATION_WIDTH, VALIDATION_HEIGHT) for path in images)
    card = (output_dir / "README.md").read_text()
    assert "StableDiffusion3Pipeline" in card and "load_lora_weights" in card and log[-1]["progress"] in card
    assert checkpoint_names(output_dir) == ["checkpoint-3", "checkpoint-6"]


def test_resumed_run_prunes_and_ends_with_the_same_weights(tiny, tmp_path, runs):
    # From the full run's checkpoint-6, mid-epoch, with buckets, random flips and dropped prompts, never validating,
    # checkpointing at every step and keeping two: the uninterrupted run (which validated after writing checkpoint-6
    # and at the end), bit for bit, and the checkpoint it resumed from pruned.
    def resumed_flags(output_dir):
        return common(tiny, output_dir, *bucketed(tiny), "--max_train_steps", 8, "--checkpointing_steps", 1,
                      "--checkpoints_total_limit", 2)

    assert_resumes_exactly(SCRIPT, resumed_flags, runs["full"][0], tmp_path, 6, [LORA, f"ema/{LORA}"], launch=launch)
    assert checkpoint_names(tmp_path) == ["checkpoint-7", "checkpoint-8"]


def test_bucketed_runs_train_in_several_buckets(runs):
    for name in ("full", "cached"):
        buckets = reported_buckets(runs[name][1].stderr)
        # The 6 images twice, in several buckets (each image's own bucket, for both repeats).
        assert sum(buckets.values()) == 12 and len(buckets) > 2, (name, buckets)
        assert all(images % 2 == 0 for images in buckets.values()), (name, buckets)


def test_cached_latents_train_like_encoding_every_step(tiny, runs):
    (cached_dir, cached_result), (encoded_dir, _) = runs["cached"], runs["full"]
    for name in (LORA, f"ema/{LORA}"):
        cached, encoded = load_file(cached_dir / name), load_file(encoded_dir / name)
        assert cached.keys() == encoded.keys()
        for key in cached:  # the VAE ran on other batch sizes: equal up to float rounding
            torch.testing.assert_close(cached[key], encoded[key], rtol=1e-4, atol=1e-5)
    # On disk: one store per bucket, holding its images' latents in its shape (both flips; each image once, though
    # it is seen twice an epoch), and the two prompts' (instance, empty) two embeddings (hidden states, pooled).
    vae_config = json.loads((tiny["sd3"] / "vae" / "config.json").read_text())
    vae_scale_factor = 2 ** (len(vae_config["block_out_channels"]) - 1)
    assert_latents_cached_per_bucket(cached_dir.parent / "features", cached_result.stderr, vae_scale_factor)
    text = load_file(next((cached_dir.parent / "features").glob("text_embeddings-*/shard-*")))
    assert sorted(text) == ["0/0", "0/1", "0/indices"] and text["0/indices"].tolist() == [0, 1]


def test_lora_blocks_restricts_the_transformer_adapter_and_text_encoders_are_saved(runs):
    output_dir, result = runs["blocks"]
    class_dir = output_dir.parent / "class"
    raw = load_file(output_dir / LORA)
    assert all("lora" in key for key in raw)
    assert {key.split(".")[0] for key in raw} == {"transformer", "text_encoder", "text_encoder_2"}
    transformer_keys = [key for key in raw if key.startswith("transformer.")]
    assert transformer_keys and all(key.startswith("transformer.transformer_blocks.0.") for key in transformer_keys)
    assert_same_files(output_dir / LORA, output_dir / "ema" / LORA)
    assert sorted(path.name for path in class_dir.iterdir()) == ["class-00000.png", "class-00001.png"]
    assert f"generated 2 class images into {class_dir}" in result.stdout


def test_outputs_load_into_a_fresh_pipeline_and_change_its_output(tiny, runs):
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny["sd3"])
    pipe.set_progress_bar_config(disable=True)

    def render():
        with torch.no_grad():
            embeddings = pipe.encode_prompt(INSTANCE_PROMPT, None, None, device="cpu",
                                            do_classifier_free_guidance=False)[0]
        images = pipe(INSTANCE_PROMPT, num_inference_steps=2, height=32, width=32, output_type="np",
                      generator=torch.Generator().manual_seed(0)).images
        return embeddings, images

    base_embeddings, base = render()
    pipe.load_lora_weights(runs["full"][0])
    transformer_embeddings, with_transformer_lora = render()
    assert torch.equal(transformer_embeddings, base_embeddings)
    assert not np.allclose(base, with_transformer_lora, atol=1e-4)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(runs["blocks"][0])
    both_embeddings, with_both = render()
    assert not torch.allclose(both_embeddings, base_embeddings, atol=1e-4)
    assert not np.allclose(base, with_both, atol=1e-4)


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_dreambooth_lora_sd3", EXAMPLES / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lora_blocks", "0,x"], "--lora_blocks='0,x': expected comma-separated block indices, e.g. 0,12"),
        (["--lora_layers", "to_q,,to_k"], "--lora_layers='to_q,,to_k': expected comma-separated layer names"),
        (["--weighting_scheme", "sigma_sqrt", "--logit_std", -1], "--logit_std=-1.0: expected a positive number"),
    ],
)
def test_bad_flags_fail_before_anything_loads(script, tiny, tmp_path, flags, message):
    with pytest.raises(UsageError) as error:
        script.parse_args([str(flag) for flag in common(tiny, tmp_path / "out", *flags)])
    assert str(error.value) == message
    assert not (tmp_path / "out").exists()


def test_a_block_the_transformer_lacks_fails_with_one_line(tiny, tmp_path):
    # Checked against the loaded transformer, so through a real launch: one line, no traceback, a failed launch.
    output_dir = tmp_path / "out"
    result = launch(SCRIPT, *common(tiny, output_dir, "--lora_blocks", "0,2"), check=False, quiet=True)
    error = launched_usage_error(result)
    assert error == "error: --lora_blocks=2: expected a block index below 2 (the transformer has 2 blocks)"
    assert not (output_dir / LORA).exists()
