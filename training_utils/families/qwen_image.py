"""Qwen-Image: its conditioning and latent layout for training, taken from the pipeline itself (`QwenImagePipeline`),
and its LoRA layout in ComfyUI.

The Qwen-Image transformer reads:

- ``encoder_hidden_states`` and ``encoder_hidden_states_mask``: what ``pipe.encode_prompt`` returns, the Qwen2.5-VL
  text encoder's last hidden states for the prompt wrapped in the pipeline's chat template, the template's system
  turn dropped, cut at ``--max_sequence_length`` (`prompt_settings`; the pipeline's default unless set), zeros after
  each prompt's tokens up to the batch's longest, and the mask of the real tokens (None when none is padding).
  Each prompt is cached as its row of such a batch with its mask (`encode_prompts`); `text_inputs` batches the
  rows again as ``encode_prompt`` batches prompts, whatever batch each was encoded in (an instance prompt and a
  shorter class prompt, cached apart, stack with the class prompt's padding masked);
- ``hidden_states`` and ``img_shapes``: the VAE's latents, a one-frame video ``(B, C, 1, h, w)`` (`OneFrameVAE`
  encodes images so), standardised with the per-channel ``latents_mean`` and ``latents_std`` of the VAE's
  configuration (`normalized_latents`, the inverse of what the pipeline does before decoding), packed into tokens of
  2×2 patches, with each image's (frames, rows, columns) of patches for the rotary position embedding
  (`model_inputs`);
- ``timestep``: the scheduler's timestep over 1000 in the latents' dtype. No ``guidance``: Qwen-Image guides by
  true classifier-free guidance (a second pass on a negative prompt, at sampling only), and the pipeline passes a
  guidance embedding only to a transformer configured with ``guidance_embeds``, which Qwen-Image's is not.

Training draws its noise levels from the training scheduler's own schedule (`flow_matching`), which Qwen-Image's
configuration (``use_dynamic_shifting``) leaves unshifted, as upstream's script trains (its ``shift=3.0`` has no
effect on such a scheduler). The pipeline's sampling loop shifts its levels for the image size (``calculate_shift``
on the configuration's ``base_shift``, ``max_shift``, ``base_image_seq_len`` and ``max_image_seq_len``, stretched to
end at ``shift_terminal``): the levels it visits are points of the same path. Every piece is the pipeline's own (its
static helpers, its ``encode_prompt`` and its call's defaults, the VAE's configuration), so training feeds the
transformer what the pipeline's sampling loop feeds it at the same noise level; its output tokens are unpacked into
the latents' layout (`prediction`), where the loss compares them with the velocity.

A ControlNet (``QwenImageControlNetModel``, for ``QwenImageControlNetPipeline``) takes the transformer's inputs and
``controlnet_cond``, the conditioning image's latents packed as the image latents are (`controlnet_cond`), and
returns one residual per ControlNet block, which the transformer spreads evenly over its own blocks.
`controlnet_from_transformer` makes one as ``QwenImageControlNetModel.from_transformer`` allows: its first blocks
copies of the transformer's, with the transformer's width.
"""

import torch
from diffusers import AutoencoderKLQwenImage, QwenImageControlNetModel

from . import base
from .layout import BLOCK, Family, Rename

# QwenImagePipeline refuses longer prompts (its check_inputs), so a longer setting would fail at the first validation.
MAX_SEQUENCE_LENGTH_LIMIT = 1024
# ComfyUI's Qwen-Image model (comfy/ldm/qwen_image/model.py) names its modules as diffusers does.
COMFYUI_LAYOUT = (
    Rename(BLOCK + r"((?:attn|img_mod|txt_mod|img_mlp|txt_mlp)\..+)", r"transformer_blocks.\1.\2"),
    Rename(r"(img_in|txt_in|time_text_embed\.timestep_embedder\.linear_[12]|norm_out\.linear|proj_out)", r"\1"),
)
FAMILY = Family("qwen_image", "Qwen-Image", ("QwenImagePipeline",), "transformer", {}, COMFYUI_LAYOUT)
normalized_latents = base.standardised_latents
prediction = base.unpacked_prediction


def add_args(parser):
    """The prompt-encoding flag of the diffusers Qwen-Image script; unset, the pipeline's own default applies."""
    base.add_max_sequence_length(parser.add_argument_group("Qwen-Image"),
                                 "text tokens per prompt at most (default: the pipeline's, 512)")


def check_args(args):
    """Fail in one line on a bad prompt length or image size, before any weights load: the size is checked against
    the VAE's configuration, which loads without weights."""
    base.check_max_sequence_length(args, MAX_SEQUENCE_LENGTH_LIMIT, "QwenImagePipeline")
    check_resolution(args)


def check_resolution(args, pipeline="a Qwen-Image pipeline"):
    """Fail in one line on an image size that the latents cannot pack, checked against the configuration of
    ``pipeline``'s VAE (Qwen-Image's, in words as the error names it)."""
    base.check_packed_resolution(args, AutoencoderKLQwenImage, vae_scale_factor,
                                 f"{pipeline}, whose vae configuration is Qwen-Image's VAE's")


def vae_scale_factor(config):
    """How many pixels make a latent along each side for a Qwen-Image VAE of ``config``, worked out as the pipeline
    works it out from the loaded VAE."""
    return 2 ** len(config["temperal_downsample"])


