"""CogVideoX (1.0 and 1.5): its conditioning, latent layout and loss for training, taken from the pipelines themselves
(`CogVideoXPipeline`, `CogVideoXImageToVideoPipeline`) and from upstream's training scripts.

The CogVideoX transformer reads:

- ``encoder_hidden_states``: what ``pipe.encode_prompt`` returns for the prompt (`encode_prompts`): T5's last hidden
  states, 226 tokens (the pipeline's ``__call__`` default, the transformer's ``max_text_seq_length``);
- ``hidden_states``: the video's VAE latents laid out ``(B, frames, C, H, W)`` and times the VAE's
  ``scaling_factor`` (`normalized_latents`; sampling divides by it before decoding); CogVideoX 1.5 (``patch_size_t``
  2) reads whole pairs of latent frames, and a clip with an odd count has its first latent frame repeated in front,
  where the pipeline puts the extra frame it drops after sampling; for image-to-video the first frame's latents,
  followed by zeros, beside them on the channels (`image_to_video_conditioning`);
- ``timestep``: the scheduler's integer timestep, one per sample, and ``image_rotary_emb``, the rotary embeddings the
  pipeline computes for the latents' grid (its ``_prepare_rotary_positional_embeddings``, where the transformer uses
  them), and 1.5 I2V's ``ofs`` (`model_inputs`).

It predicts the velocity ``v`` on a DDPM schedule with zero terminal SNR (``CogVideoXDDIMScheduler`` or
``CogVideoXDPMScheduler``, ``prediction_type="v_prediction"``; `training_noise_scheduler`). Upstream's scripts train
it on the clean latents that ``v`` implies, weighted by ``1 / (1 - alphas_cumprod[t])`` (the scripts spell that out),
at timesteps drawn uniformly (`sample_denoiser_timesteps`). One transformer denoises every timestep: these are the
video protocol's (`protocol.VideoFamily`) in their simplest form.
"""

import argparse
import inspect
import json
from pathlib import Path

import torch
from diffusers import CogVideoXDPMScheduler

from . import base
from ..errors import require
from .base import VideoGeometry
from .layout import Family

# ComfyUI has no CogVideoX model of its own (its wrappers load diffusers' files): diffusers' layout only.
FAMILY = Family("cogvideox", "CogVideoX", ("CogVideoXPipeline", "CogVideoXImageToVideoPipeline"), "transformer")
DENOISERS = ("transformer",)
# A VAE of 8× in space and 4× in time, 2×2 patches (sides of multiples of 16; 1.5 also pairs latent frames, which
# `normalized_latents` handles), 8 frames a second (CogVideoX 1.0, the pipelines' examples and upstream's --fps;
# 1.5 renders at 16), frames as PIL images (the pipelines' default).
VIDEO = VideoGeometry(spatial=8, temporal=4, size_multiple=16, fps=8, output_type="pil")
video_geometry = base.fixed_geometry(VIDEO)
# Upstream's image-to-video noise augmentation of the first frame: sigma = exp(N(mean, std)).
IMAGE_NOISE_LOG_SIGMA = (-3.0, 0.5)
call_kwargs = base.call_kwargs
image_vae = base.image_vae
prediction = base.output_as_is  # the velocity, in the latents' (B, frames, C, H, W) layout


def add_args(parser):
    """The family's flags: upstream's validation flags, each under its name there, and ``--use_dynamic_cfg``."""
    group = parser.add_argument_group("CogVideoX")
    group.add_argument("--use_dynamic_cfg", action="store_true",
                       help="validation renders with the pipeline's cosine dynamic guidance schedule")
    group.add_argument("--validation_prompt_separator", default=":::",
                       help="what splits each --validation_prompt into several (upstream's one string of prompts)")
    # Upstream's names for shared flags: their defaults stay the shared ones.
    for flag, dest, kind in (("--guidance_scale", "validation_guidance_scale", float),
                             ("--num_validation_videos", "num_validation_images", int),
                             ("--fps", "validation_fps", int), ("--tracker_name", "tracker_project_name", str)):
        group.add_argument(flag, dest=dest, type=kind, default=argparse.SUPPRESS, help=f"upstream's --{dest}")
    group.add_argument("--enable_tiling", dest="enable_vae_tiling", action="store_true", default=argparse.SUPPRESS,
                       help="upstream's --enable_vae_tiling")
    group.add_argument("--enable_slicing", action="store_true",
                       help="the VAE decodes a batch's videos one at a time in validation")


