"""Smoke tests: the DreamBooth LoRA script end to end on the tiny fixtures, through ``accelerate launch``."""

import shutil
from functools import partial

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file

from conftest import (assert_close_files, assert_close_validations, assert_resume_is_exact, assert_same_files, launch,
                      read_log, runs_with_and_without_cached_latents)
SCRIPT = "dreambooth/train_dreambooth_lora.py"
LORA = "pytorch_lora_weights.safetensors"
INSTANCE_PROMPT = "a photo of sks triangle"
CLASS_PROMPT = "a photo of a triangle"


def common(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["sd"], "--instance_data_dir", tiny["instance"],
            "--instance_prompt", INSTANCE_PROMPT, "--output_dir", output_dir, "--resolution", 32,
            "--train_batch_size", 2, "--learning_rate", 1e-3, "--random_flip", "--use_ema", "--ema_decay", 0.9,
            "--rank", 4, "--seed", 3, *extra]


def prior_flags(class_dir):
    """Prior preservation and a text-encoder LoRA, with an EMA equal to the raw weights."""
    return ["--with_prior_preservation", "--class_data_dir", class_dir, "--class_prompt", CLASS_PROMPT,
            "--num_class_images", 3, "--sample_batch_size", 2, "--class_inference_steps", 2,
            "--train_text_encoder", "--ema_decay", 0, "--max_train_steps", 3, "--checkpointing_steps", 1000]


def snapshot(folder):
    return {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def four_images(tiny, tmp_path_factory):
    """Flags for 4 instance images, one per batch: 4 steps an epoch, so step 6 falls mid-epoch."""
    folder = tmp_path_factory.mktemp("four")
    for path in sorted(tiny["instance"].iterdir())[:4]:
        shutil.copy(path, folder / path.name)
    return ["--instance_data_dir", folder, "--train_batch_size", 1]


@pytest.fixture(scope="module")
def full_run(tiny, four_images, tmp_path_factory):
    """8 steps, validating every 3 steps and at the end, checkpointing every 3."""
    output_dir = tmp_path_factory.mktemp("full")
    result = launch(SCRIPT, *common(tiny, output_dir, *four_images, "--max_train_steps", 8,
                                    "--validation_prompt", "a sks triangle",
                                    "--num_validation_images", 1, "--validation_inference_steps", 2,
                                    "--validation_steps", 3, "--checkpointing_steps", 3))
    return output_dir, result


@pytest.fixture(scope="module")
def prior_runs(tiny, tmp_path_factory):
    """Prior preservation twice with the same class folder: the first run fills it, the second finds it full."""
    root = tmp_path_factory.mktemp("prior")
    class_dir = root / "class"
    first = launch(SCRIPT, *common(tiny, root / "first", *prior_flags(class_dir)))
    after_first = snapshot(class_dir)
    second = launch(SCRIPT, *common(tiny, root / "second", *prior_flags(class_dir)))
    return root, class_dir, (first, second), after_first


def test_writes_raw_and_ema_unet_lora_with_equal_keys_and_different_values(full_run):
    output_dir, result = full_run
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and len(raw) > 0
    assert all(key.startswith("unet.") and "lora" in key for key in raw)
    assert all(raw[key].shape == ema[key].shape and raw[key].dtype == torch.float32 for key in raw)
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert f"raw LoRA: {output_dir / LORA}" in result.stdout
    assert f"ema LoRA: {output_dir / 'ema' / LORA}" in result.stdout


def test_validates_at_the_due_steps_and_the_final_step_once(full_run):
    output_dir, _ = full_run
    log = read_log(output_dir)
    assert [(r["step"], r["variant"]) for r in log] == [(3, "raw"), (3, "ema"), (6, "raw"), (6, "ema"),
                                                        (8, "raw"), (8, "ema")]
    for record in log:
        assert record["prompt"] == "a sks triangle"
        assert len(record["images"]) == 1 and (output_dir / record["images"][0]).is_file()
    assert len(list((output_dir / "validation").rglob("*.png"))) == 6
    card = (output_dir / "README.md").read_text()
    assert "DreamBooth LoRA" in card and "load_lora_weights" in card and log[-1]["images"][0] in card
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]


def test_resumed_run_prunes_and_ends_with_the_same_weights(tiny, four_images, tmp_path, full_run):
    # Resumed mid-epoch, with random flips and crops: the uninterrupted run (which also validated and
    # checkpointed on other steps), bit for bit.
    assert_resume_is_exact(SCRIPT, partial(common, tiny), tmp_path, full_run[0], [LORA, f"ema/{LORA}"], *four_images)


def test_prior_preservation_generates_the_class_images_once(prior_runs):
    root, class_dir, (first, second), after_first = prior_runs
    assert sorted(after_first) == ["class-00000.png", "class-00001.png", "class-00002.png"]
    assert f"generated 3 class images into {class_dir}" in first.stdout
    assert snapshot(class_dir) == after_first, "the second run touched the class images"
    assert f"{class_dir} holds 3 class images; none generated" in second.stdout
    assert "generated 3" not in second.stdout


def test_class_image_generation_leaves_training_untouched(prior_runs):
    # The first run generated before training, the second did not: the same weights, bit for bit.
    root, *_ = prior_runs
    assert_same_files(root / "first" / LORA, root / "second" / LORA)


