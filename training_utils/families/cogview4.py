"""CogView4: its conditioning and latent layout for training, taken from the pipelines themselves (`CogView4Pipeline`,
and `CogView4ControlPipeline`, whose transformer reads the conditioning image's latents beside the noisy ones).

The CogView4 transformer reads:

- ``encoder_hidden_states``: what ``pipe.encode_prompt`` returns, the GLM text encoder's second-to-last hidden states
  for the prompt's tokens (``[gMASK]<sop>`` and the prompt), padded at the front with the tokenizer's pad token to a
  multiple of 16, all of them run through the encoder (the pipeline passes it no mask). The pipeline renders one
  prompt at a time, so each prompt is encoded alone (`encode_prompts`): its row is what every render gives the
  transformer, whatever it was encoded with. A batch of equal lengths is stacked as it is, no mask: the pipeline's
  own inputs. A batch of prompts of different lengths is padded at the front, where ``encode_prompt`` pads, with
  zeros, and the transformer's ``attention_mask`` marks the real positions (upstream's script passes a mask too);
  diffusers' CogView4 attention adds that 0/1 mask to the attention scores, so the padding is damped, not excluded:
  only such batches differ from what the pipeline renders each prompt with (`text_inputs`). The prompt's length is
  the pipeline's default unless ``--max_sequence_length`` says otherwise;
- ``hidden_states``: the VAE latents times the VAE's ``scaling_factor`` (no shift: the pipelines divide by the
  factor alone before decoding, and the control pipeline encodes the conditioning image so), ``(B, 16, h, w)``;
- ``original_size``, ``target_size`` and ``crop_coords``: the image's height and width in pixels twice and
  ``(0, 0)``, the pipeline's defaults for an image rendered at its own size (`model_inputs`);
- ``timestep``: the scheduler's timestep, unshifted. CogView4's sampling loop hands the scheduler its timesteps
  ``linspace(1000, 1)`` and their sigmas ``t / 1000``, which the scheduler shifts for the image's size
  (``use_dynamic_shifting`` with the linear ``time_shift``, ``mu`` from the number of latent patches by the
  pipeline's ``calculate_shift``): the transformer reads the unshifted timestep while the latents are at the shifted
  noise level. `sample_timesteps` draws training levels so (upstream's script does the same).

It predicts flow matching's velocity ``noise - x_0``, which the scheduler steps with as it is (`prediction`).
"""

import torch
from diffusers import AutoencoderKL
from diffusers.pipelines.cogview4.pipeline_cogview4 import calculate_shift

from . import base
from ..flow_matching import sample_flow_matching_timesteps
from .layout import Family

FAMILY = Family("cogview4", "CogView4", ("CogView4Pipeline", "CogView4ControlPipeline"), "transformer")
call_kwargs = base.call_kwargs
image_vae = base.image_vae
normalized_latents = base.scaled_latents
prediction = base.output_as_is


def add_args(parser):
    """The prompt-encoding flag of the diffusers CogView4 script; unset, the pipeline's own default applies."""
    base.add_max_sequence_length(parser.add_argument_group("CogView4"),
                                 "the most tokens a prompt is cut to (default: the pipeline's, 1024)")


def check_args(args):
    """Fail in one line on a bad prompt length or image size, before any weights load: the size is checked against
    the VAE's configuration, which loads without weights."""
    base.check_max_sequence_length(args)
    base.check_packed_resolution(args, AutoencoderKL, lambda config: 2 ** (len(config["block_out_channels"]) - 1),
                                 "a CogView4 pipeline, whose vae is an AutoencoderKL")


def prompt_settings(pipe, args):
    """What ``pipe.encode_prompt`` runs with, in training, validation and class images alike:
    ``--max_sequence_length``, or where unset the default of the pipeline's call (which it passes on)."""
    return {"max_sequence_length": base.max_sequence_length(pipe, args, "__call__")}