def check_args(args):
    """Fail in one line on a validation length the pipeline does not render (`renders`), before anything loads, and
    split each ``--validation_prompt`` (and ``--validation_image``, where the script has it) at
    ``--validation_prompt_separator``, as upstream reads its one string of prompts."""
    require(args.validation_prompt_separator, "--validation_prompt_separator", args.validation_prompt_separator,
            "a non-empty string")
    frames = args.validation_num_frames or args.num_frames
    flag = "--validation_num_frames" if args.validation_num_frames else "--num_frames"
    require(not args.validation_prompt or renders(frames), flag, frames,
            "a length the pipeline renders, 8k+1 (1, 9, 17, ..., 49): its VAE decodes an even count of latent "
            "frames to 4 frames each (5 frames render as 8); --validation_num_frames sets it apart from training's")
    for name in ("validation_prompt", "validation_image"):
        values = getattr(args, name, None)
        if values:
            setattr(args, name, [part.strip() for value in values
                                 for part in value.split(args.validation_prompt_separator) if part.strip()])


def renders(frames):
    """Whether the pipelines render ``frames`` frames as asked: the VAE decodes an odd count of latent frames
    (``(frames - 1) / 4 + 1``) to ``frames``, an even count to 4 each (1.5's pipelines sample an extra latent frame
    where the count is odd, and drop it before decoding)."""
    return (frames - 1) % (2 * VIDEO.temporal) == 0


def prompt_settings(pipe, args):
    """What ``pipe.encode_prompt`` runs with everywhere: the ``max_sequence_length`` the pipeline's ``__call__``
    passes it (226, the transformer's text length)."""
    return {"max_sequence_length": inspect.signature(pipe.__call__).parameters["max_sequence_length"].default}


def prompt_dependencies(pipe, settings):
    return [encode_prompts, pipe.tokenizer, settings]


encode_prompts = base.prompt_embeds


text_inputs = base.embeds_text_inputs


def padded_to_patches(pipe, latents):
    """``latents`` ``(B, frames, ...)`` with as many copies of the first frame in front as make the frames whole
    patches of ``patch_size_t`` (CogVideoX 1.5; 1.0 takes any count)."""
    patch_frames = pipe.transformer.config.patch_size_t
    missing = (-latents.shape[1]) % patch_frames if patch_frames else 0
    return torch.cat([latents[:, :1].expand(-1, missing, -1, -1, -1), latents], dim=1) if missing else latents


def normalized_latents(pipe, latents):
    """The VAE's latents ``(B, C, frames, H, W)`` as the transformer reads them: ``(B, frames, C, H, W)``, times
    the ``scaling_factor``, padded to whole temporal patches (`padded_to_patches`)."""
    return padded_to_patches(pipe, latents.permute(0, 2, 1, 3, 4) * pipe.vae_scaling_factor_image)


def model_inputs(pipe, noisy_latents, timesteps, text, frame_rate=None):
    """All the transformer's inputs at ``timesteps`` as the sampling loop passes them: the latents, the timesteps,
    the rotary embeddings of the latents' grid (computed by the pipeline's own method, from the size in pixels and
    the latent frames) and 1.5 I2V's ``ofs`` of 2. CogVideoX does not condition on the clips' ``frame_rate``."""
    config = pipe.transformer.config
    frames, height, width = noisy_latents.shape[1], *noisy_latents.shape[-2:]
    scale = pipe.vae_scale_factor_spatial
    rotary = pipe._prepare_rotary_positional_embeddings(height * scale, width * scale, frames, noisy_latents.device) \
        if config.use_rotary_positional_embeddings else None
    ofs = None if config.ofs_embed_dim is None else noisy_latents.new_full((1,), 2.0)
    return {"hidden_states": noisy_latents, "timestep": timesteps, "image_rotary_emb": rotary, "ofs": ofs, **text}


def training_noise_scheduler(pipe):
    """The pipeline's noise schedule (upstream trains with ``CogVideoXDPMScheduler`` of the pipeline's scheduler
    configuration): its ``alphas_cumprod`` add the noise and turn the velocity into clean latents."""
    return CogVideoXDPMScheduler.from_config(pipe.scheduler.config)


trained_denoisers = base.only_transformer


step_denoiser = base.only_denoiser


