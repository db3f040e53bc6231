"""FLUX.2 [dev]: its conditioning and latent layout for training, taken from the pipeline itself (`Flux2Pipeline`);
its LoRA layout in ComfyUI is FLUX.2 [klein]'s (`flux2`), the same transformer.

What differs from [klein] is the text encoder and the guidance embedding. The FLUX.2 transformer reads:

- ``encoder_hidden_states`` and ``txt_ids``: what ``pipe.encode_prompt`` returns, the Mistral 3 text encoder's
  hidden states at a few layers stacked on the feature axis, for the prompt as the user turn of a conversation
  whose system turn is the pipeline's system message (Mistral's chat template), padded to the prompt length; and
  their position ids. The layers and the prompt length are the pipeline's defaults (10, 20 and 30; 512) unless
  ``--text_encoder_out_layers`` and ``--max_sequence_length`` say otherwise (`prompt_settings`);
- ``guidance``: ``--guidance_scale`` for every sample, as the pipeline passes its ``guidance_scale`` to the
  guidance-distilled [dev] at every step. It is a setting of the prompts' encoding (it goes to every render too,
  validation and class images) and each prompt's row carries it, so that the transformer's conditioning is the
  rows' (`encode_prompts`, `text_inputs`);
- ``hidden_states``, ``img_ids`` and ``timestep``: as [klein]'s (`flux2.normalized_latents`, `flux2.model_inputs`):
  the VAE latents folded into 2×2 patches, standardised with the VAE's batch-norm statistics, packed into tokens,
  their position ids, and the scheduler's timestep over 1000; reference images' tokens after them, as [klein]'s.

Its output tokens are placed back into the latents' layout by their position ids (`prediction`), where the loss
compares them with the velocity. Every piece is the pipeline's own, so training feeds the transformer what the
pipeline's sampling loop feeds it at the same noise level.
"""

import torch

from . import base, flux2
from ..errors import require
from .base import stacked
from .layout import Family

FAMILY = Family("flux2_dev", "FLUX.2 [dev]", ("Flux2Pipeline",), "transformer", {}, flux2.COMFYUI_LAYOUT)
# The prompts' settings and the guidance go to every render.
call_kwargs = flux2.call_kwargs
# [klein]'s latents and transformer inputs; reference images (Flux2Pipeline's image=) are laid out, encoded and
# placed as [klein]'s pipeline does them.
image_vae = flux2.image_vae
normalized_latents = flux2.normalized_latents
model_inputs = flux2.model_inputs
check_reference_size = flux2.check_reference_size
reference_layout = flux2.reference_layout
reference_latents = flux2.reference_latents


def add_args(parser):
    """FLUX.2's prompt-encoding flags, and the guidance flag of the diffusers FLUX.2 [dev] script; unset, the
    pipeline's own defaults apply to the prompts, and upstream's default to the guidance."""
    flux2.add_args(parser)
    base.add_guidance_scale(parser.add_argument_group("FLUX.2 [dev]"),
                            "the guidance the distilled transformer is given, in training and every render "
                            "(default 3.5, upstream's)")


def check_args(args):
    """Fail in one line on a bad prompt setting or guidance, before any weights load (FLUX.2's checks, against the
    configurations)."""
    flux2.check_args(args)
    require(args.guidance_scale > 0, "--guidance_scale", args.guidance_scale, "a positive number")


def prompt_settings(pipe, args):
    """What ``pipe.encode_prompt`` runs with (``--max_sequence_length`` and ``--text_encoder_out_layers``, or where
    unset the method's own defaults), and the guidance: in training, validation and class images alike."""
    return {**flux2.prompt_settings(pipe, args), "guidance_scale": args.guidance_scale}


def prompt_dependencies(pipe, settings):
    """What the rows depend on besides the text encoder's weights, for the disk cache's key: the encoding code, the
    tokenizer, its chat template and the pipeline's system message (neither part of its vocabulary), and the
    settings (the guidance is in the rows)."""
    return [encode_prompts, pipe.tokenizer, pipe.tokenizer.chat_template, pipe.system_message, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(prompt_embeds, text_ids, guidance)``: ``pipe.encode_prompt``'s, one row per prompt, and the guidance the
    pipeline gives the transformer with each (fp32, as it makes it)."""
    prompt_embeds, text_ids = pipe.encode_prompt(prompts, device=device,
                                                 max_sequence_length=settings["max_sequence_length"],
                                                 text_encoder_out_layers=settings["text_encoder_out_layers"])
    guidance = torch.full((len(prompts),), settings["guidance_scale"], dtype=torch.float32, device=device)
    return prompt_embeds, text_ids, guidance


def text_inputs(rows):
    """The transformer's text inputs and guidance for a batch whose samples have the `encode_prompts` rows
    ``rows``."""
    return {"encoder_hidden_states": stacked(rows, 0), "txt_ids": stacked(rows, 1), "guidance": stacked(rows, 2)}


def prediction(pipe, output, latents):
    """The transformer's output tokens in the layout of the `normalized_latents` ``latents``, placed by their
    position ids: the velocity it predicts (the tokens after the target's, the references', are dropped)."""
    ids = pipe._prepare_latent_ids(latents).to(output.device)
    return pipe._unpack_latents_with_ids(output[:, :ids.shape[1]], ids)
