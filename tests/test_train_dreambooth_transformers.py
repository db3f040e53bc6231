"""Smoke tests of the flow-matching transformers' DreamBooth LoRA scripts, one row of `FAMILIES` each: every script
end to end on its tiny fixture, with the same runs and the same checks.

That each family's training step feeds its transformer what the pipeline's sampling loop feeds it is the family's
own unit test (``test_<family>.py``); here each script runs:

- full: 8 steps on the instance pictures of mixed shapes in aspect-ratio buckets, each twice an epoch (12 samples,
  an epoch of at least 6 batches of 2), each on its caption file's caption (two have none: the instance prompt),
  30% of them on the empty prompt, random flips, validating every 3 steps and at the end, checkpointing every 4
  (mid-epoch), the VAE off the accelerator between steps (--offload);
- cached: the same 8 steps with --cache_latents, on disk (--feature_cache_dir ``../features``), neither validating
  nor checkpointing;
- prior: prior preservation (class images in ``../class``, cropped to each sample's bucket) on the same pictures
  read as a dataset with a caption column (--dataset_name), with the family's own choices (`Family.prior_flags`:
  an int8 base, other layers, ...), 3 steps;
- resumed: the full run resumed from its checkpoint-4, checkpointing every step and keeping two.

FLUX.1's full run swaps blocks (``--blocks_to_swap``), which its resumed run, without swapping, must not tell apart.

A new family is one row. The template family (FLUX.2 [klein]) also trains each adapter beside LoRA (`ADAPTERS`), on an
int8 base, compiled, with an EMA, validating and writing the ComfyUI layout.
"""

import shutil
from dataclasses import dataclass, field
from types import ModuleType

import pytest
import torch
from diffusers import (ChromaPipeline, Flux2KleinPipeline, Flux2Pipeline, FluxPipeline, HiDreamImagePipeline,
                       Ideogram4Pipeline, Krea2Pipeline, Lumina2Pipeline, QwenImagePipeline, SanaPipeline,
                       StableDiffusion3Pipeline, ZImagePipeline)
from PIL import Image
from safetensors.torch import load_file

from helpers import import_script, launch, launch_together, launched_usage_error, launching, usage_error
from training_utils.adapters.export import converted_name
from training_utils.families import (chroma, flux, flux2, flux2_dev, hidream, ideogram4, krea2, lumina2, qwen_image,
                                     sana, sd3, z_image)
from training_utils.pipeline import from_pretrained
from training_utils.testing import (assert_latents_cached_per_bucket, assert_lora_changes_pipeline_output,
                                    assert_same_files, assert_validated_at, checkpoint_names, most_common_bucket,
                                    reported_buckets)
from training_utils.testing.tiny.data import CAPTION_FILES, INSTANCE_CAPTIONS

LORA = "pytorch_lora_weights.safetensors"
INSTANCE_PROMPT = "a photo of sks triangle"
# Shorter than the instance prompt: batched with it, its embedding is padded (and masked where the model masks).
CLASS_PROMPT = "a triangle"
BUCKETED_SAMPLES = 12
PRIOR = ("--with_prior_preservation", "--class_prompt", CLASS_PROMPT, "--num_class_images", 2,
         "--sample_batch_size", 2, "--class_inference_steps", 2, "--max_train_steps", 3)
INT8 = ("--quantize_base", "int8", "--mixed_precision", "bf16")
REFUSED_EVERYWHERE = [
    (["--optimizer", "prodigy"], "--optimizer is not supported here: AdamW is the only optimizer here "
                                 "(--use_8bit_adam for bitsandbytes' 8-bit AdamW); Prodigy is not carried"),
    (["--caption_column", "text"], "--caption_column='text': expected --dataset_name with it (--instance_data_dir's "
                                   "captions are in --caption_extension files)"),
    (["--lora_layers", "to_q,,to_k"], "--lora_layers='to_q,,to_k': expected comma-separated layer names"),
    (["--weighting_scheme", "logit_normal", "--logit_std", 0], "--logit_std=0.0: expected a positive number"),
    (["--oft_block_size", 8], "--oft_block_size=8: expected no --oft_block_size with --adapter lora (a setting of "
                              "OFT)"),
]
NO_TEXT_ENCODER_TRAINING = [
    (["--text_encoder_lr", 1e-5], "--text_encoder_lr is not supported here: the text encoder does not train in this "
                                  "script"),
    (["--do_fp8_training"], "--do_fp8_training is not supported here: torchao's float8 training is not carried; "
                            "--quantize_base fp8 loads the frozen transformer in float8 instead"),
]


# The adapters beside LoRA, each with a setting of its own; OFT has no rank.
ADAPTERS = {"dora": ["--rank", 4], "lokr": ["--rank", 4, "--lokr_decompose_both"], "loha": ["--rank", 4],
            "oft": ["--oft_block_size", 8]}
