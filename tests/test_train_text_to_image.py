"""Smoke tests: the full UNet fine-tune script end to end on the tiny fixtures, through ``accelerate launch``."""

from functools import partial
from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from safetensors.torch import load_file

from conftest import (assert_close_files, assert_close_validations, assert_resume_is_exact, launch, read_log,
                      runs_with_and_without_cached_latents)
SCRIPT = "text_to_image/train_text_to_image.py"
UNET = "unet/diffusion_pytorch_model.safetensors"
EMA_UNET = "ema/" + UNET
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


def common(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["sd"], "--train_data_dir", tiny["shapes"],
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3,
            "--random_flip", "--use_ema", "--ema_decay", 0.9, "--seed", 3, *extra]


def assert_same(a, b):
    assert a.keys() == b.keys() and len(a) > 0
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[0]}"


def assert_differ(a, b):
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[key], b[key]) for key in a)


def without_prefix(tensors, prefix="unet."):
    assert all(key.startswith(prefix) for key in tensors)
    return {key[len(prefix):]: tensor for key, tensor in tensors.items()}


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory):
    """8 steps, validating every 3 steps (and at the final step 8), with a checkpoint every 4 and only the newest kept."""
    output_dir = tmp_path_factory.mktemp("full")
    result = launch(SCRIPT, *common(
        tiny, output_dir, "--max_train_steps", 8, "--validation_prompt", *PROMPTS, "--num_validation_images", 1,
        "--validation_inference_steps", 2, "--validation_steps", 3, "--checkpointing_steps", 4,
        "--checkpoints_total_limit", 1))
    return output_dir, result


@pytest.fixture(scope="module")
def plain_run(tiny, tmp_path_factory):
    """The same 8 steps without validation and without checkpoints."""
    output_dir = tmp_path_factory.mktemp("plain")
    launch(SCRIPT, *common(tiny, output_dir, "--max_train_steps", 8, "--checkpointing_steps", 1000))
    return output_dir


