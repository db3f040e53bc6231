"""Stable Diffusion XL's conditioning, shared by the SDXL scripts (text-to-image LoRA, ControlNet).

SDXL's UNet reads three things besides the noisy latents, all computed here as
``StableDiffusionXLPipeline`` computes them at inference:

- ``encoder_hidden_states``: both CLIP encoders' penultimate hidden states, concatenated;
- ``text_embeds``: the second encoder's projected (pooled) output;
- ``time_ids``: the micro-conditioning (original height, width; crop top, left; target height, width).

The last two go in ``added_cond_kwargs``; the UNet embeds the time ids in fp32 whatever its own
dtype, so they stay fp32 (bf16 would round sizes such as 1023).

Also the ``--pretrained_vae_model_name_or_path`` flag of the diffusers SDXL scripts, whose VAE
replaces the pipeline's when the pipeline loads (e.g. an fp16-safe VAE for ``--mixed_precision fp16``).
"""

import json
from pathlib import Path

import torch
from diffusers import AutoencoderKL

from .args import is_hub_id
from .data import tokenize
from .errors import require


def add_vae_args(parser):
    parser.add_argument("--pretrained_vae_model_name_or_path", default=None,
                        help="a VAE model folder or hub id that replaces the pipeline's VAE, e.g. "
                             "madebyollin/sdxl-vae-fp16-fix (SDXL's own VAE overflows in fp16)")


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


def tokenize_prompt(tokenizers, texts):
    """Token ids of ``texts`` for each tokenizer, padded to its maximum length as ``encode_prompt`` does."""
    return [tokenize(tokenizer, texts) for tokenizer in tokenizers]


def encode_prompt(text_encoders, input_ids):
    """``(prompt_embeds, pooled_prompt_embeds)`` from both encoders' ids, without classifier-free guidance.

    The hidden states are the penultimate layer's of each encoder, concatenated on the feature axis;
    the pooled embeddings are the last encoder's projection (``text_embeds``).
    """
    hidden_states = []
    for text_encoder, ids in zip(text_encoders, input_ids):
        output = text_encoder(ids, output_hidden_states=True)
        hidden_states.append(output.hidden_states[-2])
    return torch.cat(hidden_states, dim=-1), output.text_embeds


def time_ids(original_size, crop_top_left, target_size):
    """The six micro-conditioning numbers of one image: original (h, w), crop (top, left), target (h, w)."""
    return torch.tensor([*original_size, *crop_top_left, *target_size], dtype=torch.float32)

