"""Smoke tests: the advanced (pivotal tuning) DreamBooth scripts end to end on the tiny fixtures, through
``accelerate launch``, launched together:

- sdxl: 4 steps of two new tokens (``TOK`` = ``<s0><s1>``, started as "a dog"'s rows) in both text
encoders for the first half of the run, beside a LoRA on the UNet and both text encoders, with EMA, the kohya layout,
checkpoints every 2 steps and validation at the end; the run is then resumed from its checkpoint-2, where the
tokens' training stopped, and must end with bitwise the same files;
- sd15: 2 steps of two abstractions of a token each, at random, with prior preservation (2 class images generated),
  the tokens training for the first step."""

import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from safetensors.torch import load_file

from helpers import launch, launch_together, launching, usage_error
from training_utils.testing import assert_resumes_exactly, assert_validated_at, checkpoint_names, differing_keys

SCRIPT = "advanced_diffusion_training/train_dreambooth_lora_sdxl_advanced.py"
SD15_SCRIPT = "advanced_diffusion_training/train_dreambooth_lora_sd15_advanced.py"
LORA, EMBEDDINGS = "pytorch_lora_weights.safetensors", "pivotal_emb.safetensors"  # upstream's <folder name>_emb
TOKENS = ["<s0>", "<s1>"]
VALIDATION_PROMPT = "TOK on a beach"


def flags(tiny, output_dir):
    return ["--pretrained_model_name_or_path", tiny["sdxl"], "--instance_data_dir", tiny["instance"],
            "--instance_prompt", "a photo of TOK", "--train_text_encoder_ti", "--initializer_concept", "a dog",
            "--train_text_encoder_ti_frac", 0.5, "--train_text_encoder", "--resolution", 32, "--train_batch_size", 1,
            "--max_train_steps", 4, "--checkpointing_steps", 2, "--learning_rate", 1e-2, "--text_encoder_lr", 5e-2,
            "--lr_warmup_steps", 0, "--use_ema", "--ema_decay", 0.5, "--export_formats", "diffusers", "kohya",
            "--validation_prompt", VALIDATION_PROMPT, "--num_validation_images", 1,
            "--validation_inference_steps", 2, "--validation_steps", 4, "--output_dir", output_dir]


def sd15_flags(tiny, root):
    return ["--pretrained_model_name_or_path", tiny["sd"], "--instance_data_dir", tiny["instance"],
            "--instance_prompt", "a photo of TOK with SKS", "--train_text_encoder_ti", "--token_abstraction",
            "TOK,SKS", "--num_new_tokens_per_abstraction", 1, "--train_text_encoder_ti_frac", 0.5,
            "--with_prior_preservation", "--class_data_dir", root / "class", "--class_prompt", "a photo",
            "--num_class_images", 2, "--resolution", 32, "--train_batch_size", 1, "--max_train_steps", 2,
            "--checkpointing_steps", 1, "--learning_rate", 1e-2, "--text_encoder_lr", 5e-2, "--lr_warmup_steps", 0,
            "--validation_prompt", "TOK and SKS", "--num_validation_images", 1, "--validation_inference_steps", 2,
            "--output_dir", root / "sd15"]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    launch_together({"pivotal": (SCRIPT, *flags(tiny, root / "pivotal")),
                     "sd15": (SD15_SCRIPT, *sd15_flags(tiny, root))})
    return root


def base_pipeline(tiny):
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_writes_the_lora_and_the_embeddings_raw_and_ema_validating_and_checkpointing(runs):
    output_dir = runs / "pivotal"
    for folder in ("", "ema/", "checkpoint-2/", "checkpoint-2/ema/", "checkpoint-4/"):
        for name in (LORA, EMBEDDINGS, "pytorch_lora_weights_kohya.safetensors"):
            assert (output_dir / folder / name).is_file(), folder + name
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    assert_validated_at(output_dir, [4], variants=("raw", "ema"), prompts=["<s0><s1> on a beach"])
    rows = load_file(output_dir / EMBEDDINGS)
    assert {key: value.shape for key, value in rows.items()} == {"clip_l": (2, 32), "clip_g": (2, 32)}
    assert sorted(differing_keys(rows, load_file(output_dir / "ema" / EMBEDDINGS))) == ["clip_g", "clip_l"]
    # The adapters' files hold adapters only: the new rows are in the embedding file alone.
    assert not [key for key in load_file(output_dir / LORA) if "embedding" in key]
    card = (output_dir / "README.md").read_text()
    assert 'pipe.load_lora_weights(' in card and f'load_file("{output_dir}/{EMBEDDINGS}")' in card


def test_the_tokens_train_for_the_first_half_then_stay_while_the_loras_go_on(runs, tiny):
    output_dir = runs / "pivotal"
    base = base_pipeline(tiny)
    concept = base.tokenizer.encode("a dog", add_special_tokens=False)
    started = {"clip_l": base.text_encoder.get_input_embeddings().weight[concept],
               "clip_g": base.text_encoder_2.get_input_embeddings().weight[concept]}
    at_stop, final = (load_file(output_dir / folder / EMBEDDINGS) for folder in ("checkpoint-2", "."))
    assert sorted(differing_keys(started, at_stop)) == ["clip_g", "clip_l"]
    assert differing_keys(at_stop, final) == []
    lora_at_stop, lora_final = (load_file(output_dir / folder / LORA) for folder in ("checkpoint-2", "."))
    changed = differing_keys(lora_at_stop, lora_final)
    for prefix in ("unet.", "text_encoder.", "text_encoder_2."):
        assert any(key.startswith(prefix) for key in changed), prefix


