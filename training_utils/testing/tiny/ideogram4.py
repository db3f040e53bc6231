"""Tiny Ideogram 4: two Ideogram 4 transformers (the conditional one and the unconditional one of its asymmetric
guidance), FLUX.2's VAE and a Qwen3-VL text encoder as deep as the real one."""

import torch

from .flux2 import tiny_flux2_vae
from .krea2 import tiny_qwen3_vl_text_encoder
from .parts import SEED, tiny_qwen_tokenizer, vocabulary

# Qwen3-VL's chat format for one user turn whose content is a list of parts (Ideogram4Pipeline's messages), with
# the generation prompt: the text parts are written as they are.
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{ part.text }}{%- endif %}{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_ideogram4(path):
    """An Ideogram 4 pipeline: two transformers of two blocks each (seeded apart, so that the unconditional branch
    differs), FLUX.2's VAE (batch-norm statistics away from the identity), a Qwen3-VL text encoder of the real
    one's 36 decoder layers (the pipeline taps layers 0 to 35) but 16 wide, a real Qwen tokenizer with Qwen3-VL's
    chat format, and a plain flow-matching scheduler (the pipeline sets its own sigmas)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline, Ideogram4Transformer2DModel
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS

    tokenizer = tiny_qwen_tokenizer(vocabulary() + ["user", "assistant"])
    tokenizer.chat_template = QWEN3_VL_CHAT_TEMPLATE
    text_encoder = tiny_qwen3_vl_text_encoder(tokenizer, num_hidden_layers=max(QWEN3_VL_ACTIVATION_LAYERS) + 1)
    vae = tiny_flux2_vae()
    transformers = []
    for seed in (SEED, SEED + 1):
        torch.manual_seed(seed)
        transformers.append(Ideogram4Transformer2DModel(
            in_channels=4 * vae.config.latent_channels, num_layers=2, attention_head_dim=8, num_attention_heads=4,
            intermediate_size=32, adaln_dim=16,
            llm_features_dim=len(QWEN3_VL_ACTIVATION_LAYERS) * text_encoder.config.text_config.hidden_size,
            rope_theta=10_000, mrope_section=(2, 1, 1)))
    Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                      tokenizer=tokenizer, transformer=transformers[0],
                      unconditional_transformer=transformers[1]).save_pretrained(path)


FIXTURES = {"ideogram4": build_ideogram4}
