"""Smoke tests: the Kandinsky 2.2 prior scripts (the whole prior with an EMA, and a LoRA on it) end to end on the tiny
prior and decoder pipelines, their runs launched together."""

import os

import numpy as np
import pytest
import torch
from diffusers import KandinskyV22PriorPipeline, PriorTransformer
from PIL import Image
from safetensors.torch import load_file

from helpers import launch, launch_together, launching, usage_error
from training_utils.testing import (assert_checkpoint_is_the_output, assert_model_folder_loads, assert_resumes_exactly,
                                    assert_validated_at, checkpoint_names, checkpoint_weight_files, differing_keys)

FULL = "kandinsky2_2/text_to_image/train_text_to_image_prior.py"
LORA = "kandinsky2_2/text_to_image/train_text_to_image_lora_prior.py"
PRIOR = "prior/diffusion_pytorch_model.safetensors"
ADAPTER = "pytorch_lora_weights.safetensors"
RESOLUTION = 64  # the decoder's MoVQ divides by 8 and Kandinsky's sizes by 64: the smallest size it renders
PROMPT = "a red circle"


def common(tiny, output_dir, *extra):
    """6 of the shapes, 2 a batch (3 steps an epoch), with random flips, 4 steps, checkpoints every 2 steps."""
    return ["--pretrained_prior_model_name_or_path", tiny["kandinsky22_prior"],
            "--pretrained_decoder_model_name_or_path", tiny["kandinsky22_decoder"], "--train_data_dir", tiny["shapes"],
            "--resolution", RESOLUTION, "--max_train_samples", 6, "--train_batch_size", 2, "--random_flip",
            "--output_dir", output_dir, "--max_train_steps", 4, "--lr_warmup_steps", 0, "--checkpointing_steps", 2,
            "--seed", 0, *extra]


def full(tiny, output_dir, *extra):
    return common(tiny, output_dir, "--learning_rate", 1e-3, "--use_ema", "--ema_decay", 0.5, "--snr_gamma", 5,
                  *extra)


def lora(tiny, output_dir, *extra):
    return common(tiny, output_dir, "--learning_rate", 1e-2, "--use_ema", "--ema_decay", 0.5, "--rank", 4,
                  "--lora_alpha", 8, *extra)


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}``, launched together: the whole prior with an EMA (min-SNR weighted), and a
    LoRA (rank 4, alpha 8) with an EMA, each validating one image of one prompt in 2 prior and 2 decoder steps at
    steps 2 and 4 (upstream's --validation_prompts)."""
    root = tmp_path_factory.mktemp("runs")
    validation = ["--validation_prompts", PROMPT, "--validation_steps", 2, "--num_validation_images", 1,
                  "--validation_inference_steps", 2]
    results = launch_together({"full": (FULL, *full(tiny, root / "full", *validation)),
                               "lora": (LORA, *lora(tiny, root / "lora", *validation))})
    return {name: (root / name, result) for name, result in results.items()}


def embeddings(pipe, prompt=PROMPT):
    """The image embedding the prior pipeline renders for ``prompt`` from fixed noise."""
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt, num_inference_steps=2, generator=torch.Generator().manual_seed(0)).image_embeds


def test_writes_a_prior_pipeline_with_the_trained_prior_and_links_the_rest(tiny, runs):
    output_dir, result = runs["full"]
    base = tiny["kandinsky22_prior"]
    raw = assert_model_folder_loads(PriorTransformer, output_dir / "prior", initial=base / "prior").state_dict()
    ema = assert_model_folder_loads(PriorTransformer, output_dir / "ema" / "prior").state_dict()
    assert differing_keys(raw, ema)
    # The CLIP statistics that normalise the embeddings do not train.
    initial = PriorTransformer.from_pretrained(base / "prior").state_dict()
    for name in ("clip_mean", "clip_std"):
        assert torch.equal(raw[name], initial[name]) and torch.equal(ema[name], initial[name])
    # The untouched models are the pretrained files, linked.
    for name in ("text_encoder/model.safetensors", "image_encoder/model.safetensors"):
        assert os.path.samefile(output_dir / name, base / name)
    assert f"raw prior: {output_dir / 'prior'}" in result.stdout
    assert f"ema prior: {output_dir / 'ema' / 'prior'}" in result.stdout
    card = (output_dir / "README.md").read_text()
    assert "KandinskyV22PriorPipeline.from_pretrained" in card and "ema/prior" in card
    assert str(tiny["kandinsky22_decoder"]) in card
    # It loads as the prior pipeline, and renders other embeddings than the base prior.
    trained = embeddings(KandinskyV22PriorPipeline.from_pretrained(output_dir))
    assert not torch.equal(trained, embeddings(KandinskyV22PriorPipeline.from_pretrained(base)))
    assert torch.isfinite(trained).all()


@pytest.mark.parametrize("name", ["full", "lora"])
def test_validates_raw_and_ema_through_prior_and_decoder(runs, name):
    output_dir, _ = runs[name]
    log = assert_validated_at(output_dir, [2, 4], ("raw", "ema"), [PROMPT], num_images=1)
    assert {Image.open(output_dir / record["images"][0]).size for record in log} == {(RESOLUTION, RESOLUTION)}
    first = {(record["step"], record["variant"]): np.asarray(Image.open(output_dir / record["images"][0]))
             for record in log}
    assert not np.array_equal(first[0, "base"], first[4, "raw"])
    assert not np.array_equal(first[4, "raw"], first[4, "ema"])


def test_checkpoints_hold_the_outputs_and_resume_to_the_uninterrupted_weights(tiny, tmp_path, runs):
    output_dir, _ = runs["full"]
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    assert checkpoint_weight_files(output_dir / "checkpoint-4") == {PRIOR, f"ema/{PRIOR}"}
    assert_checkpoint_is_the_output(output_dir / "checkpoint-4", output_dir, [PRIOR, f"ema/{PRIOR}"])
    # Resumed mid-epoch (step 2 of 3) without validation: bitwise the weights of the run that validated twice.
    assert_resumes_exactly(FULL, lambda resumed: full(tiny, resumed), output_dir, tmp_path, 2, [PRIOR, f"ema/{PRIOR}"],
                           launch=launch)


def test_the_lora_loads_into_the_prior_pipeline_as_the_card_says_and_changes_its_output(tiny, runs):
    output_dir, result = runs["lora"]
    base = tiny["kandinsky22_prior"]
    assert f"raw LoRA: {output_dir / ADAPTER}" in result.stdout
    card = (output_dir / "README.md").read_text()
    assert 'pipe.prior.load_lora_adapter(' in card and "KandinskyV22PriorPipeline.from_pretrained" in card
    raw, ema = load_file(output_dir / ADAPTER), load_file(output_dir / "ema" / ADAPTER)
    assert raw.keys() == ema.keys() and differing_keys(raw, ema)
    # peft's keys without a component prefix, as PriorTransformer.save_lora_adapter writes them
    assert all(".lora_A." in key or ".lora_B." in key for key in raw)
    assert "transformer_blocks.0.attn1.to_q.lora_A.weight" in raw
    untrained = embeddings(KandinskyV22PriorPipeline.from_pretrained(base))
    outputs = []
    for folder in (output_dir, output_dir / "ema"):
        pipe = KandinskyV22PriorPipeline.from_pretrained(base)
        pipe.prior.load_lora_adapter(folder, prefix=None, use_safetensors=True)
        config = next(iter(pipe.prior.peft_config.values()))
        assert (config.r, config.lora_alpha) == (4, 8)
        outputs.append(embeddings(pipe))
        assert not torch.equal(outputs[-1], untrained)
    assert not torch.equal(*outputs)
    assert checkpoint_weight_files(output_dir / "checkpoint-4") == {ADAPTER, f"ema/{ADAPTER}"}
    assert_checkpoint_is_the_output(output_dir / "checkpoint-4", output_dir, [ADAPTER, f"ema/{ADAPTER}"])


def test_the_lora_resumes_to_the_uninterrupted_adapter(tiny, tmp_path, runs):
    output_dir, _ = runs["lora"]
    assert_resumes_exactly(LORA, lambda resumed: lora(tiny, resumed), output_dir, tmp_path, 2,
                           [ADAPTER, f"ema/{ADAPTER}"], launch=launch)


def test_refuses_a_missing_decoder_and_gradient_checkpointing_before_loading(tiny, tmp_path):
    message = usage_error(FULL, *common(tiny, tmp_path)[:2], "--train_data_dir", tiny["shapes"], "--output_dir",
                          tmp_path, "--pretrained_decoder_model_name_or_path", tmp_path / "none")
    assert message.startswith("error: --pretrained_decoder_model_name_or_path=")
    for script in (FULL, LORA):
        assert "PriorTransformer has no gradient checkpointing" in usage_error(
            script, *common(tiny, tmp_path), "--gradient_checkpointing")
