"""LTX-2 (`LTX2Pipeline`): its conditioning and latent layout for training the video stream, taken from the pipeline
itself. The audio stream is not trained.

The LTX-2 transformer denoises a video and an audio stream side by side, and reads:

- ``encoder_hidden_states``, ``audio_encoder_hidden_states``, ``encoder_attention_mask``: what the pipeline makes of
  the prompt (`encode_prompts`): its ``encode_prompt`` (every hidden state of the Gemma 3 text encoder, left-padded
  to ``max_sequence_length``, the pipeline's ``__call__`` default, 1024, unless ``--max_sequence_length`` says
  otherwise, and then in every render too) run through its text ``connectors``, which give the video stream's and
  the audio stream's embeddings and the mask the pipeline passes both streams; the connectors are frozen, so a
  prompt's three parts are computed once;
- ``hidden_states``: the video's VAE latents ``(B, C, frames, H, W)`` normalised with the VAE's ``latents_mean``,
  ``latents_std`` and ``scaling_factor`` (`normalized_latents`, the pipeline's ``_normalize_latents``) and packed
  into one token per latent pixel (`model_inputs`, its ``_pack_latents``);
- ``video_coords``: each token's position for the rotary embedding, whose time axis is in seconds: the pipeline's
  ``prepare_video_coords`` at the clip's own ``frame_rate`` (its sampled frames a second; the native rate, 24, for a
  still image);
- ``timestep`` and ``sigma``: the scheduler's timestep, one per sample, both as the pipeline passes them.

It predicts the velocity in tokens, unpacked into the latents' layout (`prediction`). Training draws its noise levels
from the training scheduler's own schedule (`flow_matching`), which LTX-2's configuration (``use_dynamic_shifting``)
leaves unshifted; the pipeline's sampler shifts its levels for the video's length in tokens, points of the same path.

The audio stream: the transformer always runs one, and its audio-to-video cross-attention lets the video read it. A
video-only clip has no audio latents, so the video stream trains alone (`model_inputs`: ``isolate_modalities``, which
turns off both cross-modal attentions, as Lightricks' own trainer trains video without audio and as the pipeline's
modality guidance runs the transformer), beside a one-token silent audio stream whose output is dropped.
"""

import json
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from . import base
from ..errors import require
from ..flow_matching import sample_flow_matching_timesteps
from ..pipeline import training_noise_scheduler as scheduler_from_pipeline
from .base import VideoGeometry, stacked
from .layout import Family

FAMILY = Family("ltx2", "LTX-2", ("LTX2Pipeline",), "transformer")
# The component that denoises, quantised with --quantize_base.
DENOISERS = ("transformer",)
# AutoencoderKLLTX2Video: 32× in space (4×4 patches and three halvings), 8× in time; the transformer's 1×1×1 patches
# (``LTX2Pipeline.check_inputs`` asks sides of multiples of 32); 24 frames a second (the ``__call__``'s
# ``frame_rate``); frames as PIL images (its ``output_type``).
VIDEO = VideoGeometry(spatial=32, temporal=8, size_multiple=32, fps=24, output_type="pil")
video_geometry = base.fixed_geometry(VIDEO)
AUDIO_NOT_TRAINED = "LTX-2: the video stream trains; the audio stream is not trained (the clips' audio is not read)"
call_kwargs = base.call_kwargs
image_vae = base.image_vae


# The frames the pipeline renders when its ``num_frames`` is None, as it is by default, and it has no duration head
# (LTX-2.0, 2.3): the clips' length by default (`data.video.add_video_args`' ``num_frames``).
NUM_FRAMES = 121


def add_args(parser):
    """``--max_sequence_length``."""
    group = parser.add_argument_group("LTX-2")
    base.add_max_sequence_length(group, "tokens per prompt (default: the pipeline's, 1024), a multiple of the text "
                                        "connectors' learnable registers")


