"""Tiny Chroma: a Chroma transformer (FLUX.1 [schnell]'s, its modulation from a small network instead of the
guidance and pooled-text embeddings), FLUX.1's VAE and a T5 text encoder."""

import torch

from .parts import SEED, tiny_t5_encoder, tiny_t5_tokenizer, tiny_vae


def build_chroma(path):
    """A Chroma pipeline: a Chroma transformer (one double-stream and one single-stream block), a VAE with FLUX.1's
    latent shift and scale and 4 channels (16 once packed in 2×2 patches), a T5 encoder with a real T5 tokenizer
    and no CLIP, and FLUX.1's resolution-shifted flow-matching scheduler."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    tokenizer = tiny_t5_tokenizer()
    text_encoder = tiny_t5_encoder(len(tokenizer), d_model=32)
    vae = tiny_vae(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    torch.manual_seed(SEED)
    transformer = ChromaTransformer2DModel(
        patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=1, num_single_layers=1,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=text_encoder.config.d_model,
        axes_dims_rope=(4, 4, 8), approximator_hidden_dim=32, approximator_layers=1, approximator_num_channels=16,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                   transformer=transformer, image_encoder=None, feature_extractor=None).save_pretrained(path)


FIXTURES = {"chroma": build_chroma}
