"""The released models' configs, written into pipeline folders that hold no weights: what `--print_memory_plan`
needs to plan a real-size run here, with no hub.

`real_pipeline(family, folder)` copies the family's tiny fixture (its ``model_index.json``, tokenizers and scheduler:
they weigh nothing) without its weights files, and puts each model's released config in place of the tiny one (the
tiny config's keys updated, nested ``text_config``/``vision_config`` included). The configs are those of the hub's
diffusers folders (where a diffusers class's defaults are the released model's, as for FLUX.2 [dev], Qwen-Image,
Z-Image and Wan 2.1 14B, the defaults are written out here all the same), and of the text encoders' own repositories.
A model's size depends on these numbers only; which hidden layers a model taps, its rope settings and such do not
change it and are left as the tiny fixture has them.
"""

import inspect
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import diffusers

# Qwen3-4B (FLUX.2 [klein] 4B's and Z-Image's text encoder).
QWEN3_4B = {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True}
# Mistral Small 3.1 24B (FLUX.2 [dev]'s text encoder), its Pixtral vision tower and projector.
MISTRAL_SMALL_3_1 = {
    "text_config": {"hidden_size": 5120, "intermediate_size": 32768, "num_hidden_layers": 40,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072},
    "vision_config": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                      "num_attention_heads": 16, "head_dim": 64, "patch_size": 14, "image_size": 1540},
    "spatial_merge_size": 2, "multimodal_projector_bias": False, "tie_word_embeddings": False,
}
# Qwen2.5-VL 7B (Qwen-Image's text encoder) and its vision tower.
QWEN2_5_VL_7B = {
    "text_config": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 152064,
                    "tie_word_embeddings": False},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "in_chans": 3, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31]},
    "tie_word_embeddings": False,
}
CLIP_L = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
          "projection_dim": 768, "vocab_size": 49408, "max_position_embeddings": 77}
CLIP_BIG_G = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
              "projection_dim": 1280, "vocab_size": 49408, "max_position_embeddings": 77}
T5_XXL = {"d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64, "num_layers": 24, "vocab_size": 32128,
          "feed_forward_proj": "gated-gelu", "is_gated_act": True, "dense_act_fn": "gelu_new"}
UMT5_XXL = {**T5_XXL, "vocab_size": 256384}
LLAMA_3_1_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False}
# FLUX.1's VAE (16 latent channels), which HiDream and Z-Image use.
FLUX1_VAE = {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "latent_channels": 16,
             "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
             "norm_num_groups": 32}


def defaults_of(class_name):
    """A diffusers class's defaults (the released model's, for the classes named so in `FAMILIES`)."""
    parameters = inspect.signature(getattr(diffusers, class_name).__init__).parameters
    return {name: parameter.default for name, parameter in parameters.items()
            if name != "self" and parameter.default is not inspect.Parameter.empty}


@dataclass
class RealModel:
    """A family at real size: its tiny fixture and script, and its components' released configs."""

    title: str
    fixture: str
    script: str
    configs: dict = field(default_factory=dict)
    video: bool = False


