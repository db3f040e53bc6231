"""Tiny FLUX.2 [klein]: a FLUX.2 transformer, FLUX.2's VAE and a Qwen3 text encoder."""

import torch

from .parts import SEED, tiny_qwen3_text_encoder, tiny_qwen_tokenizer


def tiny_flux2_vae(seed=SEED):
    """FLUX.2's VAE, halving the resolution, with 4 latent channels (16 once 2×2-patchified). Its batch-norm
    statistics, which standardise the patchified latents, are set away from the identity, so that a missing or
    misplaced standardisation shows."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(block_out_channels=(16, 32), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=8,
                             layers_per_block=1, sample_size=32)
    with torch.no_grad():
        vae.bn.running_mean.uniform_(-0.5, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def build_flux2_klein(path):
    """A FLUX.2 [klein] pipeline: a FLUX.2 transformer (one double-stream and two single-stream blocks, no
    guidance embedding, as klein's), FLUX.2's VAE, a Qwen3 text encoder whose three default hidden layers make
    the transformer's text features, a real Qwen tokenizer, and FLUX.2's resolution-shifted flow-matching
    scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel

    tokenizer = tiny_qwen_tokenizer()
    text_encoder = tiny_qwen3_text_encoder(tokenizer)
    vae = tiny_flux2_vae()
    torch.manual_seed(SEED)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=1, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=3 * text_encoder.config.hidden_size,
        timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096, time_shift_type="exponential",
    )
    Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                       transformer=transformer, is_distilled=False).save_pretrained(path)


FIXTURES = {"flux2_klein": build_flux2_klein}
