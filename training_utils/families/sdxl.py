"""Stable Diffusion XL: its conditioning and latent layout for training, as ``StableDiffusionXLPipeline`` computes
them, shared by the SDXL scripts (text-to-image LoRA, ControlNet), and its LoRA layout for the UI tools.

SDXL's UNet reads three things besides the noisy latents (the VAE's, times its ``scaling_factor``) and the
timestep, all computed here as the pipeline computes them at inference:

- ``encoder_hidden_states``: both CLIP encoders' penultimate hidden states, concatenated (`encode_prompts`);
- ``text_embeds``: the second encoder's projected (pooled) output;
- ``time_ids``: the micro-conditioning of each image (original height, width; crop top, left; target height, width;
  `time_ids`).

The last two go in ``added_cond_kwargs``; the UNet embeds the time ids in fp32 whatever its own
dtype, so they stay fp32 (bf16 would round sizes such as 1023).

Also the ``--pretrained_vae_model_name_or_path`` flag of the diffusers SDXL scripts, whose VAE
replaces the pipeline's when the pipeline loads (e.g. an fp16-safe VAE for ``--mixed_precision fp16``).
"""

import json
import re
from pathlib import Path

import torch
from diffusers import AutoencoderKL

from . import sd
from ..adapters.injection import CLIP_ATTENTION_PROJECTIONS
from ..errors import require
from ..pipeline import is_hub_id
from .base import stacked, tokenize
from .layout import CLIP_PAIR, Family

FAMILY = Family("sdxl", "SDXL", ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline",
                                 "StableDiffusionXLInpaintPipeline", "StableDiffusionXLControlNetPipeline"),
                "unet", CLIP_PAIR)
# What SDXL does as SD 1.x does: its prompt settings, latents and UNet inputs.
prompt_settings = sd.prompt_settings
call_kwargs = sd.call_kwargs
image_vae = sd.image_vae
normalized_latents = sd.normalized_latents
model_inputs = sd.model_inputs
prediction = sd.prediction
TEXT_ENCODERS = ("text_encoder", "text_encoder_2")


def text_encoder_adapter_layers(pipe, name):
    """The attention projections of the text encoder ``name`` that a text-encoder adapter goes on: those of the
    layers the prompt's embeddings depend on. The first encoder's last layer feeds nothing (its penultimate hidden
    states are read); every layer of the second feeds its pooled output. An adapter on a layer that feeds nothing
    would train nothing, and DDP stops a run whose parameters get no gradient."""
    text_encoder = getattr(pipe, name)
    read = text_encoder.config.num_hidden_layers - (name == "text_encoder")
    return [module_name for module_name, _ in text_encoder.named_modules()
            if module_name.rsplit(".", 1)[-1] in CLIP_ATTENTION_PROJECTIONS
            and int(re.search(r"layers\.(\d+)\.", module_name).group(1)) < read]


def add_args(parser):
    parser.add_argument("--pretrained_vae_model_name_or_path", default=None,
                        help="a VAE model folder or hub id that replaces the pipeline's VAE, e.g. "
                             "madebyollin/sdxl-vae-fp16-fix (SDXL's own VAE overflows in fp16)")


def check_args(args):
    check_vae_path(args.pretrained_vae_model_name_or_path)


def check_vae_path(value, flag="--pretrained_vae_model_name_or_path"):
    """A VAE is a model folder (``config.json`` of an ``AutoencoderKL``), not a pipeline folder, or a hub id."""
    if value is None:
        return
    path = Path(value).expanduser()
    expected = "an AutoencoderKL folder (with config.json, e.g. <pipeline>/vae) or a hub id"
    if not path.exists():
        require(is_hub_id(value), flag, value, expected)
        return
    config = path / "config.json"
    require(path.is_dir() and config.is_file(), flag, value, expected)
    try:
        class_name = json.loads(config.read_text()).get("_class_name")
    except (ValueError, AttributeError):
        class_name = None
    require(class_name == "AutoencoderKL", flag, value, f"{expected}; its config.json names {class_name!r}")


def vae_components(value, dtype):
    """``{"vae": AutoencoderKL}`` loaded from ``value`` in ``dtype`` (the frozen weights'), to pass to the pipeline's
    loading, or ``{}`` without one."""
    if value is None:
        return {}
    return {"vae": AutoencoderKL.from_pretrained(value, dtype=dtype)}


def vae_how_to_load(value, pipe):
    """The fields of the model card's loading code (`hub.how_to_load`) that load the replacement VAE too."""
    if value is None:
        return {}
    return {"imports": f"AutoencoderKL, {type(pipe).__name__}",
            "load_options": f', vae=AutoencoderKL.from_pretrained("{value}")'}


def prompt_dependencies(pipe, settings):
    """What the prompts' embeddings depend on besides the text encoders' weights, for the disk cache's key: the
    encoding code and both tokenizers."""
    return [encode_prompts, pipe.tokenizer, pipe.tokenizer_2]


def encode_prompts(pipe, prompts, device, settings, text_encoders=None):
    """``(prompt_embeds, pooled_prompt_embeds)``, one row per prompt, without classifier-free guidance: the
    penultimate hidden states of both encoders concatenated on the feature axis, and the last encoder's projection
    (``text_embeds``). ``text_encoders`` (by component name) replace the pipeline's: the wrapped modules of those
    that train."""
    hidden_states = []
    for name, tokenizer in zip(TEXT_ENCODERS, (pipe.tokenizer, pipe.tokenizer_2)):
        text_encoder = (text_encoders or {}).get(name, getattr(pipe, name))
        output = text_encoder(tokenize(tokenizer, prompts).to(device), output_hidden_states=True)
        hidden_states.append(output.hidden_states[-2])
    return torch.cat(hidden_states, dim=-1), output.text_embeds


def text_inputs(rows):
    """The UNet's text inputs for a batch whose samples have the `encode_prompts` rows ``rows``: the hidden states,
    and the pooled embeddings in ``added_cond_kwargs``, where the step adds each image's `time_ids`."""
    return {"encoder_hidden_states": stacked(rows, 0), "added_cond_kwargs": {"text_embeds": stacked(rows, 1)}}


def time_ids(original_size, crop_top_left, target_size):
    """The six micro-conditioning numbers of one image: original (h, w), crop (top, left), target (h, w)."""
    return torch.tensor([*original_size, *crop_top_left, *target_size], dtype=torch.float32)


def batch_time_ids(layouts):
    """The `time_ids` of a batch's images from their layouts, ``(B, 6)`` integers in the same order (as
    `dreambooth.instance_then_class_collate` gives them)."""
    return layouts.to(torch.float32)