def check_args(args):
    """Fail in one line on a bad setting, before any weights load: a ``--max_sequence_length`` that the text
    connectors of a local ``--pretrained_model_name_or_path`` cannot take (they replace the padding with their
    learnable registers, repeated: a prompt's length is a multiple of their count)."""
    base.check_max_sequence_length(args)
    config = Path(args.pretrained_model_name_or_path) / "connectors" / "config.json"
    if args.max_sequence_length is None or not config.is_file():
        return
    registers = json.loads(config.read_text()).get("video_connector_num_learnable_registers")
    require(not registers or args.max_sequence_length % registers == 0, "--max_sequence_length",
            args.max_sequence_length, f"a multiple of {registers} (the text connectors' learnable registers)")


prompt_settings = base.call_length_settings  # the pipeline's 1024 tokens by default


def prompt_dependencies(pipe, settings):
    return [encode_prompts, pipe.tokenizer, settings]


def text_encoders(pipe):
    """The frozen modules that embed a prompt: the Gemma 3 text encoder, then the text connectors."""
    return [pipe.text_encoder, pipe.connectors]


def encode_prompts(pipe, prompts, device, settings):
    """``(video embeddings, audio embeddings, attention mask)``, one row per prompt: ``pipe.encode_prompt`` (no
    negative prompt: that is validation's) through ``pipe.connectors``, as the pipeline's ``__call__`` runs them."""
    embeds, mask = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=device, **settings)[:2]
    return pipe.connectors(embeds, mask, padding_side=pipe.tokenizer.padding_side)


def text_inputs(rows):
    mask = stacked(rows, 2)
    return {"encoder_hidden_states": stacked(rows, 0), "audio_encoder_hidden_states": stacked(rows, 1),
            "encoder_attention_mask": mask, "audio_encoder_attention_mask": mask}


def normalized_latents(pipe, latents):
    """The video's latents ``(B, C, frames, H, W)`` as the transformer reads them (the pipeline's
    ``_normalize_latents``; sampling undoes it before decoding)."""
    vae = pipe.vae
    return pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def model_inputs(pipe, noisy_latents, timesteps, text, frame_rate=None):
    """All the transformer's inputs at ``timesteps`` as the sampling loop passes them, for the video stream alone:
    the packed latents, their positions at each clip's ``frame_rate`` (the native rate where it is unknown), and a
    silent one-token audio stream that the video, its cross-modal attention off, never reads."""
    transformer = pipe.transformer
    batch_size, _, frames, height, width = noisy_latents.shape
    device = noisy_latents.device
    rates = frame_rate if frame_rate is not None else [None] * batch_size
    video_coords = torch.cat([transformer.rope.prepare_video_coords(1, frames, height, width, device,
                                                                    fps=float(rate or VIDEO.fps))
                              for rate in rates])
    audio = torch.zeros(batch_size, 1, transformer.config.audio_in_channels, device=device, dtype=noisy_latents.dtype)
    hidden_states = pipe._pack_latents(noisy_latents, pipe.transformer_spatial_patch_size,
                                       pipe.transformer_temporal_patch_size)
    return {"hidden_states": hidden_states, "audio_hidden_states": audio, "timestep": timesteps, "sigma": timesteps,
            "num_frames": frames, "height": height, "width": width, "audio_num_frames": 1,
            "video_coords": video_coords,
            "audio_coords": transformer.audio_rope.prepare_audio_coords(batch_size, 1, device),
            "isolate_modalities": True, "use_cross_timestep": True, **text}


def prediction(pipe, output, latents):
    """The transformer's video tokens in the layout of the latents ``latents``: the velocity it predicts."""
    frames, height, width = latents.shape[2:]
    return pipe._unpack_latents(output, frames, height, width, pipe.transformer_spatial_patch_size,
                                pipe.transformer_temporal_patch_size)


def training_noise_scheduler(pipe):
    """Flow matching on the pipeline's scheduler configuration, over its 1000 training timesteps (unshifted: the
    configuration shifts at sampling, by the video's length)."""
    return scheduler_from_pipeline(pipe, FlowMatchEulerDiscreteScheduler)


trained_denoisers = base.only_transformer


step_denoiser = base.only_denoiser


def sample_denoiser_timesteps(pipe, noise_scheduler, args, latents, denoiser):
    """``(timesteps, sigmas)`` as `flow_matching.sample_flow_matching_timesteps` draws them: the one transformer
    takes every noise level."""
    return sample_flow_matching_timesteps(noise_scheduler, args, latents)


load_adapter_lines = base.load_adapter_lines
