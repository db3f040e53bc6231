"""FLUX.2 ([klein]): its conditioning and latent layout for training, taken from the pipeline itself
(`Flux2KleinPipeline`), and its LoRA layout in ComfyUI.

The FLUX.2 transformer reads:

- ``encoder_hidden_states`` and ``txt_ids``: what ``pipe.encode_prompt`` returns (`encode_prompts`), the text
  encoder's hidden states at a few layers stacked on the feature axis, and their position ids. The layers and the
  prompt length are the pipeline's defaults unless ``--text_encoder_out_layers`` and ``--max_sequence_length`` say
  otherwise (`prompt_settings`), and the same settings go to every call of the pipeline (validation, class images);
- ``hidden_states`` and ``img_ids``: the VAE latents folded into 2×2 patches, standardised with the VAE's
  batch-norm statistics (`normalized_latents`), packed into a sequence of tokens, and their position ids
  (`model_inputs`);
- ``timestep``: the scheduler's timestep over 1000, and no guidance embedding (the pipeline passes none).

With reference images (the image-to-image scripts: the pipeline's ``image=``), each reference is laid out as the
pipeline lays it out (`reference_pixels`: at most 1024² pixels in area, its sides cut down to multiples of 16,
`check_reference_size` refusing what the pipeline refuses), encoded to its latent distribution's mode, patchified and
standardised as the target is (`reference_latents`), and its tokens follow the target's in ``hidden_states``, with
position ids whose time coordinate tells the references apart (10, 20, ...: `model_inputs`).

Its output tokens, the target's (the references' are dropped, as the pipeline drops them), are unpacked into the
latents' layout (`prediction`), where the loss compares them with the velocity. Every piece is the pipeline's own
(its static helpers, its ``encode_prompt`` and that method's defaults, its image processor), so training feeds the
transformer what the pipeline's sampling loop feeds it at the same noise level.
"""

import functools
import inspect

import torch
from diffusers import Flux2Transformer2DModel
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from PIL import Image
from transformers import AutoConfig

from . import base
from ..errors import UsageError, require
from .base import stacked
from .layout import BLOCK, Family, Rename, always, fused

# The original release's module tree (ComfyUI's FLUX.2 model): diffusers'
# convert_flux2_transformer_checkpoint_to_diffusers, read backwards.
COMFYUI_LAYOUT = (
    *fused(BLOCK + r"attn\.{}", r"double_blocks.\1.img_attn.qkv", ("to_q", "to_k", "to_v")),
    *fused(BLOCK + r"attn\.{}", r"double_blocks.\1.txt_attn.qkv", ("add_q_proj", "add_k_proj", "add_v_proj")),
    Rename(BLOCK + r"attn\.to_out\.0", r"double_blocks.\1.img_attn.proj"),
    Rename(BLOCK + r"attn\.to_add_out", r"double_blocks.\1.txt_attn.proj"),
    Rename(BLOCK + r"ff\.linear_in", r"double_blocks.\1.img_mlp.0"),
    Rename(BLOCK + r"ff\.linear_out", r"double_blocks.\1.img_mlp.2"),
    Rename(BLOCK + r"ff_context\.linear_in", r"double_blocks.\1.txt_mlp.0"),
    Rename(BLOCK + r"ff_context\.linear_out", r"double_blocks.\1.txt_mlp.2"),
    Rename(r"single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj", r"single_blocks.\1.linear1"),
    Rename(r"single_transformer_blocks\.(\d+)\.attn\.to_out", r"single_blocks.\1.linear2"),
    Rename(r"(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation)\.linear", r"\1.lin"),
    Rename(r"x_embedder", "img_in"),
    Rename(r"context_embedder", "txt_in"),
    Rename(r"time_guidance_embed\.timestep_embedder\.linear_1", "time_in.in_layer"),
    Rename(r"time_guidance_embed\.timestep_embedder\.linear_2", "time_in.out_layer"),
    Rename(r"time_guidance_embed\.guidance_embedder\.linear_1", "guidance_in.in_layer"),
    Rename(r"time_guidance_embed\.guidance_embedder\.linear_2", "guidance_in.out_layer"),
    Rename(r"norm_out\.linear", "final_layer.adaLN_modulation.1", swap_halves=always),
    Rename(r"proj_out", "final_layer.linear"),
)
FAMILY = Family("flux2", "FLUX.2", ("Flux2KleinPipeline",), "transformer", {}, COMFYUI_LAYOUT)
# The largest reference, in pixels, that the FLUX.2 pipelines encode as it is; a larger one is scaled down to it.
REFERENCE_AREA = 1024 * 1024
call_kwargs = base.call_kwargs
image_vae = base.image_vae


