"""A tiny unconditional DDPM: the pixel-space UNet's config that ``train_unconditional.py`` builds a fresh model from
(``--model_config_name_or_path``, as upstream's ``diffusers/ddpm_dummy``), a pipeline of it to start from, and an
image-class dataset of 6 pictures (as upstream's ``hf-internal-testing/dummy_image_class_data``)."""

import random
from pathlib import Path

from .data import SEED, draw_shape

# Two resolutions (16 px down to 8), attention at the lower one, as upstream's default config has it at its lower ones.
TINY_DDPM_UNET = {"sample_size": 16, "in_channels": 3, "out_channels": 3, "layers_per_block": 1,
                  "block_out_channels": (8, 16), "norm_num_groups": 4, "attention_head_dim": 8,
                  "down_block_types": ("DownBlock2D", "AttnDownBlock2D"),
                  "up_block_types": ("AttnUpBlock2D", "UpBlock2D")}


def build_ddpm_unet_config(path):
    """A folder holding a tiny ``UNet2DModel``'s ``config.json`` alone (no weights): what ``UNet2DModel.load_config``
    reads."""
    from diffusers import UNet2DModel

    UNet2DModel.from_config(TINY_DDPM_UNET).save_config(path)


def build_ddpm(path):
    """A ``DDPMPipeline`` of the tiny UNet (random weights, seed 0) and a 1000-step linear ``DDPMScheduler``."""
    import torch
    from diffusers import DDPMPipeline, DDPMScheduler, UNet2DModel

    torch.manual_seed(0)
    DDPMPipeline(UNet2DModel.from_config(TINY_DDPM_UNET), DDPMScheduler()).save_pretrained(path)


def build_shapes_class(path, per_class=3):
    """An imagefolder of class subfolders without captions (``image`` and ``label`` columns): ``per_class`` pictures
    of a red circle in ``circle/`` and of a blue square in ``square/``, 64 px."""
    rng = random.Random(SEED)
    for shape, color in (("circle", "red"), ("square", "blue")):
        folder = Path(path) / shape
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            draw_shape(shape, color, "white", rng=rng)[0].save(folder / f"{index:04d}.png")


FIXTURES = {"ddpm_unet_config": build_ddpm_unet_config, "ddpm": build_ddpm, "shapes_class": build_shapes_class}
