"""Upstream's own example tests (huggingface/diffusers ``examples/*/test_*.py``), command for command, on our scripts.

`UPSTREAM` holds, for every upstream test of a script we have, its runs' flags as upstream wrote them (their
``test_args``), and what we expect of each run. The hub models and datasets they name are replaced by our tiny
fixtures (`SUBSTITUTES`), ``{tmpdir}`` by the run's folder; every other flag stays as upstream wrote it,
``--resolution 64`` included. Upstream tests of scripts we do not have (``train_text_to_image_flax.py``, ...) are
left out; upstream has no test for its Z-Image and Krea 2 scripts, and no Chroma script (ours takes its FLUX.1
script's flags).

Here: every command parses with its script's own ``parse_args`` (no launch); what the ones that once failed
(issue 13) ask for runs in the smoke tests (``--num_validation_images 0`` and ``--cache_latents`` with random
crops in test_train_text_to_image_lora's runs). ``python -m tests.benchmarks.upstream_commands`` runs them all
end to end and prints a table.
"""

import argparse
import functools
import json
import shlex
import shutil
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest

from helpers import SCRIPTS, import_script, launch
from training_utils.errors import UsageError
from training_utils.parser import RefusedFlag
from training_utils.pipeline import from_pretrained
from training_utils.testing import checkpoint_names

# Upstream's hub models and data, and the tiny fixture (`training_utils.testing.tiny`) each stands for here.
SUBSTITUTES = {
    "hf-internal-testing/tiny-stable-diffusion-pipe": "sd",
    "hf-internal-testing/tiny-stable-diffusion-torch": "sd",
    "hf-internal-testing/tiny-stable-diffusion-xl-pipe": "sdxl",
    "hf-internal-testing/tiny-sdxl-pipe": "sdxl",
    "hf-internal-testing/tiny-sd3-pipe": "sd3",
    "hf-internal-testing/tiny-flux-pipe": "flux",
    "hf-internal-testing/tiny-flux-kontext-pipe": "flux_kontext",
    # Upstream's tiny FLUX.2 [klein] and [dev] read one text-encoder layer (their tests pass
    # --text_encoder_out_layers 1); ours read three, as the real ones: `flux2_reading_one_layer` makes the ones
    # upstream has.
    "hf-internal-testing/tiny-flux2-klein": "flux2_klein_one_layer",
    "hf-internal-testing/tiny-flux2": "flux2_dev_one_layer",
    "hf-internal-testing/tiny-qwenimage-pipe": "qwen_image",
    "hf-internal-testing/tiny-sana-pipe": "sana",
    "hf-internal-testing/tiny-lumina2-pipe": "lumina2",
    "hf-internal-testing/tiny-hidream-i1-pipe": "hidream",
    # Upstream's HiDream tests pass this one folder for both the Llama and its tokenizer: `hidream_llama` holds the tiny
    # HiDream's text_encoder_4 and tokenizer_4 together.
    "hf-internal-testing/tiny-random-LlamaForCausalLM": "hidream_llama",
    # DeepFloyd IF (pixel space, no VAE) is not an SD 1.x pipeline: its test's flags run on the tiny SD one.
    "hf-internal-testing/tiny-if-pipe": "sd",
    "hf-internal-testing/tiny-controlnet": "controlnet",
    "hf-internal-testing/tiny-controlnet-sdxl": "sdxl_controlnet",
    "hf-internal-testing/tiny-sd35-pipe": "sd35",
    "DavyMorgan/tiny-sd3-pipe": "sd3",
    "DavyMorgan/tiny-controlnet-sd3": "sd3_controlnet",
    "DavyMorgan/tiny-controlnet-sd35": "sd35_controlnet",
    "hf-internal-testing/dummy_image_text_data": "shapes",  # image + text, as an imagefolder
    "hf-internal-testing/dummy_image_class_data": "shapes_class",  # 6 images + a class label, as an imagefolder
    "diffusers/ddpm_dummy": "ddpm_unet_config",  # a tiny UNet2DModel's config.json
    "hf-internal-testing/fill10": "shapes_controlnet",  # image + conditioning_image + text
    # input_image + edited_image + edit_prompt, as an imagefolder
    "hf-internal-testing/instructpix2pix-10-samples": "shapes_instruct_pix2pix",
    "hf-internal-testing/tiny-adapter": "sdxl_t2i_adapter",
    "docs/source/en/imgs": "instance",
}
LORA = "pytorch_lora_weights.safetensors"
UNET = "unet/diffusion_pytorch_model.safetensors"
TRANSFORMER = "transformer/diffusion_pytorch_model.safetensors"
SCHEDULER = "scheduler/scheduler_config.json"
CONTROLNET = "diffusion_pytorch_model.safetensors"
EMBEDS = "learned_embeds.safetensors"
ADAPTER = CONTROLNET  # a T2I-Adapter's weights file is named as a ControlNet's

# The flags most of upstream's tests share ("a 2-step smoke run"), as they write them.
SMOKE = """
    --resolution 64 --train_batch_size 1 --gradient_accumulation_steps 1 --max_train_steps 2
    --learning_rate 5.0e-04 --scale_lr --lr_scheduler constant --lr_warmup_steps 0 --output_dir {tmpdir}
"""


class Run(NamedTuple):
    """One launch of an upstream test: its flags, and what it must leave in the folder."""

    flags: str
    checkpoints: tuple = None  # the checkpoints in the folder after the run (upstream's assertion), if it checks
    files: tuple = ()  # files the run must have written ({tmpdir_name}: the run folder's name)
    remove_first: tuple = ()  # what the test deletes from the folder before this run
    # The end of the one line our script stops this run with, where it differs from upstream's on purpose (the test
    # ends there).
    refused: str = None


class Upstream(NamedTuple):
    """An upstream test: where it is, the script of ours its commands are for, and its runs, in one folder."""

    test: str  # upstream's test file (under examples/) and test name
    script: str  # ours, under examples/
    runs: tuple
    # The one line our script stops with, for a flag it refuses on purpose (docs/from-diffusers.md).
    refused: str = None
    # Fixtures that stand for upstream's hub models in this test's runs instead of `SUBSTITUTES`' own.
    substitutes: dict = None


def t2i(flags, model="hf-internal-testing/tiny-stable-diffusion-pipe", **expected):
    """A run of upstream's text_to_image tests: tiny SD (or ``model``) on their image-text data, center-cropped and
    flipped."""
    return Run(f"--pretrained_model_name_or_path {model} "
               "--dataset_name hf-internal-testing/dummy_image_text_data --resolution 64 --center_crop --random_flip "
               "--train_batch_size 1 --gradient_accumulation_steps 1 --learning_rate 5.0e-04 --scale_lr "
               "--lr_scheduler constant --lr_warmup_steps 0 --output_dir {tmpdir} " + flags, **expected)


def sdxl_lora(flags, **expected):
    """A run of upstream's SDXL text-to-image LoRA tests (no --center_crop: random crops)."""
    return Run("--pretrained_model_name_or_path hf-internal-testing/tiny-stable-diffusion-xl-pipe "
               "--dataset_name hf-internal-testing/dummy_image_text_data " + SMOKE + flags, **expected)


def controlnet(flags, **expected):
    """A run of upstream's ControlNet test (SD 1.x): fill10, a tiny ControlNet to start from."""
    return Run("--pretrained_model_name_or_path=hf-internal-testing/tiny-stable-diffusion-pipe "
               "--dataset_name=hf-internal-testing/fill10 --output_dir={tmpdir} --resolution=64 --train_batch_size=1 "
               "--gradient_accumulation_steps=1 --controlnet_model_name_or_path=hf-internal-testing/tiny-controlnet "
               + flags, **expected)


def sd3_controlnet(model, controlnet):
    """The run of upstream's SD3 and SD3.5 ControlNet tests: ``model`` on fill10, from the tiny ``controlnet``."""
    return Run(f"--pretrained_model_name_or_path={model} --dataset_name=hf-internal-testing/fill10 "
               "--output_dir={tmpdir} --resolution=64 --train_batch_size=1 --gradient_accumulation_steps=1 "
               f"--controlnet_model_name_or_path={controlnet} --max_train_steps=4 --checkpointing_steps=2",
               files=(CONTROLNET,))


def dreambooth(model, prompt, flags, **expected):
    """A smoke run of upstream's DreamBooth (LoRA) tests: ``model`` on their docs images, ``--instance_prompt
    prompt``."""
    return Run(f"--pretrained_model_name_or_path {model} --instance_data_dir docs/source/en/imgs "
               f"--instance_prompt {prompt} " + SMOKE + flags, **expected)


def dreambooth_checkpointing(model, prompt, flags, **expected):
    """A run of upstream's DreamBooth (LoRA) checkpointing tests (their ``--flag=value`` form, default lr)."""
    return Run(f"--pretrained_model_name_or_path={model} --instance_data_dir=docs/source/en/imgs "
               f"--output_dir={{tmpdir}} --instance_prompt={prompt} --resolution=64 --train_batch_size=1 "
               "--gradient_accumulation_steps=1 "
               + flags, **expected)


def sdxl_dreambooth(source, flags, **expected):
    """A run of upstream's SDXL DreamBooth LoRA tests: tiny SDXL on ``source`` (their docs images, or their
    image-text data with its captions), ``--instance_prompt photo``, ``flags`` in place of their step count."""
    return Run("--pretrained_model_name_or_path hf-internal-testing/tiny-stable-diffusion-xl-pipe " + source
               + " --instance_prompt photo --resolution 64 --train_batch_size 1 --gradient_accumulation_steps 1 "
               + flags + " --learning_rate 5.0e-04 --scale_lr --lr_scheduler constant --lr_warmup_steps 0 "
               "--output_dir {tmpdir}", **expected)


def unconditional(flags, **expected):
    """A run of upstream's unconditional tests: a fresh tiny DDPM UNet on their 6 class images, 64 px, 1 epoch by
    default, rendering in 2 (or 1) DDPM steps."""
    return Run("--dataset_name hf-internal-testing/dummy_image_class_data --model_config_name_or_path "
               "diffusers/ddpm_dummy --resolution 64 --output_dir {tmpdir} --gradient_accumulation_steps 1 "
               "--learning_rate 1e-3 --lr_warmup_steps 5 " + flags, **expected)


def textual_inversion(model, flags, **expected):
    """A run of upstream's textual inversion tests: ``model`` on their docs images, a 2-vector <cat-toy> from "a",
    the embedding written every step."""
    return Run(f"--pretrained_model_name_or_path {model} --train_data_dir docs/source/en/imgs --learnable_property "
               "object --placeholder_token <cat-toy> --initializer_token a --save_steps 1 --num_vectors 2 "
               "--resolution 64 --train_batch_size 1 --gradient_accumulation_steps 1 --learning_rate 5.0e-04 "
               "--scale_lr --lr_scheduler constant --lr_warmup_steps 0 --output_dir {tmpdir} " + flags, **expected)


def textual_inversion_family(test_file, script, model, name):
    """The three tests upstream's textual inversion files share: a smoke run, the total limit, and the limit
    with a resume. That resume asks for no more steps than the checkpoint has: upstream trains one past its limit
    and expects a checkpoint-3; here it trains nothing (docs/from-diffusers.md) and rewrites the outputs."""
    def test(suffix):
        return f"textual_inversion/{test_file}::test_{name}{suffix}"

    return [
        Upstream(test(""), script, (textual_inversion(model, "--max_train_steps 2", files=(EMBEDS,)),)),
        Upstream(test("_checkpointing"), script, (textual_inversion(
            model, "--max_train_steps 3 --checkpointing_steps=1 --checkpoints_total_limit=2",
            checkpoints=checkpoints(2, 3)),)),
        Upstream(test("_checkpointing_checkpoints_total_limit_removes_multiple_checkpoints"), script, (
            textual_inversion(model, "--max_train_steps 2 --checkpointing_steps=1", checkpoints=checkpoints(1, 2)),
            textual_inversion(model, "--max_train_steps 2 --checkpointing_steps=1 "
                              "--resume_from_checkpoint=checkpoint-2 --checkpoints_total_limit=2",
                              checkpoints=checkpoints(1, 2), files=(EMBEDS,)))),
    ]


DOCS_IMAGES = "--instance_data_dir docs/source/en/imgs"
SD_TORCH = "hf-internal-testing/tiny-stable-diffusion-torch"  # upstream's DreamBooth tests' tiny SD
CAPTIONED_DATA = "--dataset_name hf-internal-testing/dummy_image_text_data --caption_column text"

CUSTOM_DIFFUSION = "custom_diffusion/train_custom_diffusion.py"
NO_PICKLES = ("--no_safe_serialization is not supported here: every file is written as safetensors; nothing here "
              "writes pickles")


def custom_diffusion_checkpointing(flags):
    """A run of upstream's Custom Diffusion checkpointing tests: tiny SD on their docs images, a <new1> token."""
    return Run(f"--pretrained_model_name_or_path={SD_TORCH} --instance_data_dir=docs/source/en/imgs "
               "--output_dir={tmpdir} --instance_prompt=<new1> --resolution=64 --train_batch_size=1 "
               "--modifier_token=<new1> --dataloader_num_workers=0 --no_safe_serialization " + flags)


def checkpoints(*steps):
    return tuple(f"checkpoint-{step}" for step in steps)


LCM_LORA_SDXL = "consistency_distillation/train_lcm_distill_lora_sdxl.py"
FLUX_ADVANCED = "advanced_diffusion_training/train_dreambooth_lora_flux_advanced.py"
TINY_FLUX = "hf-internal-testing/tiny-flux-pipe"
PIVOTAL_EMBEDDINGS = "{tmpdir_name}_emb.safetensors"  # upstream's embedding file, named after the output folder


def lcm_lora_sdxl(flags, **expected):
    """A run of upstream's LCM-LoRA SDXL tests: tiny SDXL as the teacher on their image-text data, rank 4."""
    return Run("--pretrained_teacher_model hf-internal-testing/tiny-stable-diffusion-xl-pipe "
               "--dataset_name hf-internal-testing/dummy_image_text_data --resolution 64 --lora_rank 4 "
               "--train_batch_size 1 --gradient_accumulation_steps 1 " + flags + " --learning_rate 5.0e-04 --scale_lr "
               "--lr_scheduler constant --lr_warmup_steps 0 --output_dir {tmpdir}", **expected)


def unprompted_family(test_file, family_name, script, model, layer, extra="", first_length=16, metadata=False):
    """The tests upstream's DreamBooth LoRA files for SANA, Lumina 2 and HiDream share, each run on an empty
    --instance_prompt at 32 px with --max_sequence_length 16 (``extra``: the flags each run adds, HiDream's Llama): a
    smoke run, latent caching, one layer (``layer``), the total limit, the limit removing two checkpoints on resume
    (its first run with ``first_length`` tokens), and ``--lora_alpha`` 8 with ``--rank`` 4 (``metadata``, SANA's)."""
    def test(name):
        return f"dreambooth/{test_file}::{name}"

    def smoke(flags):
        return Run(f"--pretrained_model_name_or_path {model} {extra} --instance_data_dir docs/source/en/imgs "
                   "--resolution 32 --train_batch_size 1 --gradient_accumulation_steps 1 --max_train_steps 2 "
                   f"{flags} --learning_rate 5.0e-04 --scale_lr --lr_scheduler constant --lr_warmup_steps 0 "
                   '--output_dir {tmpdir} --max_sequence_length 16 --instance_prompt ""', files=(LORA,))

    def checkpointing(flags, length=16, **expected):
        return Run(f"--pretrained_model_name_or_path={model} {extra} --instance_data_dir=docs/source/en/imgs "
                   "--output_dir={tmpdir} --resolution=32 --train_batch_size=1 --gradient_accumulation_steps=1 "
                   f'{flags} --max_sequence_length {length} --instance_prompt ""', **expected)

    family = [
        Upstream(test(f"test_dreambooth_lora_{family_name}"), script, (smoke(""),)),
        Upstream(test("test_dreambooth_lora_latent_caching"), script, (smoke("--cache_latents"),)),
        Upstream(test("test_dreambooth_lora_layers"), script, (smoke(f"--cache_latents --lora_layers {layer}"),)),
        Upstream(test(f"test_dreambooth_lora_{family_name}_checkpointing_checkpoints_total_limit"), script, (
            checkpointing("--max_train_steps=6 --checkpoints_total_limit=2 --checkpointing_steps=2",
                          checkpoints=checkpoints(4, 6)),)),
    ]
    # SANA's and Lumina 2's first run has 166 tokens (upstream's typo), its resume 16: a change of the trained
    # prompts' padding, which a resume here refuses (docs/reliability.md).
    refused = None if first_length == 16 else (
        f"the flags the checkpoint was trained with (--max_sequence_length was {first_length}, now 16), or "
        "--resume_with_changed_args to go on anyway")
    family.append(Upstream(
        test(f"test_dreambooth_lora_{family_name}_checkpointing_checkpoints_total_limit_removes_multiple_checkpoints"),
        script, (checkpointing("--max_train_steps=4 --checkpointing_steps=2", first_length,
                               checkpoints=checkpoints(2, 4)),
                 checkpointing("--max_train_steps=8 --checkpointing_steps=2 --resume_from_checkpoint=checkpoint-4 "
                               "--checkpoints_total_limit=2", refused=refused, checkpoints=checkpoints(6, 8)))))
    if metadata:
        family.append(Upstream(test(f"test_dreambooth_lora_{family_name}_with_metadata"), script, (checkpointing(
            "--max_train_steps=4 --lora_alpha=8 --rank=4 --checkpointing_steps=2", 166, files=(LORA,)),)))
    return family


def dreambooth_family(test_file, family_name, script, model, prompt, extra="", layer=None, block=None,
                      text_encoder=False, metadata=False):
    """The tests upstream's DreamBooth LoRA files for SD3, FLUX.1, FLUX.1 Kontext, FLUX.2 [klein] and Qwen-Image
    share: a smoke run, latent caching, one layer (``layer``) or one block (``block``), the text encoder
    (``text_encoder``), the total limit, the limit removing two checkpoints on resume, and ``--lora_alpha`` 8 with
    ``--rank`` 4 (``metadata``).
    ``family_name`` is the one in its tests' names; ``extra``, the flags each of its runs adds (FLUX.2's prompt
    settings)."""
    def test(name):
        return f"dreambooth/{test_file}::{name}"

    smoke = functools.partial(dreambooth, model, prompt)
    checkpointing = functools.partial(dreambooth_checkpointing, model, prompt)
    family = [
        Upstream(test(f"test_dreambooth_lora_{family_name}"), script, (smoke(extra, files=(LORA,)),)),
        Upstream(test("test_dreambooth_lora_latent_caching"), script,
                 (smoke(f"--cache_latents {extra}", files=(LORA,)),)),
    ]
    if text_encoder:
        family.append(Upstream(test(f"test_dreambooth_lora_text_encoder_{family_name}"), script,
                               (smoke(f"--train_text_encoder {extra}", files=(LORA,)),)))
    if block is not None:
        family.append(Upstream(test("test_dreambooth_lora_block"), script,
                               (smoke(f"--lora_blocks {block} {extra}", files=(LORA,)),)))
    if layer is not None:
        # Upstream's SD3 file names it test_dreambooth_lora_layer, without --cache_latents; the others, _layers, with.
        name, cache = ("test_dreambooth_lora_layer", "") if family_name == "sd3" else (
            "test_dreambooth_lora_layers", "--cache_latents ")
        family.append(Upstream(test(name), script, (smoke(f"{cache}--lora_layers {layer} {extra}", files=(LORA,)),)))
    family += [
        Upstream(test(f"test_dreambooth_lora_{family_name}_checkpointing_checkpoints_total_limit"), script, (
            checkpointing(f"--max_train_steps=6 --checkpoints_total_limit=2 --checkpointing_steps=2 {extra}",
                          checkpoints=checkpoints(4, 6)),)),
        Upstream(test(f"test_dreambooth_lora_{family_name}_checkpointing_checkpoints_total_limit_removes_multiple"
                      "_checkpoints"), script, (
            checkpointing(f"--max_train_steps=4 --checkpointing_steps=2 {extra}", checkpoints=checkpoints(2, 4)),
            checkpointing(f"--max_train_steps=8 --checkpointing_steps=2 --resume_from_checkpoint=checkpoint-4 "
                          f"--checkpoints_total_limit=2 {extra}", checkpoints=checkpoints(6, 8)))),
    ]
    if metadata:
        family.append(Upstream(test("test_dreambooth_lora_with_metadata"), script,
                               (smoke(f"--lora_alpha=8 --rank=4 {extra}", files=(LORA,)),)))
    return family


def full_fine_tune_family(test_file, script, model):
    """The tests upstream's DreamBooth full fine-tune files for SD3 and FLUX.1 share, on ``model`` with
    ``--instance_prompt photo``: a smoke run writing the pipeline folder, checkpointing and resuming (checkpoint-2
    deleted in between), the total limit, and the limit removing two checkpoints on resume."""
    def test(name):
        return f"dreambooth/{test_file}::{name}"

    smoke = functools.partial(dreambooth, model, "photo")
    checkpointing = functools.partial(dreambooth_checkpointing, model, "photo")
    return [
        Upstream(test("test_dreambooth"), script, (smoke("", files=(TRANSFORMER, SCHEDULER)),)),
        Upstream(test("test_dreambooth_checkpointing"), script, (
            smoke("--max_train_steps 4 --checkpointing_steps=2 --seed=0", checkpoints=checkpoints(2, 4),
                  files=(TRANSFORMER, "checkpoint-2/" + TRANSFORMER)),
            smoke("--max_train_steps 6 --checkpointing_steps=2 --resume_from_checkpoint=checkpoint-4 --seed=0",
                  remove_first=("checkpoint-2",), checkpoints=checkpoints(4, 6), files=(TRANSFORMER,)))),
        Upstream(test("test_dreambooth_checkpointing_checkpoints_total_limit"), script, (
            checkpointing("--max_train_steps=6 --checkpoints_total_limit=2 --checkpointing_steps=2",
                          checkpoints=checkpoints(4, 6)),)),
        Upstream(test("test_dreambooth_checkpointing_checkpoints_total_limit_removes_multiple_checkpoints"), script, (
            checkpointing("--max_train_steps=4 --checkpointing_steps=2", checkpoints=checkpoints(2, 4)),
            checkpointing("--max_train_steps=8 --checkpointing_steps=2 --resume_from_checkpoint=checkpoint-4 "
                          "--checkpoints_total_limit=2", checkpoints=checkpoints(6, 8)))),
    ]


VQGAN = "vqgan/train_vqgan.py"
# The config files upstream's VQ-GAN test writes, and the VGG its script downloads by default (named here, so that
# the tiny one stands for it).
VQGAN_FILES = {"vqmodel.json": "vqmodel_config", "discriminator.json": "vqgan_discriminator_config",
               "vgg19": "vgg_tiny"}


def vqgan(flags, **expected):
    """A run of upstream's VQ-GAN tests: a fresh VQModel and discriminator of its test configs on their image-text
    data at 32 px, our tiny VGG in place of timm's VGG19."""
    return Run("--dataset_name hf-internal-testing/dummy_image_text_data --resolution 32 --image_column image "
               "--train_batch_size 1 --gradient_accumulation_steps 1 --learning_rate 5.0e-04 --scale_lr "
               "--lr_scheduler constant --lr_warmup_steps 0 --model_config_name_or_path vqmodel.json "
               "--discriminator_config_name_or_path discriminator.json --timm_model_backend vgg19 " + flags,
               **expected)


def vqgan_checkpointing(ema=""):
    """Upstream's VQ-GAN checkpointing test (``ema``: ``--use_ema``): checkpoints every 2 of 4 steps, checkpoint-2
    deleted, then a resume from checkpoint-4 to step 6 checkpointing every step. Upstream's script checkpoints only
    after a discriminator step (its test says so) and expects checkpoint-4 and 6; here every step is a step, and
    checkpoint-5 is written too."""
    return (vqgan(f"--max_train_steps 4 --checkpointing_steps=2 --output_dir {{tmpdir}} {ema} --seed=0",
                  checkpoints=checkpoints(2, 4), files=(f"checkpoint-2/vqmodel/{CONTROLNET}", CONTROLNET)),
            vqgan(f"--max_train_steps 6 --checkpointing_steps=1 --resume_from_checkpoint={{tmpdir}}/checkpoint-4 "
                  f"--output_dir {{tmpdir}} {ema} --seed=0", remove_first=("checkpoint-2",),
                  checkpoints=checkpoints(4, 5, 6), files=(CONTROLNET,)))


def instruct_pix2pix(flags, **expected):
    """A run of upstream's InstructPix2Pix tests: tiny SD on their 10 edit samples, flipped, at seed 0."""
    return Run("--pretrained_model_name_or_path=hf-internal-testing/tiny-stable-diffusion-torch "
               "--dataset_name=hf-internal-testing/instructpix2pix-10-samples --resolution=64 --random_flip "
               "--train_batch_size=1 --output_dir {tmpdir} --seed=0 " + flags, **expected)


