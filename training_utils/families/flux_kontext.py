"""FLUX.1 Kontext: FLUX.1's conditioning and latent layout (`flux`'s, the same transformer and encoders), with a
reference image's tokens after the target's, as `FluxKontextPipeline` places them; and its LoRA layout in ComfyUI.

The reference is resized to the Kontext resolution nearest its aspect ratio (`reference_size`), VAE-encoded, shifted
and scaled as the target is (`normalized_latents`), packed into 2×2 patches and given the position ids of a latent
image of its size whose first channel is 1 (the target's is 0), which tells the transformer the two apart
(`model_inputs`, given the reference). The transformer reads the target's and the reference's tokens as one
sequence, and the prediction is its first tokens, the target's (`prediction` cuts the rest off). A row without a
reference trains as FLUX.1 does, text to image. Every piece is the pipeline's own (its static helpers, its
preferred resolutions).
"""

import math
from dataclasses import dataclass

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from . import base, flux
from .layout import Family

FAMILY = Family("flux_kontext", "FLUX.1 Kontext", ("FluxKontextPipeline",), "transformer",
                flux.TEXT_ENCODER_PREFIXES, flux.COMFYUI_LAYOUT)
# FLUX.1's flags, prompts and latents.
add_args = flux.add_args
check_args = flux.check_args
prompt_settings = flux.prompt_settings
call_kwargs = flux.call_kwargs
prompt_dependencies = flux.prompt_dependencies
encode_prompts = flux.encode_prompts
text_inputs = flux.text_inputs
image_vae = flux.image_vae
normalized_latents = flux.normalized_latents
# The area of the pipeline's preferred resolutions (each about one megapixel).
PREFERRED_AREA = 1024 ** 2


def reference_size(pipe, width, height, area=PREFERRED_AREA):
    """``(width, height)`` a ``width`` × ``height`` reference is resized to: of Kontext's preferred resolutions, the
    one nearest its aspect ratio, as the pipeline chooses it (ties broken as it breaks them), scaled to ``area``
    (the preferred resolutions themselves at the pipeline's one megapixel) and floored to the multiple of the
    latents' 2×2 patches' pixels, as the pipeline floors it."""
    return _reference_size(pipe.vae_scale_factor * 2, width, height, area)


def _reference_size(multiple, width, height, area):
    _, preferred_width, preferred_height = min((abs(width / height - w / h), w, h)
                                               for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    scale = math.sqrt(area / PREFERRED_AREA)
    return (max(multiple, int(preferred_width * scale) // multiple * multiple),
            max(multiple, int(preferred_height * scale) // multiple * multiple))


@dataclass(frozen=True)
class ReferenceLayout:
    """A reference image laid out as the pipeline lays it out (`edit.References`'s ``lay_out``): resized to its
    `reference_size` at ``area`` by the pipeline's image processor (``resized``, a PIL image, which the pipeline
    keeps as it is), then CHW pixels in [-1, 1] (``__call__``). Its fields are all it depends on (the cache's key)."""

    multiple: int  # the pixels of the latents' 2×2 patches
    area: int

    def processor(self):
        return VaeImageProcessor(vae_scale_factor=self.multiple)

    def resized(self, image):
        width, height = _reference_size(self.multiple, image.width, image.height, self.area)
        return self.processor().resize(image, height, width)

    def __call__(self, image):
        image = self.resized(image)
        return self.processor().preprocess(image, image.height, image.width)[0]


def reference_layout(pipe, area=PREFERRED_AREA):
    """``(lay_out, depends_on)`` for `edit_samples.References`: the `ReferenceLayout` of ``pipe``'s references at
    ``area`` (a script's targets', ``--resolution`` squared: at 1024 the pipeline's own preferred resolutions), and
    the code it runs (its fields describe it, not its code)."""
    return ReferenceLayout(pipe.vae_scale_factor * 2, area), [_reference_size, ReferenceLayout.resized,
                                                             ReferenceLayout.__call__]


def check_reference_size(width, height):
    """Nothing to refuse: FluxKontextPipeline resizes a reference of any size to a preferred resolution (the edit
    protocol's check; FLUX.2's pipelines refuse small ones)."""


def reference_latents(pipe, parameters):
    """The `normalized_latents` of a batch's references from their VAE latent distributions' ``parameters`` (a list,
    one tensor per reference; Kontext takes at most one): the mode, as the pipeline encodes a reference
    (``sample_mode="argmax"``)."""
    return base.normalized_modes(pipe, parameters, normalized_latents)


def render_kwargs(size):
    """What a render of ``size`` (``{"height", "width"}``) passes to the pipeline so that it renders that size: the
    pipeline rescales the requested size to ``max_area`` (a megapixel by default), so the area is the size's own; the
    reference is passed already resized (`ReferenceLayout.resized`), so the pipeline keeps it as it is
    (``_auto_resize``)."""
    return {**size, "max_area": size["height"] * size["width"], "_auto_resize": False}


def model_inputs(pipe, noisy_latents, timesteps, text, references=()):
    """FLUX.1's transformer inputs (`flux.model_inputs`) with the reference's tokens after the target's, as the
    pipeline's sampling loop passes them: ``references`` are the batch's `reference_latents` (none, or one: a batch's
    samples all have a reference or none)."""
    inputs = flux.model_inputs(pipe, noisy_latents, timesteps, text)
    if not references:
        return inputs
    (reference,) = references
    batch, channels, height, width = reference.shape
    tokens = pipe._pack_latents(reference.to(noisy_latents.dtype), batch, channels, height, width)
    ids = pipe._prepare_latent_image_ids(batch, height // 2, width // 2, reference.device, inputs["img_ids"].dtype)
    ids[..., 0] = 1
    return {**inputs, "hidden_states": torch.cat([inputs["hidden_states"], tokens], dim=1),
            "img_ids": torch.cat([inputs["img_ids"], ids], dim=0)}


def prediction(pipe, output, latents):
    """The transformer's output tokens for the target (the first ones; the reference's follow) in the layout of the
    `normalized_latents` ``latents``: the velocity."""
    height, width = latents.shape[-2:]
    return flux.prediction(pipe, output[:, :height // 2 * (width // 2)], latents)
