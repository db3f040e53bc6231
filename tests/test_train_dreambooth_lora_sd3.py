"""Smoke tests: the SD3 DreamBooth LoRA script end to end on the tiny fixtures, through ``accelerate launch``."""

import importlib.util
import shutil
from functools import partial

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline
from safetensors.torch import load_file

from conftest import EXAMPLES, assert_resume_is_exact, assert_same_files, launch, read_log
from training_utils.args import UsageError

SCRIPT = "dreambooth/train_dreambooth_lora_sd3.py"
LORA = "pytorch_lora_weights.safetensors"
INSTANCE_PROMPT = "a photo of sks triangle"
CLASS_PROMPT = "a photo of a triangle"


def common(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["sd3"], "--instance_data_dir", tiny["instance"],
            "--instance_prompt", INSTANCE_PROMPT, "--output_dir", output_dir, "--resolution", 32,
            "--train_batch_size", 2, "--learning_rate", 1e-3, "--center_crop", "--random_flip", "--use_ema",
            "--ema_decay", 0.9, "--rank", 4, "--seed", 3, *extra]


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
def blocks_run(tiny, tmp_path_factory):
    """Block 0 only, text-encoder adapters, prior preservation with cached latents, an EMA equal to the raw weights;
    also the velocity loss with cosmap weighting, and gradient checkpointing."""
    root = tmp_path_factory.mktemp("blocks")
    result = launch(SCRIPT, *common(tiny, root / "out", "--lora_blocks", 0, "--train_text_encoder", "--ema_decay", 0,
                                    "--with_prior_preservation", "--class_data_dir", root / "class",
                                    "--class_prompt", CLASS_PROMPT, "--num_class_images", 2, "--sample_batch_size", 2,
                                    "--class_inference_steps", 2, "--cache_latents", "--max_train_steps", 3,
                                    "--precondition_outputs", 0, "--weighting_scheme", "cosmap",
                                    "--gradient_checkpointing"))
    return root, result


def test_writes_raw_and_ema_transformer_lora_with_equal_keys_and_different_values(full_run):
    output_dir, result = full_run
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
    assert "StableDiffusion3Pipeline" in card and "load_lora_weights" in card and log[-1]["images"][0] in card
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]


def test_resumed_run_prunes_and_ends_with_the_same_weights(tiny, four_images, tmp_path, full_run):
    # Resumed mid-epoch, with random flips and never validating: the uninterrupted run, which validated
    # three times and checkpointed on other steps, bit for bit.
    assert_resume_is_exact(SCRIPT, partial(common, tiny), tmp_path, full_run[0], [LORA, f"ema/{LORA}"], *four_images)


def test_cached_latents_train_like_encoding_every_step(tiny, four_images, tmp_path, full_run):
    launch(SCRIPT, *common(tiny, tmp_path, *four_images, "--max_train_steps", 8, "--checkpointing_steps", 1000,
                           "--cache_latents"))
    for name in (LORA, f"ema/{LORA}"):
        cached, encoded = load_file(tmp_path / name), load_file(full_run[0] / name)
        assert cached.keys() == encoded.keys()
        for key in cached:  # the VAE ran on other batch sizes: equal up to float rounding
            torch.testing.assert_close(cached[key], encoded[key], rtol=1e-4, atol=1e-5)


def test_lora_blocks_restricts_the_transformer_adapter_and_text_encoders_are_saved(blocks_run):
    root, result = blocks_run
    raw = load_file(root / "out" / LORA)
    assert all("lora" in key for key in raw)
    assert {key.split(".")[0] for key in raw} == {"transformer", "text_encoder", "text_encoder_2"}
    transformer_keys = [key for key in raw if key.startswith("transformer.")]
    assert transformer_keys and all(key.startswith("transformer.transformer_blocks.0.") for key in transformer_keys)
    assert_same_files(root / "out" / LORA, root / "out" / "ema" / LORA)
    assert sorted(path.name for path in (root / "class").iterdir()) == ["class-00000.png", "class-00001.png"]
    assert f"generated 2 class images into {root / 'class'}" in result.stdout


def test_outputs_load_into_a_fresh_pipeline_and_change_its_output(tiny, full_run, blocks_run):
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
    pipe.load_lora_weights(full_run[0])
    transformer_embeddings, with_transformer_lora = render()
    assert torch.equal(transformer_embeddings, base_embeddings)
    assert not np.allclose(base, with_transformer_lora, atol=1e-4)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(blocks_run[0] / "out")
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
        (["--lora_layers", "to_q,,to_k"], "--lora_layers='to_q,,to_k': expected comma-separated module names"),
        (["--weighting_scheme", "sigma_sqrt", "--logit_std", -1], "--logit_std=-1.0: expected a positive number"),
    ],
)
def test_bad_flags_fail_before_anything_loads(script, tiny, tmp_path, flags, message):
    with pytest.raises(UsageError) as error:
        script.parse_args([str(flag) for flag in common(tiny, tmp_path / "out", *flags)])
    assert str(error.value) == message
    assert not (tmp_path / "out").exists()


def test_cached_latents_need_center_crops(script, tiny, tmp_path):
    argv = [str(flag) for flag in common(tiny, tmp_path / "out", "--cache_latents") if flag != "--center_crop"]
    with pytest.raises(UsageError) as error:
        script.parse_args(argv)
    assert str(error.value) == ("--cache_latents=True: expected --center_crop with it "
                                "(random crops change every epoch and cannot be cached)")


def test_a_block_the_transformer_lacks_fails_with_one_line(tiny, tmp_path):
    output_dir = tmp_path / "out"
    result = launch(SCRIPT, *common(tiny, output_dir, "--lora_blocks", "0,2"), check=False, quiet=True)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --lora_blocks=2: expected a block index below 2 (the transformer has 2 blocks)"]
    assert not (output_dir / LORA).exists()
