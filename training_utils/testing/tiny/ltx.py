"""Tiny LTX-Video: `LTXPipeline` (which `LTXImageToVideoPipeline` loads too, as it loads the released folders) with
a VAE of LTX-Video's own compression, 32× in space (4×4 patches, then three halvings) and 8× in time (three
halvings), a T5 text encoder with an offline T5 tokenizer, and the released scheduler's configuration."""

import torch

from .parts import SEED, tiny_t5_encoder, tiny_t5_tokenizer

LATENT_CHANNELS = 8


def tiny_ltx_vae(seed=SEED):
    """LTX-Video's VAE layout with 8 channels everywhere and one layer per block: three spatio-temporal down (and
    up) blocks after 4×4 patches, causal in time when encoding; latent mean and std that are not 0 and 1, so that
    normalising them is seen."""
    from diffusers import AutoencoderKLLTXVideo

    torch.manual_seed(seed)
    vae = AutoencoderKLLTXVideo(latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8),
                                decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                decoder_layers_per_block=(1, 1, 1, 1, 1),
                                spatio_temporal_scaling=(True, True, True, False),
                                decoder_spatio_temporal_scaling=(True, True, True, False))
    vae.latents_mean.copy_(torch.linspace(-0.2, 0.2, LATENT_CHANNELS))
    vae.latents_std.copy_(torch.linspace(0.5, 1.5, LATENT_CHANNELS))
    return vae.eval()


def tiny_ltx_transformer(seed=SEED, caption_channels=32):
    from diffusers import LTXVideoTransformer3DModel

    torch.manual_seed(seed)
    return LTXVideoTransformer3DModel(in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, patch_size=1,
                                      patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
                                      cross_attention_dim=16, num_layers=2, caption_channels=caption_channels)


def ltx_scheduler():
    """LTX-Video's released sampler: flow matching shifted for the number of tokens, stretched to end at 0.1."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                           base_image_seq_len=1024, max_image_seq_len=4096, shift_terminal=0.1)


def ltx_pipeline():
    from diffusers import LTXPipeline

    tokenizer = tiny_t5_tokenizer()
    return LTXPipeline(scheduler=ltx_scheduler(), vae=tiny_ltx_vae(), text_encoder=tiny_t5_encoder(len(tokenizer), 32),
                       tokenizer=tokenizer, transformer=tiny_ltx_transformer())


def build_ltx(path):
    ltx_pipeline().save_pretrained(path)


FIXTURES = {"ltx": build_ltx}