UPSTREAM = [
    # examples/text_to_image/test_text_to_image.py, classes TextToImage and TextToImageSDXL.
    Upstream("text_to_image/test_text_to_image.py::test_text_to_image", "text_to_image/train_text_to_image.py",
             (t2i("--max_train_steps 2", files=(UNET, SCHEDULER)),)),
    Upstream("text_to_image/test_text_to_image.py::test_text_to_image_checkpointing",
             "text_to_image/train_text_to_image.py", (
                 t2i("--max_train_steps 5 --checkpointing_steps=2 --seed=0", checkpoints=checkpoints(2, 4),
                     files=("checkpoint-2/" + UNET,)),
                 t2i("--max_train_steps 7 --checkpointing_steps=2 --resume_from_checkpoint=checkpoint-4 --seed=0",
                     remove_first=("checkpoint-2",), checkpoints=checkpoints(4, 6), files=(UNET,)))),
    Upstream("text_to_image/test_text_to_image.py::test_text_to_image_checkpointing_use_ema",
             "text_to_image/train_text_to_image.py", (
                 t2i("--max_train_steps 4 --checkpointing_steps=2 --use_ema --seed=0", checkpoints=checkpoints(2, 4),
                     files=("checkpoint-2/" + UNET,)),
                 # Resumes step 4 with --max_train_steps 2: upstream trains one step past its limit and expects a
                 # checkpoint-5; here a resume past --max_train_steps trains nothing (docs/from-diffusers.md) and rewrites the outputs from checkpoint-4.
                 t2i("--max_train_steps 2 --checkpointing_steps=1 --resume_from_checkpoint=checkpoint-4 --use_ema "
                     "--seed=0", remove_first=("checkpoint-2",), checkpoints=checkpoints(4), files=(UNET,)))),
    Upstream("text_to_image/test_text_to_image.py::test_text_to_image_checkpointing_checkpoints_total_limit",
             "text_to_image/train_text_to_image.py", (
                 t2i("--max_train_steps 7 --checkpointing_steps=2 --checkpoints_total_limit=2 --seed=0",
                     checkpoints=checkpoints(4, 6), files=(UNET,)),)),
    Upstream("text_to_image/test_text_to_image.py::test_text_to_image_checkpointing_checkpoints_total_limit_removes_"
             "multiple_checkpoints", "text_to_image/train_text_to_image.py", (
                 t2i("--max_train_steps 9 --checkpointing_steps=2 --seed=0", checkpoints=checkpoints(2, 4, 6, 8)),
                 t2i("--max_train_steps 11 --checkpointing_steps=2 --resume_from_checkpoint=checkpoint-8 "
                     "--checkpoints_total_limit=3 --seed=0", checkpoints=checkpoints(6, 8, 10), files=(UNET,)))),
    Upstream("text_to_image/test_text_to_image.py::test_text_to_image_sdxl",
             "text_to_image/train_text_to_image_sdxl.py",
             (t2i("--max_train_steps 2", model="hf-internal-testing/tiny-stable-diffusion-xl-pipe",
                  files=(UNET, SCHEDULER)),)),

    # examples/text_to_image/test_text_to_image_lora.py, classes TextToImageLoRA and TextToImageLoRASDXL.
    Upstream("text_to_image/test_text_to_image_lora.py::test_text_to_image_lora_checkpointing_checkpoints_total_limit",
             "text_to_image/train_text_to_image_lora.py", (
                 t2i("--max_train_steps 6 --checkpointing_steps=2 --checkpoints_total_limit=2 --seed=0 "
                     "--num_validation_images=0", checkpoints=checkpoints(4, 6), files=(LORA,)),)),
    Upstream("text_to_image/test_text_to_image_lora.py::test_text_to_image_lora_checkpointing_checkpoints_total_limit_"
             "removes_multiple_checkpoints", "text_to_image/train_text_to_image_lora.py", (
                 t2i("--max_train_steps 4 --checkpointing_steps=2 --seed=0 --num_validation_images=0",
                     checkpoints=checkpoints(2, 4), files=(LORA,)),
                 t2i("--max_train_steps 8 --checkpointing_steps=2 --resume_from_checkpoint=checkpoint-4 "
                     "--checkpoints_total_limit=2 --seed=0 --num_validation_images=0", checkpoints=checkpoints(6, 8),
                     files=(LORA,)))),
    Upstream("text_to_image/test_text_to_image_lora.py::test_text_to_image_lora_sdxl_checkpointing_checkpoints_total_"
             "limit", "text_to_image/train_text_to_image_lora_sdxl.py", (
                 sdxl_lora("--max_train_steps 6 --checkpointing_steps=2 --checkpoints_total_limit=2",
                           checkpoints=checkpoints(4, 6), files=(LORA,)),)),
    Upstream("text_to_image/test_text_to_image_lora.py::test_text_to_image_lora_sdxl",
             "text_to_image/train_text_to_image_lora_sdxl.py", (sdxl_lora("", files=(LORA,)),)),
    Upstream("text_to_image/test_text_to_image_lora.py::test_text_to_image_lora_sdxl_with_text_encoder",
             "text_to_image/train_text_to_image_lora_sdxl.py", (sdxl_lora("--train_text_encoder", files=(LORA,)),)),
    Upstream("text_to_image/test_text_to_image_lora.py::test_text_to_image_lora_sdxl_text_encoder_checkpointing_"
             "checkpoints_total_limit", "text_to_image/train_text_to_image_lora_sdxl.py", (
                 sdxl_lora("--max_train_steps 6 --train_text_encoder --checkpointing_steps=2 "
                           "--checkpoints_total_limit=2", checkpoints=checkpoints(4, 6), files=(LORA,)),)),

    # examples/controlnet/test_controlnet.py, classes ControlNet and ControlNetSDXL.
    Upstream("controlnet/test_controlnet.py::test_controlnet_checkpointing_checkpoints_total_limit",
             "controlnet/train_controlnet.py", (
                 controlnet("--max_train_steps=6 --checkpoints_total_limit=2 --checkpointing_steps=2",
                            checkpoints=checkpoints(4, 6), files=(CONTROLNET,)),)),
    Upstream("controlnet/test_controlnet.py::test_controlnet_checkpointing_checkpoints_total_limit_removes_multiple_"
             "checkpoints", "controlnet/train_controlnet.py", (
                 controlnet("--max_train_steps=6 --checkpointing_steps=2", checkpoints=checkpoints(2, 4, 6)),
                 controlnet("--max_train_steps=8 --checkpointing_steps=2 --resume_from_checkpoint=checkpoint-6 "
                            "--checkpoints_total_limit=2", checkpoints=checkpoints(6, 8), files=(CONTROLNET,)))),
    Upstream("controlnet/test_controlnet.py::test_controlnet_sdxl", "controlnet/train_controlnet_sdxl.py", (
        Run("--pretrained_model_name_or_path=hf-internal-testing/tiny-stable-diffusion-xl-pipe "
            "--dataset_name=hf-internal-testing/fill10 --output_dir={tmpdir} --resolution=64 --train_batch_size=1 "
            "--gradient_accumulation_steps=1 --controlnet_model_name_or_path=hf-internal-testing/tiny-controlnet-sdxl "
            "--max_train_steps=4 --checkpointing_steps=2", files=(CONTROLNET,)),)),
    # Classes TestControlNetSD3, TestControlNetSD35 (whose test has SD3's name: both named by class here) and
    # TestControlNetflux.
    Upstream("controlnet/test_controlnet.py::TestControlNetSD3::test_controlnet_sd3",
             "controlnet/train_controlnet_sd3.py",
             (sd3_controlnet("DavyMorgan/tiny-sd3-pipe", "DavyMorgan/tiny-controlnet-sd3"),)),
    Upstream("controlnet/test_controlnet.py::TestControlNetSD35::test_controlnet_sd3",
             "controlnet/train_controlnet_sd3.py",
             (sd3_controlnet("hf-internal-testing/tiny-sd35-pipe", "DavyMorgan/tiny-controlnet-sd35"),)),
    Upstream("controlnet/test_controlnet.py::test_controlnet_flux", "controlnet/train_controlnet_flux.py", (
        Run("--pretrained_model_name_or_path=hf-internal-testing/tiny-flux-pipe --output_dir={tmpdir} "
            "--dataset_name=hf-internal-testing/fill10 --conditioning_image_column=conditioning_image "
            "--image_column=image --caption_column=text --resolution=64 --train_batch_size=1 "
            "--gradient_accumulation_steps=1 --max_train_steps=4 --checkpointing_steps=2 --num_double_layers=1 "
            "--num_single_layers=1", files=(CONTROLNET,)),)),

    # examples/t2i_adapter/test_t2i_adapter.py. The XL adapter adds its first two features after the UNet's first two
    # blocks, at one size: the UNet's blocks must come in SDXL's order (as upstream's tiny SDXL has them), which
    # sdxl_adapter_base's do and sdxl's do not.
    Upstream("t2i_adapter/test_t2i_adapter.py::test_t2i_adapter_sdxl", "t2i_adapter/train_t2i_adapter_sdxl.py", (
        Run("--pretrained_model_name_or_path=hf-internal-testing/tiny-stable-diffusion-xl-pipe "
            "--adapter_model_name_or_path=hf-internal-testing/tiny-adapter --dataset_name=hf-internal-testing/fill10 "
            "--output_dir={tmpdir} --resolution=64 --train_batch_size=1 --gradient_accumulation_steps=1 "
            "--max_train_steps=9 --checkpointing_steps=2", files=(ADAPTER,)),),
             substitutes={"hf-internal-testing/tiny-stable-diffusion-xl-pipe": "sdxl_adapter_base"}),
    # examples/dreambooth/test_dreambooth.py, class DreamBooth: the full fine-tune.
    Upstream("dreambooth/test_dreambooth.py::test_dreambooth", "dreambooth/train_dreambooth.py", (
        dreambooth(SD_TORCH, "photo", "", files=(UNET, SCHEDULER)),)),
    Upstream("dreambooth/test_dreambooth.py::test_dreambooth_if", "dreambooth/train_dreambooth.py", (
        dreambooth("hf-internal-testing/tiny-if-pipe", "photo",
                   "--pre_compute_text_embeddings --tokenizer_max_length=77 --text_encoder_use_attention_mask",
                   files=(UNET, SCHEDULER)),),
             refused="--tokenizer_max_length is not supported here: DeepFloyd IF's T5 prompt options; Stable "
                     "Diffusion's prompts are tokenized as its pipeline's encode_prompt does (CLIP, the tokenizer's "
                     "length, no attention mask)"),
    Upstream("dreambooth/test_dreambooth.py::test_dreambooth_checkpointing", "dreambooth/train_dreambooth.py", (
        dreambooth(SD_TORCH, "photo", "--max_train_steps 4 --checkpointing_steps=2 --seed=0",
                   checkpoints=checkpoints(2, 4), files=(UNET, "checkpoint-2/" + UNET)),
        dreambooth(SD_TORCH, "photo", "--max_train_steps 6 --checkpointing_steps=2 "
                   "--resume_from_checkpoint=checkpoint-4 --seed=0", remove_first=("checkpoint-2",),
                   checkpoints=checkpoints(4, 6), files=(UNET,)))),
    Upstream("dreambooth/test_dreambooth.py::test_dreambooth_checkpointing_checkpoints_total_limit",
             "dreambooth/train_dreambooth.py", (
                 dreambooth_checkpointing(SD_TORCH, "prompt",
                                          "--max_train_steps=6 --checkpoints_total_limit=2 --checkpointing_steps=2",
                                          checkpoints=checkpoints(4, 6)),)),
    Upstream("dreambooth/test_dreambooth.py::test_dreambooth_checkpointing_checkpoints_total_limit_removes_multiple_"
             "checkpoints", "dreambooth/train_dreambooth.py", (
                 dreambooth_checkpointing(SD_TORCH, "prompt", "--max_train_steps=4 --checkpointing_steps=2",
                                          checkpoints=checkpoints(2, 4)),
                 dreambooth_checkpointing(SD_TORCH, "prompt", "--max_train_steps=8 --checkpointing_steps=2 "
                                          "--resume_from_checkpoint=checkpoint-4 --checkpoints_total_limit=2",
                                          checkpoints=checkpoints(6, 8)))),

    # examples/dreambooth/test_dreambooth_sd3.py and test_dreambooth_flux.py: the transformers' full fine-tunes.
    *full_fine_tune_family("test_dreambooth_sd3.py", "dreambooth/train_dreambooth_sd3.py",
                           "hf-internal-testing/tiny-sd3-pipe"),
    *full_fine_tune_family("test_dreambooth_flux.py", "dreambooth/train_dreambooth_flux.py",
                           "hf-internal-testing/tiny-flux-pipe"),

    # examples/dreambooth/test_dreambooth_lora.py, classes DreamBoothLoRA and DreamBoothLoRASDXL.
    Upstream("dreambooth/test_dreambooth_lora.py::test_dreambooth_lora", "dreambooth/train_dreambooth_lora.py", (
        dreambooth("hf-internal-testing/tiny-stable-diffusion-pipe", "photo", "", files=(LORA,)),)),
    Upstream("dreambooth/test_dreambooth_lora.py::test_dreambooth_lora_with_text_encoder",
             "dreambooth/train_dreambooth_lora.py", (
                 dreambooth("hf-internal-testing/tiny-stable-diffusion-pipe", "photo", "--train_text_encoder",
                            files=(LORA,)),)),
    Upstream("dreambooth/test_dreambooth_lora.py::test_dreambooth_lora_checkpointing_checkpoints_total_limit",
             "dreambooth/train_dreambooth_lora.py", (
                 dreambooth_checkpointing("hf-internal-testing/tiny-stable-diffusion-pipe", "prompt",
                                          "--max_train_steps=6 --checkpoints_total_limit=2 --checkpointing_steps=2",
                                          checkpoints=checkpoints(4, 6)),)),
    Upstream("dreambooth/test_dreambooth_lora.py::test_dreambooth_lora_checkpointing_checkpoints_total_limit_removes_"
             "multiple_checkpoints", "dreambooth/train_dreambooth_lora.py", (
                 dreambooth_checkpointing("hf-internal-testing/tiny-stable-diffusion-pipe", "prompt",
                                          "--max_train_steps=4 --checkpointing_steps=2", checkpoints=checkpoints(2, 4)),
                 dreambooth_checkpointing("hf-internal-testing/tiny-stable-diffusion-pipe", "prompt",
                                          "--max_train_steps=8 --checkpointing_steps=2 "
                                          "--resume_from_checkpoint=checkpoint-4 --checkpoints_total_limit=2",
                                          checkpoints=checkpoints(6, 8)))),
    Upstream("dreambooth/test_dreambooth_lora.py::test_dreambooth_lora_if_model",
             "dreambooth/train_dreambooth_lora.py", (
        dreambooth("hf-internal-testing/tiny-if-pipe", "photo",
                   "--pre_compute_text_embeddings --tokenizer_max_length=77 --text_encoder_use_attention_mask",
                   files=(LORA,)),),
             refused="--tokenizer_max_length is not supported here: DeepFloyd IF's T5 prompt options; Stable "
                     "Diffusion's prompts are tokenized as its pipeline's encode_prompt does (CLIP, the tokenizer's "
                     "length, no attention mask)"),
    Upstream("dreambooth/test_dreambooth_lora.py::test_dreambooth_lora_sdxl",
             "dreambooth/train_dreambooth_lora_sdxl.py",
             (sdxl_dreambooth(DOCS_IMAGES, "--max_train_steps 2", files=(LORA,)),)),
    Upstream("dreambooth/test_dreambooth_lora.py::test_dreambooth_lora_sdxl_with_text_encoder",
             "dreambooth/train_dreambooth_lora_sdxl.py",
             (sdxl_dreambooth(DOCS_IMAGES, "--max_train_steps 2 --train_text_encoder", files=(LORA,)),)),
    Upstream("dreambooth/test_dreambooth_lora.py::test_dreambooth_lora_sdxl_custom_captions",
             "dreambooth/train_dreambooth_lora_sdxl.py",
             (sdxl_dreambooth(CAPTIONED_DATA, "--max_train_steps 2", files=(LORA,)),)),
    Upstream("dreambooth/test_dreambooth_lora.py::test_dreambooth_lora_sdxl_text_encoder_custom_captions",
             "dreambooth/train_dreambooth_lora_sdxl.py",
             (sdxl_dreambooth(CAPTIONED_DATA, "--max_train_steps 2 --train_text_encoder", files=(LORA,)),)),
    Upstream("dreambooth/test_dreambooth_lora.py::test_dreambooth_lora_sdxl_checkpointing_checkpoints_total_limit",
             "dreambooth/train_dreambooth_lora_sdxl.py", (sdxl_dreambooth(
                 DOCS_IMAGES, "--max_train_steps 6 --checkpointing_steps=2 --checkpoints_total_limit=2",
                 checkpoints=checkpoints(4, 6), files=(LORA,)),)),
    Upstream("dreambooth/test_dreambooth_lora.py::test_dreambooth_lora_sdxl_text_encoder_checkpointing_checkpoints_"
             "total_limit", "dreambooth/train_dreambooth_lora_sdxl.py", (sdxl_dreambooth(
                 DOCS_IMAGES, "--max_train_steps 7 --checkpointing_steps=2 --checkpoints_total_limit=2 "
                 "--train_text_encoder", checkpoints=checkpoints(4, 6), files=(LORA,)),)),

    # examples/dreambooth/test_dreambooth_lora_sd3.py, _flux.py, _flux_kontext.py, _flux2_klein.py, _flux2.py,
    # _qwenimage.py, _sana.py, _lumina2.py and _hidream.py.
    *dreambooth_family("test_dreambooth_lora_sd3.py", "sd3", "dreambooth/train_dreambooth_lora_sd3.py",
                       "hf-internal-testing/tiny-sd3-pipe", "photo", layer="attn.to_k", block=0, text_encoder=True),
    *dreambooth_family("test_dreambooth_lora_flux.py", "flux", "dreambooth/train_dreambooth_lora_flux.py",
                       "hf-internal-testing/tiny-flux-pipe", "photo", layer="single_transformer_blocks.0.attn.to_k",
                       text_encoder=True, metadata=True),
    *dreambooth_family("test_dreambooth_lora_flux_kontext.py", "flux_kontext",
                       "dreambooth/train_dreambooth_lora_flux_kontext.py", "hf-internal-testing/tiny-flux-kontext-pipe",
                       "photo", layer="single_transformer_blocks.0.attn.to_k", text_encoder=True, metadata=True),
    *dreambooth_family("test_dreambooth_lora_flux2_klein.py", "flux2",
                       "dreambooth/train_dreambooth_lora_flux2_klein.py", "hf-internal-testing/tiny-flux2-klein", "dog",
                       extra="--max_sequence_length 8 --text_encoder_out_layers 1",
                       layer="single_transformer_blocks.0.attn.to_qkv_mlp_proj", metadata=True),
    *dreambooth_family("test_dreambooth_lora_flux2.py", "flux2", "dreambooth/train_dreambooth_lora_flux2.py",
                       "hf-internal-testing/tiny-flux2", "dog",
                       extra="--max_sequence_length 8 --text_encoder_out_layers 1",
                       layer="single_transformer_blocks.0.attn.to_qkv_mlp_proj", metadata=True),
    *dreambooth_family("test_dreambooth_lora_qwenimage.py", "qwen", "dreambooth/train_dreambooth_lora_qwen_image.py",
                       "hf-internal-testing/tiny-qwenimage-pipe", "photo", layer="transformer_blocks.0.attn.to_k",
                       metadata=True),
    *unprompted_family("test_dreambooth_lora_sana.py", "sana", "dreambooth/train_dreambooth_lora_sana.py",
                       "hf-internal-testing/tiny-sana-pipe", "transformer_blocks.0.attn1.to_k", first_length=166,
                       metadata=True),
    *unprompted_family("test_dreambooth_lora_lumina2.py", "lumina2", "dreambooth/train_dreambooth_lora_lumina2.py",
                       "hf-internal-testing/tiny-lumina2-pipe", "layers.0.attn.to_k", first_length=166),
    *unprompted_family("test_dreambooth_lora_hidream.py", "hidream", "dreambooth/train_dreambooth_lora_hidream.py",
                       "hf-internal-testing/tiny-hidream-i1-pipe", "double_stream_blocks.0.block.attn1.to_k",
                       extra=" ".join(f"--pretrained_{part}_4_name_or_path hf-internal-testing/tiny-random-"
                                      "LlamaForCausalLM" for part in ("text_encoder", "tokenizer"))),
    # examples/unconditional_image_generation/test_unconditional.py, class TestUnconditional.
    Upstream("unconditional_image_generation/test_unconditional.py::test_train_unconditional",
             "unconditional_image_generation/train_unconditional.py", (
                 unconditional("--train_batch_size 2 --num_epochs 1 --ddpm_num_inference_steps 2",
                               files=(UNET, SCHEDULER)),)),
    Upstream("unconditional_image_generation/test_unconditional.py::"
             "test_unconditional_checkpointing_checkpoints_total_limit",
             "unconditional_image_generation/train_unconditional.py", (
                 unconditional("--train_batch_size 1 --num_epochs 1 --ddpm_num_inference_steps 2 "
                               "--checkpointing_steps=2 --checkpoints_total_limit=2", checkpoints=checkpoints(4, 6)),)),
    Upstream("unconditional_image_generation/test_unconditional.py::"
             "test_unconditional_checkpointing_checkpoints_total_limit_removes_multiple_checkpoints",
             "unconditional_image_generation/train_unconditional.py", (
                 unconditional("--train_batch_size 1 --num_epochs 1 --ddpm_num_inference_steps 1 "
                               "--checkpointing_steps=2", checkpoints=checkpoints(2, 4, 6)),
                 unconditional("--train_batch_size 1 --num_epochs 2 --ddpm_num_inference_steps 1 "
                               "--resume_from_checkpoint=checkpoint-6 --checkpointing_steps=2 "
                               "--checkpoints_total_limit=2", checkpoints=checkpoints(10, 12), files=(UNET,)))),
    # examples/custom_diffusion/test_custom_diffusion.py: every run asks for pickles (--no_safe_serialization).
    Upstream("custom_diffusion/test_custom_diffusion.py::test_custom_diffusion", CUSTOM_DIFFUSION, (
        Run(f"--pretrained_model_name_or_path {SD_TORCH} {DOCS_IMAGES} --instance_prompt <new1> --resolution 64 "
            "--train_batch_size 1 --gradient_accumulation_steps 1 --max_train_steps 2 --learning_rate 1.0e-05 "
            "--scale_lr --lr_scheduler constant --lr_warmup_steps 0 --modifier_token <new1> --no_safe_serialization "
            "--output_dir {tmpdir}"),), refused=NO_PICKLES),
    Upstream("custom_diffusion/test_custom_diffusion.py::test_custom_diffusion_checkpointing_checkpoints_total_limit",
             CUSTOM_DIFFUSION, (custom_diffusion_checkpointing("--max_train_steps=6 --checkpoints_total_limit=2 "
                                                               "--checkpointing_steps=2"),), refused=NO_PICKLES),
    Upstream("custom_diffusion/test_custom_diffusion.py::test_custom_diffusion_checkpointing_checkpoints_total_limit_"
             "removes_multiple_checkpoints", CUSTOM_DIFFUSION, (
                 custom_diffusion_checkpointing("--max_train_steps=4 --checkpointing_steps=2"),
                 custom_diffusion_checkpointing("--max_train_steps=8 --checkpointing_steps=2 "
                                                "--resume_from_checkpoint=checkpoint-4 --checkpoints_total_limit=2")),
             refused=NO_PICKLES),
    *textual_inversion_family("test_textual_inversion.py", "textual_inversion/textual_inversion.py", SD_TORCH,
                              "textual_inversion"),
    *textual_inversion_family("test_textual_inversion_sdxl.py", "textual_inversion/textual_inversion_sdxl.py",
                              "hf-internal-testing/tiny-sdxl-pipe", "textual_inversion_sdxl"),
    # examples/instruct_pix2pix/test_instruct_pix2pix.py: the total limit, and the limit removing two on resume.
    Upstream("instruct_pix2pix/test_instruct_pix2pix.py::test_instruct_pix2pix_checkpointing_checkpoints_total_limit",
             "instruct_pix2pix/train_instruct_pix2pix.py", (
                 instruct_pix2pix("--max_train_steps=6 --checkpointing_steps=2 --checkpoints_total_limit=2",
                                  checkpoints=checkpoints(4, 6), files=(UNET,)),)),
    Upstream("instruct_pix2pix/test_instruct_pix2pix.py::test_instruct_pix2pix_checkpointing_checkpoints_total_limit_"
             "removes_multiple_checkpoints", "instruct_pix2pix/train_instruct_pix2pix.py", (
                 instruct_pix2pix("--max_train_steps=4 --checkpointing_steps=2", checkpoints=checkpoints(2, 4)),
                 instruct_pix2pix("--max_train_steps=8 --checkpointing_steps=2 --resume_from_checkpoint=checkpoint-4 "
                                  "--checkpoints_total_limit=2", checkpoints=checkpoints(6, 8), files=(UNET,)))),
    # examples/vqgan/test_vqgan.py: a smoke run, checkpointing and resuming (with and without the EMA), the total
    # limit, and the limit removing two on resume. The VQModel is written to the output folder itself, not to
    # upstream's vqmodel/ (checkpoints keep it in vqmodel/, as upstream's); the discriminator to discriminator/.
    Upstream("vqgan/test_vqgan.py::test_vqmodel", VQGAN, (vqgan(
        "--max_train_steps 2 --output_dir {tmpdir}", files=(CONTROLNET, f"discriminator/{CONTROLNET}")),),
             substitutes=VQGAN_FILES),
    Upstream("vqgan/test_vqgan.py::test_vqmodel_checkpointing", VQGAN, vqgan_checkpointing(),
             substitutes=VQGAN_FILES),
    Upstream("vqgan/test_vqgan.py::test_vqmodel_checkpointing_use_ema", VQGAN, vqgan_checkpointing("--use_ema"),
             substitutes=VQGAN_FILES),
    Upstream("vqgan/test_vqgan.py::test_vqmodel_checkpointing_checkpoints_total_limit", VQGAN, (vqgan(
        "--max_train_steps 6 --output_dir {tmpdir} --checkpointing_steps=2 --checkpoints_total_limit=2 --seed=0",
        checkpoints=checkpoints(4, 6), files=(CONTROLNET,)),), substitutes=VQGAN_FILES),
    Upstream("vqgan/test_vqgan.py::test_vqmodel_checkpointing_checkpoints_total_limit_removes_multiple_checkpoints",
             VQGAN, (vqgan("--max_train_steps 4 --checkpointing_steps=2 --output_dir {tmpdir} --seed=0",
                           checkpoints=checkpoints(2, 4)),
                     vqgan("--max_train_steps 8 --output_dir {tmpdir} --checkpointing_steps=2 "
                           "--resume_from_checkpoint={tmpdir}/checkpoint-4 --checkpoints_total_limit=2 --seed=0",
                           checkpoints=checkpoints(6, 8), files=(CONTROLNET,))), substitutes=VQGAN_FILES),
    # examples/consistency_distillation/test_lcm_lora.py: a 2-step run, and checkpoints every 2 steps then a resume.
    Upstream("consistency_distillation/test_lcm_lora.py::test_text_to_image_lcm_lora_sdxl", LCM_LORA_SDXL, (
        lcm_lora_sdxl("--max_train_steps 2", files=(LORA,)),)),
    Upstream("consistency_distillation/test_lcm_lora.py::test_text_to_image_lcm_lora_sdxl_checkpointing",
             LCM_LORA_SDXL, (
                 lcm_lora_sdxl("--max_train_steps 7 --checkpointing_steps 2", checkpoints=checkpoints(2, 4, 6)),
                 lcm_lora_sdxl("--max_train_steps 9 --checkpointing_steps 2 --resume_from_checkpoint latest",
                               checkpoints=checkpoints(2, 4, 6, 8), files=(LORA,)))),
    # examples/advanced_diffusion_training/test_dreambooth_lora_flux_advanced.py: upstream's FLUX.1 DreamBooth LoRA
    # tests (but the one layer), and pivotal tuning in CLIP, then in CLIP and T5, writing <folder name>_emb.
    *[Upstream(f"advanced_diffusion_training/test_dreambooth_lora_flux_advanced.py::{name}", FLUX_ADVANCED, runs)
      for name, runs in (
          ("test_dreambooth_lora_flux", (dreambooth(TINY_FLUX, "photo", "", files=(LORA,)),)),
          ("test_dreambooth_lora_text_encoder_flux",
           (dreambooth(TINY_FLUX, "photo", "--train_text_encoder", files=(LORA,)),)),
          ("test_dreambooth_lora_pivotal_tuning_flux_clip",
           (dreambooth(TINY_FLUX, "photo", "--train_text_encoder_ti", files=(LORA, PIVOTAL_EMBEDDINGS)),)),
          ("test_dreambooth_lora_pivotal_tuning_flux_clip_t5",
           (dreambooth(TINY_FLUX, "photo", "--train_text_encoder_ti --enable_t5_ti",
                       files=(LORA, PIVOTAL_EMBEDDINGS)),)),
          ("test_dreambooth_lora_latent_caching", (dreambooth(TINY_FLUX, "photo", "--cache_latents", files=(LORA,)),)),
          ("test_dreambooth_lora_flux_checkpointing_checkpoints_total_limit",
           (dreambooth_checkpointing(TINY_FLUX, "photo", "--max_train_steps=6 --checkpoints_total_limit=2 "
                                     "--checkpointing_steps=2", checkpoints=checkpoints(4, 6)),)),
          ("test_dreambooth_lora_flux_checkpointing_checkpoints_total_limit_removes_multiple_checkpoints", (
              dreambooth_checkpointing(TINY_FLUX, "photo", "--max_train_steps=4 --checkpointing_steps=2",
                                       checkpoints=checkpoints(2, 4)),
              dreambooth_checkpointing(TINY_FLUX, "photo", "--max_train_steps=8 --checkpointing_steps=2 "
                                       "--resume_from_checkpoint=checkpoint-4 --checkpoints_total_limit=2",
                                       checkpoints=checkpoints(6, 8)))),
          ("test_dreambooth_lora_with_metadata",
           (dreambooth(TINY_FLUX, "photo", "--lora_alpha=8 --rank=4", files=(LORA,)),)))],
]