def test_the_lora_and_the_embeddings_load_into_the_stock_pipeline_and_change_its_pictures(runs, tiny):
    output_dir = runs / "pivotal"

    def render(pipe):
        return pipe("<s0><s1> on a beach", num_inference_steps=2, height=32, width=32, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images

    pictures = []
    for folder in (output_dir, output_dir / "ema"):
        pipe = base_pipeline(tiny)
        frozen = [encoder.get_input_embeddings().weight.detach().clone()
                  for encoder in (pipe.text_encoder, pipe.text_encoder_2)]
        if not pictures:
            pictures.append(render(base_pipeline(tiny)))  # the base pipeline, the tokens unknown
        pipe.load_lora_weights(folder)
        rows = load_file(folder / EMBEDDINGS)
        pipe.load_textual_inversion(rows["clip_l"], token=TOKENS, text_encoder=pipe.text_encoder,
                                    tokenizer=pipe.tokenizer)
        pipe.load_textual_inversion(rows["clip_g"], token=TOKENS, text_encoder=pipe.text_encoder_2,
                                    tokenizer=pipe.tokenizer_2)
        for encoder, base_rows, key in zip((pipe.text_encoder, pipe.text_encoder_2), frozen, ("clip_l", "clip_g")):
            weight = encoder.get_input_embeddings().weight
            assert torch.equal(weight[:len(base_rows)], base_rows)
            assert torch.equal(weight[len(base_rows):], rows[key])
        pictures.append(render(pipe))
    assert not torch.allclose(pictures[0], pictures[1], atol=1e-4)
    assert not torch.allclose(pictures[1], pictures[2], atol=1e-4)


def test_a_run_resumed_where_the_tokens_stopped_ends_with_the_same_files(runs, tmp_path, tiny):
    resumed = tmp_path / "pivotal"  # the embedding file is named after the output folder, as upstream names it
    resumed.mkdir()
    assert_resumes_exactly(SCRIPT, lambda output_dir: flags(tiny, output_dir), runs / "pivotal", resumed, 2,
                           [LORA, EMBEDDINGS, f"ema/{LORA}", f"ema/{EMBEDDINGS}"], launch=launch)


def test_sd15_trains_each_abstractions_token_for_the_first_step_and_the_stock_pipeline_loads_both(runs, tiny):
    output_dir = runs / "sd15"
    assert checkpoint_names(output_dir) == ["checkpoint-1", "checkpoint-2"]
    assert_validated_at(output_dir, [2], variants=("raw",), prompts=["<s0> and <s1>"])
    assert len(list((runs / "class").glob("*.png"))) == 2
    file = "sd15_emb.safetensors"
    rows = load_file(output_dir / file)
    assert {key: value.shape for key, value in rows.items()} == {"clip_l": (2, 32)}
    assert differing_keys(load_file(output_dir / "checkpoint-1" / file), rows) == []
    assert differing_keys(load_file(output_dir / "checkpoint-1" / LORA), load_file(output_dir / LORA))
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    frozen = pipe.text_encoder.get_input_embeddings().weight.detach().clone()
    pipe.load_lora_weights(output_dir)
    pipe.load_textual_inversion(rows["clip_l"], token=["<s0>", "<s1>"], text_encoder=pipe.text_encoder,
                                tokenizer=pipe.tokenizer)
    weight = pipe.text_encoder.get_input_embeddings().weight
    assert torch.equal(weight[:len(frozen)], frozen) and torch.equal(weight[len(frozen):], rows["clip_l"])


@pytest.mark.parametrize("script", [SCRIPT, SD15_SCRIPT])
@pytest.mark.parametrize("extra, expected", [
    (["--train_text_encoder_ti_frac", 0], "--train_text_encoder_ti_frac=0.0: expected a fraction in (0, 1]"),
    (["--token_abstraction", "TOK,"], "--token_abstraction='TOK,': expected comma-separated non-empty words"),
    (["--initializer_concept", " "], "--initializer_concept=' ': expected one or more words"),
    (["--use_blora"], "--use_blora is not supported here"),
])
def test_bad_pivotal_flags_stop_in_one_line_before_anything_loads(tiny, tmp_path, script, extra, expected):
    if script == SD15_SCRIPT and extra == ["--use_blora"]:
        extra, expected = ["--pretrained_vae_model_name_or_path", "vae"], "--pretrained_vae_model_name_or_path is"
    error = usage_error(script, "--pretrained_model_name_or_path", tiny["sd" if script == SD15_SCRIPT else "sdxl"],
                        "--instance_data_dir", tiny["instance"], "--instance_prompt", "a photo of TOK",
                        "--train_text_encoder_ti", "--output_dir", tmp_path / "out", *extra)
    assert expected in error, error

