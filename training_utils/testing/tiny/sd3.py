"""Tiny Stable Diffusion 3 and 3.5: an MMDiT transformer, two CLIP encoders and T5; ControlNets made from their
transformers; and the pretrained SD3 pipeline."""

import shutil
from pathlib import Path

import torch

from .parts import SEED, tiny_clip_text_encoder, tiny_clip_tokenizer, tiny_t5_encoder, tiny_t5_tokenizer, tiny_vae

# The committed weights of a tiny SD3 that draws the shapes (made by `pretrain_sd3`).
PRETRAINED = Path(__file__).with_name("pretrained") / "sd3"


# What SD3.5's transformer adds to SD3's: RMS-normalised queries and keys, and (Medium) a second attention in its
# first blocks.
SD35_TRANSFORMER = {"qk_norm": "rms_norm", "dual_attention_layers": (0,)}


def sd3_transformer(**options):
    """The tiny MMDiT transformer (two blocks); ``options`` add to its configuration (`SD35_TRANSFORMER`)."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(SEED)
    return SD3Transformer2DModel(
        sample_size=16, patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64, **options,
    )


def sd3_pipeline(vae=None, **transformer_options):
    """A Stable Diffusion 3 pipeline: an MMDiT transformer (`sd3_transformer`, with ``transformer_options``), two
    CLIP encoders with projection, a T5 encoder with a real T5 tokenizer, and the flow-matching Euler scheduler; a
    random VAE unless ``vae`` is given."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    clip_tokenizer, t5_tokenizer = tiny_clip_tokenizer(), tiny_t5_tokenizer()
    transformer = sd3_transformer(**transformer_options)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        vae=vae or tiny_vae(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609,
                            scaling_factor=1.5035),
        text_encoder=tiny_clip_text_encoder(len(clip_tokenizer), with_projection=True),
        text_encoder_2=tiny_clip_text_encoder(len(clip_tokenizer), with_projection=True, seed=SEED + 1),
        text_encoder_3=tiny_t5_encoder(len(t5_tokenizer)),
        tokenizer=clip_tokenizer,
        tokenizer_2=clip_tokenizer,
        tokenizer_3=t5_tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def build_sd3(path):
    """The random `sd3_pipeline`."""
    sd3_pipeline().save_pretrained(path)


def build_sd3_pretrained(path):
    """The pretrained pipeline, whose VAE reconstructs the shapes and whose transformer draws them (`pretrain_sd3`):
    its committed weights (`PRETRAINED`) copied to ``path``."""
    shutil.copytree(PRETRAINED, path, dirs_exist_ok=True)


def build_sd35(path):
    """The random `sd3_pipeline` with SD3.5's transformer (`SD35_TRANSFORMER`)."""
    sd3_pipeline(**SD35_TRANSFORMER).save_pretrained(path)


def build_controlnet(path, **transformer_options):
    """An SD3ControlNetModel made from the tiny transformer's first block, as upstream's SD3 ControlNet script makes
    one (without extra conditioning channels)."""
    from diffusers import SD3ControlNetModel

    SD3ControlNetModel.from_transformer(sd3_transformer(**transformer_options), num_layers=1,
                                        num_extra_conditioning_channels=0).save_pretrained(path)


def build_sd35_controlnet(path):
    """`build_controlnet` for the tiny SD3.5."""
    build_controlnet(path, **SD35_TRANSFORMER)


FIXTURES = {"sd3": build_sd3, "sd3_pretrained": build_sd3_pretrained, "sd35": build_sd35,
            "sd3_controlnet": build_controlnet, "sd35_controlnet": build_sd35_controlnet}