def flux2_reading_one_layer(pipeline, directory):
    """Our tiny FLUX.2 pipeline ``pipeline`` ([klein] or [dev]) saved in ``directory`` with a transformer that reads
    one text-encoder layer's features, as upstream's tiny-flux2-klein and tiny-flux2 do (their tests pass
    --text_encoder_out_layers 1)."""
    from diffusers import DiffusionPipeline, Flux2Transformer2DModel

    pipe = from_pretrained(DiffusionPipeline, pipeline)  # [dev]'s tokenizer is a PixtralProcessor, as released
    text_encoder = getattr(pipe.text_encoder.config, "text_config", pipe.text_encoder.config)  # [dev]'s: Mistral 3's
    config = dict(pipe.transformer.config, joint_attention_dim=text_encoder.hidden_size)
    pipe.transformer = Flux2Transformer2DModel.from_config(config)
    pipe.save_pretrained(directory)
    return Path(directory)


def llama_folder(hidream, directory):
    """The tiny HiDream pipeline ``hidream``'s Llama and its tokenizer, together in ``directory`` (as a hub model
    holds them)."""
    for component in ("text_encoder_4", "tokenizer_4"):
        shutil.copytree(Path(hidream) / component, directory, dirs_exist_ok=True)
    return Path(directory)


def upstream_fixtures(tiny, directory):
    """``{fixture name: path}``: the tiny fixtures, and the one-layer FLUX.2 pipelines and the Llama folder upstream's
    tests need."""
    return {**tiny, **{f"{name}_one_layer": flux2_reading_one_layer(tiny[name], Path(directory) / f"{name}_one_layer")
                       for name in ("flux2_klein", "flux2_dev")},
            "hidream_llama": llama_folder(tiny["hidream"], Path(directory) / "hidream_llama")}


def command(flags, fixtures, output_dir, substitutes=SUBSTITUTES):
    """``flags`` (upstream's text) as an argument list: each hub model or dataset of ``substitutes`` (a value, or
    the value of a ``--flag=value``) replaced by its fixture's path in ``fixtures``, ``{tmpdir}`` by ``output_dir``;
    the words split as a shell splits them (``""`` is an empty argument)."""
    def substitute(value):
        return str(fixtures[substitutes[value]]) if value in substitutes else value

    arguments = []
    for word in shlex.split(flags.replace("{tmpdir}", str(output_dir))):
        flag, equals, value = word.partition("=")
        arguments.append(flag + equals + substitute(value) if equals and flag.startswith("--") else substitute(word))
    return arguments


def run_upstream_test(upstream, fixtures, output_dir, launch=launch):
    """Launch ``upstream``'s runs in turn in ``output_dir`` as its test does (deleting what it deletes between them);
    returns the results. A refused command (or run) must stop with its one line; every other run must succeed and
    leave the checkpoints and files its `Run` names."""
    results = []
    for run in upstream.runs:
        for name in run.remove_first:
            shutil.rmtree(Path(output_dir) / name)
        refused = upstream.refused is not None or run.refused is not None
        arguments = command(run.flags, fixtures, output_dir, {**SUBSTITUTES, **(upstream.substitutes or {})})
        result = launch(upstream.script, *arguments, check=not refused, quiet=True)
        results.append(result)
        if upstream.refused is not None:
            assert result.returncode != 0 and f"error: {upstream.refused}" in result.stderr, result.stderr[-2000:]
            return results
        if run.refused is not None:
            assert result.returncode != 0 and f"{run.refused}\n" in result.stderr, result.stderr[-2000:]
            return results
        if run.checkpoints is not None:
            assert checkpoint_names(output_dir) == list(run.checkpoints), (upstream.test, checkpoint_names(output_dir))
        missing = [name for name in run.files
                   if not (Path(output_dir) / name.replace("{tmpdir_name}", Path(output_dir).name)).is_file()]
        assert not missing, f"{upstream.test}: no {missing} in {output_dir}"
    return results


