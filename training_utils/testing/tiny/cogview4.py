"""Tiny CogView4: a CogView4 transformer, a 16-channel VAE dividing the size by 8 and a GLM text encoder, as
THUDM/CogView4-6B lays them out; and its control form (`CogView4ControlPipeline`), whose transformer reads the
conditioning image's latents beside the noisy ones."""

import torch

from .parts import SEED, tiny_glm_text_encoder, tiny_glm_tokenizer, tiny_vae


def components():
    """The pipeline's components: a CogView4 transformer (two blocks, 16 latent channels in and out), a VAE with
    CogView4's four blocks (the size divided by 8), 16 latent channels and its scale 1 with no shift, a GLM model and
    a real GLM-style tokenizer, and CogView4's flow-matching scheduler (its size-dependent linear shift)."""
    from diffusers import CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler

    tokenizer = tiny_glm_tokenizer()
    text_encoder = tiny_glm_text_encoder(tokenizer)
    vae = tiny_vae(latent_channels=16, scaling_factor=1.0, shift_factor=0.0, block_out_channels=(16,) * 4,
                   down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                   use_quant_conv=False, use_post_quant_conv=False)
    torch.manual_seed(SEED)
    transformer = CogView4Transformer2DModel(
        patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        text_embed_dim=text_encoder.config.hidden_size, time_embed_dim=8, condition_dim=4, sample_size=4)
    scheduler = FlowMatchEulerDiscreteScheduler(base_shift=0.25, max_shift=0.75, base_image_seq_len=256,
                                                use_dynamic_shifting=True, time_shift_type="linear")
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae, "transformer": transformer,
            "scheduler": scheduler}


def build_cogview4(path):
    """A CogView4 pipeline (THUDM/CogView4-6B's layout)."""
    from diffusers import CogView4Pipeline

    CogView4Pipeline(**components()).save_pretrained(path)


def build_cogview4_control(path):
    """A CogView4 control pipeline: its transformer's patch embedding reads 32 channels, the noisy latents' 16 and
    the conditioning image's 16, and outputs 16 (a control model trained by train_control_cogview4.py)."""
    from diffusers import CogView4ControlPipeline, CogView4Transformer2DModel

    parts = components()
    torch.manual_seed(SEED)
    parts["transformer"] = CogView4Transformer2DModel.from_config(parts["transformer"].config, in_channels=32,
                                                                  out_channels=16)
    CogView4ControlPipeline(**parts).save_pretrained(path)


FIXTURES = {"cogview4": build_cogview4, "cogview4_control": build_cogview4_control}