# The adapter whose klein run is compiled too: the one whose forward is least like LoRA's (a rotation of the input).
# Each compiled run costs about 15 s of tracing, so the others run eager (the prior run compiles klein's LoRA).
COMPILED_ADAPTERS = ("oft",)
# Ideogram 4's blocks' layers that upstream's default --lora_layers adapt (the tiny transformer's two blocks).
IDEOGRAM4_LAYERS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                    "feed_forward.w2", "feed_forward.w3")
# Krea 2's image blocks and its text-fusion stages' blocks (the tiny one's).
KREA2_BLOCKS = ("transformer_blocks.0", "transformer_blocks.1", "text_fusion.layerwise_blocks.0",
                "text_fusion.refiner_blocks.0")


def attention(blocks, layers, prefix="transformer_blocks"):
    """The module names ``<prefix>.<block>.attn.<layer>`` of every block and layer."""
    return {f"{prefix}.{block}.attn.{layer}" for block in blocks for layer in layers}


@dataclass(frozen=True)
class Family:
    """A transformer family's DreamBooth script and what its runs must show."""

    name: str  # the row's id, and its tiny fixture
    script: str
    pipeline: type
    module: ModuleType  # its `training_utils.families` module
    adapted: set  # the transformer's modules that upstream's default --lora_layers adapt
    prior_flags: tuple  # what the prior run adds to `PRIOR`
    prior_adapted: set  # the modules the prior run adapts (a "text_encoder" component: its encoders train)
    flags: tuple = ()  # what every run adds (the family's prompt settings)
    validation_size: tuple = None  # (height, width) asked for; by default the most common bucket's
    refused: list = field(default_factory=list)  # (flags, message) of the family's own refusals and checks
    fixture_flags: dict = field(default_factory=dict)  # {flag: folder of the fixture} that every run adds
    prepare_render: object = None  # what the script does to the pipeline it renders with, if anything
    render_kwargs: dict = field(default_factory=dict)  # what the script's renders pass besides the prompt length
    full_flags: tuple = ()  # what the full run alone adds (the resumed run, without them, must end the same)