def add_args(parser):
    """The prompt-encoding flags of the diffusers FLUX.2 scripts ([klein]'s and [dev]'s); unset, the pipeline's own
    defaults apply."""
    group = parser.add_argument_group("FLUX.2")
    base.add_max_sequence_length(group, "tokens per prompt, [dev]'s system message included (default: the "
                                        "pipeline's, 512)")
    group.add_argument("--text_encoder_out_layers", type=int, nargs="+", default=None,
                       help="indices of the text encoder's hidden states that the prompt embedding stacks "
                            "(default: the pipeline's, 9 18 27 for FLUX.2 [klein], 10 20 30 for [dev])")


def check_args(args):
    """Fail in one line on a bad prompt setting, before any weights load: ``--text_encoder_out_layers`` is
    checked against the text encoder's and the transformer's configurations, which load without weights."""
    base.check_max_sequence_length(args)
    if args.text_encoder_out_layers is not None:
        check_text_encoder_out_layers(args.text_encoder_out_layers, *model_configs(args))


def model_configs(args):
    """The text encoder's configuration and the transformer's (a dict) of ``--pretrained_model_name_or_path``."""
    path, options = args.pretrained_model_name_or_path, {"revision": args.revision, "cache_dir": args.cache_dir}
    try:
        return (AutoConfig.from_pretrained(path, subfolder="text_encoder", **options),
                Flux2Transformer2DModel.load_config(path, subfolder="transformer", **options))
    except (OSError, ValueError):
        raise UsageError("--pretrained_model_name_or_path", path,
                         "a FLUX.2 pipeline whose text_encoder and transformer configurations load") from None


def check_text_encoder_out_layers(layers, text_encoder_config, transformer_config):
    # A multimodal encoder's (FLUX.2 [dev]'s Mistral 3) hidden states are its language model's.
    text_encoder_config = getattr(text_encoder_config, "text_config", text_encoder_config)
    depth, width = text_encoder_config.num_hidden_layers, text_encoder_config.hidden_size
    # The hidden states are the embeddings' and each layer's output: depth + 1 of them, indexed from either end.
    require(all(-depth - 1 <= layer <= depth for layer in layers), "--text_encoder_out_layers", layers,
            f"indices of the text encoder's hidden states, from {-depth - 1} to {depth} (it has {depth} layers)")
    features = transformer_config["joint_attention_dim"]
    require(len(layers) * width == features, "--text_encoder_out_layers", layers,
            f"{features // width} indices: the transformer reads {features} text features, {width} from each layer")


def prompt_settings(pipe, args):
    """What ``pipe.encode_prompt`` runs with, in training, validation and class images alike:
    ``--max_sequence_length`` and ``--text_encoder_out_layers``, or where unset the method's own defaults."""
    defaults = inspect.signature(pipe.encode_prompt).parameters
    return {"max_sequence_length": base.max_sequence_length(pipe, args),
            "text_encoder_out_layers": tuple(args.text_encoder_out_layers
                                             or defaults["text_encoder_out_layers"].default)}


