"""Stable Diffusion 1.x (and 2.x): its conditioning and latent layout for training, as ``StableDiffusionPipeline``
computes them, and its LoRA layout for the UI tools.

The UNet reads the noisy latents (the VAE's, times its ``scaling_factor``: `normalized_latents`), the timestep, and
``encoder_hidden_states``: the CLIP text encoder's last hidden states for the prompt padded to the tokenizer's
length (`encode_prompts`). It predicts the noise or the velocity as the scheduler's ``prediction_type`` says, in the
latents' layout (`prediction`). Its LoRA files for the UI tools are kohya's (``lora_unet_…``, ``lora_te_…``).
"""

from . import base
from .base import stacked, tokenize
from .layout import Family

FAMILY = Family("sd", "SD 1.x", ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline",
                                 "StableDiffusionInpaintPipeline", "StableDiffusionControlNetPipeline"),
                "unet", {"text_encoder": "lora_te"})
# The UNet reads the VAE's latents scaled, and its output is the noise or the velocity in their own layout.
call_kwargs = base.call_kwargs
image_vae = base.image_vae
normalized_latents = base.scaled_latents
prediction = base.output_as_is


def prompt_settings(pipe, args):
    """How prompts are encoded: as the pipeline does, with nothing to set."""
    return {}


def prompt_dependencies(pipe, settings):
    """What the prompts' embeddings depend on besides the text encoder's weights, for the disk cache's key: the
    encoding code and the tokenizer."""
    return [encode_prompts, pipe.tokenizer]


def encode_prompts(pipe, prompts, device, settings, text_encoders=None):
    """``(prompt_embeds,)``, one row per prompt. ``text_encoders`` (by component name) replace the pipeline's: the
    wrapped module when it trains."""
    text_encoder = (text_encoders or {}).get("text_encoder", pipe.text_encoder)
    return (text_encoder(tokenize(pipe.tokenizer, prompts).to(device), return_dict=False)[0],)


def text_inputs(rows):
    """The UNet's text input for a batch whose samples have the `encode_prompts` rows ``rows``."""
    return {"encoder_hidden_states": stacked(rows, 0)}


def model_inputs(pipe, noisy_latents, timesteps, text):
    """The UNet's inputs: the noisy latents, the timesteps and the `text_inputs` ``text``."""
    return {"sample": noisy_latents, "timestep": timesteps, **text}