def prompt_settings(pipe, args):
    """What the pipeline encodes prompts with, in training, validation and class images alike:
    ``--max_sequence_length``, or where unset the default of the pipeline's call (which it passes to encode_prompt)."""
    return {"max_sequence_length": base.max_sequence_length(pipe, args, "__call__")}


def call_kwargs(pipe, settings):
    """What every render (validation, class images) passes to the pipeline: the prompt settings, without true
    classifier-free guidance, which needs a negative prompt that upstream's script gives none either (saying so
    keeps the pipeline's warning out of every call)."""
    return {**settings, "true_cfg_scale": 1.0}


def prompt_dependencies(pipe, settings):
    """What the prompts' embeddings depend on besides the text encoder's weights, for the disk cache's key: the
    encoding code, the tokenizer, and the pipeline's template that wraps each prompt (and how much of it is
    dropped), which is not the tokenizer's."""
    return [encode_prompts, pipe.tokenizer, pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx,
            settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(prompt_embeds, mask)`` of ``pipe.encode_prompt(prompts)``: the mask always a tensor (the pipeline gives
    None when no prompt of the batch is padded), so that each prompt's row says how many of its tokens are real."""
    prompt_embeds, mask = pipe.encode_prompt(prompts, device=device, **settings)
    if mask is None:
        mask = torch.ones(prompt_embeds.shape[:2], dtype=torch.long, device=prompt_embeds.device)
    return prompt_embeds, mask


def text_inputs(rows):
    """The transformer's text inputs for a batch whose samples have the `encode_prompts` rows ``rows``
    ``(embeds, mask)``, as ``encode_prompt`` returns them for the batch: each prompt's real tokens (the first ones
    of its row), zeros after them up to the longest, and the mask of the real tokens, or None when no prompt is
    padded."""
    tokens = [embeds[: int(mask.sum())] for embeds, mask in rows]
    length = max(len(real) for real in tokens)
    prompt_embeds = torch.stack([torch.cat([real, real.new_zeros(length - len(real), real.shape[1])])
                                 for real in tokens])
    mask = torch.stack([torch.arange(length, device=prompt_embeds.device) < len(real) for real in tokens]).long()
    return {"encoder_hidden_states": prompt_embeds, "encoder_hidden_states_mask": None if mask.all() else mask}


class OneFrameVAE(torch.nn.Module):
    """The pipeline's video VAE as the image VAE that `frozen_encoders.FrozenEncoders` drives: ``encode`` takes images
    ``(B, 3, H, W)`` as one-frame videos, and the latents keep the frame axis, ``(B, C, 1, h, w)``, the layout
    that the pipeline packs and decodes. It holds the pipeline's VAE itself: moving this moves it."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae
        self.config = vae.config  # what describes it for the disk cache is the VAE's configuration

    def encode(self, images):
        return self.vae.encode(images.unsqueeze(2))


def image_vae(pipe):
    """The VAE that encodes the training images: the pipeline's video VAE, taking them as one-frame videos."""
    return OneFrameVAE(pipe.vae)


def model_inputs(pipe, noisy_latents, timesteps, text):
    """All the transformer's inputs for `normalized_latents` at ``timesteps``, as the pipeline's denoising loop
    passes them: the latents packed into tokens of 2×2 patches, each image's (frames, rows, columns) of patches, and
    the timesteps in the latents' dtype over 1000 (the pipeline's scale; the transformer multiplies it back)."""
    batch_size, channels, frames, height, width = noisy_latents.shape
    return {"hidden_states": pipe._pack_latents(noisy_latents, batch_size, channels, height, width),
            "img_shapes": [[(frames, height // 2, width // 2)]] * batch_size,
            "timestep": timesteps.to(noisy_latents.dtype) / 1000, **text}


def controlnet_from_transformer(transformer, num_layers):
    """A ``QwenImageControlNetModel`` of ``num_layers`` blocks made by its ``from_transformer``: the transformer's
    embedders and first blocks copied (blocks past the transformer's last start random), its input projection for
    the conditioning and its output projections zero, so it changes nothing until it trains. The class's own
    defaults for the width are the released model's; here they are the transformer's, whatever its size."""
    config = transformer.config
    return QwenImageControlNetModel.from_transformer(
        transformer, num_layers=num_layers, attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads)


@torch.no_grad()
def controlnet_cond(pipe, conditioning_pixels, generator=None):
    """The ControlNet's ``controlnet_cond`` for conditioning images ``(B, 3, H, W)`` in [0, 1], as
    ``QwenImageControlNetPipeline`` prepares its control image: in [-1, 1], a one-frame video, encoded to a sample of
    the VAE's latent distribution (from ``generator``, or the global RNG), standardised as the image latents, and
    packed into tokens of 2×2 patches as `model_inputs` packs them. The standardisation multiplies by the reciprocal
    of ``latents_std`` as that pipeline does (`normalized_latents` divides), so the tokens are exactly its own."""
    vae = pipe.vae
    images = (conditioning_pixels * 2 - 1).unsqueeze(2).to(vae.device, vae.dtype)
    latents = vae.encode(images).latent_dist.sample(generator)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device)
    reciprocal_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device)
    latents = (latents - mean) * reciprocal_std
    batch_size, channels, _, height, width = latents.shape
    return pipe._pack_latents(latents, batch_size, channels, height, width)
