"""Tiny transformers of each flow-matching family, for the layout tests (test_convert_lora.py,
test_adapter_layouts.py): each with the function that takes a checkpoint in the original release's layout, which
ComfyUI's models have, back to diffusers' names (diffusers' own single-file converters)."""

import inspect

import diffusers.loaders.single_file_utils
import torch
from diffusers import (ChromaPipeline, ChromaTransformer2DModel, Flux2KleinPipeline, Flux2Transformer2DModel,
                       HiDreamImagePipeline, HiDreamImageTransformer2DModel, Krea2Pipeline, Krea2Transformer2DModel,
                       Lumina2Pipeline, Lumina2Transformer2DModel,
                       QwenImagePipeline, QwenImageTransformer2DModel,
                       SD3Transformer2DModel, StableDiffusion3Pipeline, ZImagePipeline, ZImageTransformer2DModel)
from diffusers.loaders.single_file_utils import (convert_flux2_transformer_checkpoint_to_diffusers,
                                                 convert_krea2_transformer_checkpoint_to_diffusers,
                                                 convert_lumina2_to_diffusers,
                                                 convert_sd3_transformer_checkpoint_to_diffusers,
                                                 convert_z_image_transformer_checkpoint_to_diffusers)


def tiny_sd3_transformer():
    """An SD3.5-style MMDiT: a dual-attention block (attn2) and a last, context-pre-only block."""
    torch.manual_seed(0)
    return SD3Transformer2DModel(sample_size=16, patch_size=1, in_channels=4, out_channels=4, num_layers=2,
                                 attention_head_dim=8, num_attention_heads=4, joint_attention_dim=64,
                                 caption_projection_dim=32, pooled_projection_dim=64, dual_attention_layers=(0,))


def tiny_flux2_transformer():
    torch.manual_seed(0)
    return Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
                                   timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True)


def tiny_z_image_transformer():
    torch.manual_seed(0)
    return ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, n_layers=2,
                                    n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=16, axes_dims=[8, 4, 4],
                                    axes_lens=[64, 32, 32])


def tiny_qwen_image_transformer():
    torch.manual_seed(0)
    return QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                       axes_dims_rope=(8, 4, 4))


def tiny_chroma_transformer():
    torch.manual_seed(0)
    return ChromaTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                    attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                    axes_dims_rope=(4, 4, 8), approximator_hidden_dim=32, approximator_layers=2,
                                    approximator_num_channels=16)


def tiny_krea2_transformer():
    torch.manual_seed(0)
    return Krea2Transformer2DModel(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=32, timestep_embed_dim=8,
                                   text_hidden_dim=16, num_text_layers=3, text_num_attention_heads=2,
                                   text_num_key_value_heads=1, text_intermediate_size=16, num_layerwise_text_blocks=1,
                                   num_refiner_text_blocks=1, axes_dims_rope=(4, 2, 2))


class ZerosWhereMissing(dict):
    """A checkpoint that gives what a whole-checkpoint converter asks of it besides the LoRA's weights: zero biases,
    and `MISSING` for the rest (norms)."""

    def __init__(self, weights):
        super().__init__(weights)
        self.biases = {key.removesuffix(".weight") + ".bias": torch.zeros(weight.shape[0])
                       for key, weight in weights.items()}

    def pop(self, key, *default):
        return super().pop(key) if key in self else self.biases.get(key, MISSING)


MISSING = torch.zeros(1)


def convert_tiny_chroma(deltas):
    """diffusers' convert_chroma_transformer_checkpoint_to_diffusers on ``deltas``, with the model width it assumes
    (the real model's 3072) that of `tiny_chroma_transformer` (32), and without what it made of the keys the deltas
    lack."""
    source = inspect.getsource(diffusers.loaders.single_file_utils.convert_chroma_transformer_checkpoint_to_diffusers)
    assert "    inner_dim = 3072\n" in source
    namespace = dict(vars(diffusers.loaders.single_file_utils))
    exec(source.replace("    inner_dim = 3072\n", "    inner_dim = 32\n"), namespace)
    converted = namespace["convert_chroma_transformer_checkpoint_to_diffusers"](ZerosWhereMissing(deltas))
    return {key: value for key, value in converted.items() if value is not MISSING}


def tiny_lumina2_transformer():
    torch.manual_seed(0)
    return Lumina2Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
                                     num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=16,
                                     axes_dim_rope=(4, 2, 2), axes_lens=(32, 32, 32), cap_feat_dim=16)


def tiny_hidream_transformer():
    torch.manual_seed(0)
    return HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_channels=[32, 16], text_emb_dim=64, num_routed_experts=2,
        num_activated_experts=1, axes_dims_rope=(4, 2, 2), max_resolution=(16, 16), llama_layers=(0, 1))


def lumina2_to_diffusers(deltas):
    """diffusers' Lumina 2 converter, whose split of the fused qkv is Lumina-Image 2.0's sizes (2304 query rows,
    768 key and value rows): the fused rows are split here in the same 3:1:1, then every key goes through it."""
    unfused = {}
    for key, delta in deltas.items():
        if key.endswith(".qkv.weight"):
            rows = delta.shape[0] // 5
            for name, part in zip(("to_q", "to_k", "to_v"), delta.split([3 * rows, rows, rows])):
                unfused[key.replace(".qkv.", f".{name}.")] = part
        else:
            unfused[key] = delta
    return convert_lumina2_to_diffusers(unfused)


def zero_biases_and_pos_embed(deltas):
    """What diffusers' SD3 converter reads besides the weights: it takes whole checkpoints (zeros for the patch
    embedding's convolution, which only LoRA adapts here)."""
    completed = {"x_embedder.proj.weight": torch.zeros(1), **deltas}
    for key, delta in list(completed.items()):
        completed[key.replace(".weight", ".bias")] = torch.zeros(delta.shape[0])
    completed["pos_embed"] = torch.zeros(1)
    return completed


TRANSFORMERS = {
    "sd3": (StableDiffusion3Pipeline, tiny_sd3_transformer,
            lambda deltas: convert_sd3_transformer_checkpoint_to_diffusers(zero_biases_and_pos_embed(deltas))),
    "flux2": (Flux2KleinPipeline, tiny_flux2_transformer, convert_flux2_transformer_checkpoint_to_diffusers),
    "z_image": (ZImagePipeline, tiny_z_image_transformer, convert_z_image_transformer_checkpoint_to_diffusers),
    # ComfyUI's Qwen-Image model (comfy/ldm/qwen_image/model.py) names its modules as diffusers does.
    "qwen_image": (QwenImagePipeline, tiny_qwen_image_transformer, dict),
    "chroma": (ChromaPipeline, tiny_chroma_transformer, convert_tiny_chroma),
    "krea2": (Krea2Pipeline, tiny_krea2_transformer, convert_krea2_transformer_checkpoint_to_diffusers),
    "lumina2": (Lumina2Pipeline, tiny_lumina2_transformer, lumina2_to_diffusers),
    # ComfyUI's HiDream model (comfy/ldm/hidream/model.py) names its modules as diffusers does.
    "hidream": (HiDreamImagePipeline, tiny_hidream_transformer, dict),
}
