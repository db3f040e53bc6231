"""Tiny HunyuanVideo 1.5: text-to-video and image-to-video pipelines with the family's VAE at its real compression
(16× in space, 4× in time: 9 frames of 32×32 pixels are 3 latent frames of 2×2), a Qwen2.5-VL language model with a
real Qwen tokenizer and chat template, a ByT5 glyph encoder with its (vocabulary-free) tokenizer, and for
image-to-video a SigLIP vision encoder. Saved in the released folders' layout (the image processor named
``SiglipImageProcessor``, which transformers loads as its PIL implementation without torchvision)."""

import json
from pathlib import Path

import torch

from .parts import SEED, tiny_qwen_tokenizer

LATENT_CHANNELS = 4
TEXT_DIM, GLYPH_DIM, IMAGE_DIM = 16, 32, 12


def tiny_hunyuan_video15_vae(seed=SEED):
    """The HunyuanVideo 1.5 VAE with its released compression: four 2× downsamplings in space, the last two also
    in time."""
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(seed)
    return AutoencoderKLHunyuanVideo15(latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8),
                                       layers_per_block=1, spatial_compression_ratio=16,
                                       temporal_compression_ratio=4, downsample_match_channel=False,
                                       upsample_match_channel=False)


def tiny_hunyuan_video15_transformer(task_type, seed=SEED):
    """Two blocks reading the noisy latents, the condition latents and their mask (``2C + 1`` channels), at the
    released 1×1 patches; ``target_size`` 32, the image-to-video pipeline's render size."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(seed)
    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1, out_channels=LATENT_CHANNELS, num_attention_heads=2, attention_head_dim=8,
        num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=TEXT_DIM,
        text_embed_2_dim=GLYPH_DIM, image_embed_dim=IMAGE_DIM, rope_axes_dim=(2, 2, 4), target_size=32,
        task_type=task_type)


def tiny_text_encoders(seed=SEED):
    """``{tokenizer, text_encoder, tokenizer_2, text_encoder_2}``: Qwen2.5-VL's language model (the pipeline reads
    its third-to-last hidden states) and a T5 encoder over ByT5's bytes."""
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = tiny_qwen_tokenizer(), ByT5Tokenizer()
    torch.manual_seed(seed)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
        pad_token_id=tokenizer.pad_token_id)).eval()
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), d_model=GLYPH_DIM, d_kv=8, d_ff=37,
                                             num_layers=1, num_heads=4, relative_attention_num_buckets=8,
                                             decoder_start_token_id=0)).eval()
    return {"tokenizer": tokenizer, "text_encoder": text_encoder, "tokenizer_2": tokenizer_2,
            "text_encoder_2": text_encoder_2}


def shared_components(task_type):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.guiders import ClassifierFreeGuidance

    return {**tiny_text_encoders(), "vae": tiny_hunyuan_video15_vae(),
            "transformer": tiny_hunyuan_video15_transformer(task_type),
            "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
            "guider": ClassifierFreeGuidance(guidance_scale=1.0)}


def hunyuan_video15_pipeline():
    from diffusers import HunyuanVideo15Pipeline

    return HunyuanVideo15Pipeline(**shared_components("t2v"))


def hunyuan_video15_i2v_pipeline():
    """Image-to-video: a SigLIP vision encoder of 64 tokens (8×8 patches of a 32×32 image) for the image embedding."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessorPil, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(SEED)
    image_encoder = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=IMAGE_DIM, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=32,
        patch_size=4)).eval()
    feature_extractor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    return HunyuanVideo15ImageToVideoPipeline(**shared_components("i2v"), image_encoder=image_encoder,
                                              feature_extractor=feature_extractor)


def build_hunyuan_video15(path):
    hunyuan_video15_pipeline().save_pretrained(path)


def build_hunyuan_video15_i2v(path):
    hunyuan_video15_i2v_pipeline().save_pretrained(path)
    index_file = Path(path) / "model_index.json"
    index = json.loads(index_file.read_text())
    index["feature_extractor"] = ["transformers", "SiglipImageProcessor"]
    index_file.write_text(json.dumps(index, indent=2))


FIXTURES = {"hunyuan_video15": build_hunyuan_video15, "hunyuan_video15_i2v": build_hunyuan_video15_i2v}