@pytest.fixture(scope="module")
def decay_zero_run(tiny, tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("decay0")
    launch(SCRIPT, *common(tiny, output_dir, "--max_train_steps", 3, "--ema_decay", 0, "--checkpointing_steps", 1000))
    return output_dir


def test_writes_a_loadable_pipeline_holding_the_final_in_run_weights(tiny, full_run):
    output_dir, result = full_run
    for name in ("model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json",
                 "tokenizer/tokenizer_config.json", "scheduler/scheduler_config.json", "ema/unet/config.json"):
        assert (output_dir / name).is_file(), name
    assert not list(output_dir.rglob(".incomplete-*"))
    # checkpoint-8 holds the trained tensors as they were in memory at the final step.
    final = without_prefix(load_file(output_dir / "checkpoint-8" / "trained_parameters.safetensors"))
    pipe = StableDiffusionPipeline.from_pretrained(output_dir)
    assert_same(pipe.unet.state_dict(), final)
    assert_same(load_file(output_dir / UNET), final)
    assert all(tensor.dtype == torch.float32 for tensor in final.values())
    assert_differ(load_file(Path(tiny["sd"]) / UNET), final)
    assert f"pipeline: {output_dir}" in result.stdout


def test_writes_the_ema_unet_from_the_final_ema_state(full_run):
    output_dir, result = full_run
    ema_unet = UNet2DConditionModel.from_pretrained(output_dir / "ema" / "unet").state_dict()
    shadows = without_prefix(load_file(output_dir / "checkpoint-8" / "ema.safetensors"))
    assert_same(ema_unet, shadows)
    assert_differ(ema_unet, load_file(output_dir / UNET))
    assert f"EMA UNet: {output_dir / 'ema' / 'unet'}" in result.stdout
    card = (output_dir / "README.md").read_text()
    assert f'StableDiffusionPipeline.from_pretrained("{output_dir}")' in card
    assert f'UNet2DConditionModel.from_pretrained("{output_dir}/ema/unet")' in card


def test_validates_raw_and_ema_at_the_due_steps_and_the_final_step_once(full_run):
    output_dir, _ = full_run
    log = read_log(output_dir)
    assert [(r["step"], r["variant"], r["prompt"]) for r in log] == [
        (step, variant, prompt) for step in (3, 6, 8) for variant in ("raw", "ema") for prompt in PROMPTS]
    for record in log:
        assert len(record["images"]) == 1 and (output_dir / record["images"][0]).is_file()
    assert len(list((output_dir / "validation").rglob("*.png"))) == 3 * 2 * 2
    assert log[-1]["images"][0] in (output_dir / "README.md").read_text()
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-8"]


def test_validation_and_checkpointing_leave_the_weights_untouched(full_run, plain_run):
    output_dir, _ = full_run
    assert_same(load_file(output_dir / UNET), load_file(plain_run / UNET))
    assert_same(load_file(output_dir / EMA_UNET), load_file(plain_run / EMA_UNET))
    assert not (plain_run / "validation").exists() and not list(plain_run.glob("checkpoint-*"))


def test_resumed_run_prunes_and_ends_with_the_uninterrupted_weights(tiny, tmp_path, full_run):
    # Mid-epoch, with random flips and an optimizer state for every UNet parameter: bit for bit.
    assert_resume_is_exact(SCRIPT, partial(common, tiny), tmp_path, full_run[0], [UNET, EMA_UNET])


def test_ema_decay_zero_equals_the_raw_unet(decay_zero_run):
    assert_same(load_file(decay_zero_run / EMA_UNET), load_file(decay_zero_run / UNET))
    assert "ema/unet" in (decay_zero_run / "README.md").read_text()


def test_input_perturbation_changes_the_result(tiny, tmp_path, decay_zero_run):
    launch(SCRIPT, *common(tiny, tmp_path, "--max_train_steps", 3, "--ema_decay", 0, "--checkpointing_steps", 1000,
                           "--input_perturbation", 0.1))
    assert_differ(load_file(tmp_path / UNET), load_file(decay_zero_run / UNET))


def test_bad_input_fails_with_one_line_before_anything_loads(tiny, tmp_path):
    output_dir = tmp_path / "out"
    result = launch(SCRIPT, *common(tiny, output_dir, "--input_perturbation", -1), check=False, quiet=True)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --input_perturbation=-1.0: expected a non-negative number"], result.stderr[-2000:]
    assert not output_dir.exists()


def cache_flags(*extra):
    """4 center-cropped, randomly flipped steps, validating and checkpointing every 2.

    Adam moves every UNet weight by up to the learning rate per step however small its gradient, so
    float-level differences (the VAE's results depend on its batch) grow with it: at 1e-3 they reach
    7e-5, at 5e-5 4e-6, while ignoring the flips would still change weights by 2e-4."""
    return ["--center_crop", "--learning_rate", 5e-5, "--max_train_steps", 4, "--checkpointing_steps", 2,
            "--validation_prompt", PROMPTS[0], "--num_validation_images", 1, "--validation_inference_steps", 2,
            "--validation_steps", 2, *extra]


@pytest.fixture(scope="module")
def cache_runs(tiny, tmp_path_factory):
    """``{cache_latents: output_dir}``: the same run with the VAE in the step and with its latents cached."""
    def run_args(output_dir, *extra):
        return common(tiny, output_dir, *cache_flags(*extra))

    return runs_with_and_without_cached_latents(SCRIPT, run_args, tmp_path_factory.mktemp("cache"))


def test_cached_run_matches_the_uncached_one(tiny, cache_runs):
    for name in (UNET, EMA_UNET):
        assert_close_files(cache_runs[False] / name, cache_runs[True] / name)
    assert_differ(load_file(Path(tiny["sd"]) / UNET), load_file(cache_runs[True] / UNET))


def test_cached_run_validates_with_the_offloaded_encoders_back(cache_runs):
    assert_close_validations(cache_runs[False], cache_runs[True], [(2, "raw"), (2, "ema"), (4, "raw"), (4, "ema")])
