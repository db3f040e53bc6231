"""Ideogram 4: its conditioning and latent layout for training, taken from the pipeline itself (`Ideogram4Pipeline`),
and its LoRA layout in ComfyUI.

The Ideogram 4 transformer reads one packed sequence per sample: ``max_sequence_length`` text positions (the prompt's
tokens at their end, left-padded), then the image's tokens. Its inputs:

- ``encoder_hidden_states``: the prompt's features, as ``pipe.encode_prompt`` makes them (the chat template, the
  hidden states of Qwen3-VL's decoder layers ``QWEN3_VL_ACTIVATION_LAYERS`` concatenated, the padding zeroed), then
  zeros over the image's positions. `encode_prompts` keeps each prompt's features and length, which do not depend on
  the image's size (the cache holds them once); `model_inputs` lays them out for the batch's latent grid;
- ``hidden_states``: zeros over the text's positions, then the VAE latents folded into 2×2 patches (the inverse of
  the pipeline's decoding) and standardised with the VAE's batch-norm statistics (`normalized_latents`), a token per
  patch;
- ``position_ids``, ``segment_ids`` and ``indicator``: the pipeline's own ``_prepare_ids`` of the prompts' lengths
  and the latent grid (`model_inputs`);
- ``timestep``: the model's time, ``1 - sigma`` (0 is noise), as the sampling loop converts the scheduler's.

The transformer predicts ``latents - noise`` (the pipeline steps with its negation): `prediction` drops the text's
positions and negates the image's, which the loss compares with the velocity ``noise - latents``. The training noise
levels are upstream's (`sample_timesteps`): a sigma drawn with ``--weighting_scheme``'s density itself, its
logit-normal mean shifted by the image's size as the pipeline shifts its sampling schedule (``_resolution_aware_mu``).

Only the conditional ``transformer`` trains; the ``unconditional_transformer``, which renders the negative branch of
the pipeline's asymmetric guidance on no text, stays frozen (upstream's choice).
"""

import inspect

import torch
from diffusers import AutoencoderKLFlux2, Ideogram4Pipeline
from diffusers.models.transformers.transformer_ideogram4 import LLM_TOKEN_INDICATOR
from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS, _resolution_aware_mu
from diffusers.training_utils import compute_density_for_timestep_sampling

from . import base
from ..errors import UsageError
from .layout import Family, Rename, fused

# The original release's module tree, as diffusers' Ideogram 4 LoRA conversion reads it backwards
# (_convert_non_diffusers_ideogram4_lora_to_diffusers: fused q, k, v; the attention's output "o"). It names the
# blocks' layers alone: the layers outside them (input_proj, final_layer, ...) have no known original names.
COMFYUI_LAYOUT = (
    *fused(r"layers\.(\d+)\.attention\.{}", r"layers.\1.attention.qkv", ("to_q", "to_k", "to_v")),
    Rename(r"layers\.(\d+)\.attention\.to_out\.0", r"layers.\1.attention.o"),
    Rename(r"layers\.(\d+)\.(feed_forward\.w[123]|adaln_modulation)", r"layers.\1.\2"),
)
FAMILY = Family("ideogram4", "Ideogram 4", ("Ideogram4Pipeline",), "transformer", {}, COMFYUI_LAYOUT)
# The guidance of validation and class images: that of all but the last steps of the pipeline's default schedule (7).
GUIDANCE_SCALE = inspect.signature(Ideogram4Pipeline.__call__).parameters["guidance_schedule"].default[0]
image_vae = base.image_vae


def add_args(parser):
    """The prompt-encoding flag of the diffusers Ideogram 4 script; unset, the pipeline's own default applies."""
    base.add_max_sequence_length(parser.add_argument_group("Ideogram 4"), "text positions of the packed sequence, "
                                 "the chat template's tokens included (default: the pipeline's, 2048)")


def check_args(args):
    """Fail in one line on a bad prompt length or image size, before any weights load: the size is checked against
    the VAE's configuration, which loads without weights."""
    base.check_max_sequence_length(args)
    base.check_packed_resolution(args, AutoencoderKLFlux2, lambda config: 2 ** (len(config["block_out_channels"]) - 1),
                                 "an Ideogram 4 pipeline, whose vae configuration is FLUX.2's VAE's")


def prompt_settings(pipe, args):
    """What ``pipe.encode_prompt`` runs with, in training, validation and class images alike:
    ``--max_sequence_length``, or where unset the pipeline's default."""
    return {"max_sequence_length": base.max_sequence_length(pipe, args, "__call__")}


def call_kwargs(pipe, settings):
    """What every render (validation, class images) passes to the pipeline: the prompt settings, and the main scale
    of the pipeline's default guidance schedule as a constant guidance (`GUIDANCE_SCALE`), since that schedule fits
    only the pipeline's default number of steps."""
    return {**settings, "guidance_scale": GUIDANCE_SCALE, "guidance_schedule": None}


