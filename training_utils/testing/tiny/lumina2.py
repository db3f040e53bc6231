"""Tiny Lumina 2: a Lumina 2 transformer, a 16-channel VAE and a Gemma 2 text encoder."""

import torch

from .parts import SEED, tiny_gemma2_text_encoder, tiny_gemma_tokenizer, tiny_vae


def build_lumina2(path):
    """A Lumina 2 pipeline: a Lumina 2 transformer (two main blocks, one noise- and one context-refiner block,
    three query heads to one key-value head as Lumina-Image 2.0's 24 to 8), a VAE dividing the size by 8 with its 16
    latent channels and latent shift and scale (FLUX.1's VAE), a Gemma 2 model and a real Gemma tokenizer that holds
    the words of the pipeline's system prompt, and a flow-matching scheduler with a static shift of 6, no
    resolution-dependent one."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    system_prompt = Lumina2Pipeline(transformer=None, scheduler=None, vae=None, text_encoder=None,
                                    tokenizer=None).system_prompt
    tokenizer = tiny_gemma_tokenizer(texts=[system_prompt, "<Prompt Start>"])
    text_encoder = tiny_gemma2_text_encoder(tokenizer)
    # Lumina2Pipeline takes its VAE to divide the size by 8 (it says so, whatever the VAE): four blocks.
    vae = tiny_vae(latent_channels=16, scaling_factor=0.3611, shift_factor=0.1159, block_out_channels=(16,) * 4,
                   down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4)
    torch.manual_seed(SEED)
    transformer = Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=vae.config.latent_channels, hidden_size=24, num_layers=2,
        num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 2, 2),
        axes_lens=(300, 64, 64), cap_feat_dim=text_encoder.config.hidden_size)
    Lumina2Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=6.0), vae=vae,
                    text_encoder=text_encoder, tokenizer=tokenizer).save_pretrained(path)


FIXTURES = {"lumina2": build_lumina2}
