"""Tiny Wan: Wan 2.1-style text-to-video (one transformer), Wan 2.2-style with two experts split at
``boundary_ratio``, and Wan 2.1-style image-to-video with a CLIP image encoder; a UMT5 text encoder with an offline
T5 tokenizer, and the Wan VAE (4× in time, 8× in space) of diffusers' own tests, or TI2V-5B's (16× in space)."""

import json
from pathlib import Path

import torch

from .parts import SEED, tiny_t5_tokenizer


def tiny_umt5_encoder(vocab_size, d_model=32, seed=SEED):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, decoder_start_token_id=0)
    return UMT5EncoderModel(config).eval()


def tiny_wan_vae(seed=SEED, ti2v=False):
    """Wan 2.1's VAE (8× in space, 4× in time, 16 channels), or with ``ti2v`` Wan 2.2 TI2V-5B's (16× in space: 2×2
    pixel patches, residual down- and up-sampling, 48 channels)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    if ti2v:
        return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=48, in_channels=12, out_channels=12,
                                dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
                                is_residual=True, patch_size=2, scale_factor_spatial=16,
                                latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


def tiny_wan_transformer(seed=SEED, in_channels=16, out_channels=16, **overrides):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                 in_channels=in_channels, out_channels=out_channels, text_dim=32, freq_dim=256, ffn_dim=32,
                                 num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                 rope_max_seq_len=32, **overrides)


def wan_scheduler():
    """Wan's sampler: UniPC on flow-matching sigmas, shifted by ``flow_shift``."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


def wan_pipeline(two_experts=False, expand_timesteps=False):
    """A text-to-video `WanPipeline` in memory (Wan 2.1-style, or Wan 2.2-style with two experts, or TI2V-5B-style:
    per-token timesteps and its VAE 16× in space)."""
    from diffusers import WanPipeline

    tokenizer = tiny_t5_tokenizer()
    experts = {"transformer_2": tiny_wan_transformer(SEED + 1), "boundary_ratio": 0.875} if two_experts else {}
    channels = 48 if expand_timesteps else 16
    return WanPipeline(tokenizer=tokenizer, text_encoder=tiny_umt5_encoder(len(tokenizer)),
                       vae=tiny_wan_vae(ti2v=expand_timesteps), scheduler=wan_scheduler(),
                       transformer=tiny_wan_transformer(in_channels=channels, out_channels=channels),
                       expand_timesteps=expand_timesteps, **experts)


def build_wan21(path):
    wan_pipeline().save_pretrained(path)


def build_wan22(path):
    """Wan 2.2 A14B-style: a high-noise ``transformer`` and a low-noise ``transformer_2``, split at 0.875."""
    wan_pipeline(two_experts=True).save_pretrained(path)


def wan_i2v_pipeline():
    """A Wan 2.1 I2V-style `WanImageToVideoPipeline`: the transformer reads the noisy latents, the first frame's
    mask and latents (36 channels) and a CLIP image embedding, which its cross-attention reads with projections of
    its own (Wan 2.1 I2V's ``added_kv_proj_dim``)."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    tokenizer = tiny_t5_tokenizer()
    torch.manual_seed(SEED)
    image_encoder = CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=4, projection_dim=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=16, patch_size=4)).eval()
    return WanImageToVideoPipeline(
        tokenizer=tokenizer, text_encoder=tiny_umt5_encoder(len(tokenizer)), vae=tiny_wan_vae(),
        scheduler=wan_scheduler(),
        transformer=tiny_wan_transformer(in_channels=36, image_dim=4, added_kv_proj_dim=24),
        image_encoder=image_encoder, image_processor=CLIPImageProcessor(crop_size=32, size=32))


def build_wan_i2v(path):
    """Saved as the released Wan 2.1 I2V folders name their image processor, ``CLIPImageProcessor`` (which
    transformers 5 loads as its PIL implementation without torchvision; saved, it names that one)."""
    wan_i2v_pipeline().save_pretrained(path)
    index_file = Path(path) / "model_index.json"
    index = json.loads(index_file.read_text())
    index["image_processor"] = ["transformers", "CLIPImageProcessor"]
    index_file.write_text(json.dumps(index, indent=2))


FIXTURES = {"wan21": build_wan21, "wan22": build_wan22, "wan_i2v": build_wan_i2v}