def prompt_dependencies(pipe, settings):
    """What the prompts' embeddings depend on besides the text encoder's weights, for the disk cache's key: the
    encoding code, the tokenizer, its chat template (not part of its vocabulary) and the settings."""
    return [encode_prompts, pipe.tokenizer, pipe.tokenizer.chat_template, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(prompt_embeds, text_ids)`` of ``pipe.encode_prompt``, one row per prompt."""
    return pipe.encode_prompt(prompts, device=device, **settings)


def text_inputs(rows):
    """The transformer's text inputs for a batch whose samples have the `encode_prompts` rows ``rows``."""
    return {"encoder_hidden_states": stacked(rows, 0), "txt_ids": stacked(rows, 1)}


def normalized_latents(pipe, latents):
    """VAE latents ``(B, C, H, W)`` as the transformer reads them: 2×2 patches folded into the channels, then
    standardised with the VAE's batch-norm running statistics, as the pipeline encodes images (sampling undoes
    both before decoding)."""
    return base.batch_norm_standardised(pipe, pipe._patchify_latents(latents))


def model_inputs(pipe, noisy_latents, timesteps, text, references=()):
    """All the transformer's inputs for `normalized_latents` at ``timesteps``, as the pipeline's denoising loop
    passes them: the latents packed into tokens, their position ids, and the timesteps in the latents' dtype over
    1000 (the pipeline's scale; the transformer multiplies it back). The `reference_latents` ``references`` (of each
    sample, one tensor per reference) follow in the sequence, with the ids the pipeline gives them."""
    hidden_states = pipe._pack_latents(noisy_latents)
    img_ids = pipe._prepare_latent_ids(noisy_latents).to(noisy_latents.device)
    if references:
        reference_ids = pipe._prepare_image_ids([latents[:1] for latents in references]).to(noisy_latents.device)
        tokens = torch.cat([pipe._pack_latents(latents) for latents in references], dim=1)
        hidden_states = torch.cat([hidden_states, tokens.to(hidden_states.dtype)], dim=1)
        img_ids = torch.cat([img_ids, reference_ids.expand(len(noisy_latents), -1, -1)], dim=1)
    return {"hidden_states": hidden_states, "img_ids": img_ids, "timestep": timesteps.to(noisy_latents.dtype) / 1000,
            **text}


def prediction(pipe, output, latents):
    """The transformer's output tokens in the layout of the `normalized_latents` ``latents``, placed by their
    position ids: the velocity it predicts (the tokens after the target's, the references', are dropped)."""
    height, width = latents.shape[-2:]
    ids = pipe._prepare_latent_ids(latents).to(output.device)
    return pipe._unpack_latents_with_ids(output[:, :ids.shape[1]], ids, height, width)


def check_reference_size(width, height):
    """Raise ValueError for a reference of ``width``×``height`` that the pipeline refuses (too small, too narrow)."""
    Flux2ImageProcessor.check_image_input(Image.new("RGB", (width, height)))


def reference_pixels(pipe, image):
    """A reference image (PIL) laid out as the pipeline lays out its ``image=``: scaled down to `REFERENCE_AREA` if
    larger, then resized and centre-cropped to sides that are multiples of 16 (2×2 patches of the VAE's 8×8 cells);
    CHW in [-1, 1]."""
    processor = pipe.image_processor
    if image.width * image.height > REFERENCE_AREA:
        image = processor._resize_to_target_area(image, REFERENCE_AREA)
    multiple = pipe.vae_scale_factor * 2
    height, width = image.height // multiple * multiple, image.width // multiple * multiple
    return processor.preprocess(image, height=height, width=width, resize_mode="crop")[0]


def reference_layout(pipe):
    """``(lay_out, depends_on)`` for `edit_samples.References`: `reference_pixels` with ``pipe``'s image processor,
    and what it depends on besides its code (the processor's settings, the VAE's scale, the largest area)."""
    return (functools.partial(reference_pixels, pipe),
            [dict(pipe.image_processor.config), pipe.vae_scale_factor, REFERENCE_AREA])


def reference_latents(pipe, parameters):
    """The references of a batch as the pipeline encodes them, from their VAE latent distributions' ``parameters``
    (a list, one ``(B, 2C, h, w)`` tensor per reference): the mode (the pipeline's ``sample_mode="argmax"``),
    patchified and standardised (`normalized_latents`)."""
    return base.normalized_modes(pipe, parameters, normalized_latents)