KLEIN = "dreambooth/train_dreambooth_lora_flux2_klein.py"
FAMILIES = {
    "flux2_dev": RealModel("FLUX.2 [dev]", "flux2_dev", "dreambooth/train_dreambooth_lora_flux2.py", {
        "transformer": defaults_of("Flux2Transformer2DModel"), "vae": defaults_of("AutoencoderKLFlux2"),
        "text_encoder": MISTRAL_SMALL_3_1}),
    "qwen_image": RealModel("Qwen-Image", "qwen_image", "dreambooth/train_dreambooth_lora_qwen_image.py", {
        "transformer": defaults_of("QwenImageTransformer2DModel"), "vae": defaults_of("AutoencoderKLQwenImage"),
        "text_encoder": QWEN2_5_VL_7B}),
    "hidream": RealModel("HiDream-I1", "hidream", "dreambooth/train_dreambooth_lora_hidream.py", {
        "transformer": {"patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 16,
                        "num_single_layers": 32, "attention_head_dim": 128, "num_attention_heads": 20,
                        "caption_channels": [4096, 4096], "text_emb_dim": 2048, "num_routed_experts": 4,
                        "num_activated_experts": 2, "axes_dims_rope": [64, 32, 32], "max_resolution": [128, 128],
                        "llama_layers": list(range(48))},
        "vae": FLUX1_VAE, "text_encoder": CLIP_L, "text_encoder_2": CLIP_BIG_G, "text_encoder_3": T5_XXL,
        "text_encoder_4": LLAMA_3_1_8B}),
    "wan_14b": RealModel("Wan 2.1 14B", "wan21", "video/train_text_to_video_lora_wan.py", {
        "transformer": defaults_of("WanTransformer3DModel"), "vae": defaults_of("AutoencoderKLWan"),
        "text_encoder": UMT5_XXL}, video=True),
    "z_image": RealModel("Z-Image", "z_image", "dreambooth/train_dreambooth_lora_z_image.py", {
        "transformer": defaults_of("ZImageTransformer2DModel"), "vae": FLUX1_VAE, "text_encoder": QWEN3_4B}),
    "flux2_klein": RealModel("FLUX.2 [klein] 4B", "flux2_klein", KLEIN, {
        "transformer": {**defaults_of("Flux2Transformer2DModel"), "num_layers": 5, "num_single_layers": 20,
                        "num_attention_heads": 24, "joint_attention_dim": 7680, "guidance_embeds": False},
        "vae": defaults_of("AutoencoderKLFlux2"), "text_encoder": QWEN3_4B}),
}


def plain(value):
    """``value`` as JSON writes it (tuples as lists)."""
    return json.loads(json.dumps(value))


# Keys that transformers derives from the layer count: the tiny fixture's would not match the real count. (Other
# derived keys, T5's gating and heads' widths, are written out in the configs above.)
DERIVED = ("layer_types",)


def updated(config, real):
    """The tiny ``config`` with ``real``'s values, nested configs merged key by key (less `DERIVED` keys)."""
    config = {key: value for key, value in config.items() if key not in DERIVED}
    for key, value in plain(real).items():
        config[key] = updated(config.get(key) or {}, value) if isinstance(value, dict) else value
    return config


def real_pipeline(family, folder, tiny_folder):
    """Write ``family``'s pipeline folder at real size, without weights, into ``folder`` (from its tiny fixture in
    ``tiny_folder``); returns ``folder``. The Llama of HiDream, a folder of its own upstream, is in
    ``folder/text_encoder_4`` as the tiny fixture has it."""
    model = FAMILIES[family]
    folder = Path(folder)
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(Path(tiny_folder) / model.fixture, folder,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.pth"))
    for component, real in model.configs.items():
        path = folder / component / "config.json"
        path.write_text(json.dumps(updated(json.loads(path.read_text()), real), indent=1))
    return folder


@dataclass
class TransformerOnly:
    """A family with a diffusers transformer but no training script here: its transformer at real size, and its
    VAE's compression (space, time), for a plan of the transformer alone."""

    title: str
    class_name: str
    config: dict
    spatial: int
    temporal: int


# diffusers 0.42.1's defaults are the released models': LTX-2's 19B audio-video transformer (its VAE: 32x in space,
# 8x in time) and HunyuanVideo 1.5's 8.3B transformer (16x, 4x).
TRANSFORMER_ONLY = {
    "ltx2": TransformerOnly("LTX-2", "LTX2VideoTransformer3DModel", defaults_of("LTX2VideoTransformer3DModel"), 32, 8),
    "hunyuan_video_15": TransformerOnly("HunyuanVideo 1.5", "HunyuanVideo15Transformer3DModel",
                                        defaults_of("HunyuanVideo15Transformer3DModel"), 16, 4),
}
