"""Smoke tests: the aMUSEd script end to end on the tiny aMUSEd, a full fine-tune and a LoRA launched together."""

import os

import numpy as np
import pytest
import torch
from diffusers import AmusedPipeline, UVit2DModel
from safetensors.torch import load_file

from helpers import launch, launch_together, launching, usage_error
from training_utils.testing import (assert_checkpoint_is_the_output, assert_model_folder_loads, assert_resumes_exactly,
                                    assert_validated_at, checkpoint_names, differing_keys)

SCRIPT = "amused/train_amused.py"
TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"
LORA = "pytorch_lora_weights.safetensors"
RESOLUTION = 64  # 4 x 4 tokens: the tiny VQ-GAN compresses 16 times, as aMUSEd's
PROMPT = "a red circle"


def full(tiny, output_dir, *extra):
    """The whole transformer on the instance folder's 6 pictures, 2 a batch (the VQ-GAN encoding one at a time), 4
    steps, an EMA, checkpoints every 2, half the captions dropped."""
    return ["--pretrained_model_name_or_path", tiny["amused"], "--instance_data_dir", tiny["instance"],
            "--resolution", RESOLUTION, "--train_batch_size", 2, "--output_dir", output_dir, "--max_train_steps", 4,
            "--learning_rate", 1e-2, "--lr_warmup_steps", 0, "--use_ema", "--ema_decay", 0.5,
            "--checkpointing_steps", 2, "--cond_dropout_prob", 0.5, "--split_vae_encode", 1, *extra]


def lora(tiny, output_dir, *extra):
    """A rank-4 LoRA (alpha 8) on one picture (upstream's --instance_data_image), 3 steps, an EMA."""
    return ["--pretrained_model_name_or_path", tiny["amused"], "--instance_data_image", tiny["instance"] / "0000.png",
            "--resolution", RESOLUTION, "--train_batch_size", 2, "--output_dir", output_dir, "--max_train_steps", 3,
            "--learning_rate", 5e-2, "--lr_warmup_steps", 0, "--use_lora", "--lora_r", 4, "--lora_alpha", 8,
            "--use_ema", "--ema_decay", 0.5, "--checkpointing_steps", 2, *extra]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}``, launched together: `full`, validating 2 images every 2 steps in 2 steps
    (upstream's --validation_prompts); `lora`, validating 1 image at its final step only."""
    root = tmp_path_factory.mktemp("runs")
    results = launch_together({
        "full": (SCRIPT, *full(tiny, root / "full", "--validation_prompts", PROMPT, "--validation_steps", 2,
                                "--num_validation_images", 2, "--validation_inference_steps", 2)),
        "lora": (SCRIPT, *lora(tiny, root / "lora", "--validation_prompt", PROMPT, "--num_validation_images", 1,
                                "--validation_inference_steps", 2)),
    })
    return {name: (root / name, result) for name, result in results.items()}


def render(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe(PROMPT, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="np").images


def test_full_run_writes_a_pipeline_with_the_trained_transformer_and_hard_links_the_rest(tiny, runs):
    output_dir, result = runs["full"]
    raw = assert_model_folder_loads(UVit2DModel, output_dir / "transformer",
                                    initial=tiny["amused"] / "transformer").state_dict()
    ema = assert_model_folder_loads(UVit2DModel, output_dir / "ema" / "transformer").state_dict()
    assert differing_keys(raw, ema)
    for untouched in ("vqvae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        assert os.path.samefile(output_dir / untouched, tiny["amused"] / untouched)
    assert f"raw transformer: {output_dir / 'transformer'}" in result.stdout
    card = (output_dir / "README.md").read_text()
    assert "AmusedPipeline.from_pretrained" in card and "ema/transformer" in card
    trained, base = render(AmusedPipeline.from_pretrained(output_dir)), render(AmusedPipeline.from_pretrained(
        tiny["amused"]))
    assert trained.shape == (1, RESOLUTION, RESOLUTION, 3) and not np.array_equal(trained, base)


def test_full_run_validates_raw_and_ema_and_resumes_exactly(tiny, tmp_path, runs):
    output_dir, _ = runs["full"]
    assert_validated_at(output_dir, [2, 4], ("raw", "ema"), [PROMPT], num_images=2)
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    files = [TRANSFORMER, f"ema/{TRANSFORMER}"]
    assert_checkpoint_is_the_output(output_dir / "checkpoint-4", output_dir, files)
    # Resumed without validation: bitwise the weights of the run that validated twice.
    assert_resumes_exactly(SCRIPT, lambda out: full(tiny, out), output_dir, tmp_path, 2, files, launch=launch)


def test_lora_run_writes_an_adapter_that_loads_at_its_scale_and_changes_the_render(tiny, runs):
    output_dir, result = runs["lora"]
    assert_validated_at(output_dir, [3], ("raw", "ema"), [PROMPT], num_images=1)
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and all(key.startswith("transformer.") for key in raw)
    assert {key.split(".")[-3] for key in raw} == {"to_q", "to_k", "to_v"}
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert checkpoint_names(output_dir) == ["checkpoint-2"]
    pipe = AmusedPipeline.from_pretrained(tiny["amused"])
    base = render(pipe)
    pipe.transformer.load_lora_adapter(output_dir, prefix="transformer", weight_name=LORA)
    layer = pipe.transformer.transformer_layers[0].attn1.to_q
    assert layer.scaling["default_0"] == 8 / 4  # --lora_alpha / --lora_r, read from the file's metadata
    assert not np.array_equal(render(pipe), base)
    assert "load_lora_adapter" in (output_dir / "README.md").read_text()


def test_lora_run_resumes_exactly(tiny, tmp_path, runs):
    output_dir, _ = runs["lora"]
    assert_resumes_exactly(SCRIPT, lambda out: lora(tiny, out), output_dir, tmp_path, 2, [LORA, f"ema/{LORA}"],
                           launch=launch)


def test_refuses_a_second_source_and_what_it_does_not_carry_before_loading(tiny, tmp_path):
    common = ["--pretrained_model_name_or_path", tiny["amused"], "--output_dir", tmp_path]
    assert usage_error(SCRIPT, *common, "--instance_data_dir", tiny["instance"], "--instance_data_image",
                       tiny["instance"] / "0000.png").startswith("error: --instance_data_dir/--instance_data_image=")
    assert usage_error(SCRIPT, *common, "--instance_data_dir", tmp_path / "none").startswith(
        "error: --instance_data_dir=")
    assert "text encoder stays frozen" in usage_error(SCRIPT, *common, "--instance_data_dir", tiny["instance"],
                                                      "--train_text_encoder")
    assert usage_error(SCRIPT, *common, "--instance_data_dir", tiny["instance"], "--min_masking_rate", 2).startswith(
        "error: --min_masking_rate=")
    assert usage_error(SCRIPT, *common, "--instance_data_dataset", tiny["shapes"], "--image_key", "picture",
                       "--prompt_key", "text").startswith("error: --image_key='picture': expected a column")
    assert "--ema_update_after_step is not supported" in usage_error(SCRIPT, *common, "--instance_data_dir",
                                                                     tiny["instance"], "--ema_update_after_step", 5)