def test_text_encoder_lora_is_saved_with_the_unet_lora_and_ema_decay_zero_equals_raw(prior_runs):
    root, *_ = prior_runs
    raw = load_file(root / "first" / LORA)
    assert all("lora" in key for key in raw)
    assert {key.split(".")[0] for key in raw} == {"unet", "text_encoder"}
    assert_same_files(root / "first" / LORA, root / "first" / "ema" / LORA)


def test_outputs_load_into_a_fresh_pipeline_and_change_its_output(tiny, full_run, prior_runs):
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)
    input_ids = pipe.tokenizer(INSTANCE_PROMPT, padding="max_length", max_length=pipe.tokenizer.model_max_length,
                               return_tensors="pt").input_ids

    def render():
        with torch.no_grad():
            embeddings = pipe.text_encoder(input_ids)[0]
        images = pipe(INSTANCE_PROMPT, num_inference_steps=2, height=32, width=32, output_type="np",
                      generator=torch.Generator().manual_seed(0)).images
        return embeddings, images

    base_embeddings, base = render()
    pipe.load_lora_weights(full_run[0])
    unet_embeddings, with_unet_lora = render()
    assert torch.equal(unet_embeddings, base_embeddings)
    assert not np.allclose(base, with_unet_lora, atol=1e-4)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(prior_runs[0] / "first")
    both_embeddings, with_both = render()
    assert not torch.allclose(both_embeddings, base_embeddings, atol=1e-4)
    assert not np.allclose(base, with_both, atol=1e-4)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--instance_data_dir", "{tmp}"], "error: --instance_data_dir='{tmp}': expected a folder holding images"),
        (["--with_prior_preservation", "--class_data_dir", "{tmp}/class"],
         "error: --class_prompt=None: expected a non-empty prompt with --with_prior_preservation"),
    ],
)
def test_bad_input_fails_with_one_line_before_anything_loads(tiny, tmp_path, flags, message):
    output_dir = tmp_path / "out"
    flags = [str(flag).format(tmp=tmp_path) for flag in flags]
    result = launch(SCRIPT, *common(tiny, output_dir, *flags), check=False, quiet=True)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [message.format(tmp=tmp_path)], result.stderr[-2000:]
    assert not output_dir.exists() and not (tmp_path / "class").exists()


def cache_flags(class_dir, *extra):
    """4 center-cropped, randomly flipped steps with prior preservation (a frozen text encoder), validating
    and checkpointing every 2. The 6 instance images pair with 3 class images, each drawn twice an epoch."""
    return ["--center_crop", "--with_prior_preservation", "--class_data_dir", class_dir, "--class_prompt", CLASS_PROMPT,
            "--num_class_images", 3, "--sample_batch_size", 3, "--class_inference_steps", 2, "--max_train_steps", 4,
            "--checkpointing_steps", 2, "--validation_prompt", "a sks triangle", "--num_validation_images", 1,
            "--validation_inference_steps", 2, "--validation_steps", 2, *extra]


@pytest.fixture(scope="module")
def cache_runs(tiny, tmp_path_factory):
    """``{cache_latents: output_dir}`` and the class folder: the uncached run generates the class images
    that the cached run then encodes once, with the instance images."""
    root = tmp_path_factory.mktemp("cache")
    def run_args(output_dir, *extra):
        return common(tiny, output_dir, *cache_flags(root / "class", *extra))

    return runs_with_and_without_cached_latents(SCRIPT, run_args, root), root / "class"


def test_cached_run_with_prior_preservation_matches_the_uncached_one(cache_runs):
    outputs, _ = cache_runs
    for name in (LORA, f"ema/{LORA}"):
        cached = assert_close_files(outputs[False] / name, outputs[True] / name)
        assert all(key.startswith("unet.") for key in cached)


def test_cached_run_validates_with_the_offloaded_encoders_back(cache_runs):
    outputs, _ = cache_runs
    assert_close_validations(outputs[False], outputs[True], [(2, "raw"), (2, "ema"), (4, "raw"), (4, "ema")])


def test_cached_run_resumed_mid_epoch_is_the_uninterrupted_one(tiny, tmp_path, cache_runs):
    outputs, class_dir = cache_runs
    shutil.copytree(outputs[True] / "checkpoint-2", tmp_path / "checkpoint-2")
    result = launch(SCRIPT, *common(tiny, tmp_path, *cache_flags(class_dir, "--cache_latents",
                                                                 "--resume_from_checkpoint", "latest")))
    assert f"resumed from {tmp_path / 'checkpoint-2'} at step 2" in result.stdout
    assert f"{class_dir} holds 3 class images; none generated" in result.stdout
    for name in (LORA, f"ema/{LORA}"):
        assert_same_files(tmp_path / name, outputs[True] / name)


def test_cached_latents_without_prior_and_with_a_trained_text_encoder_match_the_uncached_run(tiny, tmp_path):
    """No class half in the cached batch, and prompts encoded in the step by the trained text encoder."""
    def run_args(output_dir, *extra):
        return common(tiny, output_dir, "--center_crop", "--train_text_encoder", "--max_train_steps", 3,
                      "--checkpointing_steps", 1000, *extra)

    outputs = runs_with_and_without_cached_latents(SCRIPT, run_args, tmp_path)
    for name in (LORA, f"ema/{LORA}"):
        cached = assert_close_files(outputs[False] / name, outputs[True] / name)
        assert {key.split(".")[0] for key in cached} == {"unet", "text_encoder"}
