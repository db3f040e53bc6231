"""Kandinsky 2.2's decoder for training, as ``KandinskyV22Pipeline`` runs it: the UNet denoises MoVQ latents (unscaled:
the pipeline decodes them as they are) conditioned on a CLIP image embedding, which in training is the prior
pipeline's image encoder's embedding of the training image itself (``added_cond_kwargs={"image_embeds": ...}``, no
text); it predicts the noise in its first 4 output channels, the learned variance in the rest. Validation renders
prompts through ``KandinskyV22CombinedPipeline`` built from the live decoder and prior components (the prior turns the
prompt into an image embedding, the decoder renders it).
"""

from types import SimpleNamespace

import torch
from diffusers import KandinskyV22CombinedPipeline, KandinskyV22PriorPipeline
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from .pipeline import from_pretrained

NO_SPREAD = -30.0  # the log-variance of a distribution whose samples are its mean (exp(-15) is 3e-7)


class MoVQLatents(torch.nn.Module):
    """The pipeline's MoVQ as the VAE that `data.frozen_encoders.FrozenEncoders` drives: ``encode(images).latent_dist``
    is the encoder's (unquantised) latents as a distribution of no spread. It holds the MoVQ: moving this moves it."""

    def __init__(self, movq):
        super().__init__()
        self.movq = movq
        self.config = movq.config  # what describes it for the disk cache is the MoVQ's configuration

    def encode(self, images):
        latents = self.movq.encode(images).latents
        distribution = DiagonalGaussianDistribution(torch.cat([latents, torch.full_like(latents, NO_SPREAD)], 1))
        return SimpleNamespace(latent_dist=distribution)


def load_prior(args, weight_dtype):
    """``KandinskyV22PriorPipeline`` from ``--pretrained_prior_model_name_or_path``, frozen, in ``weight_dtype``: its
    image encoder and processor condition the decoder, all of it renders validation prompts."""
    prior = from_pretrained(KandinskyV22PriorPipeline, args.pretrained_prior_model_name_or_path,
                            revision=args.revision, dtype=weight_dtype)
    prior.set_progress_bar_config(disable=True)
    for module in (prior.prior, prior.image_encoder, prior.text_encoder):
        module.requires_grad_(False)
    return prior


def clip_pixels(prior, image):
    """The image encoder's input for one PIL ``image``: the prior's ``CLIPImageProcessor`` on the whole image, as the
    prior pipeline embeds an image (its resize and centre crop, not the training crop)."""
    return prior.image_processor(image.convert("RGB"), return_tensors="pt").pixel_values[0]


@torch.no_grad()
def image_embeddings(prior, pixels):
    """The CLIP image embeddings of a batch of `clip_pixels`, the decoder's conditioning."""
    encoder = prior.image_encoder
    return encoder(pixels.to(encoder.device, encoder.dtype)).image_embeds


def model_inputs(noisy_latents, timesteps, image_embeds):
    """The decoder UNet's inputs, as the pipeline's sampling loop passes them: no text, the image embeddings."""
    return {"sample": noisy_latents, "timestep": timesteps, "encoder_hidden_states": None,
            "added_cond_kwargs": {"image_embeds": image_embeds}}


def prediction(output, latents):
    """The noise the UNet predicts: the first channels of its output, those the latents have (the rest are the
    learned variance)."""
    return output[:, :latents.shape[1]]


def combined_pipeline(decoder, prior):
    """``KandinskyV22CombinedPipeline`` of the live ``decoder`` and ``prior`` pipelines' modules (no weights read):
    validation renders prompts with it."""
    pipe = KandinskyV22CombinedPipeline(
        unet=decoder.unet, scheduler=decoder.scheduler, movq=decoder.movq, prior_prior=prior.prior,
        prior_image_encoder=prior.image_encoder, prior_text_encoder=prior.text_encoder,
        prior_tokenizer=prior.tokenizer, prior_scheduler=prior.scheduler, prior_image_processor=prior.image_processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe
