"""Tiny Stable Diffusion 1.x: the pipeline, and a ControlNet made from its UNet."""

from .parts import sd_components, sd_inference_scheduler, tiny_unet


def build_sd(path):
    """A Stable Diffusion 1.x pipeline: UNet, VAE, CLIP text encoder and tokenizer, PNDM scheduler."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(unet=tiny_unet(), scheduler=sd_inference_scheduler(), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False, **sd_components())
    pipe.save_pretrained(path)


def build_controlnet(path):
    """A ControlNet initialised from the tiny UNet; its conditioning embedding halves the
    resolution, as the tiny VAE does (real ones divide by 8 with four embedding blocks)."""
    from diffusers import ControlNetModel

    ControlNetModel.from_unet(tiny_unet(), conditioning_embedding_out_channels=(16, 32)).save_pretrained(path)


FIXTURES = {"sd": build_sd, "controlnet": build_controlnet}