FAMILIES = [
    Family("flux2_klein", "dreambooth/train_dreambooth_lora_flux2_klein.py", Flux2KleinPipeline, flux2,
           attention([0], ["to_q", "to_k", "to_v", "to_out.0"])
           | attention([0, 1], ["to_qkv_mlp_proj", "to_out"], "single_transformer_blocks"),
           # Compiled too (aot_eager traces the graphs inductor would compile), on other text-encoder layers.
           (*INT8, "--lora_layers", "to_qkv_mlp_proj", "--text_encoder_out_layers", 1, 2, -1, "--weighting_scheme",
            "logit_normal", "--gradient_checkpointing", "--torch_compile", "aot_eager"),
           attention([0, 1], ["to_qkv_mlp_proj"], "single_transformer_blocks"), ("--max_sequence_length", 32),
           refused=[
               (["--guidance_scale", 1], "--guidance_scale is not supported here: FLUX.2 [klein]'s transformer takes "
                                         "no guidance embedding (Flux2KleinPipeline passes none, and upstream's "
                                         "script ignores the flag for it)"),
               (["--text_encoder_out_layers", 10, 20, 30],
                "--text_encoder_out_layers=[10, 20, 30]: expected indices of the text encoder's hidden states, from "
                "-29 to 28 (it has 28 layers)"),
               *NO_TEXT_ENCODER_TRAINING]),
    Family("flux", "dreambooth/train_dreambooth_lora_flux.py", FluxPipeline, flux,
           attention([0], ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"])
           | {f"transformer_blocks.0.{layer}" for layer in ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                                                           "ff_context.net.2")}
           | attention([0, 1], ["to_q", "to_k", "to_v"], "single_transformer_blocks"),
           # The single-stream blocks' MLP input (fused with q, k and v in the original's linear1), another guidance,
           # and the CLIP encoder's adapter (it embeds the batch's prompts in every step, T5 beside it, frozen), also
           # in ComfyUI's layout.
           # Every block of the int8 base swapped, with gradient checkpointing.
           (*INT8, "--lora_layers", "proj_mlp", "--guidance_scale", 2.0, "--gradient_checkpointing",
            "--train_text_encoder", "--text_encoder_lr", 1e-3, "--export_formats", "comfyui", "--blocks_to_swap", 3),
           {f"single_transformer_blocks.{block}.proj_mlp" for block in (0, 1)} | {"text_encoder"},
           ("--max_sequence_length", 32),
           refused=[
               (["--max_sequence_length", 513], "--max_sequence_length=513: expected a positive integer of at most 512 "
                                                "(FluxPipeline's limit)"),
               (["--text_encoder_lr", 0], "--text_encoder_lr=0.0: expected a positive number"),
               (["--blocks_to_swap", 4], "--blocks_to_swap=4: expected at most the 3 repeated blocks of "
                                         "FluxTransformer2DModel"),
               NO_TEXT_ENCODER_TRAINING[1]],
           # The full run swaps its double-stream block and a single-stream one, validating with them swapped: the
           # resumed run, without swapping, must end bitwise the same.
           full_flags=("--blocks_to_swap", 2)),
    Family("z_image", "dreambooth/train_dreambooth_lora_z_image.py", ZImagePipeline, z_image,
           {f"{block}.attention.{layer}" for block in ("noise_refiner.0", "context_refiner.0", "layers.0", "layers.1")
            for layer in ("to_q", "to_k", "to_v", "to_out.0")},
           (*INT8, "--lora_layers", "feed_forward.w2", "--weighting_scheme", "logit_normal",
            "--gradient_checkpointing"),
           {f"{block}.feed_forward.w2" for block in ("noise_refiner.0", "context_refiner.0", "layers.0", "layers.1")},
           ("--max_sequence_length", 32),
           refused=[
               (["--guidance_scale", 1], "--guidance_scale is not supported here: Z-Image's transformer takes no "
                                         "guidance embedding (upstream's script ignores the flag); validation and "
                                         "class images use ZImagePipeline's own classifier-free guidance"),
               (["--max_sequence_length", 0], "--max_sequence_length=0: expected a positive integer"),
               *NO_TEXT_ENCODER_TRAINING]),
    Family("qwen_image", "dreambooth/train_dreambooth_lora_qwen_image.py", QwenImagePipeline, qwen_image,
           attention([0, 1], ["to_q", "to_k", "to_v", "to_out.0"]),
           # An adapter on one projection of each stream: the image's attention output, the text's values.
           (*INT8, "--lora_layers", "attn.to_out.0,add_v_proj", "--gradient_checkpointing"),
           attention([0, 1], ["to_out.0", "add_v_proj"]),
           refused=[
               (["--pretrained_text_encoder_4_name_or_path", "meta-llama/Meta-Llama-3.1-8B-Instruct"],
                "--pretrained_text_encoder_4_name_or_path is not supported here: a leftover of upstream's HiDream "
                "script that its Qwen-Image script never reads; the tokenizer and the text encoder are the "
                "pipeline's"),
               (["--max_sequence_length", 2048],
                "--max_sequence_length=2048: expected a positive integer of at most 1024 (QwenImagePipeline's "
                "limit)")]),
    Family("flux2_dev", "dreambooth/train_dreambooth_lora_flux2.py", Flux2Pipeline, flux2_dev,
           attention([0], ["to_q", "to_k", "to_v", "to_out.0"])
           | attention([0, 1], ["to_qkv_mlp_proj", "to_out"], "single_transformer_blocks"),
           (*INT8, "--lora_layers", "to_qkv_mlp_proj", "--guidance_scale", 2.5, "--gradient_checkpointing"),
           attention([0, 1], ["to_qkv_mlp_proj"], "single_transformer_blocks"),
           ("--max_sequence_length", 48),  # the system message's 30 tokens and the prompt
           refused=[
               (["--remote_text_encoder"], "--remote_text_encoder is not supported here: the pipeline's own text "
                                           "encoder embeds the prompts, once, before training, and then leaves the "
                                           "accelerator; a remote one is not carried"),
               (["--guidance_scale", 0], "--guidance_scale=0.0: expected a positive number"),
               *NO_TEXT_ENCODER_TRAINING]),
    Family("chroma", "dreambooth/train_dreambooth_lora_chroma.py", ChromaPipeline, chroma,
           attention([0], ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"])
           | {f"transformer_blocks.0.{layer}" for layer in ("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
                                                            "ff_context.net.2")}
           | attention([0], ["to_q", "to_k", "to_v"], "single_transformer_blocks"),
           (*INT8, "--lora_layers", "proj_mlp", "--weighting_scheme", "logit_normal", "--gradient_checkpointing"),
           {"single_transformer_blocks.0.proj_mlp"}, ("--max_sequence_length", 32),
           refused=[
               (["--guidance_scale", 1], "--guidance_scale is not supported here: Chroma's transformer takes no "
                                         "guidance embedding; validation and class images use ChromaPipeline's own "
                                         "classifier-free guidance"),
               (["--train_text_encoder"], "--train_text_encoder is not supported here: upstream's FLUX.1 script "
                                          "trains CLIP's text encoder, which Chroma does not have; T5 does not train "
                                          "there either"),
               (["--max_sequence_length", 0], "--max_sequence_length=0: expected a positive integer"),
               *NO_TEXT_ENCODER_TRAINING]),
    Family("krea2", "dreambooth/train_dreambooth_lora_krea2.py", Krea2Pipeline, krea2,
           {"img_in", "final_layer.linear", "time_embed.linear_1", "time_embed.linear_2", "time_mod_proj",
            "txt_in.linear_1", "txt_in.linear_2", "text_fusion.projector"}
           | {f"{block}.{layer}" for block in KREA2_BLOCKS
              for layer in ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_gate", "ff.up",
                            "ff.down")},
           (*INT8, "--lora_layers", "to_out.0,ff.down", "--gradient_checkpointing"),
           {f"{block}.{layer}" for block in KREA2_BLOCKS for layer in ("attn.to_out.0", "ff.down")},
           ("--max_sequence_length", 32),
           refused=[
               (["--validation_model_path", "krea/Krea-2-Turbo"],
                "--validation_model_path is not supported here: validation renders with the pipeline that trains, "
                "its live weights, in the loop (no adapter is moved onto another checkpoint); load the LoRA onto "
                "Krea 2 Turbo after training"),
               (["--max_sequence_length", 0], "--max_sequence_length=0: expected a positive integer"),
               *NO_TEXT_ENCODER_TRAINING]),
    # SANA's sizes are multiples of 32 (its DC-AE's factor): buckets of about 64² pixels, the most common a square.
    Family("sana", "dreambooth/train_dreambooth_lora_sana.py", SanaPipeline, sana,
           {f"transformer_blocks.0.{attention}.{layer}" for attention in ("attn1", "attn2")
            for layer in ("to_q", "to_k", "to_v")},
           (*INT8, "--lora_layers", "attn1.to_out.0", "--complex_human_instruction", "", "--gradient_checkpointing"),
           {"transformer_blocks.0.attn1.to_out.0"}, ("--resolution", 64, "--max_sequence_length", 16),
           validation_size=(32, 64),
           refused=[
               (["--enable_vae_tiling"], "--enable_vae_tiling is not supported here: VAE tiling (upstream's, for its "
                                         "validation renders only) is not carried; validation decodes whole images"),
               (["--max_sequence_length", 1], "--max_sequence_length=1: expected an integer above 1 (the first token "
                                              "and the last ones are kept)"),
               *NO_TEXT_ENCODER_TRAINING]),
    Family("lumina2", "dreambooth/train_dreambooth_lora_lumina2.py", Lumina2Pipeline, lumina2,
           {f"{block}.attn.{layer}" for block in ("noise_refiner.0", "context_refiner.0", "layers.0", "layers.1")
            for layer in ("to_q", "to_k", "to_v", "to_out.0")},
           (*INT8, "--lora_layers", "feed_forward.linear_2", "--system_prompt", "Draw:", "--gradient_checkpointing"),
           {f"{block}.feed_forward.linear_2" for block in ("noise_refiner.0", "context_refiner.0", "layers.0",
                                                           "layers.1")},
           ("--max_sequence_length", 48), validation_size=(32, 48),
           refused=[
               (["--max_sequence_length", 513], "--max_sequence_length=513: expected a positive integer of at most "
                                                "512 (Lumina2Pipeline's limit)"),
               *NO_TEXT_ENCODER_TRAINING]),
    # HiDream renders at --resolution's area, whatever the size asked (`hidream.render_at_resolution`): a bucket's
    # aspect ratio at 32² pixels. Its Llama comes from flags of its own (the fixture holds it as a component).
    Family("hidream", "dreambooth/train_dreambooth_lora_hidream.py", HiDreamImagePipeline, hidream,
           {f"{stream}_stream_blocks.0.block.attn1.{layer}" for stream in ("double", "single")
            for layer in ("to_q", "to_k", "to_v", "to_out")},
           # The text stream's attention, which upstream's default layers leave out.
           (*INT8, "--lora_layers", "to_q_t,to_k_t,to_v_t,to_out_t", "--gradient_checkpointing"),
           {f"double_stream_blocks.0.block.attn1.{layer}" for layer in ("to_q_t", "to_k_t", "to_v_t", "to_out_t")},
           ("--max_sequence_length", 16), validation_size=(16, 64),
           refused=[(["--max_sequence_length", 0], "--max_sequence_length=0: expected a positive integer"),
                    *NO_TEXT_ENCODER_TRAINING],
           fixture_flags={"--pretrained_text_encoder_4_name_or_path": "text_encoder_4",
                          "--pretrained_tokenizer_4_name_or_path": "tokenizer_4"},
           prepare_render=lambda pipe: hidream.render_at_resolution(pipe, 32)),
    # Ideogram 4 renders with a constant guidance (its default schedule fits 48 steps alone); the prior run also
    # writes ComfyUI's layout, which diffusers' own Ideogram 4 conversion reads back.
    Family("ideogram4", "dreambooth/train_dreambooth_lora_ideogram4.py", Ideogram4Pipeline, ideogram4,
           {f"layers.{block}.{layer}" for block in (0, 1) for layer in IDEOGRAM4_LAYERS},
           (*INT8, "--lora_layers", "to_q,to_k,to_v,w2", "--gradient_checkpointing", "--export_formats", "comfyui"),
           {f"layers.{block}.{layer}" for block in (0, 1)
            for layer in ("attention.to_q", "attention.to_k", "attention.to_v", "feed_forward.w2")},
           ("--max_sequence_length", 40),  # the longest caption's 35 tokens, its chat template's included
           refused=[
               (["--guidance_scale", 3.5], "--guidance_scale is not supported here: upstream's flag is a FLUX.1 "
                                           "leftover that its script never reads: Ideogram 4's transformer takes no "
                                           "guidance embedding; validation and class images use Ideogram4Pipeline's "
                                           "own asymmetric guidance"),
               (["--disable_training_autocast"], "--disable_training_autocast is not supported here: the autocast "
                                                 "damage it avoids (the image's rotary positions rounded in bf16) is "
                                                 "fixed in diffusers' Ideogram 4 transformer, which computes them "
                                                 "outside autocast; training runs under the usual mixed precision"),
               (["--upsample_prompt"], "--upsample_prompt is not supported here: prompt upsampling (the "
                                       "prompt-enhancer head, sampling JSON captions) is not carried; write the "
                                       "captions in Ideogram 4's JSON schema (--caption_extension, --caption_column)"),
               (["--max_sequence_length", 0], "--max_sequence_length=0: expected a positive integer"),
               *NO_TEXT_ENCODER_TRAINING],
           render_kwargs={"guidance_scale": ideogram4.GUIDANCE_SCALE, "guidance_schedule": None}),
    Family("sd3", "dreambooth/train_dreambooth_lora_sd3.py", StableDiffusion3Pipeline, sd3,
           attention([0, 1], ["to_q", "to_k", "to_v", "to_out.0"]),
           # Block 0 only, the CLIP encoders' adapters (they embed the batch's prompts in every step) at their own
           # learning rate, cached latents, an EMA equal to the raw weights; the velocity loss with cosmap weights.
           ("--lora_blocks", 0, "--train_text_encoder", "--text_encoder_lr", 1e-3, "--cache_latents", "--ema_decay",
            0, "--precondition_outputs", 0, "--weighting_scheme", "cosmap", "--gradient_checkpointing"),
           attention([0], ["to_q", "to_k", "to_v", "to_out.0"]) | {"text_encoder"},
           validation_size=(32, 48),  # no bucket's
           refused=[
               (["--lora_blocks", "0,x"], "--lora_blocks='0,x': expected comma-separated block indices, e.g. 0,12"),
               (["--text_encoder_lr", 0], "--text_encoder_lr=0.0: expected a positive number")]),
]
FAMILY_IDS = [family.name for family in FAMILIES]


def sidecar_captioned(tiny):
    """The captioned instance pictures with their caption files; two of them have none (the instance prompt)."""
    return "--instance_data_dir", tiny["instance_captioned"], "--caption_extension", ".txt"


def dataset_captioned(tiny):
    """The captioned instance pictures as a dataset, with a caption column."""
    return "--dataset_name", tiny["instance_captioned"], "--caption_column", "text"


def common(tiny, family, output_dir, *extra, source=None, adapter=("--rank", 4)):
    return ["--pretrained_model_name_or_path", tiny[family.name], *(source or sidecar_captioned(tiny)),
            "--instance_prompt", INSTANCE_PROMPT, "--output_dir", output_dir, "--resolution", 32,
            "--train_batch_size", 2, "--learning_rate", 1e-3, "--center_crop", "--random_flip", "--use_ema",
            "--ema_decay", 0.9, *adapter, "--seed", 3, "--use_aspect_ratio_buckets", "--repeats", 2,
            "--caption_dropout", 0.3, *family.flags, *extra,
            *(word for flag, folder in family.fixture_flags.items() for word in (flag, tiny[family.name] / folder))]


def adapter_flags(tiny, family, output_dir, adapter):
    """4 steps of ``adapter`` on an int8 base (compiled for `COMPILED_ADAPTERS`), validating at the end, every file
    also in ComfyUI's layout; at a learning rate that changes the images in so few steps."""
    compiled = ["--torch_compile", "aot_eager"] if adapter in COMPILED_ADAPTERS else []
    return common(tiny, family, output_dir, "--max_train_steps", 4, "--learning_rate", 1e-2,
                  "--validation_prompt", "a sks triangle",
                  "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", 4,
                  "--checkpointing_steps", 1000, *INT8, *compiled, "--export_formats", "comfyui",
                  adapter=("--adapter", adapter, *ADAPTERS[adapter]))


