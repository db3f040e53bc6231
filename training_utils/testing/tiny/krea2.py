"""Tiny Krea 2: a Krea 2 transformer (single-stream, with its text-fusion stage), Qwen-Image's video VAE and a
Qwen3-VL text encoder."""

import torch

from .parts import SEED, tiny_qwen_tokenizer, vocabulary
from .qwen_image import QWEN_IMAGE_TEMPLATE_WORDS, tiny_qwen_image_vae

# The hidden states of the tiny text encoder that the pipeline stacks (Krea 2's taps twelve of Qwen3-VL-4B's 36).
TEXT_ENCODER_SELECT_LAYERS = (1, 2, 3)


def tiny_qwen3_vl_text_encoder(tokenizer, num_hidden_layers=3, hidden_size=16, seed=SEED):
    """A Qwen3-VL model, Krea 2's text encoder class, with a small language model and a one-block vision tower
    (which text prompts never run). Its multimodal rotary sections (time, height, width) share the 4 frequencies of
    its 8-wide attention heads."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    torch.manual_seed(seed)
    text_config = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=32,
                       num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                       max_position_embeddings=2048,
                       rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1],
                                        "mrope_interleaved": True},
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                       eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    vision_config = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=hidden_size,
                         deepstack_visual_indexes=[])
    return Qwen3VLModel(Qwen3VLConfig(text_config=text_config, vision_config=vision_config)).eval()


def build_krea2(path):
    """A Krea 2 pipeline (the base, not the distilled Turbo): a Krea 2 transformer (two blocks, a one-block text
    fusion of each stage over the three stacked hidden states), Qwen-Image's VAE, a Qwen3-VL text encoder, a real
    Qwen tokenizer that splits the pipeline's system prefix into the 34 tokens it drops, and Krea 2's
    resolution-shifted flow-matching scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel

    tokenizer = tiny_qwen_tokenizer(vocabulary() + list(QWEN_IMAGE_TEMPLATE_WORDS))
    text_encoder = tiny_qwen3_vl_text_encoder(tokenizer)
    vae = tiny_qwen_image_vae()
    torch.manual_seed(SEED)
    transformer = Krea2Transformer2DModel(
        in_channels=4 * vae.config.z_dim, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=32, timestep_embed_dim=8,
        text_hidden_dim=text_encoder.config.text_config.hidden_size, num_text_layers=len(TEXT_ENCODER_SELECT_LAYERS),
        text_num_attention_heads=2, text_num_key_value_heads=1, text_intermediate_size=16,
        num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2), rope_theta=1000.0,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=6400)
    Krea2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                  text_encoder_select_layers=TEXT_ENCODER_SELECT_LAYERS).save_pretrained(path)


FIXTURES = {"krea2": build_krea2}