# The scripts here whose upstream counterparts have no example test, and why.
WITHOUT_UPSTREAM_TESTS = {"amused/train_amused.py": "upstream has no test for its aMUSEd script",
                          "discrete_diffusion/train_llada2.py": "upstream has no test for its LLaDA2 script",
                          "dreambooth/train_dreambooth_lora_z_image.py": "upstream has no test for its Z-Image script",
                          "kandinsky2_2/text_to_image/train_text_to_image_decoder.py":
                              "upstream has no test for its Kandinsky 2.2 scripts",
                          "kandinsky2_2/text_to_image/train_text_to_image_lora_decoder.py":
                              "upstream has no test for its Kandinsky 2.2 scripts",
                          "dreambooth/train_dreambooth_lora_krea2.py": "upstream has no test for its Krea 2 script",
                          "dreambooth/train_dreambooth_lora_ideogram4.py":
                              "upstream has no test for its Ideogram 4 script",
                          "dreambooth/train_dreambooth_lora_chroma.py": "upstream has no Chroma script",
                          "dreambooth/train_dreambooth_lora_flux2_klein_img2img.py":
                              "upstream has no test for its FLUX.2 [klein] image-to-image script",
                          "dreambooth/train_dreambooth_lora_flux2_img2img.py":
                              "upstream has no test for its FLUX.2 image-to-image script",
                          "video/train_text_to_video_lora_wan.py": "upstream has no Wan training script",
                          "video/train_image_to_video_lora_wan.py": "upstream has no Wan training script",
                          "cogvideo/train_cogvideox_lora.py": "upstream has no test for its CogVideoX scripts",
                          "cogvideo/train_cogvideox_image_to_video_lora.py":
                              "upstream has no test for its CogVideoX scripts",
                          "video/train_text_to_video_lora_ltx2.py": "upstream has no LTX-2 training script",
                          "video/train_image_to_video_lora_ltx.py": "upstream has no LTX-Video training script",
                          "video/train_text_to_video_lora_ltx.py": "upstream has no LTX-Video training script",
                          "video/train_text_to_video_lora_hunyuan_video15.py":
                              "upstream has no HunyuanVideo 1.5 training script",
                          "video/train_image_to_video_lora_hunyuan_video15.py":
                              "upstream has no HunyuanVideo 1.5 training script",
                          "dreambooth/train_dreambooth_lora_qwen_image_edit.py":
                              "upstream has no Qwen-Image-Edit script",
                          "controlnet/train_controlnet_z_image.py": "upstream has no Z-Image ControlNet script",
                          "controlnet/train_controlnet_qwen_image.py": "upstream has no Qwen-Image ControlNet script",
                          "cogview4-control/train_control_cogview4.py":
                              "upstream has no test for its CogView4 Control script",
                          "flux-control/train_control_flux.py": "upstream has no test for its FLUX.1 Control scripts",
                          "flux-control/train_control_lora_flux.py":
                              "upstream has no test for its FLUX.1 Control scripts",
                          "instruct_pix2pix/train_instruct_pix2pix_sdxl.py":
                              "upstream has no test for its SDXL InstructPix2Pix script",
                          "advanced_diffusion_training/train_dreambooth_lora_sdxl_advanced.py":
                              "upstream has tests only for its FLUX.1 advanced script",
                          "advanced_diffusion_training/train_dreambooth_lora_sd15_advanced.py":
                              "upstream has tests only for its FLUX.1 advanced script",
                          "kandinsky2_2/text_to_image/train_text_to_image_prior.py":
                              "upstream has no tests for its Kandinsky 2.2 scripts",
                          "kandinsky2_2/text_to_image/train_text_to_image_lora_prior.py":
                              "upstream has no tests for its Kandinsky 2.2 scripts",
                          "consistency_distillation/train_lcm_distill_lora_sd_wds.py":
                              "upstream tests only its SDXL LCM-LoRA script (test_lcm_lora.py)",
                          "cosmos/train_cosmos_predict25_lora.py": "upstream has no test for its Cosmos script",
                          **dict.fromkeys(["consistency_distillation/train_lcm_distill_lora_sdxl_wds.py",
                                           "consistency_distillation/train_lcm_distill_sd_wds.py",
                                           "consistency_distillation/train_lcm_distill_sdxl_wds.py"],
                                          "upstream tests only its SDXL LCM-LoRA script (test_lcm_lora.py)")}
