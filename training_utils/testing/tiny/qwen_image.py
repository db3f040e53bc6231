"""Tiny Qwen-Image: a Qwen-Image transformer, its video VAE and a Qwen2.5-VL text encoder; and a ControlNet made from
the transformer."""

import torch

from .parts import SEED, tiny_qwen_tokenizer, vocabulary


# The words of QwenImagePipeline's prompt template, whole tokens as in Qwen's own vocabulary: the template's system
# turn then tokenizes to the 34 tokens that the pipeline drops from every prompt's hidden states, as Qwen's does.
QWEN_IMAGE_TEMPLATE_WORDS = ("system", "Describe", "image", "by", "detailing", "color", "shape", "size", "texture",
                             "quantity", "text", "spatial", "relationships", "objects", "and", "user", "assistant")


def tiny_qwen2_5_vl_text_encoder(tokenizer, hidden_size=32, seed=SEED, **config_kwargs):
    """A Qwen2.5-VL model, Qwen-Image's text encoder class, with a two-layer language model and a one-block vision
    tower (which text prompts never run; Qwen-Image-Edit's reference images do, in patches of 2×2 pixels, each its
    own token). Its multimodal rotary sections (time, height, width) share the 8 frequencies of its 16-wide
    attention heads. ``config_kwargs`` go to its configuration (the vision tokens' ids)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    text_config = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=37, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                       eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    vision_config = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden_size,
                         patch_size=2, spatial_merge_size=1, temporal_patch_size=1, window_size=4,
                         fullatt_block_indexes=[0])
    config = Qwen2_5_VLConfig(text_config=text_config, vision_config=vision_config, **config_kwargs)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_qwen_image_vae(seed=SEED):
    """Qwen-Image's (video) VAE, halving the resolution, with 4 latent channels. Its per-channel latent mean and
    standard deviation, which standardise the latents, are set away from the identity, so that a missing or
    misplaced standardisation shows."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    z_dim = 4
    return AutoencoderKLQwenImage(base_dim=16, z_dim=z_dim, dim_mult=[1, 2], num_res_blocks=1,
                                  temperal_downsample=[False],
                                  latents_mean=torch.empty(z_dim).uniform_(-0.5, 0.5).tolist(),
                                  latents_std=torch.empty(z_dim).uniform_(0.5, 2.0).tolist())


def tiny_qwen_image_transformer(z_dim=4, text_hidden_size=32):
    """A Qwen-Image transformer (two blocks, no guidance embedding) for the latents of a VAE of ``z_dim`` channels
    (packed in 2×2 patches) and text features of ``text_hidden_size``."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(SEED)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * z_dim, out_channels=z_dim, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=text_hidden_size, axes_dims_rope=(4, 6, 6), guidance_embeds=False,
    )


def build_qwen_image(path):
    """A Qwen-Image pipeline: a Qwen-Image transformer (two blocks, no guidance embedding), Qwen-Image's VAE, a
    Qwen2.5-VL text encoder whose last hidden states are the text features, a real Qwen tokenizer, and Qwen-Image's
    flow-matching scheduler (its configuration: a resolution-dependent shift, stretched to end at 0.02)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    tokenizer = tiny_qwen_tokenizer(vocabulary() + list(QWEN_IMAGE_TEMPLATE_WORDS))
    text_encoder = tiny_qwen2_5_vl_text_encoder(tokenizer)
    vae = tiny_qwen_image_vae()
    transformer = tiny_qwen_image_transformer(vae.config.z_dim, text_encoder.config.text_config.hidden_size)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    )
    QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                      transformer=transformer).save_pretrained(path)


def build_qwen_image_controlnet(path):
    """A QwenImageControlNetModel of two blocks made from the tiny transformer
    (`families.qwen_image.controlnet_from_transformer`), as ``QwenImageControlNetModel.from_pretrained`` loads a
    released one."""
    from ...families import qwen_image

    qwen_image.controlnet_from_transformer(tiny_qwen_image_transformer(), 2).save_pretrained(path)


FIXTURES = {"qwen_image": build_qwen_image, "qwen_image_controlnet": build_qwen_image_controlnet}
