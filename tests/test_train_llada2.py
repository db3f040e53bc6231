"""Smoke tests: the LLaDA2 script end to end on the tiny causal LM, on texts with validation and an EMA, and on
upstream's random tokens, launched together."""

import json

import pytest
import torch
from diffusers import BlockRefinementScheduler, LLaDA2Pipeline
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import launch, launch_together, launching, usage_error
from training_utils.testing import (assert_checkpoint_is_the_output, assert_model_folder_loads, assert_resumes_exactly,
                                    checkpoint_names, differing_keys, read_log)
from training_utils.testing.tiny.llada2 import MASK_TOKEN

SCRIPT = "discrete_diffusion/train_llada2.py"
WEIGHTS = "model.safetensors"
PROMPTS = ["once upon a time", "a red circle"]
BLOCK_LENGTH = 4
# What validation renders: two blocks of four tokens, sampled (greedy, an untrained model keeps its masks).
RENDER = {"gen_length": 8, "block_length": BLOCK_LENGTH, "num_inference_steps": 4, "temperature": 1.0,
          "use_chat_template": False}


def texts_run(tiny, output_dir, *extra):
    """The whole model on the corpus's six texts (their empty rows dropped), 2 a batch, 16 tokens each, the first 2
    never masked, 4 steps, an EMA, checkpoints every 2."""
    return ["--model_name_or_path", tiny["llada2"], "--dataset_name", tiny["llada2_text"], "--output_dir", output_dir,
            "--max_train_steps", 4, "--max_length", 16, "--prompt_length", 2, "--block_length", BLOCK_LENGTH,
            "--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 1, "--learning_rate", 1e-2,
            "--lr_warmup_steps", 0, "--use_ema", "--ema_decay", 0.5, "--checkpointing_steps", 2, *extra]


