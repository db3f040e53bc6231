"""Kandinsky 2.2's decoder for training, as ``KandinskyV22Pipeline`` runs it: the UNet denoises MoVQ latents (unscaled:
the pipeline decodes them as they are) conditioned on a CLIP image embedding, which in training is the prior
pipeline's image encoder's embedding of the training image itself (``added_cond_kwargs={"image_embeds": ...}``, no
text); it predicts the noise in its first 4 output channels, the learned variance in the rest. Validation renders
prompts through ``KandinskyV22CombinedPipeline`` built from the live decoder and prior components (the prior turns the
prompt into an image embedding, the decoder renders it).
"""

from types import SimpleNamespace

import torch
from diffusers import KandinskyV22CombinedPipeline, KandinskyV22PriorPipeline, StableDiffusionPipeline
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from .pipeline import from_pretrained

# The model cards' loading code: the decoder renders an image embedding, so a prompt goes through the prior first, as
# ``AutoPipelineForText2Image`` (``KandinskyV22CombinedPipeline``) of the decoder folder and the prior does it.
FINE_TUNE_HOW_TO_LOAD = """
from diffusers import AutoPipelineForText2Image, KandinskyV22PriorPipeline, {model_class}

prior = KandinskyV22PriorPipeline.from_pretrained("{prior_model}")
pipe = AutoPipelineForText2Image.from_pretrained(
    "{output_dir}", **{{f"prior_{{name}}": component for name, component in prior.components.items()}})
{swap_in_ema}image = pipe("{prompt}").images[0]
"""
# The LoRA on the UNet (upstream's README calls ``pipe.unet.load_attn_procs``, which diffusers now keeps for Custom
# Diffusion only; ``load_lora_adapter`` reads the same file).
LORA_HOW_TO_LOAD = """
from diffusers import AutoPipelineForText2Image

pipe = AutoPipelineForText2Image.from_pretrained("{base_model}")
pipe.unet.load_lora_adapter("{output_dir}", weight_name="pytorch_lora_weights.safetensors", prefix="unet")
# or "{output_dir}/ema" for the EMA adapter
image = pipe("{prompt}").images[0]
"""
# The decoder UNet's attention layers that a LoRA adapts: upstream's LoRAAttnAddedKVProcessor's, the projections of
# the queries, keys, values and output and of the image tokens' added keys and values.
LORA_LAYERS = ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj"]
# KandinskyV22Pipeline has no LoRA loader: the LoRA is written by SD's, whose file (upstream's file name) holds the
# UNet's adapter under ``unet.``, which ``pipe.unet.load_lora_adapter(output_dir, prefix="unet")`` reads.
LORA_WRITER = StableDiffusionPipeline
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


def prior_steps(validation_inference_steps):
    """The prior's denoising steps when validation renders ``validation_inference_steps`` decoder steps: as many, but
    at least 2 (the prior's ``UnCLIPScheduler`` divides by one less than its step count)."""
    return max(2, validation_inference_steps)


def combined_pipeline(decoder, prior):
    """``KandinskyV22CombinedPipeline`` of the live ``decoder`` and ``prior`` pipelines' modules (no weights read):
    validation renders prompts with it."""
    pipe = KandinskyV22CombinedPipeline(
        unet=decoder.unet, scheduler=decoder.scheduler, movq=decoder.movq, prior_prior=prior.prior,
        prior_image_encoder=prior.image_encoder, prior_text_encoder=prior.text_encoder,
        prior_tokenizer=prior.tokenizer, prior_scheduler=prior.scheduler, prior_image_processor=prior.image_processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe
