"""LTX-Video: its conditioning and latent layout for training, taken from the pipelines themselves (`LTXPipeline`,
`LTXImageToVideoPipeline`, which load the same released folders), and its LoRA layout in ComfyUI.

The LTX transformer reads:

- ``encoder_hidden_states`` and ``encoder_attention_mask``: what ``pipe.encode_prompt`` returns for the prompt
  (`encode_prompts`): T5's last hidden states and the mask of the prompt's tokens, ``max_sequence_length`` long (the
  pipeline's default, 128, unless ``--max_sequence_length`` says otherwise, and then in every render too);
- ``hidden_states``: the video's VAE latents ``(B, C, frames, H, W)`` normalised with the VAE's ``latents_mean``,
  ``latents_std`` and ``scaling_factor`` (`normalized_latents`: the pipeline's ``_normalize_latents``; sampling
  undoes it before decoding), packed into a sequence of tokens (`model_inputs`: its ``_pack_latents``), with the
  latents' frames, height and width;
- ``rope_interpolation_scale``: the rotary positions' scale, ``(temporal / frame_rate, spatial, spatial)``: the
  model places its frames in time by the clip's frames a second. Each sample gets its own clip's rate (the
  transformer broadcasts a ``(B, 1, 1, 1, 1)`` tensor in the scale's first place over the batch), the native rate
  where a clip states none (a still, whose one frame sits at time 0 whatever the rate);
- ``timestep``: the sampler's timestep, one per sample, or for image-to-video one per token, zero on the first
  frame's tokens, which hold the image's clean latents (`image_to_video_inputs`, as ``LTXImageToVideoPipeline``'s
  conditioning mask makes them).

It predicts the velocity in the packed layout (`prediction` unpacks it). The training noise levels are those of the
pipeline's sampler for the clip's number of tokens: its scheduler's resolution-dependent shift (``calculate_shift``
on ``base_image_seq_len``, ``max_image_seq_len``, ``base_shift``, ``max_shift``) and terminal stretch
(``shift_terminal``), applied to the training schedule's levels (`sample_denoiser_timesteps`); the transformer
reads the shifted level as its timestep, as in the pipeline's loop. One transformer denoises every level.
"""

import logging

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

from ..flow_matching import sample_flow_matching_timesteps
from . import base
from .base import VideoGeometry
from .layout import BLOCK, Family, Rename

logger = logging.getLogger(__name__)

# The original release's module tree (ComfyUI's LTXV model): the same names as diffusers' inside the blocks
# (diffusers' LTX-Video LoRA loader only strips ComfyUI's prefix), the patch and timestep embedders renamed.
COMFYUI_LAYOUT = (
    Rename(BLOCK + r"(attn[12]\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.0\.proj|ff\.net\.2)", r"transformer_blocks.\1.\2"),
    Rename(r"proj_in", "patchify_proj"),
    Rename(r"time_embed\.(emb\.timestep_embedder\.linear_[12]|linear)", r"adaln_single.\1"),
    Rename(r"caption_projection\.(linear_[12])", r"caption_projection.\1"),
    Rename(r"proj_out", "proj_out"),
)
FAMILY = Family("ltx", "LTX-Video", ("LTXPipeline", "LTXImageToVideoPipeline"), "transformer", {}, COMFYUI_LAYOUT)
# The one component that denoises, quantised with --quantize_base.
DENOISERS = ("transformer",)
# LTX-Video's VAE: 32× in space, 8× in time, 1×1×1 patches (``check_inputs`` asks sides of multiples of 32), 25
# frames a second (``__call__``'s ``frame_rate``), frames as PIL images (the pipeline's default ``output_type``).
VIDEO = VideoGeometry(spatial=32, temporal=8, size_multiple=32, fps=25, output_type="pil")
video_geometry = base.fixed_geometry(VIDEO)
check_args = base.check_max_sequence_length
call_kwargs = base.call_kwargs
image_vae = base.image_vae
text_inputs = base.masked_text_inputs
load_adapter_lines = base.load_adapter_lines


def add_args(parser):
    base.add_max_sequence_length(parser.add_argument_group("LTX-Video"),
                                 "T5 tokens per prompt (default: the pipeline's, 128)")


prompt_settings = base.call_length_settings  # the pipeline's 128 tokens by default


def prompt_dependencies(pipe, settings):
    return [encode_prompts, pipe.tokenizer, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(prompt_embeds, prompt_attention_mask)`` of ``pipe.encode_prompt``, one row per prompt (no negative prompt:
    that is validation's)."""
    return pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=device, **settings)[:2]


def normalized_latents(pipe, latents):
    """The video's VAE latents ``(B, C, frames, h, w)`` as the transformer reads them, before packing: the
    pipeline's ``_normalize_latents`` with the VAE's mean, std and scaling factor (which it undoes before
    decoding)."""
    vae = pipe.vae
    return pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def rope_interpolation_scale(pipe, frame_rate, batch_size, device):
    """``rope_interpolation_scale`` for a batch of clips of ``frame_rate`` frames a second (a list, one per sample,
    None where unknown: the native rate), as the pipeline makes it for its one ``frame_rate``: the time scale a
    ``(B, 1, 1, 1, 1)`` tensor, one per sample, which the transformer's rotary grid broadcasts."""
    rates = frame_rate if frame_rate is not None else [None] * batch_size
    scales = [pipe.vae_temporal_compression_ratio / (rate or VIDEO.fps) for rate in rates]
    temporal = torch.tensor(scales, dtype=torch.float32, device=device).view(-1, 1, 1, 1, 1)
    return temporal, pipe.vae_spatial_compression_ratio, pipe.vae_spatial_compression_ratio


def model_inputs(pipe, noisy_latents, timesteps, text, frame_rate=None):
    """All the transformer's inputs for `normalized_latents` ``(B, C, frames, h, w)`` at ``timesteps``, as the
    sampling loop passes them: the latents packed into tokens, their frames, height and width, the timesteps (per
    sample, or per token), and the rotary scale of each sample's frame rate."""
    batch_size, _, frames, height, width = noisy_latents.shape
    patch, patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
    return {"hidden_states": pipe._pack_latents(noisy_latents, patch, patch_t), "timestep": timesteps,
            "num_frames": frames, "height": height, "width": width,
            "rope_interpolation_scale": rope_interpolation_scale(pipe, frame_rate, batch_size, noisy_latents.device),
            **text}


def prediction(pipe, output, latents):
    """The transformer's output tokens, the velocity, in the layout of the latents ``latents`` (the pipeline's
    ``_unpack_latents``)."""
    frames, height, width = latents.shape[2:]
    return pipe._unpack_latents(output, frames, height, width, pipe.transformer_spatial_patch_size,
                                pipe.transformer_temporal_patch_size)


def training_noise_scheduler(pipe):
    """The flow-matching scheduler of the pipeline's configuration, whose schedule `sample_denoiser_timesteps`
    shifts as the pipeline's sampler does."""
    return FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)


def sampler_schedule(noise_scheduler, tokens):
    """The levels the pipeline's sampler visits for ``tokens`` latent tokens in as many steps as the training
    schedule has: its ``set_timesteps`` on ``linspace(1, 1/N, N)`` with the ``mu`` of ``calculate_shift`` (a
    configuration without ``use_dynamic_shifting`` shifts by its fixed ``shift``), the terminal stretch included."""
    config = noise_scheduler.config
    count = config.num_train_timesteps
    mu = calculate_shift(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                         config.get("base_shift", 0.5), config.get("max_shift", 1.15))
    schedule = FlowMatchEulerDiscreteScheduler.from_config(config)
    schedule.set_timesteps(sigmas=np.linspace(1.0, 1 / count, count), mu=mu)
    return schedule


trained_denoisers = base.only_transformer


step_denoiser = base.only_denoiser


def sample_denoiser_timesteps(pipe, noise_scheduler, args, latents, denoiser):
    """``(timesteps, sigmas)`` for `normalized_latents` ``latents``: levels of the sampler's schedule for their
    number of tokens (`sampler_schedule`), drawn with ``--weighting_scheme``'s density
    (`flow_matching.sample_flow_matching_timesteps`); the timestep is the shifted level, as the transformer reads
    it in the pipeline's loop."""
    patch, patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
    frames, height, width = latents.shape[2:]
    tokens = (frames // patch_t) * (height // patch) * (width // patch)
    return sample_flow_matching_timesteps(sampler_schedule(noise_scheduler, tokens), args, latents)


def clips_with_frames_to_learn(clips):
    """The clips of an image-to-video run that have a latent frame past the first: a one-frame clip (a still) is
    all conditioning, its first frame's clean latents, with no frame to learn; those are left out, with a
    warning."""
    kept = [clip for clip in clips if (len(clip.indices) - 1) // VIDEO.temporal > 0]
    if len(kept) < len(clips):
        logger.warning(f"left out {len(clips) - len(kept)} one-frame clips (still images): in LTX-Video's "
                       "image-to-video the first frame is the conditioning, so they have no frame to learn")
    return kept


def image_to_video_conditioning(pipe, first_frames):
    """The first frames' latents (``(B, C, 1, h, w)``) for a batch's first frames (``(B, 3, H, W)`` in [-1, 1]),
    exactly as ``LTXImageToVideoPipeline.prepare_latents`` makes them for its image: each frame encoded alone as a
    one-frame clip, a draw of the VAE's distribution (from the global RNG), normalised with the VAE's mean and std
    (without its scaling factor, as the pipeline)."""
    vae = pipe.vae
    with torch.no_grad():
        latents = torch.cat([vae.encode(frame[None, :, None].to(vae.dtype)).latent_dist.sample()
                             for frame in first_frames])
    return pipe._normalize_latents(latents.float(), vae.latents_mean, vae.latents_std)


def image_to_video_inputs(pipe, noisy_latents, timesteps, text, first_latents, frame_rate=None):
    """The transformer's inputs for image-to-video, as ``LTXImageToVideoPipeline``'s loop passes them: the first
    latent frame replaced by the image's latents (`image_to_video_conditioning`), and a timestep per token, the
    sample's on every token but the first frame's, which are clean (0: its conditioning mask)."""
    latents = torch.cat([first_latents.to(noisy_latents.dtype), noisy_latents[:, :, 1:]], dim=2)
    mask = torch.zeros(latents[:, :1].shape, device=latents.device)
    mask[:, :, 0] = 1.0
    patch, patch_t = pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size
    mask = pipe._pack_latents(mask, patch, patch_t).squeeze(-1)
    per_token = timesteps.float()[:, None] * (1 - mask)
    return model_inputs(pipe, latents, per_token, text, frame_rate)