# The flags each script's upstream counterpart adds to its parser (`UPSTREAM_FLAGS["source"]` says where from).
UPSTREAM_FLAGS = json.loads((Path(__file__).with_name("upstream_flags.json")).read_text())


def test_the_table_holds_every_script_heres_upstream_tests_once():
    tests = [upstream.test for upstream in UPSTREAM]
    assert len(tests) == len(set(tests))
    tested = {upstream.script for upstream in UPSTREAM}
    assert tested <= set(SCRIPTS), sorted(tested - set(SCRIPTS))
    assert set(SCRIPTS) - tested == set(WITHOUT_UPSTREAM_TESTS), \
        "a script here without upstream tests in UPSTREAM: add its upstream tests' commands, or say why it has none"


class ParserBuilt(Exception):
    """Raised where a script's parser starts parsing, to give the parser, its refused flags added."""

    def __init__(self, parser):
        super().__init__()
        self.parser = parser


def script_parser(script):
    """The parser that ``examples/<script>``'s ``parse_args`` builds, with every flag it accepts or refuses."""
    def built(parser, args=None, namespace=None):
        raise ParserBuilt(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", built), \
            pytest.raises(ParserBuilt) as stopped:
        import_script(script).parse_args([])
    return stopped.value.parser


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_of_the_upstream_counterpart_is_carried_or_refused_in_one_line(script):
    assert script in UPSTREAM_FLAGS["scripts"], f"no upstream flags recorded for {script} (tests/upstream_flags.json)"
    parser = script_parser(script)
    missing = [flag for flag in UPSTREAM_FLAGS["scripts"][script] if flag not in parser._option_string_actions]
    assert not missing, f"{script} neither carries nor refuses upstream's {missing}"


# What each shared refusal reason claims of the script that states it, as a check on its parser.
CLAIMS = {
    # --train_text_encoder absent, or itself refused
    "the text encoder does not train in this script": lambda parser: not isinstance(
        parser._option_string_actions.get("--train_text_encoder"), argparse._StoreTrueAction),
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_refusal_reason_holds_for_the_script_that_states_it(script):
    parser = script_parser(script)
    reasons = {flag: action.why for flag, action in parser._option_string_actions.items()
               if isinstance(action, RefusedFlag)}
    for flag, why in reasons.items():
        for claim, holds in CLAIMS.items():
            assert claim not in why or holds(parser), f"{script} refuses {flag} because {why!r}, which is false there"


@pytest.fixture(scope="module")
def fixtures(tiny, tmp_path_factory):
    return upstream_fixtures(tiny, tmp_path_factory.mktemp("upstream"))


def leave_checkpoints(output_dir, names):
    """Checkpoint folders ``names`` in ``output_dir`` as far as parsing looks at them (a state file): what the run
    before a resume leaves."""
    for name in names:
        (Path(output_dir) / name).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / name / "training_state.json").write_text("{}")


def as_param(upstream):
    """``upstream`` as a pytest parameter named by its test ("test_file:test_name")."""
    return pytest.param(upstream, id=upstream.test.split("/")[1].replace(".py::", ":"))


@pytest.mark.parametrize("upstream", map(as_param, UPSTREAM))
def test_every_upstream_command_parses_or_is_refused_in_one_line(upstream, fixtures, tmp_path):
    script = import_script(upstream.script)
    for run in upstream.runs:
        arguments = command(run.flags, fixtures, tmp_path, {**SUBSTITUTES, **(upstream.substitutes or {})})
        if upstream.refused is not None:
            with pytest.raises(UsageError) as error:
                script.parse_args(arguments)
            assert str(error.value) == upstream.refused
            return
        args = script.parse_args(arguments)
        assert Path(args.output_dir) == tmp_path
        leave_checkpoints(tmp_path, run.checkpoints or ())
