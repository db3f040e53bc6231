"""Tiny Z-Image: a Z-Image transformer, a 16-channel VAE and a Qwen3 text encoder; and a ControlNet made from the
transformer."""

import torch

from .parts import SEED, tiny_qwen3_text_encoder, tiny_qwen_tokenizer, tiny_vae

# The tiny Qwen3 text encoder's width: the caption features' size.
TEXT_HIDDEN_SIZE = 16


def tiny_z_image_transformer(in_channels=16):
    """A Z-Image transformer: one noise- and one caption-refiner block, two main blocks, reading ``in_channels``
    latent channels and the tiny text encoder's caption features."""
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(SEED)
    transformer = ZImageTransformer2DModel(
        in_channels=in_channels, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
        cap_feat_dim=TEXT_HIDDEN_SIZE, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
    )
    with torch.no_grad():  # the padding tokens are created uninitialised (torch.empty)
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()
    return transformer


def build_z_image(path):
    """A Z-Image pipeline: a Z-Image transformer (`tiny_z_image_transformer`), a VAE with Z-Image's 16 latent
    channels and its latent shift and scale (FLUX.1's VAE), a Qwen3 model whose second-to-last hidden states are the
    caption features, a real Qwen tokenizer, and Z-Image's flow-matching scheduler: a static shift of 3, no
    resolution-dependent shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    tokenizer = tiny_qwen_tokenizer()
    # ZImagePipeline's text encoder is the bare Qwen3 model, without the language-model head.
    text_encoder = tiny_qwen3_text_encoder(tokenizer, num_hidden_layers=2, hidden_size=TEXT_HIDDEN_SIZE).model
    vae = tiny_vae(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159)
    transformer = tiny_z_image_transformer(vae.config.latent_channels)
    ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=text_encoder,
                   tokenizer=tokenizer, transformer=transformer).save_pretrained(path)


def build_z_image_controlnet(path):
    """A ZImageControlNetModel made from the tiny transformer (`families.z_image.controlnet_from_transformer`),
    guiding both its main layers, as ``ZImageControlNetModel.from_pretrained`` loads a released one."""
    from ...families import z_image

    z_image.controlnet_from_transformer(tiny_z_image_transformer(), [0, 1]).save_pretrained(path)


FIXTURES = {"z_image": build_z_image, "z_image_controlnet": build_z_image_controlnet}