def prompt_dependencies(pipe, settings):
    """What the prompts' embeddings depend on besides the text encoder's weights, for the disk cache's key: the
    encoding code, the tokenizer (its padding side and pad token among it) and the settings."""
    return [encode_prompts, pipe.tokenizer, pipe.tokenizer.padding_side, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(embeddings, lengths)``: each prompt's ``pipe.encode_prompt`` embedding, encoded alone as the pipeline
    renders it (no negative prompt: training has no classifier-free guidance), zero-padded at the front to the
    longest into one tensor ``(B, L, D)``, and each one's length ``(B,)``."""
    embeddings = [pipe.encode_prompt(prompt, do_classifier_free_guidance=False, device=device, **settings)[0][0]
                  for prompt in prompts]
    length = max(len(embedding) for embedding in embeddings)
    padded = torch.stack([torch.nn.functional.pad(embedding, (0, 0, length - len(embedding), 0))
                          for embedding in embeddings])
    return padded, torch.tensor([len(embedding) for embedding in embeddings], device=device)


def text_inputs(rows):
    """The transformer's text inputs for a batch whose samples have the `encode_prompts` rows ``rows``: each
    prompt's own embedding (its last ``length`` positions), zero-padded at the front to the batch's longest, and the
    ``attention_mask`` of the real positions, or None when every prompt has the same length (the pipeline's own
    inputs then)."""
    embeddings = [embedding[len(embedding) - int(length):] for embedding, length in rows]
    longest = max(len(embedding) for embedding in embeddings)
    padded = torch.stack([torch.nn.functional.pad(embedding, (0, 0, longest - len(embedding), 0))
                          for embedding in embeddings])
    if all(len(embedding) == longest for embedding in embeddings):
        return {"encoder_hidden_states": padded, "attention_mask": None}
    positions = torch.arange(longest, device=padded.device)
    mask = torch.stack([positions >= longest - len(embedding) for embedding in embeddings]).to(padded.dtype)
    return {"encoder_hidden_states": padded, "attention_mask": mask}


def sample_timesteps(pipe, noise_scheduler, args, latents):
    """``(timesteps, sigmas)`` for a batch of `normalized_latents` ``(B, C, h, w)``, as the sampling loop pairs them:
    a timestep of the training schedule drawn with ``--weighting_scheme``'s density
    (`flow_matching.sample_flow_matching_timesteps`), unshifted as the transformer reads it, and its sigma shifted
    for the latents' number of patches as the pipeline's scheduler shifts it (``calculate_shift`` on the scheduler
    configuration's ``base_image_seq_len``, ``base_shift`` and ``max_shift``; the scheduler's ``time_shift``).
    ``sigmas`` broadcast over the latents."""
    timesteps, sigmas = sample_flow_matching_timesteps(noise_scheduler, args, latents)
    config = noise_scheduler.config
    patches = latents.shape[-2] * latents.shape[-1] // pipe.transformer.config.patch_size ** 2
    mu = calculate_shift(patches, config.get("base_image_seq_len", 256), config.get("base_shift", 0.25),
                         config.get("max_shift", 0.75))
    return timesteps, noise_scheduler.time_shift(mu, 1.0, sigmas)


def model_inputs(pipe, noisy_latents, timesteps, text):
    """All the transformer's inputs for `normalized_latents` at the scheduler's (unshifted) ``timesteps``, as the
    pipeline's denoising loop passes them: the latents, the timesteps, and the image's size in pixels as its original
    and target size with crop coordinates ``(0, 0)``, in the prompt embeddings' dtype."""
    batch = len(noisy_latents)
    embeddings = text["encoder_hidden_states"]
    size = [side * pipe.vae_scale_factor for side in noisy_latents.shape[-2:]]
    sizes = torch.tensor([size], dtype=embeddings.dtype, device=embeddings.device).repeat(batch, 1)
    return {"hidden_states": noisy_latents, "timestep": timesteps, "original_size": sizes, "target_size": sizes,
            "crop_coords": torch.zeros_like(sizes), **text}