def dummy_run(tiny, output_dir):
    """Upstream's random tokens: 4 samples of 8, 2 steps of 2 micro-batches of 1, upstream's cosine schedule."""
    return ["--model_name_or_path", tiny["llada2"], "--use_dummy_data", "--num_dummy_samples", 4, "--max_length", 8,
            "--prompt_length", 2, "--block_length", BLOCK_LENGTH, "--output_dir", output_dir, "--max_train_steps", 2,
            "--gradient_accumulation_steps", 2, "--learning_rate", 1e-2, "--lr_warmup_steps", 1]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}``, launched together: `texts_run`, validating 2 texts a prompt every 2 steps
    (upstream's sample_llada2.py renders so); `dummy_run`, without validation."""
    root = tmp_path_factory.mktemp("runs")
    results = launch_together({
        "texts": (SCRIPT, *texts_run(tiny, root / "texts", "--validation_prompt", *PROMPTS, "--validation_steps", 2,
                                     "--num_validation_images", 2, "--validation_gen_length", RENDER["gen_length"],
                                     "--validation_inference_steps", RENDER["num_inference_steps"],
                                     "--validation_temperature", RENDER["temperature"])),
        "dummy": (SCRIPT, *dummy_run(tiny, root / "dummy")),
    })
    return {name: (root / name, result) for name, result in results.items()}


def render(folder, prompt, seed):
    """The ``LLaDA2Pipeline`` of the stock classes' load of ``folder``: its text for ``prompt`` and ``seed``."""
    pipe = LLaDA2Pipeline(model=AutoModelForCausalLM.from_pretrained(folder),
                          scheduler=BlockRefinementScheduler(block_length=BLOCK_LENGTH),
                          tokenizer=AutoTokenizer.from_pretrained(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), **RENDER).texts[0]


def test_texts_run_writes_a_model_folder_the_stock_classes_load_and_llada2_renders_it(tiny, runs):
    output_dir, result = runs["texts"]
    raw = assert_model_folder_loads(AutoModelForCausalLM, output_dir, initial=tiny["llada2"]).state_dict()
    ema = assert_model_folder_loads(AutoModelForCausalLM, output_dir / "ema").state_dict()
    assert differing_keys(raw, ema)
    for folder in (output_dir, output_dir / "ema"):
        assert AutoTokenizer.from_pretrained(folder).mask_token == MASK_TOKEN
    assert f"raw model: {output_dir}" in result.stdout and f"ema model: {output_dir / 'ema'}" in result.stdout
    card = (output_dir / "README.md").read_text()
    assert "AutoModelForCausalLM.from_pretrained" in card and "LLaDA2Pipeline(" in card
    # The saved model renders what the final validation rendered from the live one, and not what the base renders.
    final = {record["variant"]: record for record in read_log(output_dir)
             if record["step"] == 4 and record["prompt"] == PROMPTS[0]}
    for variant, folder in (("raw", output_dir), ("ema", output_dir / "ema")):
        assert [render(folder, PROMPTS[0], seed) for seed in (0, 1)] == final[variant]["texts"]
    assert render(output_dir, PROMPTS[0], 0) != render(tiny["llada2"], PROMPTS[0], 0)


def test_texts_run_validates_base_raw_and_ema_at_due_steps_and_writes_each_text(runs):
    output_dir, _ = runs["texts"]
    records = read_log(output_dir)
    assert [(record["step"], record["variant"], record["prompt"]) for record in records] == [
        (0, "base", PROMPTS[0]), (0, "base", PROMPTS[1]),
        *[(step, variant, prompt) for step in (2, 4) for variant in ("raw", "ema") for prompt in PROMPTS]]
    for record in records:
        index = PROMPTS.index(record["prompt"])
        assert record["files"] == [f"validation/step-{record['step']:06d}/{record['variant']}-p{index:02d}-{number:02d}"
                                   f".txt" for number in range(2)]
        assert [(output_dir / path).read_text() for path in record["files"]] == record["texts"]
        assert all(record["texts"])
    # Sampled with two seeds: two texts; the weights changed between validations, so did the texts.
    texts = {(record["step"], record["variant"]): record["texts"] for record in records
             if record["prompt"] == PROMPTS[0]}
    assert texts[4, "raw"][0] != texts[4, "raw"][1]
    assert texts[0, "base"] != texts[2, "raw"] != texts[4, "raw"]


def test_texts_run_checkpoints_the_output_and_resumes_exactly_without_validating(tiny, tmp_path, runs):
    output_dir, _ = runs["texts"]
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    assert_checkpoint_is_the_output(output_dir / "checkpoint-4", output_dir,
                                    {f"model/{WEIGHTS}": WEIGHTS, f"ema/model/{WEIGHTS}": f"ema/{WEIGHTS}"})
    assert AutoTokenizer.from_pretrained(output_dir / "checkpoint-4" / "model").mask_token == MASK_TOKEN
    # Resumed without validation: bitwise the weights of the run that validated three times.
    assert_resumes_exactly(SCRIPT, lambda out: texts_run(tiny, out), output_dir, tmp_path, 2,
                           [WEIGHTS, f"ema/{WEIGHTS}"], launch=launch)


def test_dummy_run_trains_on_random_tokens_without_validating(tiny, runs):
    output_dir, _ = runs["dummy"]
    assert_model_folder_loads(AutoModelForCausalLM, output_dir, initial=tiny["llada2"])
    assert not (output_dir / "validation").exists() and not (output_dir / "ema").exists()
    assert json.loads((output_dir / "run_status.json").read_text())["last_step"] == 2
    assert load_file(output_dir / WEIGHTS).keys() == load_file(tiny["llada2"] / WEIGHTS).keys()


def test_refuses_bad_input_and_what_it_does_not_carry_before_loading(tiny, tmp_path):
    common = ["--model_name_or_path", tiny["llada2"], "--output_dir", tmp_path / "out"]
    texts = ["--dataset_name", tiny["llada2_text"]]
    assert usage_error(SCRIPT, *common, *texts, "--prompt_length", 16, "--max_length", 16).startswith(
        "error: --prompt_length=16: expected a non-negative integer below --max_length (16)")
    assert usage_error(SCRIPT, *common, *texts, "--text_column", "story").startswith(
        "error: --text_column='story': expected a column of the dataset: text")
    assert usage_error(SCRIPT, *common, *texts, "--conf_temperature", 0).startswith("error: --conf_temperature=0")
    assert usage_error(SCRIPT, *common, *texts, "--max_length", 1000).startswith(
        "error: --max_length=1000: expected at most the model's 256 positions")
    assert "--logging_steps is not supported" in usage_error(SCRIPT, *common, *texts, "--logging_steps", 10)
    assert "renders text" in usage_error(SCRIPT, *common, *texts, "--resolution", 64)
    assert usage_error(SCRIPT, "--model_name_or_path", tiny["sd"], "--output_dir", tmp_path / "out", *texts).startswith(
        f"error: --model_name_or_path='{tiny['sd']}': expected a causal LM folder (with config.json)")
    # LLaDA2.0's own checkpoints: their model class is code from the hub, which is never run here.
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({
        "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"],
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}}))
    assert "trust_remote_code" in usage_error(SCRIPT, "--model_name_or_path", remote, "--output_dir",
                                              tmp_path / "out", *texts)