def full_flags(tiny, family, output_dir):
    size = ["--validation_height", family.validation_size[0], "--validation_width", family.validation_size[1]] \
        if family.validation_size else []
    return common(tiny, family, output_dir, "--max_train_steps", 8, "--validation_prompt", "a sks triangle",
                  "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", 3, *size,
                  "--checkpointing_steps", 4, "--offload", *family.full_flags)


def resumed_flags(tiny, family, output_dir):
    """The full run's training flags, never validating, checkpointing at every step and keeping two."""
    return common(tiny, family, output_dir, "--max_train_steps", 8, "--checkpointing_steps", 1,
                  "--checkpoints_total_limit", 2, "--resume_from_checkpoint", "latest")


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{(family name, run): (output_dir, result)}`` of every family's runs, launched together; the resumed runs
    once the full ones have left their checkpoint-4."""
    root = tmp_path_factory.mktemp("dreambooth_transformers")
    launches = {}
    for family in FAMILIES:
        folder = root / family.name
        launches[family.name, "full"] = (family.script, *full_flags(tiny, family, folder / "full"))
        launches[family.name, "cached"] = (family.script, *common(
            tiny, family, folder / "cached", "--max_train_steps", 8, "--checkpointing_steps", 1000, "--cache_latents",
            "--feature_cache_dir", folder / "features"))
        launches[family.name, "prior"] = (family.script, *common(
            tiny, family, folder / "prior", *PRIOR, "--class_data_dir", folder / "class", *family.prior_flags,
            source=dataset_captioned(tiny)))
    template = FAMILIES[0]
    for adapter in ADAPTERS:
        launches[template.name, adapter] = (template.script, *adapter_flags(
            tiny, template, root / template.name / adapter, adapter))
    results = launch_together(launches)
    resumed = {}
    for family in FAMILIES:
        folder = root / family.name / "resumed"
        shutil.copytree(root / family.name / "full" / "checkpoint-4", folder / "checkpoint-4")
        resumed[family.name, "resumed"] = (family.script, *resumed_flags(tiny, family, folder))
    results.update(launch_together(resumed))
    return {(name, run): (root / name / run, result) for (name, run), result in results.items()}


@pytest.fixture(params=FAMILIES, ids=FAMILY_IDS)
def family(request):
    return request.param


def adapted_modules(lora):
    """The modules a LoRA file adapts: the transformer's by their path, and "text_encoder" for the text encoders."""
    return {key.split(".lora")[0].removeprefix("transformer.") if key.startswith("transformer.") else "text_encoder"
            for key in lora}


def test_writes_raw_and_ema_transformer_lora_on_upstreams_default_layers(runs, family):
    output_dir, result = runs[family.name, "full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and all(key.startswith("transformer.") and "lora" in key for key in raw)
    assert adapted_modules(raw) == family.adapted
    assert all(raw[key].shape == ema[key].shape and raw[key].dtype == torch.float32 for key in raw)
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert f"raw LoRA: {output_dir / LORA}" in result.stdout
    assert f"ema LoRA: {output_dir / 'ema' / LORA}" in result.stdout


def test_trains_in_buckets_and_validates_at_the_due_steps_at_the_validation_size(runs, family):
    output_dir, result = runs[family.name, "full"]
    buckets = reported_buckets(result.stderr)
    assert len(buckets) >= 3 and sum(buckets.values()) == BUCKETED_SAMPLES, result.stderr[-3000:]
    log = assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"), ["a sks triangle"], num_images=1)
    # Rendered at the asked size, or the most common bucket's (the largest among equals), not --resolution's.
    height, width = family.validation_size or most_common_bucket(buckets)
    assert height != width
    assert {Image.open(output_dir / record["images"][0]).size for record in log} == {(width, height)}
    card = (output_dir / "README.md").read_text()
    assert family.pipeline.__name__ in card and "load_lora_weights" in card and log[-1]["progress"] in card
    assert f'## Training captions\n\n- "{INSTANCE_CAPTIONS[0]}"' in card
    assert checkpoint_names(output_dir) == ["checkpoint-4", "checkpoint-8"]


def test_a_run_resumed_mid_epoch_ends_with_the_weights_of_the_uninterrupted_one_and_prunes(runs, family):
    # Resumed from checkpoint-4, mid-epoch, with random flips, empty prompts and repeats, never validating: the
    # uninterrupted run (which validated after steps 3 and 6 and at the end), bit for bit.
    (output_dir, result), (straight_dir, _) = runs[family.name, "resumed"], runs[family.name, "full"]
    assert f"resumed from {output_dir / 'checkpoint-4'} at step 4" in result.stdout
    for name in (LORA, f"ema/{LORA}"):
        assert_same_files(output_dir / name, straight_dir / name)
    assert checkpoint_names(output_dir) == ["checkpoint-7", "checkpoint-8"]


def test_cached_latents_train_like_encoding_every_step_and_prompts_embed_as_the_family_does(tiny, runs, family,
                                                                                             tmp_path):
    (cached_dir, result), (encoded_dir, _) = runs[family.name, "cached"], runs[family.name, "full"]
    for name in (LORA, f"ema/{LORA}"):
        cached, encoded = load_file(cached_dir / name), load_file(encoded_dir / name)
        assert cached.keys() == encoded.keys()
        for key in cached:  # the VAE ran on other batch sizes: equal up to float rounding
            torch.testing.assert_close(cached[key], encoded[key], rtol=1e-4, atol=1e-5)
    features = cached_dir.parent / "features"
    pipe = from_pretrained(family.pipeline, tiny[family.name])
    assert_latents_cached_per_bucket(features, result.stderr, pipe.vae_scale_factor)
    # What the run trained on, each caption file's caption, the instance prompt (for the two pictures without one)
    # and (for the dropped samples) the empty one, each once, is bitwise what the family's encoding gives for them
    # (its own test: what the pipeline's encode_prompt gives); `test_dreambooth` shows each sample gets its own's.
    assert "2 of 6 instance images have no .txt caption file beside them; they train on --instance_prompt" \
        in result.stderr
    args = import_script(family.script).parse_args(list(map(str, common(tiny, family, tmp_path))))
    settings = family.module.prompt_settings(pipe, args)
    prompts = [*INSTANCE_CAPTIONS[:CAPTION_FILES], INSTANCE_PROMPT, ""]
    with torch.no_grad():
        expected = family.module.encode_prompts(pipe, prompts, "cpu", settings)
    text = load_file(next(features.glob("text_embeddings-*/shard-*")))
    assert text["0/indices"].tolist() == list(range(len(prompts)))
    assert len(text) == len(expected) + 1
    # A batch of 6 takes other kernels on another thread count: not bitwise. FLUX.1's text ids, one for all the
    # prompts, are stored with each prompt's row.
    for part, tensor in enumerate(expected):
        torch.testing.assert_close(text[f"0/{part}"], tensor.expand_as(text[f"0/{part}"]), rtol=1e-5, atol=1e-6)


def test_prior_preservation_generates_class_images_and_trains_the_named_layers(runs, family):
    # On the pictures of a dataset with a caption column: its distinct captions head the card.
    output_dir, result = runs[family.name, "prior"]
    listed = (output_dir / "README.md").read_text().split("## Training captions\n\n")[1].split("\n\n")[0]
    assert listed.splitlines() == [f'- "{caption}"' for caption in INSTANCE_CAPTIONS[:5]]
    class_dir = output_dir.parent / "class"
    assert sorted(path.name for path in class_dir.iterdir()) == ["class-00000.png", "class-00001.png"]
    assert f"generated 2 class images into {class_dir}" in result.stdout
    raw = load_file(output_dir / LORA)
    assert adapted_modules(raw) == family.prior_adapted
    assert all(tensor.dtype == torch.float32 for tensor in raw.values())


def test_outputs_load_into_a_fresh_pipeline_and_change_its_output(tiny, runs, family):
    full_dir, prior_dir = runs[family.name, "full"][0], runs[family.name, "prior"][0]
    # At the runs' prompt length: the pipelines' own 512 tokens would take most of the test's time.
    length = dict(zip(family.flags[::2], family.flags[1::2])).get("--max_sequence_length")
    assert_lora_changes_pipeline_output(tiny[family.name], full_dir, full_dir / "ema", prior_dir,
                                        prompt=INSTANCE_PROMPT, prepare=family.prepare_render,
                                        **({"max_sequence_length": length} if length else {}), **family.render_kwargs)


@pytest.mark.parametrize("family, flags, message", [
    pytest.param(family, flags, message, id=f"{family.name}-{flags[0]}")
    for family in FAMILIES for flags, message in [*REFUSED_EVERYWHERE, *family.refused]])
def test_bad_flags_fail_in_one_line_before_anything_loads(tiny, tmp_path, family, flags, message):
    assert usage_error(family.script, *common(tiny, family, tmp_path / "out", *flags)) == f"error: {message}"
    assert not (tmp_path / "out").exists()


def test_flux_swaps_blocks_in_its_full_run_and_its_int8_checkpointed_prior_run(runs):
    # Bitwise neutral: the resumed run, which does not swap, ends with the full run's weights (the resume test).
    assert "--blocks_to_swap: the frozen weights of 2 of the 3 blocks of transformer stay in CPU memory" \
        in runs["flux", "full"][1].stderr
    assert "--blocks_to_swap: the frozen weights of 3 of the 3 blocks of transformer stay in CPU memory" \
        in runs["flux", "prior"][1].stderr
    assert "--blocks_to_swap" not in runs["flux", "resumed"][1].stderr


def test_klein_compiles_its_double_and_single_stream_blocks(runs):
    # In one graph set whatever the bucket after the first two (the compile test counts them).
    _, result = runs["flux2_klein", "prior"]
    assert "aot_eager compiles, at their first call, 1 Flux2TransformerBlock, 2 Flux2SingleTransformerBlock" \
        in result.stderr


def test_sd3s_text_encoders_train_beside_block_0_and_change_the_prompts_embedding(tiny, runs):
    output_dir, _ = runs["sd3", "prior"]
    raw = load_file(output_dir / LORA)
    assert {key.split(".")[0] for key in raw} == {"transformer", "text_encoder", "text_encoder_2"}
    assert_same_files(output_dir / LORA, output_dir / "ema" / LORA)  # --ema_decay 0
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny["sd3"])

    def embedding():
        with torch.no_grad():
            return pipe.encode_prompt(INSTANCE_PROMPT, None, None, device="cpu", do_classifier_free_guidance=False)[0]

    base = embedding()
    pipe.load_lora_weights(runs["sd3", "full"][0])
    assert torch.equal(embedding(), base)  # a transformer LoRA leaves the prompt alone
    pipe.unload_lora_weights()
    pipe.load_lora_weights(output_dir)
    assert not torch.allclose(embedding(), base, atol=1e-4)


def test_flux_clip_encoder_trains_beside_the_transformer_and_changes_the_pooled_embedding(tiny, runs):
    output_dir, _ = runs["flux", "prior"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert {key.split(".")[0] for key in raw} == {"transformer", "text_encoder"} and raw.keys() == ema.keys()
    assert any(not torch.equal(raw[key], ema[key]) for key in raw if key.startswith("text_encoder."))
    pipe = FluxPipeline.from_pretrained(tiny["flux"])

    def embeddings():
        with torch.no_grad():
            return pipe.encode_prompt(INSTANCE_PROMPT, None, device="cpu", max_sequence_length=32)[:2]

    embeds, pooled = embeddings()
    pipe.load_lora_weights(output_dir)
    trained_embeds, trained_pooled = embeddings()
    assert torch.equal(trained_embeds, embeds) and not torch.allclose(trained_pooled, pooled, atol=1e-4)  # T5, CLIP
    # ComfyUI reads FLUX.1's CLIP-L adapter under kohya's lora_te1 names, beside the transformer's original ones.
    comfyui = load_file(output_dir / converted_name("comfyui"))
    assert {key.split("_")[0] if key.startswith("lora_te1_") else key.split(".")[0] for key in comfyui} == {
        "lora", "diffusion_model"}
    assert len([key for key in comfyui if key.startswith("lora_te1_text_model_encoder_layers_")]) == \
        3 * len([key for key in raw if key.startswith("text_encoder.") and "lora_A" in key])  # down, up, alpha


def test_ideogram4s_comfyui_file_changes_the_transformer_exactly_as_its_diffusers_file(tiny, runs):
    # No offline ComfyUI has Ideogram 4: diffusers' own loader reads the original layout (fused q, k and v, under
    # "diffusion_model."), and both files must fuse into the same weights.
    output_dir, _ = runs["ideogram4", "prior"]
    comfyui = converted_name("comfyui")
    assert load_file(output_dir / comfyui) and all(key.startswith("diffusion_model.")
                                                  for key in load_file(output_dir / comfyui))

    def fused_weights(name):
        pipe = Ideogram4Pipeline.from_pretrained(tiny["ideogram4"])
        pipe.load_lora_weights(output_dir / name)
        pipe.fuse_lora(components=["transformer"])
        return {key: tensor for key, tensor in pipe.transformer.state_dict().items() if "lora_" not in key}

    expected, converted = fused_weights(LORA), fused_weights(comfyui)
    assert converted.keys() == expected.keys()
    assert all(torch.equal(converted[key], expected[key]) for key in expected)


@pytest.mark.slow
def test_a_block_the_sd3_transformer_lacks_fails_with_one_line(tiny, tmp_path):
    # Checked against the loaded transformer, so in a run: one line, no traceback, a failed exit status.
    family = FAMILIES[FAMILY_IDS.index("sd3")]
    output_dir = tmp_path / "out"
    result = launch(family.script, *common(tiny, family, output_dir, "--lora_blocks", "0,2"), check=False)
    error = launched_usage_error(result)
    assert error == "error: --lora_blocks=2: expected a block index below 2 (the transformer has 2 blocks)"
    assert not (output_dir / LORA).exists()


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_each_adapter_trains_on_an_int8_klein_with_an_ema_and_writes_comfyuis_layout(tiny, runs, adapter):
    output_dir, result = runs["flux2_klein", adapter]
    assert_validated_at(output_dir, [4], ("raw", "ema"), ["a sks triangle"], num_images=1)
    compiled = "aot_eager compiles, at their first call, 1 Flux2TransformerBlock, 2 Flux2SingleTransformerBlock"
    assert (compiled in result.stderr) == (adapter in COMPILED_ADAPTERS)
    own = [LORA] if adapter == "dora" else ["transformer/adapter_config.json", "transformer/adapter_model.safetensors"]
    for folder in (output_dir, output_dir / "ema"):
        assert all((folder / name).is_file() for name in own), folder
        comfyui = load_file(folder / converted_name("comfyui"))
        assert comfyui and all(key.startswith("diffusion_model.") for key in comfyui)
    # In 4 steps a LoHa (a product of products) moves the tiny transformer's images by less than LoRA's 1e-4.
    assert_lora_changes_pipeline_output(tiny["flux2_klein"], output_dir, output_dir / "ema", prompt=INSTANCE_PROMPT,
                                        atol=1e-6)
