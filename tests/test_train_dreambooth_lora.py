"""Smoke tests: the DreamBooth LoRA script end to end on the tiny fixtures, through ``accelerate launch``."""

import os
import shutil

import numpy as np
import pytest
import torch
from diffusers import (FluxPipeline, FluxTransformer2DModel, SD3Transformer2DModel, StableDiffusion3Pipeline,
                       StableDiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel)
from PIL import Image
from safetensors.torch import load_file

from helpers import import_script, launch, launch_together, launching, usage_error
from training_utils.families import sd
from training_utils.testing import (assert_close_files, assert_close_validations, assert_lora_changes_pipeline_output,
                                    assert_model_folder_loads, assert_resumes_exactly, assert_same_files,
                                    assert_same_tensors, assert_validated_at, checkpoint_names, differing_keys,
                                    most_common_bucket, rendered_images, reported_buckets)
from training_utils.pipeline import modules_of
from transformers import CLIPTextModel, CLIPTextModelWithProjection
from training_utils.testing.tiny.data import CAPTION_FILES, INSTANCE_CAPTIONS

SCRIPT = "dreambooth/train_dreambooth_lora.py"
SDXL_SCRIPT = "dreambooth/train_dreambooth_lora_sdxl.py"
FULL_SCRIPT = "dreambooth/train_dreambooth.py"  # the full fine-tunes: their launches are `full_fine_tunes`
SD3_FULL_SCRIPT = "dreambooth/train_dreambooth_sd3.py"
FLUX_FULL_SCRIPT = "dreambooth/train_dreambooth_flux.py"
LORA = "pytorch_lora_weights.safetensors"
INSTANCE_PROMPT = "a photo of sks triangle"
CLASS_PROMPT = "a photo of a triangle"


def common(tiny, output_dir, *extra, source=None, model="sd"):
    return ["--pretrained_model_name_or_path", tiny[model], *(source or ("--instance_data_dir", tiny["instance"])),
            "--instance_prompt", INSTANCE_PROMPT, "--output_dir", output_dir, "--resolution", 32,
            "--train_batch_size", 2, "--learning_rate", 1e-3, "--random_flip", "--use_ema", "--ema_decay", 0.9,
            "--rank", 4, "--seed", 3, *extra]


def prior_flags(class_dir):
    """Prior preservation and a text-encoder LoRA, with an EMA equal to the raw weights."""
    return ["--with_prior_preservation", "--class_data_dir", class_dir, "--class_prompt", CLASS_PROMPT,
            "--num_class_images", 3, "--sample_batch_size", 2, "--class_inference_steps", 2,
            "--train_text_encoder", "--ema_decay", 0, "--max_train_steps", 3, "--checkpointing_steps", 1000]


def bucketed(*source):
    """The 6 instance images of mixed shapes from ``source`` (flags: a folder or a dataset, and their captions) in
    aspect-ratio buckets, each seen twice an epoch (12 samples), the captions dropped with probability 0.3."""
    return [*source, "--use_aspect_ratio_buckets", "--caption_dropout", 0.3, "--repeats", 2]


def sidecar_captioned(tiny):
    """The captioned instance pictures with their caption files; two of them have none (the instance prompt)."""
    return ["--instance_data_dir", tiny["instance_captioned"], "--caption_extension", ".txt"]


def dataset_captioned(tiny):
    """The captioned instance pictures as a dataset, with a caption column."""
    return ["--dataset_name", tiny["instance_captioned"], "--caption_column", "text"]


def sdxl_flags(tiny, output_dir, *extra, source=None):
    """Tiny SDXL on the `bucketed` captioned pictures (a dataset's caption column unless ``source`` says
    otherwise), center-cropped to each bucket (the crop's offsets and the bucket are each image's time ids)."""
    return common(tiny, output_dir, *bucketed(), "--center_crop", *extra, source=source or dataset_captioned(tiny),
                  model="sdxl")


def sdxl_trained_flags(tiny, class_dir, *extra):
    """SDXL's UNet and both text encoders trained with prior preservation, 3 steps, checkpointing every 2."""
    return ["--with_prior_preservation", "--class_data_dir", class_dir, "--class_prompt", CLASS_PROMPT,
            "--num_class_images", 2, "--sample_batch_size", 2, "--class_inference_steps", 2, "--train_text_encoder",
            "--max_train_steps", 3, "--checkpointing_steps", 2, *extra]


