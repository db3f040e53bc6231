"""Smoke tests: the Kandinsky 2.2 decoder scripts (the whole UNet, and a LoRA on it) end to end on the tiny decoder
and prior, both launched together: outputs that load into ``KandinskyV22Pipeline`` and change what it renders,
validation through the combined pipeline (raw and EMA), and exact resume."""

import shutil

import pytest
import torch
from diffusers import KandinskyV22Pipeline, UNet2DConditionModel
from safetensors.torch import load_file

from helpers import launch_together, launching
from training_utils.testing import (assert_model_folder_loads, assert_same_files, assert_validated_at,
                                    checkpoint_names, differing_keys)

FULL = "kandinsky2_2/text_to_image/train_text_to_image_decoder.py"
LORA = "kandinsky2_2/text_to_image/train_text_to_image_lora_decoder.py"
UNET = "unet/diffusion_pytorch_model.safetensors"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
PROMPT = "a red circle on a white background"


def flags(tiny, output_dir, *extra):
    """4 steps at 64 px (the MoVQ's 8x8 latents) with an EMA, a checkpoint every 2 steps."""
    return ["--pretrained_decoder_model_name_or_path", tiny["kandinsky22_decoder"],
            "--pretrained_prior_model_name_or_path", tiny["kandinsky22_prior"], "--train_data_dir", tiny["shapes"],
            "--output_dir", output_dir, "--resolution", 64, "--train_batch_size", 2, "--learning_rate", 1e-3,
            "--max_train_steps", 4, "--checkpointing_steps", 2, "--use_ema", "--ema_decay", 0.5, "--seed", 3, *extra]


VALIDATION = ["--validation_prompts", PROMPT, "--num_validation_images", 1, "--validation_inference_steps", 2,
              "--validation_steps", 2]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: output_dir}``: "full" and "lora" (rank 4), each validating every 2 steps."""
    root = tmp_path_factory.mktemp("kandinsky")
    launch_together({"full": (FULL, *flags(tiny, root / "full", *VALIDATION)),
                     "lora": (LORA, *flags(tiny, root / "lora", "--rank", 4, *VALIDATION))})
    return {name: root / name for name in ("full", "lora")}


def render(pipe):
    """The decoder's image for a fixed image embedding, 2 steps, fixed seed."""
    embeds = torch.linspace(-1, 1, 32).unsqueeze(0)
    return pipe(image_embeds=embeds, negative_image_embeds=-embeds, height=64, width=64, num_inference_steps=2,
                generator=torch.Generator().manual_seed(0), output_type="pt").images


def test_validates_raw_and_ema_through_the_combined_pipeline(runs):
    for output_dir in runs.values():
        assert_validated_at(output_dir, [2, 4], ("raw", "ema"), [PROMPT], num_images=1)


def test_the_full_output_is_a_decoder_pipeline_whose_unet_trained_and_renders_differently(tiny, runs):
    output_dir = runs["full"]
    raw = assert_model_folder_loads(UNet2DConditionModel, output_dir / "unet",
                                    initial=tiny["kandinsky22_decoder"] / "unet")
    ema = assert_model_folder_loads(UNet2DConditionModel, output_dir / "ema" / "unet")
    assert differing_keys(raw.state_dict(), ema.state_dict())
    # The MoVQ did not train: it is the base's file, hard-linked.
    base_movq = tiny["kandinsky22_decoder"] / "movq" / "diffusion_pytorch_model.safetensors"
    assert (output_dir / "movq" / base_movq.name).samefile(base_movq)
    base, tuned = (KandinskyV22Pipeline.from_pretrained(path) for path in (tiny["kandinsky22_decoder"], output_dir))
    assert not torch.equal(render(base), render(tuned))
    card = (output_dir / "README.md").read_text()
    assert "KandinskyV22PriorPipeline.from_pretrained" in card and "ema/unet" in card


def test_the_lora_loads_into_the_decoder_unet_and_changes_its_images(tiny, runs):
    output_dir = runs["lora"]
    raw, ema = (load_file(output_dir / path) for path in (LORA_WEIGHTS, f"ema/{LORA_WEIGHTS}"))
    assert raw.keys() == ema.keys() and differing_keys(raw, ema)
    assert all(key.startswith("unet.") for key in raw)
    # Upstream's layers: the attention projections and the image tokens' added keys and values.
    assert any(".add_k_proj.lora_A." in key for key in raw) and any(".to_q.lora_B." in key for key in raw)
    pipe = KandinskyV22Pipeline.from_pretrained(tiny["kandinsky22_decoder"])
    before = render(pipe)
    pipe.unet.load_lora_adapter(output_dir, weight_name=LORA_WEIGHTS, prefix="unet")
    assert not torch.equal(before, render(pipe))
    assert "load_lora_adapter" in (output_dir / "README.md").read_text()


def test_both_resume_from_their_checkpoints_to_the_uninterrupted_weights(tiny, tmp_path, runs):
    for name in runs:
        shutil.copytree(runs[name] / "checkpoint-2", tmp_path / name / "checkpoint-2")
    results = launch_together({
        "full": (FULL, *flags(tiny, tmp_path / "full", "--resume_from_checkpoint", "latest")),
        "lora": (LORA, *flags(tiny, tmp_path / "lora", "--rank", 4, "--resume_from_checkpoint", "latest"))})
    for name, weights in (("full", [UNET, f"ema/{UNET}"]), ("lora", [LORA_WEIGHTS, f"ema/{LORA_WEIGHTS}"])):
        assert f"resumed from {tmp_path / name / 'checkpoint-2'} at step 2" in results[name].stdout
        for path in weights:
            assert_same_files(tmp_path / name / path, runs[name] / path)
        assert checkpoint_names(tmp_path / name) == ["checkpoint-2", "checkpoint-4"]