def sample_denoiser_timesteps(pipe, noise_scheduler, args, latents, denoiser):
    """``(timesteps, None)``: integer timesteps drawn uniformly from the schedule, one per sample, as upstream draws
    them (the scheduler adds the noise: there are no sigmas)."""
    count = noise_scheduler.config.num_train_timesteps
    return torch.randint(0, count, (latents.shape[0],), device=latents.device), None


load_adapter_lines = base.load_adapter_lines


IMAGE_TO_VIDEO = ("an image-to-video pipeline (CogVideoXImageToVideoPipeline) whose transformer takes the noisy "
                  "latents and the first frame's latents on the channels (CogVideoX-5b-I2V, CogVideoX1.5-5B-I2V)")


def takes_first_frame(config):
    """Whether a transformer of ``config`` reads the first frame's latents beside the noisy latents."""
    return config.get("in_channels") == 2 * config.get("out_channels", 0)


def check_image_to_video_model(args):
    """Stop in one line, before any weights load, if a local ``--pretrained_model_name_or_path`` is no image-to-video
    model (read from its ``model_index.json`` and ``transformer/config.json``)."""
    folder = Path(args.pretrained_model_name_or_path)
    if not (folder / "model_index.json").is_file() or not (folder / "transformer" / "config.json").is_file():
        return
    index = json.loads((folder / "model_index.json").read_text())
    config = json.loads((folder / "transformer" / "config.json").read_text())
    require(index.get("_class_name") == "CogVideoXImageToVideoPipeline" and takes_first_frame(config),
            "--pretrained_model_name_or_path", args.pretrained_model_name_or_path,
            f"{IMAGE_TO_VIDEO} (it is a {index.get('_class_name')} whose transformer takes "
            f"{config.get('in_channels')} channels; a text-to-video model trains with train_cogvideox_lora.py)")


def check_image_to_video(pipe):
    """Stop in one line on a pipeline whose transformer does not read the first frame's latents (a hub name that
    `check_image_to_video_model` could not read before loading)."""
    require(takes_first_frame(pipe.transformer.config), "--pretrained_model_name_or_path", pipe.name_or_path,
            f"{IMAGE_TO_VIDEO} (its transformer takes {pipe.transformer.config.in_channels} channels)")


def image_to_video_conditioning(pipe, first_frames, latents, dropout=0.0):
    """The first frame's latents beside the transformer's ``latents`` ``(B, frames, C, H, W)``, for a batch's first
    frames (``(B, 3, H, W)`` in [-1, 1]), as upstream's script makes them: each frame noised with a sigma of
    ``exp(N(-3, 0.5))``, encoded (a sample of the VAE's distribution) and scaled as the pipeline's
    ``prepare_latents`` scales its image (``invert_scale_latents``: divided), followed by zeros, placed where the
    pipeline places its image (the first latent frame, the padding of 1.5's pairs included), and with probability
    ``dropout`` (``--noised_image_dropout``) all zeros."""
    frames = first_frames[:, :, None].to(pipe.vae.dtype)  # (B, 3, 1, H, W)
    sigmas = torch.exp(torch.normal(*IMAGE_NOISE_LOG_SIGMA, size=(frames.shape[0], 1, 1, 1, 1))).to(frames)
    with torch.no_grad():
        encoded = pipe.vae.encode(frames + torch.randn_like(frames) * sigmas).latent_dist.sample()
    scale = pipe.vae_scaling_factor_image
    image_latents = encoded.permute(0, 2, 1, 3, 4).to(latents.dtype)
    image_latents = image_latents / scale if pipe.vae.config.invert_scale_latents else image_latents * scale
    condition = torch.cat([image_latents, image_latents.new_zeros(
        (latents.shape[0], latents.shape[1] - 1, *latents.shape[2:]))], dim=1)
    kept = (torch.rand(latents.shape[0]) >= dropout).to(condition)
    return {"image_latents": condition * kept.view(-1, 1, 1, 1, 1)}


def image_to_video_inputs(pipe, noisy_latents, timesteps, text, conditioning, frame_rate=None):
    """The transformer's inputs for image-to-video: the noisy latents with the first frame's latents beside them on
    the channels, as the pipeline's loop passes them."""
    hidden_states = torch.cat([noisy_latents, conditioning["image_latents"].to(noisy_latents.dtype)], dim=2)
    return model_inputs(pipe, hidden_states, timesteps, text, frame_rate)
