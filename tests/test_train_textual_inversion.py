"""Smoke tests: the textual inversion scripts (SD 1.x and SDXL) end to end on the tiny fixtures, through
``accelerate launch``, launched together:

- sd: 4 steps of a 2-vector token on the instance pictures, with EMA, validating and checkpointing every 2 steps,
  the embedding written every 2 (--save_steps), and the whole pipeline (--save_as_full_pipeline);
- sdxl: 2 steps of the same token in both of SDXL's text encoders, with EMA, validating at the end.

The sd run is then resumed from its checkpoint-2 and must end with bitwise the same embeddings."""

import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from safetensors.torch import load_file

from helpers import launch, launch_together, launching
from training_utils.testing import assert_resumes_exactly, assert_validated_at, checkpoint_names

TOKEN = "<cat-toy>"
PROMPT = f"a photo of a {TOKEN}"
EMBEDS, EMBEDS_2, UI_FILE = "learned_embeds.safetensors", "learned_embeds_2.safetensors", "cat-toy.safetensors"


def flags(tiny, model, output_dir, steps, *extra):
    return ["--pretrained_model_name_or_path", tiny[model], "--train_data_dir", tiny["instance"],
            "--placeholder_token", TOKEN, "--initializer_token", "a", "--num_vectors", 2, "--resolution", 32,
            "--train_batch_size", 2, "--repeats", 1, "--max_train_steps", steps, "--learning_rate", 5e-2,
            "--lr_warmup_steps", 0, "--use_ema", "--ema_decay", 0.5, "--validation_prompt", PROMPT,
            "--num_validation_images", 1, "--validation_inference_steps", 2, "--output_dir", output_dir, *extra]


def sd_flags(tiny, output_dir):
    return flags(tiny, "sd", output_dir, 4, "--validation_steps", 2, "--checkpointing_steps", 2, "--save_steps", 2,
                 "--save_as_full_pipeline")


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    launch_together({
        "sd": ("textual_inversion/textual_inversion.py", *sd_flags(tiny, root / "sd")),
        "sdxl": ("textual_inversion/textual_inversion_sdxl.py", *flags(tiny, "sdxl", root / "sdxl", 2)),
    })
    return root


def load(pipeline_class, path):
    pipe = pipeline_class.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render(pipe):
    return pipe(PROMPT, num_inference_steps=2, height=32, width=32, output_type="pt",
                generator=torch.Generator().manual_seed(0)).images


def test_writes_the_embedding_every_save_steps_and_raw_and_ema_at_the_end_validating_and_checkpointing(runs):
    output_dir = runs / "sd"
    for name in (EMBEDS, UI_FILE, f"ema/{EMBEDS}", f"ema/{UI_FILE}", "learned_embeds-steps-2.safetensors",
                 "learned_embeds-steps-4.safetensors", "model_index.json", "README.md"):
        assert (output_dir / name).is_file(), name
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    assert_validated_at(output_dir, [2, 4], variants=("raw", "ema"), prompts=[PROMPT])
    raw, ema = (load_file(output_dir / name)[TOKEN] for name in (EMBEDS, f"ema/{EMBEDS}"))
    assert raw.shape == (2, 32) and not torch.equal(raw, ema)
    assert torch.equal(load_file(output_dir / "learned_embeds-steps-4.safetensors")[TOKEN], raw)
    assert not torch.equal(load_file(output_dir / "learned_embeds-steps-2.safetensors")[TOKEN], raw)
    assert torch.equal(load_file(output_dir / UI_FILE)["emb_params"], raw)
    assert 'pipe.load_textual_inversion(' in (output_dir / "README.md").read_text()


def test_raw_and_ema_embeddings_load_into_the_stock_pipeline_and_change_its_pictures(runs, tiny):
    pictures = []
    for folder in (runs / "sd", runs / "sd" / "ema"):
        pipe = load(StableDiffusionPipeline, tiny["sd"])
        pipe.load_textual_inversion(folder, weight_name=EMBEDS)
        assert torch.equal(pipe.text_encoder.get_input_embeddings().weight[-2:], load_file(folder / EMBEDS)[TOKEN])
        pictures.append(render(pipe))
    assert not torch.allclose(pictures[0], pictures[1], atol=1e-4)


def test_the_full_pipeline_holds_the_token_and_every_other_row_as_it_loaded(runs, tiny):
    base = load(StableDiffusionPipeline, tiny["sd"]).text_encoder.get_input_embeddings().weight
    saved = load(StableDiffusionPipeline, runs / "sd")
    rows = saved.text_encoder.get_input_embeddings().weight
    assert torch.equal(rows[:len(base)], base)
    assert torch.equal(rows[len(base):], load_file(runs / "sd" / EMBEDS)[TOKEN])
    assert saved.tokenizer.convert_tokens_to_ids([TOKEN, f"{TOKEN}_1"]) == [len(base), len(base) + 1]
    # Only the text encoder is written anew; the UNet's and the VAE's files are the base model's.
    for weights in ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors"):
        assert (runs / "sd" / weights).samefile(tiny["sd"] / weights)
    assert not (runs / "sd" / "text_encoder/model.safetensors").samefile(tiny["sd"] / "text_encoder/model.safetensors")


def test_a_resumed_run_ends_with_the_same_embeddings(runs, tmp_path, tiny):
    assert_resumes_exactly("textual_inversion/textual_inversion.py", lambda output_dir: sd_flags(tiny, output_dir),
                           runs / "sd", tmp_path, 2, [EMBEDS, f"ema/{EMBEDS}"], launch=launch)


def test_sdxl_trains_the_token_in_both_text_encoders_which_the_stock_pipeline_loads(runs, tiny):
    output_dir = runs / "sdxl"
    assert_validated_at(output_dir, [2], variants=("raw", "ema"), prompts=[PROMPT])
    ui = load_file(output_dir / UI_FILE)
    assert {key: value.shape for key, value in ui.items()} == {"clip_l": (2, 32), "clip_g": (2, 32)}
    base = load(StableDiffusionXLPipeline, tiny["sdxl"])
    frozen = [encoder.get_input_embeddings().weight.detach().clone()
              for encoder in (base.text_encoder, base.text_encoder_2)]
    for file, encoder, tokenizer, key in ((EMBEDS, "text_encoder", "tokenizer", "clip_l"),
                                          (EMBEDS_2, "text_encoder_2", "tokenizer_2", "clip_g")):
        vectors = load_file(output_dir / file)[TOKEN]
        assert torch.equal(vectors, ui[key])
        base.load_textual_inversion(output_dir / file, token=TOKEN, text_encoder=getattr(base, encoder),
                                    tokenizer=getattr(base, tokenizer))
    for encoder, rows in zip((base.text_encoder, base.text_encoder_2), frozen):
        weight = encoder.get_input_embeddings().weight
        assert torch.equal(weight[:len(rows)], rows)
        assert not torch.equal(weight[len(rows):], rows[base.tokenizer.encode("a", add_special_tokens=False)[0]]
                               .expand(2, -1))