def prompt_dependencies(pipe, settings):
    """What the prompts' features depend on besides the text encoder's weights, for the disk cache's key: the
    encoding code, the tokenizer, its chat template (not part of its vocabulary), the tapped layers and the
    settings."""
    return [encode_prompts, pipe.tokenizer, pipe.tokenizer.chat_template, QWEN3_VL_ACTIVATION_LAYERS, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(features, lengths, sequence_lengths)``: each prompt's features as ``pipe.encode_prompt`` makes them (on an
    empty image grid: they do not depend on it), cut to the last positions that the longest prompt fills (the rest is
    zero padding), each prompt's length in tokens, and ``max_sequence_length`` for each."""
    length = settings["max_sequence_length"]
    try:
        features, _, _, indicator = pipe.encode_prompt(list(prompts), grid_h=0, grid_w=0, max_sequence_length=length,
                                                       device=device)
    except ValueError as error:  # a prompt with more tokens than the sequence has positions
        raise UsageError("--max_sequence_length", length, f"enough text positions ({error})") from None
    lengths = (indicator == LLM_TOKEN_INDICATOR).sum(1)
    return features[:, length - int(lengths.max()):], lengths, torch.full_like(lengths, length)


def text_inputs(rows):
    """The batch's prompt features left-padded with zeros to ``max_sequence_length`` positions, as
    ``pipe.encode_prompt`` lays them out, and the prompts' lengths (which `model_inputs` reads), from the
    `encode_prompts` rows ``rows``."""
    length = int(rows[0][2])
    features = torch.stack([torch.nn.functional.pad(row[0], (0, 0, length - len(row[0]), 0)) for row in rows])
    return {"encoder_hidden_states": features, "text_lengths": torch.stack([row[1] for row in rows])}


def normalized_latents(pipe, latents):
    """VAE latents ``(B, C, H, W)`` as the transformer reads them: each 2×2 patch folded into the channels, ordered
    (patch row, patch column, channel) as the pipeline unfolds them before decoding, and standardised with the VAE's
    batch-norm running statistics (which the pipeline undoes before decoding)."""
    batch, channels, height, width = latents.shape
    patch = pipe.patch_size
    patches = latents.reshape(batch, channels, height // patch, patch, width // patch, patch).permute(0, 3, 5, 1, 2, 4)
    return base.batch_norm_standardised(pipe, patches.reshape(batch, patch * patch * channels, height // patch,
                                                             width // patch))


def sample_timesteps(pipe, noise_scheduler, args, latents):
    """``(timesteps, sigmas)`` for a batch of `normalized_latents`, as upstream's script draws them: each sigma is
    ``--weighting_scheme``'s density itself (from the global RNG), the logit-normal mean ``--logit_mean`` shifted by
    the images' size as the pipeline shifts its sampling schedule; the timesteps are the scheduler's scale of them.
    ``sigmas`` are in the latents' dtype, with as many dims, to broadcast over them."""
    height, width = (side * pipe.vae_scale_factor * pipe.patch_size for side in latents.shape[-2:])
    density = compute_density_for_timestep_sampling(
        args.weighting_scheme, len(latents), logit_mean=_resolution_aware_mu(height, width, args.logit_mean),
        logit_std=args.logit_std, mode_scale=args.mode_scale).to(latents.device)
    sigmas = density.to(latents.dtype).reshape(len(latents), *[1] * (latents.ndim - 1))
    return density * noise_scheduler.config.num_train_timesteps, sigmas


def model_inputs(pipe, noisy_latents, timesteps, text):
    """All the transformer's inputs for `normalized_latents` at the scheduler's ``timesteps``, as the pipeline's
    denoising loop passes them: the packed sequence of zeros over the text's positions and the latents' tokens, the
    prompts' features and zeros over the image's positions, the pipeline's ids for the prompts' lengths and the
    latent grid, and the model's time ``1 - timesteps / num_train_timesteps``."""
    batch, channels, grid_h, grid_w = noisy_latents.shape
    features, device = text["encoder_hidden_states"], noisy_latents.device
    text_positions = features.shape[1]
    tokens = noisy_latents.flatten(2).transpose(1, 2)
    position_ids, segment_ids, indicator = pipe._prepare_ids(text["text_lengths"].tolist(), grid_h, grid_w,
                                                             text_positions, device)
    time = 1.0 - timesteps.float() / pipe.scheduler.config.num_train_timesteps
    return {"hidden_states": torch.cat([tokens.new_zeros(batch, text_positions, channels), tokens], dim=1),
            "encoder_hidden_states": torch.cat([features, features.new_zeros(batch, tokens.shape[1],
                                                                             features.shape[2])], dim=1),
            "position_ids": position_ids, "segment_ids": segment_ids, "indicator": indicator,
            "timestep": time.to(noisy_latents.dtype)}


def prediction(pipe, output, latents):
    """The transformer's output over the image's tokens (the text's positions dropped, as the pipeline drops them)
    in the layout of the `normalized_latents` ``latents``, negated: the velocity ``noise - latents``."""
    batch, channels, grid_h, grid_w = latents.shape
    return -output[:, -grid_h * grid_w:].transpose(1, 2).reshape(batch, channels, grid_h, grid_w)
