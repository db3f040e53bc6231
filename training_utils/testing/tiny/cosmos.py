"""Tiny Cosmos Predict 2.5: a Cosmos transformer that projects the text features as the released ones do, the Wan 2.1
VAE (8× in space, 4× in time: Cosmos Predict 2.5's own), a Qwen2.5-VL text encoder with a Qwen tokenizer that formats
prompts as Qwen2.5-VL's chat does, and the released sampler's configuration."""

import torch

from .parts import SEED, tiny_qwen_tokenizer, vocabulary
from .qwen_image import tiny_qwen2_5_vl_text_encoder
from .wan import tiny_wan_vae

# Qwen2.5-VL's chat format for text turns, whose content is a list of parts (the pipeline's prompt format).
QWEN2_5_VL_TEXT_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}{%- else %}"
    "{%- for part in message.content %}{%- if part.type == 'text' %}{{ part.text }}{%- endif %}{%- endfor %}"
    "{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The words of the pipeline's system turn, whole tokens, so that a short --max_sequence_length still reaches the prompt.
SYSTEM_TURN_WORDS = ("system", "user", "You", "are", "helpful", "assistant", "who", "will", "provide", "prompts", "to",
                     "image", "generator", ".")


def tiny_cosmos_transformer(text_features, seed=SEED):
    """Cosmos Predict 2.5's transformer in small: 16 latent channels and the condition mask in, 1×2×2 patches, the
    text features (every Qwen layer's, side by side) projected before cross-attention, no learnable positions."""
    from diffusers import CosmosTransformer3DModel

    torch.manual_seed(seed)
    return CosmosTransformer3DModel(
        in_channels=16 + 1, out_channels=16, num_attention_heads=2, attention_head_dim=16, num_layers=2, mlp_ratio=2.0,
        text_embed_dim=24, adaln_lora_dim=4, max_size=(8, 32, 32), patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0),
        concat_padding_mask=True, extra_pos_embed_type=None, use_crossattn_projection=True,
        crossattn_proj_in_channels=text_features, encoder_hidden_states_channels=24)


def cosmos_scheduler():
    """The released pipeline's sampler: UniPC on Karras flow sigmas from 200 to 0.01."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(use_karras_sigmas=True, use_flow_sigmas=True, prediction_type="flow_prediction",
                                   sigma_max=200.0, sigma_min=0.01)


def cosmos_pipeline():
    from diffusers import Cosmos2_5_PredictBasePipeline

    from training_utils.families.cosmos import PassThroughSafetyChecker

    tokenizer = tiny_qwen_tokenizer(vocabulary() + list(SYSTEM_TURN_WORDS))
    tokenizer.chat_template = QWEN2_5_VL_TEXT_CHAT_TEMPLATE
    text_encoder = tiny_qwen2_5_vl_text_encoder(tokenizer)
    text_config = text_encoder.config.text_config
    transformer = tiny_cosmos_transformer(text_config.hidden_size * text_config.num_hidden_layers)
    return Cosmos2_5_PredictBasePipeline(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer,
                                         vae=tiny_wan_vae(), scheduler=cosmos_scheduler(),
                                         safety_checker=PassThroughSafetyChecker())


def build_cosmos_predict25(path):
    """Saved as the released folders are: no safety checker component (the pipeline is given one when it loads)."""
    import json
    from pathlib import Path

    cosmos_pipeline().save_pretrained(path)
    index_file = Path(path) / "model_index.json"
    index = json.loads(index_file.read_text())
    index["safety_checker"] = [None, None]
    index_file.write_text(json.dumps(index, indent=2))


def build_cosmos_clips(path):
    """Clips in upstream's Cosmos layout, ``videos/<n>.mp4`` beside ``metas/<n>.txt``: 9, 13 and 10 frames (three,
    four and three latent frames, past the two a Video2World sample conditions on) of a moving shape."""
    from pathlib import Path

    from training_utils.data.rendered_video import write_mp4

    from .video import moving_shape

    path = Path(path)
    (path / "videos").mkdir(parents=True, exist_ok=True)
    (path / "metas").mkdir(exist_ok=True)
    for index, (shape, color, background, frames) in enumerate(COSMOS_CLIPS):
        write_mp4(path / "videos" / f"{index}.mp4", moving_shape(shape, color, background, frames, seed=index), fps=8)
        (path / "metas" / f"{index}.txt").write_text(f"a {color} {shape} on a {background} background\n")


COSMOS_CLIPS = [("circle", "red", "white", 9), ("square", "blue", "black", 13), ("triangle", "green", "gray", 10)]
FIXTURES = {"cosmos_predict25": build_cosmos_predict25, "cosmos_clips": build_cosmos_clips}
