"""Tiny Z-Image: a Z-Image transformer, a 16-channel VAE and a Qwen3 text encoder."""

import torch

from .parts import SEED, tiny_qwen3_text_encoder, tiny_qwen_tokenizer, tiny_vae


def build_z_image(path):
    """A Z-Image pipeline: a Z-Image transformer (one noise- and one caption-refiner block, two main blocks), a VAE
    with Z-Image's 16 latent channels and its latent shift and scale (FLUX.1's VAE), a Qwen3 model whose
    second-to-last hidden states are the caption features, a real Qwen tokenizer, and Z-Image's flow-matching
    scheduler: a static shift of 3, no resolution-dependent shift."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    tokenizer = tiny_qwen_tokenizer()
    # ZImagePipeline's text encoder is the bare Qwen3 model, without the language-model head.
    text_encoder = tiny_qwen3_text_encoder(tokenizer, num_hidden_layers=2).model
    vae = tiny_vae(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159)
    torch.manual_seed(SEED)
    transformer = ZImageTransformer2DModel(
        in_channels=vae.config.latent_channels, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
        cap_feat_dim=text_encoder.config.hidden_size, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
    )
    with torch.no_grad():  # the padding tokens are created uninitialised (torch.empty)
        transformer.x_pad_token.normal_()
        transformer.cap_pad_token.normal_()
    ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=text_encoder,
                   tokenizer=tokenizer, transformer=transformer).save_pretrained(path)


FIXTURES = {"z_image": build_z_image}
