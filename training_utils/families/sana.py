"""SANA: its conditioning and latent layout for training, taken from the pipeline itself (`SanaPipeline`). ComfyUI has
no SANA model (its loaders know no SANA checkpoint), so SANA LoRAs have no ComfyUI layout here.

The SANA transformer reads:

- ``encoder_hidden_states`` and ``encoder_attention_mask``: what ``pipe.encode_prompt`` returns, the Gemma 2 text
  encoder's last hidden states for the lower-cased prompt behind the pipeline's complex human instruction (its
  "enhance this prompt" preamble), padded to the instruction's tokens plus ``--max_sequence_length``, of which the
  first token and the last ``max_sequence_length - 1`` are kept, with their attention mask. The instruction and the
  length are those the pipeline's call samples with unless ``--complex_human_instruction`` and
  ``--max_sequence_length`` say otherwise (`prompt_settings`), and the same go to every render;
- ``hidden_states``: the DC-AE's latents (a deterministic encoder: `image_vae` gives them as a distribution of no
  spread, for the caches) times the VAE's ``scaling_factor`` (`normalized_latents`), as the pipeline divides them
  back before decoding;
- ``timestep``: the scheduler's timestep times the transformer's ``timestep_scale``, as the sampling loop scales it
  (SANA's DPM-Solver gives its timesteps rounded down to integers; training keeps the fraction of ``sigma * 1000``).

Training draws its noise levels from a flow-matching schedule shifted by the pipeline's sampler's ``flow_shift``
(`training_noise_scheduler`: SANA samples with a DPM-Solver on flow sigmas, whose configuration a flow-matching
scheduler would read unshifted). The output is the velocity; with learned sigmas (twice the latent channels) its
first half, as the pipeline takes it (`prediction`).
"""

import inspect
from types import SimpleNamespace

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from . import base
from ..errors import require
from .layout import Family

FAMILY = Family("sana", "SANA", ("SanaPipeline",), "transformer")
# The smallest log-variance a `DiagonalGaussianDistribution` keeps (it clamps below): the DC-AE's latents as a
# distribution whose samples differ from them by a standard deviation of exp(-15), about 3e-7.
NO_SPREAD = -30.0
text_inputs = base.masked_text_inputs  # every prompt is padded to the same length: rows batch as they are
normalized_latents = base.scaled_latents


def add_args(parser):
    """The prompt-encoding flags of the diffusers SANA script; unset, the pipeline's call's own defaults apply."""
    group = parser.add_argument_group("SANA")
    base.add_max_sequence_length(group, "prompt tokens the transformer reads (default: the pipeline's, 300)")
    group.add_argument("--complex_human_instruction", default=None,
                       help="the instruction written before every prompt (default: SanaPipeline's own; '' for none)")


def check_args(args):
    require(args.max_sequence_length is None or args.max_sequence_length > 1, "--max_sequence_length",
            args.max_sequence_length, "an integer above 1 (the first token and the last ones are kept)")


def prompt_settings(pipe, args):
    """What the pipeline encodes prompts with, in training, validation and class images alike:
    ``--max_sequence_length`` and ``--complex_human_instruction`` (one line; '' for none), or where unset the
    defaults of the pipeline's call (which it passes to encode_prompt)."""
    defaults = inspect.signature(type(pipe).__call__).parameters
    instruction = defaults["complex_human_instruction"].default if args.complex_human_instruction is None \
        else [args.complex_human_instruction] if args.complex_human_instruction else []
    return {"max_sequence_length": base.max_sequence_length(pipe, args, "__call__"),
            "complex_human_instruction": tuple(instruction)}


def call_kwargs(pipe, settings):
    """What every render (validation, class images) passes to the pipeline: the prompt settings, and no resolution
    binning (which would render at the nearest of the model's native sizes, not the one asked for)."""
    return {**encode_kwargs(settings), "use_resolution_binning": False}


def encode_kwargs(settings):
    return {"max_sequence_length": settings["max_sequence_length"],
            "complex_human_instruction": list(settings["complex_human_instruction"])}


def prompt_dependencies(pipe, settings):
    """What the prompts' embeddings depend on besides the text encoder's weights, for the disk cache's key: the
    encoding code, the tokenizer and the settings (the instruction among them)."""
    return [encode_prompts, pipe.tokenizer, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(prompt_embeds, prompt_attention_mask)`` of ``pipe.encode_prompt``, one row per prompt (every prompt is
    padded to the same length, so rows batch as they are)."""
    prompt_embeds, mask, _, _ = pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False, device=device,
                                                   **encode_kwargs(settings))
    return prompt_embeds, mask


def training_noise_scheduler(pipe):
    """The flow-matching scheduler that noises training latents: the pipeline's scheduler configuration, shifted by
    its ``flow_shift`` (SANA's DPM-Solver) or its own ``shift`` (a flow-matching sampler)."""
    config = pipe.scheduler.config
    return FlowMatchEulerDiscreteScheduler.from_config(config, shift=config.get("flow_shift", config.get("shift")))


class DeterministicVAE(torch.nn.Module):
    """The pipeline's DC-AE as the VAE that `frozen_encoders.FrozenEncoders` drives: ``encode(images).latent_dist`` is the
    encoder's latents as a distribution of no spread (`NO_SPREAD`). It holds the DC-AE itself: moving this moves
    it."""

    def __init__(self, vae):
        super().__init__()
        self.vae = vae
        self.config = vae.config  # what describes it for the disk cache is the VAE's configuration

    def encode(self, images):
        latents = self.vae.encode(images).latent
        distribution = DiagonalGaussianDistribution(torch.cat([latents, torch.full_like(latents, NO_SPREAD)], 1))
        return SimpleNamespace(latent_dist=distribution)


def image_vae(pipe):
    """The VAE that encodes the training images: the pipeline's DC-AE, its latents given as a distribution."""
    return DeterministicVAE(pipe.vae)


def model_inputs(pipe, noisy_latents, timesteps, text):
    """All the transformer's inputs at the scheduler's ``timesteps``, as the sampling loop passes them: the
    latents, and the timesteps times the transformer's ``timestep_scale``."""
    return {"hidden_states": noisy_latents, "timestep": timesteps * pipe.transformer.config.timestep_scale, **text}


def prediction(pipe, output, latents):
    """The velocity the transformer predicts: its output, or with learned sigmas its first half of the channels,
    as the pipeline reads it."""
    if output.shape[1] == 2 * latents.shape[1]:
        return output.chunk(2, dim=1)[0]
    return output
