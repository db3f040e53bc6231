"""Tiny Stable Diffusion 1.x: the pipeline, a ControlNet made from its UNet, and the pretrained pipeline."""

import shutil
from pathlib import Path

from .parts import sd_components, sd_inference_scheduler, tiny_unet

# The committed weights of a tiny SD 1.x that draws the shapes (made by `pretrain`).
PRETRAINED = Path(__file__).with_name("pretrained") / "sd"


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


def build_sd_pretrained(path):
    """The pretrained pipeline, whose VAE reconstructs the shapes and whose UNet draws them (`pretrain`): its
    committed weights (`PRETRAINED`) copied to ``path``."""
    shutil.copytree(PRETRAINED, path, dirs_exist_ok=True)


FIXTURES = {"sd": build_sd, "controlnet": build_controlnet, "sd_pretrained": build_sd_pretrained}
