"""Smoke tests: the advanced (pivotal tuning) DreamBooth scripts end to end on the tiny fixtures, through
``accelerate launch``, launched together:

- sdxl: 4 steps of two new tokens (``TOK`` = ``<s0><s1>``, started as "a dog"'s rows) in both text
encoders for the first half of the run, beside a LoRA on the UNet and both text encoders, with EMA, the kohya layout,
checkpoints every 2 steps and validation at the end; the run is then resumed from its checkpoint-2, where the
tokens' training stopped, and must end with bitwise the same files;
- sd15: 2 steps of two abstractions of a token each, at random, with prior preservation (2 class images generated),
  the tokens training for the first step;
- flux: 4 steps of two new tokens (started as "a dog"'s rows) in CLIP and T5 (``--enable_t5_ti``) for the first half,
  beside a LoRA on the transformer, with EMA, the ComfyUI layout, checkpoints every 2 steps and validation at the end;
- flux_tokens_only: 2 steps of one new token at random in CLIP alone, the transformer's LoRA never training
  (``--train_transformer_frac 0``, upstream's pure textual inversion)."""

import pytest
import torch
from diffusers import FluxPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline
from safetensors.torch import load_file

from helpers import launch, launch_together, launching, usage_error
from training_utils.testing import assert_resumes_exactly, assert_validated_at, checkpoint_names, differing_keys

SCRIPT = "advanced_diffusion_training/train_dreambooth_lora_sdxl_advanced.py"
SD15_SCRIPT = "advanced_diffusion_training/train_dreambooth_lora_sd15_advanced.py"
FLUX_SCRIPT = "advanced_diffusion_training/train_dreambooth_lora_flux_advanced.py"
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


def flux_flags(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["flux"], "--instance_data_dir", tiny["instance"],
            "--instance_prompt", "a photo of TOK", "--train_text_encoder_ti", "--resolution", 32,
            "--train_batch_size", 1, "--learning_rate", 1e-2, "--text_encoder_lr", 5e-2, "--lr_warmup_steps", 0,
            "--output_dir", output_dir, *extra]


FLUX_PIVOTAL = ("--enable_t5_ti", "--initializer_concept", "a dog", "--train_text_encoder_ti_frac", 0.5,
                "--max_train_steps", 4, "--checkpointing_steps", 2, "--use_ema", "--ema_decay", 0.5,
                "--export_formats", "diffusers", "comfyui", "--validation_prompt", VALIDATION_PROMPT,
                "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", 4)
FLUX_TOKENS_ONLY = ("--num_new_tokens_per_abstraction", 1, "--train_transformer_frac", 0,
                    "--train_text_encoder_ti_frac", 1, "--max_train_steps", 2, "--checkpointing_steps", 1)


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    launch_together({"pivotal": (SCRIPT, *flags(tiny, root / "pivotal")),
                     "sd15": (SD15_SCRIPT, *sd15_flags(tiny, root)),
                     "flux": (FLUX_SCRIPT, *flux_flags(tiny, root / "flux", *FLUX_PIVOTAL)),
                     "flux_tokens_only": (FLUX_SCRIPT, *flux_flags(tiny, root / "flux_tokens_only",
                                                                   *FLUX_TOKENS_ONLY))})
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



def flux_pipeline(tiny):
    pipe = FluxPipeline.from_pretrained(tiny["flux"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_flux_writes_the_lora_and_both_encoders_embeddings_raw_and_ema_validating_and_checkpointing(runs):
    output_dir, file = runs / "flux", "flux_emb.safetensors"
    for folder in ("", "ema/", "checkpoint-2/", "checkpoint-2/ema/", "checkpoint-4/"):
        for name in (LORA, file, "pytorch_lora_weights_comfyui.safetensors"):
            assert (output_dir / folder / name).is_file(), folder + name
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    assert_validated_at(output_dir, [4], variants=("raw", "ema"), prompts=["<s0><s1> on a beach"])
    rows = load_file(output_dir / file)
    assert {key: value.shape for key, value in rows.items()} == {"clip_l": (2, 32), "t5": (2, 64)}
    assert sorted(differing_keys(rows, load_file(output_dir / "ema" / file))) == ["clip_l", "t5"]
    # As upstream's: the LoRA is the transformer's alone; the new rows are in the embedding file only.
    assert all(key.startswith("transformer.") for key in load_file(output_dir / LORA))
    card = (output_dir / "README.md").read_text()
    assert 'pipe.load_textual_inversion(state_dict["t5"], token=' in card and "FluxPipeline" in card


def test_flux_tokens_train_in_clip_and_t5_for_the_first_half_then_stay_while_the_lora_goes_on(runs, tiny):
    output_dir, file = runs / "flux", "flux_emb.safetensors"
    base = flux_pipeline(tiny)
    started = {key: encoder.get_input_embeddings().weight[tokenizer.encode("a dog", add_special_tokens=False)]
               for key, encoder, tokenizer in (("clip_l", base.text_encoder, base.tokenizer),
                                               ("t5", base.text_encoder_2, base.tokenizer_2))}
    at_stop, final = (load_file(output_dir / folder / file) for folder in ("checkpoint-2", "."))
    assert sorted(differing_keys(started, at_stop)) == ["clip_l", "t5"]
    assert differing_keys(at_stop, final) == []
    assert differing_keys(load_file(output_dir / "checkpoint-2" / LORA), load_file(output_dir / LORA))


def test_flux_lora_and_embeddings_load_into_the_stock_pipeline_every_other_row_as_it_was_and_change_its_output(
        runs, tiny):
    output_dir, file = runs / "flux", "flux_emb.safetensors"

    def render(pipe):
        return pipe("<s0><s1> on a beach", num_inference_steps=2, height=32, width=32, output_type="pt",
                    generator=torch.Generator().manual_seed(0)).images

    pictures = [render(flux_pipeline(tiny))]  # the base pipeline, the tokens unknown
    for folder in (output_dir, output_dir / "ema"):
        pipe = flux_pipeline(tiny)
        encoders = {"clip_l": (pipe.text_encoder, pipe.tokenizer), "t5": (pipe.text_encoder_2, pipe.tokenizer_2)}
        frozen = {key: encoder.get_input_embeddings().weight.detach().clone() for key, (encoder, _) in encoders.items()}
        pipe.load_lora_weights(folder)
        rows = load_file(folder / file)
        for key, (encoder, tokenizer) in encoders.items():
            pipe.load_textual_inversion(rows[key], token=TOKENS, text_encoder=encoder, tokenizer=tokenizer)
            weight = encoder.get_input_embeddings().weight
            assert torch.equal(weight[:len(frozen[key])], frozen[key])
            assert torch.equal(weight[len(frozen[key]):], rows[key])
        pictures.append(render(pipe))
    assert not torch.allclose(pictures[0], pictures[1], atol=1e-4)
    assert not torch.allclose(pictures[1], pictures[2], atol=1e-4)


def test_flux_with_train_transformer_frac_0_trains_the_clip_token_alone(runs):
    output_dir, file = runs / "flux_tokens_only", "flux_tokens_only_emb.safetensors"
    rows = [load_file(output_dir / folder / file) for folder in ("checkpoint-1", ".")]
    assert {key: value.shape for key, value in rows[1].items()} == {"clip_l": (1, 32)}
    assert differing_keys(*rows) == ["clip_l"]
    # The transformer's LoRA stays as it started: its up projections zero, so it changes nothing.
    lora = load_file(output_dir / LORA)
    assert differing_keys(load_file(output_dir / "checkpoint-1" / LORA), lora) == []
    assert all(not tensor.any() for key, tensor in lora.items() if "lora_B" in key)


@pytest.mark.parametrize("extra, expected", [
    (["--train_text_encoder"], "--train_text_encoder=True: expected no --train_text_encoder_ti beside it"),
    (["--train_transformer_frac", 0.5], "--train_transformer_frac=0.5: expected 1 unless --train_text_encoder_ti_frac "
                                        "is 1"),
    (["--train_transformer_frac", 1.5], "--train_transformer_frac=1.5: expected a fraction in [0, 1]"),
    (["--train_text_encoder_ti_frac", 0], "--train_text_encoder_ti_frac=0.0: expected a fraction in (0, 1]"),
    (["--enable_t5_ti", "--initializer_concept", " "], "--initializer_concept=' ': expected one or more words"),
])
def test_bad_flux_pivotal_flags_stop_in_one_line_before_anything_loads(tiny, tmp_path, extra, expected):
    error = usage_error(FLUX_SCRIPT, *flux_flags(tiny, tmp_path / "out", *extra))
    assert expected in error, error


def test_flux_enable_t5_ti_needs_the_pivotal_tuning(tiny, tmp_path):
    error = usage_error(FLUX_SCRIPT, "--pretrained_model_name_or_path", tiny["flux"], "--instance_data_dir",
                        tiny["instance"], "--instance_prompt", "a photo", "--enable_t5_ti", "--output_dir", tmp_path)
    assert "--enable_t5_ti=True: expected --train_text_encoder_ti beside it" in error, error