def snapshot(folder):
    return {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def four_images(tiny, tmp_path_factory):
    """Flags for 4 instance images, one per batch: 4 steps an epoch, so step 6 falls mid-epoch."""
    folder = tmp_path_factory.mktemp("four")
    for path in sorted(tiny["instance"].iterdir())[:4]:
        shutil.copy(path, folder / path.name)
    return ["--instance_data_dir", folder, "--train_batch_size", 1]


def cache_flags(tiny, class_dir, *extra):
    """4 center-cropped, randomly flipped steps with prior preservation (a frozen text encoder) on the `bucketed`
    images with their caption files (`sidecar_captioned`), validating and checkpointing every 2. The 12 samples pair
    with 3 class images, each drawn 4 times an epoch and laid out to its instance image's bucket; every bucket holds
    an even number of them (each image is there twice), so there are 6 batches an epoch and step 2 falls
    mid-epoch."""
    return [*bucketed(*sidecar_captioned(tiny)), "--center_crop", "--with_prior_preservation", "--class_data_dir",
            class_dir, "--class_prompt", CLASS_PROMPT,
            "--num_class_images", 3, "--sample_batch_size", 3, "--class_inference_steps", 2, "--max_train_steps", 4,
            "--checkpointing_steps", 2, "--validation_prompt", "a sks triangle", "--num_validation_images", 1,
            "--validation_inference_steps", 2, "--validation_steps", 2, *extra]


def trained_text_encoder_flags(*extra):
    """3 center-cropped steps on the `bucketed` images (of `dataset_captioned`, the source to launch with) without
    prior preservation, the text encoder trained with the UNet (embedding the batch's captions in every step)."""
    return [*bucketed(), "--center_crop", "--train_text_encoder", "--max_train_steps", 3,
            "--checkpointing_steps", 1000, *extra]


@pytest.fixture(scope="module")
@launching
def runs_and_class_images_after_the_first(tiny, four_images, tmp_path_factory):
    """``{name: (output_dir, result)}`` of every run here that starts from scratch, and a `snapshot` of the prior
    preservation runs' class folder after the first. Launched together, but for the runs that find the class
    images of another, launched together next:

    - full: 8 steps on `four_images`, validating every 3 steps and at the end, checkpointing every 3;
    - prior_first, prior_second: `prior_flags` twice with the same class folder (``../prior_class``): the first
      run fills it, the second finds it full;
    - uncached, cached: `cache_flags` without and with --cache_latents (on disk, in ``../features``); the uncached
      run generates the class images (``../class``) that the cached run then encodes once per bucket they are
      drawn into, with the instance images;
    - trained_text_encoder_uncached, trained_text_encoder_cached: `trained_text_encoder_flags` without and with
      --cache_latents;
    - sdxl_full, then sdxl_cached and sdxl_resumed: the SDXL script, `sdxl_trained_flags`, validating at steps 2
      and 3; the same with --cache_latents (on the class images the first made); resumed from its checkpoint-2;
    - sdxl_int8: the SDXL script on an int8 UNet (frozen text encoders, their embeddings on disk in
      ``../sdxl_features``), on the pictures' caption files.
    """
    root = tmp_path_factory.mktemp("runs")
    results = launch_together({
        "full": (SCRIPT, *common(tiny, root / "full", *four_images, "--max_train_steps", 8,
                                 "--validation_prompt", "a sks triangle", "--num_validation_images", 1,
                                 "--validation_inference_steps", 2, "--validation_steps", 3,
                                 "--checkpointing_steps", 3)),
        "prior_first": (SCRIPT, *common(tiny, root / "prior_first", *prior_flags(root / "prior_class"))),
        "uncached": (SCRIPT, *common(tiny, root / "uncached", *cache_flags(tiny, root / "class"))),
        "trained_text_encoder_uncached": (SCRIPT, *common(tiny, root / "trained_text_encoder_uncached",
                                                          *trained_text_encoder_flags(),
                                                          source=dataset_captioned(tiny))),
        "trained_text_encoder_cached": (SCRIPT, *common(tiny, root / "trained_text_encoder_cached",
                                                        *trained_text_encoder_flags("--cache_latents"),
                                                        source=dataset_captioned(tiny))),
        "sdxl_full": (SDXL_SCRIPT, *sdxl_flags(tiny, root / "sdxl_full", *sdxl_trained_flags(
            tiny, root / "sdxl_class", "--validation_prompt", "a sks triangle", "--num_validation_images", 1,
            "--validation_inference_steps", 2, "--validation_steps", 2))),
        "sdxl_int8": (SDXL_SCRIPT, *sdxl_flags(tiny, root / "sdxl_int8", "--quantize_base", "int8", "--max_train_steps",
                                               2, "--feature_cache_dir", root / "sdxl_features",
                                               source=sidecar_captioned(tiny))),
    })
    shutil.copytree(root / "sdxl_full" / "checkpoint-2", root / "sdxl_resumed" / "checkpoint-2")
    after_first = snapshot(root / "prior_class")
    results |= launch_together({
        "prior_second": (SCRIPT, *common(tiny, root / "prior_second", *prior_flags(root / "prior_class"))),
        "cached": (SCRIPT, *common(tiny, root / "cached", *cache_flags(tiny, root / "class", "--cache_latents",
                                                                       "--feature_cache_dir", root / "features"))),
        "sdxl_cached": (SDXL_SCRIPT, *sdxl_flags(tiny, root / "sdxl_cached", *sdxl_trained_flags(
            tiny, root / "sdxl_class", "--cache_latents"))),
        "sdxl_resumed": (SDXL_SCRIPT, *sdxl_flags(tiny, root / "sdxl_resumed", *sdxl_trained_flags(
            tiny, root / "sdxl_class", "--resume_from_checkpoint", "latest"))),
    })
    return {name: (root / name, result) for name, result in results.items()}, after_first


@pytest.fixture(scope="module")
def runs(runs_and_class_images_after_the_first):
    return runs_and_class_images_after_the_first[0]


def test_writes_raw_and_ema_unet_lora_with_equal_keys_and_different_values(runs):
    output_dir, result = runs["full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and len(raw) > 0
    assert all(key.startswith("unet.") and "lora" in key for key in raw)
    assert all(raw[key].shape == ema[key].shape and raw[key].dtype == torch.float32 for key in raw)
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert f"raw LoRA: {output_dir / LORA}" in result.stdout
    assert f"ema LoRA: {output_dir / 'ema' / LORA}" in result.stdout


def test_validates_at_the_due_steps_and_the_final_step_once(runs):
    output_dir, _ = runs["full"]
    log = assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"), ["a sks triangle"], num_images=1)
    assert len(rendered_images(output_dir)) == 6
    card = (output_dir / "README.md").read_text()
    assert "DreamBooth LoRA" in card and "load_lora_weights" in card and log[-1]["progress"] in card
    assert checkpoint_names(output_dir) == ["checkpoint-3", "checkpoint-6"]


def test_resumed_run_prunes_and_ends_with_the_same_weights(tiny, four_images, tmp_path, runs):
    # From the full run's checkpoint-6, mid-epoch, with random flips and crops, never validating, checkpointing at
    # every step and keeping two: the uninterrupted run (which validated after writing checkpoint-6 and at the
    # end), bit for bit, and the checkpoint it resumed from pruned.
    def resumed_flags(output_dir):
        return common(tiny, output_dir, *four_images, "--max_train_steps", 8, "--checkpointing_steps", 1,
                      "--checkpoints_total_limit", 2)

    assert_resumes_exactly(SCRIPT, resumed_flags, runs["full"][0], tmp_path, 6, [LORA, f"ema/{LORA}"],
                           launch=launch)
    assert checkpoint_names(tmp_path) == ["checkpoint-7", "checkpoint-8"]


def test_prior_preservation_generates_the_class_images_once(runs_and_class_images_after_the_first):
    runs, after_first = runs_and_class_images_after_the_first
    class_dir = runs["prior_first"][0].parent / "prior_class"
    assert sorted(after_first) == ["class-00000.png", "class-00001.png", "class-00002.png"]
    assert f"generated 3 class images into {class_dir}" in runs["prior_first"][1].stdout
    assert snapshot(class_dir) == after_first, "the second run touched the class images"
    assert f"{class_dir} holds 3 class images; none generated" in runs["prior_second"][1].stdout
    assert "generated 3" not in runs["prior_second"][1].stdout


def test_class_image_generation_leaves_training_untouched(runs):
    # The first run generated before training, the second did not: the same weights, bit for bit.
    assert_same_files(runs["prior_first"][0] / LORA, runs["prior_second"][0] / LORA)


def test_text_encoder_lora_is_saved_with_the_unet_lora_and_ema_decay_zero_equals_raw(runs):
    output_dir, _ = runs["prior_first"]
    raw = load_file(output_dir / LORA)
    assert all("lora" in key for key in raw)
    assert {key.split(".")[0] for key in raw} == {"unet", "text_encoder"}
    assert_same_files(output_dir / LORA, output_dir / "ema" / LORA)


def test_outputs_load_into_a_fresh_pipeline_and_change_its_output(tiny, runs):
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
    pipe.load_lora_weights(runs["full"][0])
    unet_embeddings, with_unet_lora = render()
    assert torch.equal(unet_embeddings, base_embeddings)
    assert not np.allclose(base, with_unet_lora, atol=1e-4)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(runs["prior_first"][0])
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
    assert usage_error(SCRIPT, *common(tiny, output_dir, *flags)) == message.format(tmp=tmp_path)
    assert not output_dir.exists() and not (tmp_path / "class").exists()


@pytest.mark.parametrize("name", ["uncached", "cached"])
def test_bucketed_runs_train_in_several_buckets_and_validate_at_the_most_common(runs, name):
    output_dir, result = runs[name]
    buckets = reported_buckets(result.stderr)
    # The 6 images twice, in several buckets (each image's own bucket, for both repeats).
    assert sum(buckets.values()) == 12 and len(buckets) > 2 and all(images % 2 == 0 for images in buckets.values())
    # The most common bucket (of equally common ones, the largest); PIL gives (width, height).
    height, width = most_common_bucket(buckets)
    images = rendered_images(output_dir)
    assert len(images) == 4 and all(Image.open(path).size == (width, height) for path in images)


def test_cached_run_with_prior_preservation_matches_the_uncached_one(runs):
    (uncached, _), (cached, _) = runs["uncached"], runs["cached"]
    for name in (LORA, f"ema/{LORA}"):
        cached_weights = assert_close_files(uncached / name, cached / name)
        assert all(key.startswith("unet.") for key in cached_weights)


def test_cached_run_validates_with_the_offloaded_encoders_back(runs):
    (uncached, _), (cached, _) = runs["uncached"], runs["cached"]
    assert_close_validations(uncached, cached, [(2, "raw"), (2, "ema"), (4, "raw"), (4, "ema")])


def test_cached_run_resumed_mid_epoch_is_the_uninterrupted_one(tiny, tmp_path, runs):
    cached, _ = runs["cached"]
    class_dir = cached.parent / "class"

    def resumed_flags(output_dir):
        return common(tiny, output_dir, *cache_flags(tiny, class_dir, "--cache_latents"))

    result = assert_resumes_exactly(SCRIPT, resumed_flags, cached, tmp_path, 2, [LORA, f"ema/{LORA}"], launch=launch)
    assert f"{class_dir} holds 3 class images; none generated" in result.stdout


def test_cached_latents_without_prior_and_with_a_trained_text_encoder_match_the_uncached_run(runs):
    """No class half in the cached batch, and prompts encoded in the step by the trained text encoder."""
    (uncached, _), (cached, _) = runs["trained_text_encoder_uncached"], runs["trained_text_encoder_cached"]
    for name in (LORA, f"ema/{LORA}"):
        cached_weights = assert_close_files(uncached / name, cached / name)
        assert {key.split(".")[0] for key in cached_weights} == {"unet", "text_encoder"}


def test_caption_files_caption_their_images_and_each_caption_is_embedded_once_as_the_pipeline_does(tiny, runs,
                                                                                                   tmp_path):
    # The cached run: four pictures with caption files, two without (the instance prompt), class images on the class
    # prompt, dropped captions on the empty one; each embedded once, in that order, as sd.encode_prompts does (its
    # own test: what the pipeline's encode_prompt gives). `test_dreambooth` shows each sample gets its own's.
    output_dir, result = runs["cached"]
    assert "2 of 6 instance images have no .txt caption file beside them; they train on --instance_prompt" \
        in result.stderr
    prompts = [*INSTANCE_CAPTIONS[:CAPTION_FILES], INSTANCE_PROMPT, CLASS_PROMPT, ""]
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    args = import_script(SCRIPT).parse_args(list(map(str, common(tiny, tmp_path))))
    with torch.no_grad():
        expected = sd.encode_prompts(pipe, prompts, "cpu", sd.prompt_settings(pipe, args))
    text = load_file(next((output_dir.parent / "features").glob("text_embeddings-*/shard-*")))
    assert text["0/indices"].tolist() == list(range(len(prompts)))
    assert len(text) == len(expected) + 1
    for part, tensor in enumerate(expected):  # a batch of 6 takes other kernels on another thread count: not bitwise
        torch.testing.assert_close(text[f"0/{part}"], tensor, rtol=1e-5, atol=1e-6)
    card = (output_dir / "README.md").read_text()
    assert "## Training captions" in card and all(f'- "{caption}"' in card for caption in prompts[:5])


def test_a_datasets_caption_column_captions_its_images_on_the_card(runs):
    # The runs whose text encoder trains read the pictures as a dataset, each distinct caption listed once.
    card = (runs["trained_text_encoder_uncached"][0] / "README.md").read_text()
    listed = card.split("## Training captions\n\n")[1].split("\n\n")[0].splitlines()
    assert listed == [f'- "{caption}"' for caption in INSTANCE_CAPTIONS[:5]]


def test_sdxl_trains_its_unet_and_both_text_encoders_with_prior_preservation_and_validates(runs):
    output_dir, result = runs["sdxl_full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and all("lora" in key for key in raw)
    assert {key.split(".")[0] for key in raw} == {"unet", "text_encoder", "text_encoder_2"}
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert f"generated 2 class images into {output_dir.parent / 'sdxl_class'}" in result.stdout
    log = assert_validated_at(output_dir, [2, 3], ("raw", "ema"), ["a sks triangle"], num_images=1)
    card = (output_dir / "README.md").read_text()
    assert "StableDiffusionXLPipeline" in card and log[-1]["progress"] in card
    assert f'## Training captions\n\n- "{INSTANCE_CAPTIONS[0]}"' in card


def test_sdxl_cached_latents_train_like_encoding_every_step_and_a_resumed_run_like_the_whole_one(runs):
    full, cached, resumed = (runs[name][0] for name in ("sdxl_full", "sdxl_cached", "sdxl_resumed"))
    for name in (LORA, f"ema/{LORA}"):
        assert_close_files(full / name, cached / name)
        assert_same_files(full / name, resumed / name)
    assert f"resumed from {resumed / 'checkpoint-2'} at step 2" in runs["sdxl_resumed"][1].stdout


def test_sdxl_on_an_int8_unet_embeds_each_caption_once_as_the_pipeline_does_and_its_loras_load(tiny, runs):
    output_dir, result = runs["sdxl_int8"]
    raw = load_file(output_dir / LORA)
    assert all(key.startswith("unet.") and tensor.dtype == torch.float32 for key, tensor in raw.items())
    assert "2 of 6 instance images have no .txt caption file beside them; they train on --instance_prompt" \
        in result.stderr
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"])
    prompts = [*INSTANCE_CAPTIONS[:CAPTION_FILES], INSTANCE_PROMPT, ""]
    with torch.no_grad():
        expected = pipe.encode_prompt(prompts, device="cpu", do_classifier_free_guidance=False)
    text = load_file(next((output_dir.parent / "sdxl_features").glob("text_embeddings-*/shard-*")))
    assert text["0/indices"].tolist() == list(range(len(prompts)))
    # A batch of 6 takes other kernels on another thread count: equal up to float rounding, not bitwise.
    torch.testing.assert_close(text["0/0"], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(text["0/1"], expected[2], rtol=1e-5, atol=1e-6)
    assert_lora_changes_pipeline_output(tiny["sdxl"], output_dir, prompt=INSTANCE_PROMPT)


def transformer_full_fine_tune_flags(tiny, model, output_dir, *extra):
    """A transformer family's full fine-tune (``model``: its fixture) for 4 steps, checkpointing at 2, with an EMA
    of decay 0.9 on the CPU updated every 2 steps; ``extra`` adds validation (or anything else)."""
    return ["--pretrained_model_name_or_path", tiny[model], "--instance_data_dir", tiny["instance"],
            "--instance_prompt", INSTANCE_PROMPT, "--output_dir", output_dir, "--resolution", 32,
            "--train_batch_size", 2, "--learning_rate", 1e-3, "--seed", 3, "--max_train_steps", 4,
            "--checkpointing_steps", 2, "--use_ema", "--ema_decay", 0.9, "--ema_device", "cpu",
            "--ema_update_every", 2, "--max_sequence_length", 32, *extra]


# The transformer families' full fine-tunes, by fixture.
TRANSFORMER_FULL_FINE_TUNES = {"sd3": SD3_FULL_SCRIPT, "flux": FLUX_FULL_SCRIPT}
VALIDATING = ("--validation_prompt", "a sks triangle", "--num_validation_images", 1, "--validation_inference_steps", 2,
              "--validation_steps", 2)


def transformer_run_flags(tiny, model, root, name, *extra):
    """`transformer_full_fine_tune_flags` of ``model`` into ``root/name``, with the family's own: SD3 trains its two
    CLIP encoders too, with prior preservation (class images in ``root/sd3_class``); FLUX.1 its transformer alone,
    at another guidance."""
    own = (("--train_text_encoder", "--with_prior_preservation", "--class_data_dir", root / "sd3_class",
            "--class_prompt", CLASS_PROMPT, "--num_class_images", 2, "--sample_batch_size", 2,
            "--class_inference_steps", 2) if model == "sd3" else ("--guidance_scale", 2.0))
    return transformer_full_fine_tune_flags(tiny, model, root / name, *own, *extra)


@pytest.fixture(scope="module")
@launching
def full_fine_tunes(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}`` of the full fine-tune scripts' runs:

    - sd: the whole UNet and text encoder trained for 3 steps with prior preservation (3 class images it generates)
      and an EMA, validating every 2 steps and at the end;
    - sd3, flux: `TRANSFORMER_FULL_FINE_TUNES`' scripts (`transformer_run_flags`), validating every 2 steps;
    - sd3_resumed, flux_resumed: those resumed from their checkpoint-2, without validating (launched next).
    """
    root = tmp_path_factory.mktemp("full_fine_tune")
    results = launch_together({
        "sd": (FULL_SCRIPT, "--pretrained_model_name_or_path", tiny["sd"], "--instance_data_dir", tiny["instance"],
               "--instance_prompt", INSTANCE_PROMPT, "--output_dir", root / "sd", "--resolution", 32,
               "--train_batch_size", 2, "--learning_rate", 1e-3, "--seed", 3, *prior_flags(root / "class"),
               "--use_ema", "--ema_decay", 0.9, *VALIDATING),
        **{model: (script, *transformer_run_flags(tiny, model, root, model, *VALIDATING))
           for model, script in TRANSFORMER_FULL_FINE_TUNES.items()},
    })
    for model in TRANSFORMER_FULL_FINE_TUNES:
        shutil.copytree(root / model / "checkpoint-2", root / f"{model}_resumed" / "checkpoint-2")
    results |= launch_together({
        f"{model}_resumed": (script, *transformer_run_flags(tiny, model, root, f"{model}_resumed",
                                                            "--resume_from_checkpoint", "latest"))
        for model, script in TRANSFORMER_FULL_FINE_TUNES.items()})
    return {name: (root / name, result) for name, result in results.items()}


@pytest.fixture(scope="module")
def full_fine_tune(full_fine_tunes):
    return full_fine_tunes["sd"]


def test_full_fine_tune_writes_a_pipeline_folder_with_what_trained_and_its_ema(tiny, full_fine_tune):
    output_dir, result = full_fine_tune
    assert f"ema UNet and text encoder: {output_dir / 'ema'}" in result.stdout
    pipe = StableDiffusionPipeline.from_pretrained(output_dir)
    assert isinstance(pipe, StableDiffusionPipeline)
    for name, model_class in (("unet", UNet2DConditionModel), ("text_encoder", CLIPTextModel)):
        raw = assert_model_folder_loads(model_class, output_dir / name, initial=tiny["sd"] / name).state_dict()
        ema = assert_model_folder_loads(model_class, output_dir / "ema" / name, initial=tiny["sd"] / name)
        assert any(not torch.equal(tensor, ema.state_dict()[key]) for key, tensor in raw.items()), \
            f"ema/{name} holds the raw weights"


def test_full_fine_tune_with_prior_preservation_validates_at_the_due_steps_and_the_last(full_fine_tune):
    output_dir, _ = full_fine_tune
    assert len(list((output_dir.parent / "class").glob("*.png"))) == 3
    assert_validated_at(output_dir, [2, 3], ("raw", "ema"), ["a sks triangle"], num_images=1)
    assert "StableDiffusionPipeline.from_pretrained" in (output_dir / "README.md").read_text()


TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"


@pytest.mark.parametrize("model, pipeline_class, trained", [
    ("sd3", StableDiffusion3Pipeline, {"transformer": SD3Transformer2DModel,
                                       "text_encoder": CLIPTextModelWithProjection,
                                       "text_encoder_2": CLIPTextModelWithProjection}),
    ("flux", FluxPipeline, {"transformer": FluxTransformer2DModel}),
])
def test_transformer_full_fine_tunes_write_a_pipeline_folder_with_what_trained_and_its_ema(tiny, full_fine_tunes,
                                                                                           model, pipeline_class,
                                                                                           trained):
    output_dir, result = full_fine_tunes[model]
    pipe = pipeline_class.from_pretrained(output_dir)
    base = pipeline_class.from_pretrained(tiny[model])
    for name, model_class in trained.items():
        raw = assert_model_folder_loads(model_class, output_dir / name, initial=tiny[model] / name).state_dict()
        assert_same_tensors(raw, getattr(pipe, name).state_dict(), name)
        ema = assert_model_folder_loads(model_class, output_dir / "ema" / name, initial=tiny[model] / name)
        assert differing_keys(raw, ema.state_dict()), f"ema/{name} holds the raw weights"
    for name, module in modules_of(base).items():  # the VAE and the frozen text encoders (T5's tied weights too)
        if name not in trained:  # the files they were loaded from, linked
            assert_same_tensors(getattr(pipe, name).state_dict(), module.state_dict(), name)
            weights = sorted((tiny[model] / name).glob("*.safetensors"))
            assert weights and all(os.path.samefile(output_dir / name / path.name, path) for path in weights), name
    assert (output_dir / TRANSFORMER).stat().st_nlink == 1
    assert sorted(path.name for path in (output_dir / "ema").iterdir()) == sorted(trained)
    what = "transformer and CLIP text encoders" if len(trained) > 1 else "transformer"
    assert f"ema {what}: {output_dir / 'ema'}" in result.stdout
    card = (output_dir / "README.md").read_text()
    assert f"{pipeline_class.__name__}.from_pretrained" in card
    assert f'pipe.transformer = {trained["transformer"].__name__}.from_pretrained("{output_dir}/ema/transformer")' \
        in card


@pytest.mark.parametrize("model", TRANSFORMER_FULL_FINE_TUNES)
def test_transformer_full_fine_tunes_validate_at_the_due_steps_and_the_last_and_resume_exactly(full_fine_tunes, model):
    output_dir, _ = full_fine_tunes[model]
    assert_validated_at(output_dir, [2, 4], ("raw", "ema"), ["a sks triangle"], num_images=1)
    resumed, result = full_fine_tunes[f"{model}_resumed"]
    assert f"resumed from {resumed / 'checkpoint-2'} at step 2" in result.stdout
    trained = ["transformer", *(["text_encoder", "text_encoder_2"] if model == "sd3" else [])]
    for name in trained:
        file = TRANSFORMER if name == "transformer" else f"{name}/model.safetensors"
        for variant in (file, f"ema/{file}"):
            assert_same_files(resumed / variant, output_dir / variant)
    assert checkpoint_names(resumed) == ["checkpoint-2", "checkpoint-4"]


def test_sd3_full_fine_tune_generates_its_class_images_with_the_base_model(full_fine_tunes):
    output_dir, result = full_fine_tunes["sd3"]
    assert f"generated 2 class images into {output_dir.parent / 'sd3_class'}" in result.stdout
    assert f"{output_dir.parent / 'sd3_class'} holds 2 class images; none generated" in \
        full_fine_tunes["sd3_resumed"][1].stdout
