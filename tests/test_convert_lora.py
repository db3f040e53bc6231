"""Converting diffusers-format LoRA files to kohya's and ComfyUI's layouts (training_utils.adapters.convert).

SD 1.x and SDXL: diffusers' own ``load_lora_weights`` reads kohya files, so a kohya file must change a fresh
pipeline's weights exactly as the diffusers file does (lora_alpha != rank, text encoders included). Transformer
families: no offline loader reads ComfyUI's layout, so each converted LoRA's effective weights, taken back to
diffusers' names by diffusers' own single-file checkpoint converters (the original layout that ComfyUI's models
have), must equal what peft applies in the diffusers model; a few names are checked against ComfyUI's mapping tables.
"""

import json
import math
import stat

import pytest
import torch
from diffusers import (FluxPipeline, FluxTransformer2DModel, Ideogram4Pipeline, Ideogram4Transformer2DModel,
                       StableDiffusionPipeline, StableDiffusionXLPipeline)
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from training_utils.adapters.convert import METADATA_KEY, convert, main, write_converted
from training_utils.adapters.export import LoraExport
from training_utils.adapters.injection import ATTENTION_PROJECTIONS, CLIP_ATTENTION_PROJECTIONS, add_lora
from training_utils.errors import UsageError
from training_utils.families.layout import Family, fused
from training_utils.families.registry import FAMILIES, family_of, formats_for
from training_utils.pipeline import trainable_parameters
from transformer_layouts import TRANSFORMERS

UNET_PIPELINES = {"sd": StableDiffusionPipeline, "sdxl": StableDiffusionXLPipeline}
# (rank, lora_alpha) per component: alpha != rank everywhere, and differing between components.
UNET_LORAS = {"unet": (4, 8.0), "text_encoder": (2, 3.0), "text_encoder_2": (3, 1.5)}


def perturb(parameters, seed=0):
    """Random adapter tensors, lora_B included (peft starts it at zero), as if trained."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in parameters:
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)


def lora_tensors(path):
    with safe_open(path, "pt") as file:
        return {key: file.get_tensor(key) for key in file.keys()}, file.metadata()


@pytest.fixture(scope="module", params=sorted(UNET_PIPELINES))
def unet_lora(request, tiny, tmp_path_factory):
    """``(family, diffusers LoRA file)`` of a tiny SD 1.x or SDXL pipeline, LoRA on the UNet and every text
    encoder (the second's MLP too), saved as our scripts save it."""
    family = request.param
    pipe = UNET_PIPELINES[family].from_pretrained(tiny[family])
    trained = {"unet": pipe.unet, "text_encoder": pipe.text_encoder}
    add_lora(pipe.unet, UNET_LORAS["unet"][0], ATTENTION_PROJECTIONS, alpha=UNET_LORAS["unet"][1])
    add_lora(pipe.text_encoder, UNET_LORAS["text_encoder"][0], CLIP_ATTENTION_PROJECTIONS,
             alpha=UNET_LORAS["text_encoder"][1])
    if family == "sdxl":
        add_lora(pipe.text_encoder_2, UNET_LORAS["text_encoder_2"][0], CLIP_ATTENTION_PROJECTIONS + ["fc1", "fc2"],
                 alpha=UNET_LORAS["text_encoder_2"][1])
        trained["text_encoder_2"] = pipe.text_encoder_2
    perturb(trainable_parameters(trained).values())
    return family, LoraExport.of(UNET_PIPELINES[family], trained).save(tmp_path_factory.mktemp(family))


def weights_with_lora(family, tiny, lora_file):
    """A fresh pipeline's UNet and text-encoder weights with ``lora_file`` loaded by diffusers and fused in."""
    pipe = UNET_PIPELINES[family].from_pretrained(tiny[family])
    if lora_file is not None:
        pipe.load_lora_weights(lora_file)
        pipe.fuse_lora(components=pipe._lora_loadable_modules)
    return {f"{component}.{name.replace('base_layer.', '')}": tensor
            for component in ("unet", "text_encoder", "text_encoder_2") if getattr(pipe, component, None) is not None
            for name, tensor in getattr(pipe, component).state_dict().items() if "lora_" not in name}


def test_a_kohya_file_changes_a_pipeline_exactly_as_the_diffusers_file_does(unet_lora, tiny, tmp_path):
    family, diffusers_file = unet_lora
    kohya_file = write_converted(diffusers_file, tmp_path / "kohya.safetensors", "kohya")
    assert all(key.startswith(("lora_unet_", "lora_te")) for key in load_file(kohya_file))

    base = weights_with_lora(family, tiny, None)
    expected = weights_with_lora(family, tiny, diffusers_file)
    converted = weights_with_lora(family, tiny, kohya_file)
    changed = {name.split(".")[0] for name in base if not torch.equal(expected[name], base[name])}
    assert changed == {"unet", "text_encoder"} | ({"text_encoder_2"} if family == "sdxl" else set())
    assert converted.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(converted[name], expected[name])]
    assert not different, different[:5]


def expected_kohya_name(family, key):
    """Each diffusers key's kohya module name, by the rules sd-scripts and ComfyUI use (see the module docstring)."""
    component, _, path = key.partition(".")
    if component == "unet":
        return "lora_unet_" + path.replace(".", "_")
    prefix = {"text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}[component] if family == "sdxl" else "lora_te"
    # transformers 5's CLIPTextModel has no `text_model.` level; CLIPTextModelWithProjection still has it.
    path = path if path.startswith("text_model.") else f"text_model.{path}"
    return f"{prefix}_{path.replace('.', '_')}"


@pytest.mark.parametrize("to", ["kohya", "comfyui"])
def test_every_adapter_tensor_is_in_the_converted_file_with_its_trained_alpha(unet_lora, to):
    family, diffusers_file = unet_lora
    tensors, metadata = lora_tensors(diffusers_file)
    converted = convert(tensors, metadata, to)
    modules = {key.rsplit(".lora_", 1)[0] for key in tensors}
    expected_keys = set()
    for module in modules:
        name = expected_kohya_name(family, module)
        expected_keys |= {f"{name}.lora_down.weight", f"{name}.lora_up.weight", f"{name}.alpha"}
        assert torch.equal(converted[f"{name}.lora_down.weight"], tensors[f"{module}.lora_A.weight"])
        assert torch.equal(converted[f"{name}.lora_up.weight"], tensors[f"{module}.lora_B.weight"])
        assert converted[f"{name}.alpha"].item() == UNET_LORAS[module.split(".")[0]][1]
    assert converted.keys() == expected_keys
    if family == "sd":
        assert "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.alpha" in converted
        assert "lora_te_text_model_encoder_layers_0_self_attn_q_proj.alpha" in converted
    else:
        assert "lora_te1_text_model_encoder_layers_1_self_attn_out_proj.alpha" in converted
        assert "lora_te2_text_model_encoder_layers_0_mlp_fc1.alpha" in converted


RANK, ALPHA = 4, 6.0
# Per-module rank and alpha, so that fused q/k/v parts differ in both.
RANK_PATTERN, ALPHA_PATTERN = {"to_v": 2}, {"to_k": 2.0}


@pytest.fixture(scope="module", params=sorted(TRANSFORMERS))
def transformer_lora(request, tmp_path_factory):
    """``(family, transformer, diffusers LoRA file)``: LoRA on every linear and convolution layer of a tiny
    transformer, with per-module ranks and alphas, saved by the pipeline's ``save_lora_weights``."""
    family = request.param
    pipeline_class, build, _ = TRANSFORMERS[family]
    transformer = build()
    targets = [name for name, module in transformer.named_modules()
               if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))]
    transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, rank_pattern=RANK_PATTERN,
                                       alpha_pattern=ALPHA_PATTERN))
    perturb([parameter for name, parameter in transformer.named_parameters() if "lora_" in name])
    path = LoraExport.of(pipeline_class, {"transformer": transformer}).save(tmp_path_factory.mktemp(family))
    return family, transformer, path


def peft_deltas(transformer):
    """``{module path: weight change}`` that peft's layers add in the diffusers model."""
    return {name: module.get_delta_weight("default").detach() for name, module in transformer.named_modules()
            if isinstance(module, LoraLayer)}


def comfyui_deltas(converted):
    """``{original weight key: weight change}`` as ComfyUI computes it (``weight_adapter/lora.py``):
    ``alpha / rank * up @ down``."""
    deltas = {}
    for key in converted:
        if key.endswith(".alpha"):
            name = key[:-len(".alpha")]
            down, up = converted[f"{name}.lora_A.weight"], converted[f"{name}.lora_B.weight"]
            product = (up.flatten(1) @ down.flatten(1)).reshape(up.shape[0], *down.shape[1:])
            deltas[name.removeprefix("diffusion_model.") + ".weight"] = converted[key].item() / down.shape[0] * product
    return deltas


def test_comfyui_layout_puts_every_module_exactly_on_the_original_models_weights(transformer_lora):
    family, transformer, path = transformer_lora
    tensors, metadata = lora_tensors(path)
    converted = convert(tensors, metadata, "comfyui", family=family)
    assert all(key.startswith("diffusion_model.") for key in converted)
    to_diffusers_names = TRANSFORMERS[family][2]
    back = {key.removesuffix(".weight"): delta for key, delta in to_diffusers_names(comfyui_deltas(converted)).items()
            if key.endswith(".weight")}
    expected = peft_deltas(transformer)
    assert back.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(back[name], expected[name], msg=name)


def test_comfyui_alphas_keep_each_modules_trained_strength(transformer_lora):
    family, _, path = transformer_lora
    converted = convert(*lora_tensors(path), "comfyui", family=family)
    for key, alpha in converted.items():
        # Fused (Chroma's single blocks' linear1 too): to_q's strength (the others' are absorbed into lora_B).
        if key.endswith((".qkv.alpha", ".linear1.alpha")):
            rank = converted[key.replace(".alpha", ".lora_A.weight")].shape[0]
            assert alpha.item() / rank == ALPHA / RANK, key
        elif key.endswith(".alpha"):  # the module's trained lora_alpha itself
            to_k = key.endswith((".to_k.alpha", ".attn.wk.alpha"))  # Krea 2's original name: wk
            assert alpha.item() == (ALPHA_PATTERN["to_k"] if to_k else ALPHA), key


# Names from ComfyUI's tables (comfy/utils.py mmdit_to_diffusers, flux_to_diffusers, z_image_to_diffusers) and
# diffusers' convert_flux2_transformer_checkpoint_to_diffusers: diffusers module -> ComfyUI's module.
KNOWN_NAMES = {
    "sd3": {"transformer_blocks.0.attn.to_k": "joint_blocks.0.x_block.attn.qkv",
            "transformer_blocks.1.attn.add_v_proj": "joint_blocks.1.context_block.attn.qkv",
            "transformer_blocks.0.attn2.to_q": "joint_blocks.0.x_block.attn2.qkv",
            "transformer_blocks.0.attn.to_add_out": "joint_blocks.0.context_block.attn.proj",
            "transformer_blocks.1.ff_context.net.0.proj": None,  # the last block has no context MLP
            "transformer_blocks.0.ff.net.2": "joint_blocks.0.x_block.mlp.fc2",
            "pos_embed.proj": "x_embedder.proj", "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
            "norm_out.linear": "final_layer.adaLN_modulation.1"},
    "flux2": {"transformer_blocks.0.attn.to_v": "double_blocks.0.img_attn.qkv",
              "transformer_blocks.0.attn.add_q_proj": "double_blocks.0.txt_attn.qkv",
              "transformer_blocks.0.attn.to_out.0": "double_blocks.0.img_attn.proj",
              "transformer_blocks.0.ff_context.linear_out": "double_blocks.0.txt_mlp.2",
              "single_transformer_blocks.1.attn.to_qkv_mlp_proj": "single_blocks.1.linear1",
              "single_transformer_blocks.0.attn.to_out": "single_blocks.0.linear2",
              "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
              "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer", "x_embedder": "img_in"},
    "z_image": {"layers.1.attention.to_k": "layers.1.attention.qkv",
                "noise_refiner.0.attention.to_out.0": "noise_refiner.0.attention.out",
                "context_refiner.0.feed_forward.w3": "context_refiner.0.feed_forward.w3",
                "all_x_embedder.2-1": "x_embedder", "all_final_layer.2-1.adaLN_modulation.1":
                "final_layer.adaLN_modulation.1"},
    "chroma": {"transformer_blocks.0.attn.to_k": "double_blocks.0.img_attn.qkv",
               "transformer_blocks.0.attn.add_v_proj": "double_blocks.0.txt_attn.qkv",
               "transformer_blocks.0.ff_context.net.2": "double_blocks.0.txt_mlp.2",
               "single_transformer_blocks.1.proj_mlp": "single_blocks.1.linear1",
               "single_transformer_blocks.0.proj_out": "single_blocks.0.linear2",
               "distilled_guidance_layer.layers.1.linear_2": "distilled_guidance_layer.layers.1.out_layer",
               "context_embedder": "txt_in", "proj_out": "final_layer.linear"},
    "krea2": {"transformer_blocks.1.attn.to_gate": "blocks.1.attn.gate",
              "text_fusion.refiner_blocks.0.attn.to_out.0": "txtfusion.refiner_blocks.0.attn.wo",
              "text_fusion.layerwise_blocks.0.ff.up": "txtfusion.layerwise_blocks.0.mlp.up",
              "time_mod_proj": "tproj.1", "txt_in.linear_2": "txtmlp.3", "img_in": "first"},
    "qwen_image": {"transformer_blocks.1.attn.to_add_out": "transformer_blocks.1.attn.to_add_out",
                   "transformer_blocks.0.img_mlp.net.0.proj": "transformer_blocks.0.img_mlp.net.0.proj",
                   "img_in": "img_in", "norm_out.linear": "norm_out.linear"},
    "lumina2": {"layers.1.attn.to_v": "layers.1.attention.qkv", "context_refiner.0.attn.to_out.0":
                "context_refiner.0.attention.out", "noise_refiner.0.feed_forward.linear_2":
                "noise_refiner.0.feed_forward.w2", "layers.0.norm1.linear": "layers.0.adaLN_modulation.1",
                "time_caption_embed.caption_embedder.1": "cap_embedder.1", "norm_out.linear_2": "final_layer.linear"},
    "hidream": {"double_stream_blocks.0.block.attn1.to_q_t": "double_stream_blocks.0.block.attn1.to_q_t",
                "single_stream_blocks.0.block.ff_i.experts.1.w2": "single_stream_blocks.0.block.ff_i.experts.1.w2",
                "caption_projection.2.linear": "caption_projection.2.linear", "x_embedder.proj": "x_embedder.proj"},
}


def test_known_modules_take_comfyuis_names(transformer_lora):
    family, _, path = transformer_lora
    tensors, metadata = lora_tensors(path)
    converted = convert(tensors, metadata, "comfyui", family=family)
    for diffusers_name, comfyui_name in KNOWN_NAMES[family].items():
        if comfyui_name is None:
            assert f"transformer.{diffusers_name}.lora_A.weight" not in tensors
        else:
            assert f"transformer.{diffusers_name}.lora_A.weight" in tensors
            assert f"diffusion_model.{comfyui_name}.lora_B.weight" in converted, comfyui_name


def test_ideogram4s_comfyui_layout_is_what_diffusers_own_ideogram4_conversion_reads_back(tmp_path):
    """No single-file converter knows Ideogram 4's original layout; diffusers' Ideogram 4 LoRA loader reads it (the
    trainers' "diffusion_model." keys, q, k and v fused, the attention's output "o"). Every linear layer of its
    blocks, at per-module ranks and alphas, comes back as the weight change peft applies; a layer outside the blocks
    has no known original name and is refused."""
    torch.manual_seed(0)
    transformer = Ideogram4Transformer2DModel(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
                                              intermediate_size=32, adaln_dim=16, llm_features_dim=32,
                                              rope_theta=10_000, mrope_section=(2, 1, 1))
    targets = [name for name, module in transformer.named_modules()
               if name.startswith("layers.") and isinstance(module, torch.nn.Linear)]
    transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, rank_pattern=RANK_PATTERN,
                                       alpha_pattern=ALPHA_PATTERN))
    perturb([parameter for name, parameter in transformer.named_parameters() if "lora_" in name])
    path = LoraExport.of(Ideogram4Pipeline, {"transformer": transformer}).save(tmp_path)
    converted = convert(*lora_tensors(path), "comfyui", family="Ideogram4Pipeline")
    assert {"diffusion_model.layers.1.attention.qkv.lora_A.weight", "diffusion_model.layers.0.attention.o.alpha",
            "diffusion_model.layers.1.feed_forward.w3.lora_B.weight",
            "diffusion_model.layers.0.adaln_modulation.lora_A.weight"} <= converted.keys()
    back = Ideogram4Pipeline.lora_state_dict(dict(converted))  # alphas folded into the weights
    deltas = {key.removeprefix("transformer.").removesuffix(".lora_A.weight"):
              back[key.replace("lora_A", "lora_B")] @ back[key] for key in back if key.endswith("lora_A.weight")}
    expected = peft_deltas(transformer)
    assert deltas.keys() == expected.keys() == set(targets)
    for name in expected:
        torch.testing.assert_close(deltas[name], expected[name], msg=name)
    outside = {"transformer.input_proj.lora_A.weight": torch.ones(2, 16), "transformer.input_proj.lora_B.weight":
               torch.ones(32, 2)}
    with pytest.raises(UsageError, match="--family='Ideogram4Pipeline': expected a family whose models have "
                                         "transformer.input_proj"):
        convert(outside, None, "comfyui", lora_alpha=2.0, family="Ideogram4Pipeline")


# diffusers' convert_flux_transformer_checkpoint_to_diffusers (ComfyUI's flux_to_diffusers): diffusers -> ComfyUI.
FLUX1_NAMES = {"transformer_blocks.0.attn.to_add_out": "double_blocks.0.txt_attn.proj",
               "transformer_blocks.0.ff.net.0.proj": "double_blocks.0.img_mlp.0",
               "transformer_blocks.0.ff_context.net.2": "double_blocks.0.txt_mlp.2",
               "transformer_blocks.0.norm1_context.linear": "double_blocks.0.txt_mod.lin",
               "single_transformer_blocks.1.proj_out": "single_blocks.1.linear2",
               "single_transformer_blocks.1.norm.linear": "single_blocks.1.modulation.lin",
               "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
               "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer", "proj_out": "final_layer.linear"}


def test_flux1s_linear1_takes_q_k_v_and_the_four_times_wider_mlp_each_at_its_own_strength(tmp_path):
    # FLUX.1's single-stream blocks fuse q, k, v and the MLP's input projection (4 times as many rows) into one
    # linear1: ComfyUI applies one LoRA there, whose rows must be each module's own change, at its trained strength.
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
                                         pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    targets = [name for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)]
    transformer.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets,
                                       rank_pattern={"proj_mlp": 2, **RANK_PATTERN}, alpha_pattern=ALPHA_PATTERN))
    perturb([parameter for name, parameter in transformer.named_parameters() if "lora_" in name])
    tensors, metadata = lora_tensors(LoraExport.of(FluxPipeline, {"transformer": transformer}).save(tmp_path))
    converted = convert(tensors, metadata, "comfyui", family="flux")
    deltas, expected = comfyui_deltas(converted), peft_deltas(transformer)
    linear1 = torch.cat([expected[f"single_transformer_blocks.0.{name}"]
                         for name in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")])
    assert linear1.shape[0] == 7 * transformer.inner_dim
    torch.testing.assert_close(deltas["single_blocks.0.linear1.weight"], linear1)
    for stream, names in (("img", ("to_q", "to_k", "to_v")), ("txt", ("add_q_proj", "add_k_proj", "add_v_proj"))):
        qkv = torch.cat([expected[f"transformer_blocks.0.attn.{name}"] for name in names])
        torch.testing.assert_close(deltas[f"double_blocks.0.{stream}_attn.qkv.weight"], qkv)
    for diffusers_name, comfyui_name in FLUX1_NAMES.items():
        torch.testing.assert_close(deltas[f"{comfyui_name}.weight"], expected[diffusers_name], msg=comfyui_name)
    shift, scale = expected["norm_out.linear"].chunk(2)  # the original orders the final modulation's halves so
    torch.testing.assert_close(deltas["final_layer.adaLN_modulation.1.weight"], torch.cat([scale, shift]))
    assert len(deltas) == len(expected) - 2 * 3 - 2 * 2  # every module placed; the fused ones once


FLUX2_ATTENTION = "transformer.transformer_blocks.0.attn"
QKV = "diffusion_model.double_blocks.0.img_attn.qkv"


def flux2_attention_lora(ranks, alphas, parts=("to_q", "to_k", "to_v")):
    """A FLUX.2 LoRA on some of a block's q/k/v projections (width 32, input 16), with per-module ranks and
    alphas in its metadata."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for part, rank in zip(parts, ranks):
        tensors[f"{FLUX2_ATTENTION}.{part}.lora_A.weight"] = torch.randn(rank, 16, generator=generator)
        tensors[f"{FLUX2_ATTENTION}.{part}.lora_B.weight"] = torch.randn(32, rank, generator=generator)
    config = {"transformer.r": ranks[0], "transformer.lora_alpha": alphas[0],
              "transformer.rank_pattern": dict(zip(parts, ranks)),
              "transformer.alpha_pattern": dict(zip(parts, alphas))}
    return tensors, {METADATA_KEY: json.dumps(config)}


def part_delta(tensors, part, scale):
    module = f"{FLUX2_ATTENTION}.{part}"
    return scale * tensors[f"{module}.lora_B.weight"] @ tensors[f"{module}.lora_A.weight"]


def fused_delta(converted):
    down, up = converted[f"{QKV}.lora_A.weight"], converted[f"{QKV}.lora_B.weight"]
    return converted[f"{QKV}.alpha"].item() / down.shape[0] * up @ down


@pytest.mark.parametrize("ranks, alphas", [((4, 4, 4), (8.0, 8.0, 8.0)), ((4, 2, 3), (8.0, 1.0, 5.0))])
def test_fused_qkv_is_exactly_the_stacked_parts_with_alpha_growing_with_the_rank(ranks, alphas):
    tensors, metadata = flux2_attention_lora(ranks, alphas)
    converted = convert(tensors, metadata, "comfyui", family="flux2")
    assert set(converted) == {f"{QKV}.lora_A.weight", f"{QKV}.lora_B.weight", f"{QKV}.alpha"}
    down, up, alpha = converted[f"{QKV}.lora_A.weight"], converted[f"{QKV}.lora_B.weight"], converted[f"{QKV}.alpha"]
    assert down.shape == (sum(ranks), 16) and up.shape == (96, sum(ranks))
    assert alpha.item() / sum(ranks) == pytest.approx(alphas[0] / ranks[0])
    parts = [part_delta(tensors, part, alphas[i] / ranks[i]) for i, part in enumerate(("to_q", "to_k", "to_v"))]
    torch.testing.assert_close(fused_delta(converted), torch.cat(parts))
    if ranks == (4, 4, 4):  # alike parts: the tensors themselves, unscaled
        assert torch.equal(down[4:8], tensors[f"{FLUX2_ATTENTION}.to_k.lora_A.weight"])
        assert torch.equal(up[32:64, 4:8], tensors[f"{FLUX2_ATTENTION}.to_k.lora_B.weight"])
        assert not up[:32, 4:].any() and not up[32:64, :4].any()
        assert alpha.item() == 24.0


def test_a_part_without_lora_gets_zero_rows_in_the_fused_layer():
    tensors, metadata = flux2_attention_lora((4, 2), (8.0, 3.0), parts=("to_q", "to_v"))
    q, k, v = fused_delta(convert(tensors, metadata, "comfyui", family="flux2")).chunk(3)
    torch.testing.assert_close(q, part_delta(tensors, "to_q", 2.0))
    assert not k.any()
    torch.testing.assert_close(v, part_delta(tensors, "to_v", 1.5))


# A layer that fuses q, k and v with an MLP projection four times wider, as FLUX.1's single-stream blocks do.
SINGLE_BLOCK = Family("single_blocks", "fused parts of unequal size", ("SingleBlockPipeline",), "transformer", {},
                      fused(r"single_transformer_blocks\.(\d+)\.{}", r"single_blocks.\1.linear1",
                            ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), sizes=(1, 1, 1, 4)))
LINEAR1 = "diffusion_model.single_blocks.0.linear1"


@pytest.mark.parametrize("parts", [("attn.to_q", "attn.to_v", "proj_mlp"), ("proj_mlp",), ("attn.to_k",)])
def test_parts_of_unequal_size_fuse_each_into_its_own_rows(monkeypatch, parts):
    monkeypatch.setitem(FAMILIES, SINGLE_BLOCK.name, SINGLE_BLOCK)
    generator = torch.Generator().manual_seed(0)
    width = 8  # q, k and v's rows; the MLP projection has four times as many
    rows = {"attn.to_q": width, "attn.to_k": width, "attn.to_v": width, "proj_mlp": 4 * width}
    tensors = {}
    for rank, part in enumerate(parts, start=2):
        module = f"transformer.single_transformer_blocks.0.{part}"
        tensors[f"{module}.lora_A.weight"] = torch.randn(rank, 16, generator=generator)
        tensors[f"{module}.lora_B.weight"] = torch.randn(rows[part], rank, generator=generator)
    converted = convert(tensors, None, "comfyui", lora_alpha=4.0, family=SINGLE_BLOCK.name)
    down, up = converted[f"{LINEAR1}.lora_A.weight"], converted[f"{LINEAR1}.lora_B.weight"]
    delta = converted[f"{LINEAR1}.alpha"].item() / down.shape[0] * up @ down
    assert delta.shape == (7 * width, 16)
    start = 0
    for part, size in rows.items():  # each part's product in its rows of the fused layer; zero where not trained
        module = f"transformer.single_transformer_blocks.0.{part}"
        expected = torch.zeros(size, 16)
        if part in parts:
            rank = tensors[f"{module}.lora_A.weight"].shape[0]
            expected = 4.0 / rank * tensors[f"{module}.lora_B.weight"] @ tensors[f"{module}.lora_A.weight"]
        torch.testing.assert_close(delta[start:start + size], expected, msg=part)
        start += size


def test_parts_whose_rows_disagree_with_the_layout_are_refused(monkeypatch):
    monkeypatch.setitem(FAMILIES, SINGLE_BLOCK.name, SINGLE_BLOCK)
    prefix = "transformer.single_transformer_blocks.0"
    tensors = {f"{prefix}.{part}.lora_{half}.weight": torch.ones(*shape) for part in ("attn.to_q", "proj_mlp")
               for half, shape in (("A", (2, 16)), ("B", (8, 2)))}  # the MLP part as narrow as q
    with pytest.raises(UsageError, match="fusing diffusion_model.single_blocks.0.linear1 needs linear parts whose rows "
                                         "are as 1:1:1:4"):
        convert(tensors, None, "comfyui", lora_alpha=4.0, family=SINGLE_BLOCK.name)


def unet_module(rank=4, **config):
    """A one-module UNet LoRA and its metadata (none when ``config`` is empty)."""
    path = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"
    tensors = {f"{path}.lora_A.weight": torch.ones(rank, 8), f"{path}.lora_B.weight": torch.ones(8, rank)}
    metadata = {METADATA_KEY: json.dumps({f"unet.{key}": value for key, value in config.items()})} if config else None
    return tensors, metadata


def kohya_alpha(tensors, metadata, **kwargs):
    converted = convert(tensors, metadata, "kohya", **kwargs)
    return converted["lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.alpha"].item()


def test_alpha_follows_peft_patterns_rslora_and_the_flag_for_files_without_metadata():
    assert kohya_alpha(*unet_module(r=4, lora_alpha=8)) == 8
    assert kohya_alpha(*unet_module(r=4, lora_alpha=8, alpha_pattern={"attn1.to_q": 2})) == 2
    assert kohya_alpha(*unet_module(r=4, lora_alpha=8, alpha_pattern={"attn2.to_q": 2})) == 8
    # rslora scales by alpha / sqrt(r); the tools by alpha / rank.
    assert kohya_alpha(*unet_module(r=4, lora_alpha=8, use_rslora=True)) == pytest.approx(8 / math.sqrt(4) * 4)
    assert kohya_alpha(*unet_module(), lora_alpha=5.0) == 5
    with pytest.raises(UsageError, match="no adapter metadata for unet: pass --lora_alpha"):
        kohya_alpha(*unet_module())
    with pytest.raises(UsageError, match="--lora_alpha=3.0: expected nothing, or the file's own lora_alpha"):
        kohya_alpha(*unet_module(r=4, lora_alpha=8), lora_alpha=3.0)


def test_formats_that_do_not_apply_and_keys_that_cannot_be_placed_are_refused():
    tensors, metadata = flux2_attention_lora((4, 4, 4), (8.0, 8.0, 8.0))
    with pytest.raises(UsageError, match=r"--to='kohya': expected comfyui for a FLUX.2 LoRA \(kohya applies to the "
                                         r"SD 1.x, SDXL families\)"):
        convert(tensors, metadata, "kohya", family="flux2")
    # Attention projections alone fit SD3, FLUX.1 (and Kontext), FLUX.2 ([klein] and [dev]), Qwen-Image (and
    # Qwen-Image-Edit), Chroma, Krea 2 and HiDream, whose layouts differ.
    with pytest.raises(UsageError, match="fit the families sd3, flux, flux2, qwen_image, chroma, flux2_dev, krea2, "
                                         "hidream, flux_kontext, qwen_image_edit, which convert them differently"):
        convert(tensors, metadata, "comfyui")
    with pytest.raises(UsageError, match="--family='sd': expected a family whose models have transformer."):
        convert(tensors, metadata, "comfyui", family="sd")
    bias = {**unet_module()[0], "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.bias":
            torch.ones(8)}
    with pytest.raises(UsageError, match="no bias or embedding adapters"):
        convert(bias, None, "kohya", lora_alpha=4.0)


def test_formats_for_pipeline_classes_and_families():
    assert formats_for("StableDiffusionPipeline") == formats_for("StableDiffusionXLPipeline") == ("kohya", "comfyui")
    assert formats_for("StableDiffusionXLImg2ImgPipeline") == formats_for("sd") == ("kohya", "comfyui")
    for name in ("StableDiffusion3Pipeline", "FluxPipeline", "Flux2KleinPipeline", "Flux2Pipeline", "ZImagePipeline",
                 "QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline", "ChromaPipeline",
                 "Krea2Pipeline", "WanPipeline", "WanImageToVideoPipeline", "FluxKontextPipeline", "Ideogram4Pipeline"):
        assert formats_for(name) == ("comfyui",), name
    assert formats_for("CogVideoXPipeline") == ()


@pytest.mark.parametrize("name", ["FluxKontextInpaintPipeline", "QwenImageEditInpaintPipeline",
                                  "StableDiffusionXLPipelineForMyTask", "Flux2KleinPipelineX"])
def test_a_family_is_matched_by_its_pipeline_class_exactly(name):
    # An inpainting pipeline is not its edit pipeline's, a pipeline is not its look-alikes: a look-alike name matches
    # no family until a family module names it.
    assert family_of(name) is None and formats_for(name) == ()
    assert family_of("Flux2KleinPipeline").name == "flux2" and family_of("flux2").name == "flux2"
    assert family_of("FluxPipeline").name == "flux" and family_of("flux").name == "flux"
    assert family_of("FluxKontextPipeline").name == "flux_kontext"


def test_the_command_converts_a_file(unet_lora, tmp_path, capsys):
    family, diffusers_file = unet_lora
    main([str(diffusers_file), str(tmp_path / "out" / "comfyui.safetensors"), "--to", "comfyui"])
    written = load_file(tmp_path / "out" / "comfyui.safetensors")
    expected = convert(*lora_tensors(diffusers_file), "comfyui")
    assert written.keys() == expected.keys() and all(torch.equal(written[key], expected[key]) for key in expected)
    assert capsys.readouterr().out.startswith("wrote ")


def command_error(capsys, *args):
    """The one ``error:`` line of the command, which must exit with status 2 and no traceback."""
    with pytest.raises(SystemExit) as exited:
        main([str(arg) for arg in args])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and stderr.count("\n") == 1 and stderr.startswith("error: "), stderr
    return stderr.strip()


def test_the_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    tensors, metadata = flux2_attention_lora((4, 4, 4), (8.0, 8.0, 8.0))
    source = tmp_path / "flux2.safetensors"
    save_file(tensors, source, metadata)
    assert "--to='kohya': expected comfyui for a FLUX.2 LoRA" in command_error(
        capsys, source, tmp_path / "out.safetensors", "--to", "kohya", "--family", "Flux2KleinPipeline")
    assert "pass --family" in command_error(capsys, source, tmp_path / "out.safetensors", "--to", "comfyui")
    assert "SRC=" in command_error(capsys, tmp_path / "missing.safetensors", tmp_path / "out.safetensors", "--to",
                                   "comfyui")
    assert "invalid choice" in command_error(capsys, source, tmp_path / "out.safetensors", "--to", "a1111")
    assert not (tmp_path / "out.safetensors").exists()


@pytest.fixture
def flux2_file(tmp_path):
    """A FLUX.2 LoRA file without adapter metadata (so --lora_alpha is read), in a folder of its own."""
    tensors, _ = flux2_attention_lora((4, 4, 4), (8.0, 8.0, 8.0))
    source = tmp_path / "lora" / "pytorch_lora_weights.safetensors"
    source.parent.mkdir()
    save_file(tensors, source)
    return source


def dst_aliases_of_src(source):
    """What names SRC itself as the command's DST: its path, a symbolic and a hard link to it, its folder."""
    symbolic, hard = source.with_name("symbolic.safetensors"), source.with_name("hard.safetensors")
    symbolic.symlink_to(source)
    hard.hardlink_to(source)
    return {"the same path": source, "a symbolic link": symbolic, "a hard link": hard, "its folder": source.parent}


def test_the_command_never_writes_over_its_source(flux2_file, capsys):
    original = flux2_file.read_bytes()
    for alias, dst in dst_aliases_of_src(flux2_file).items():
        line = command_error(capsys, flux2_file, dst, "--to", "comfyui", "--family", "flux2", "--lora_alpha", 8)
        assert line.startswith(f"error: DST={str(dst)!r}: expected a file other than SRC: "), alias
        assert line.endswith("is SRC itself, which the converted LoRA would overwrite") or "(a link to it)" in line
        assert flux2_file.read_bytes() == original, alias


@pytest.mark.parametrize("alpha", ["nan", "inf", "0", "-8"])
def test_the_command_refuses_an_alpha_that_is_not_a_positive_number(flux2_file, alpha, capsys):
    dst = flux2_file.with_name("out.safetensors")
    line = command_error(capsys, flux2_file, dst, "--to", "comfyui", "--family", "flux2", "--lora_alpha", alpha)
    assert line == f"error: --lora_alpha={float(alpha)!r}: expected a positive number"
    assert not dst.exists()


def test_the_command_refuses_destinations_it_cannot_write_in_one_line(flux2_file, tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    arguments = ["--to", "comfyui", "--family", "flux2", "--lora_alpha", 8]
    assert command_error(capsys, flux2_file, tmp_path / "out.ckpt", *arguments) == (
        f"error: DST={str(tmp_path / 'out.ckpt')!r}: expected a .safetensors file to write, or a folder to write it "
        f"into")
    assert command_error(capsys, flux2_file, a_file / "out.safetensors", *arguments) == (
        f"error: DST={str(a_file / 'out.safetensors')!r}: expected a file this user can write ({a_file} is a file, "
        f"not a folder)")
    assert command_error(capsys, tmp_path / "missing.safetensors", tmp_path / "out.safetensors", *arguments) == (
        f"error: SRC={str(tmp_path / 'missing.safetensors')!r}: expected an existing .safetensors file or folder of "
        f"peft adapters")
    assert command_error(capsys, tmp_path / "lora", tmp_path / "out.safetensors", *arguments) == (
        f"error: SRC={str(tmp_path / 'lora')!r}: expected a folder of peft adapters, a subfolder with "
        f"adapter_config.json per component")
    (tmp_path / "peft" / "transformer").mkdir(parents=True)
    assert command_error(capsys, tmp_path / "peft", tmp_path / "peft" / "transformer", *arguments) == (
        f"error: DST={str(tmp_path / 'peft' / 'transformer')!r}: expected a file outside SRC's folder of adapters "
        f"({tmp_path / 'peft'})")


def test_a_folder_dst_gets_the_sources_name_and_an_existing_file_is_replaced_whole(flux2_file, tmp_path, capsys,
                                                                                    group_umask):
    elsewhere = tmp_path / "converted"
    elsewhere.mkdir()
    (elsewhere / flux2_file.name).write_bytes(b"an older conversion")
    main([str(flux2_file), str(elsewhere), "--to", "comfyui", "--family", "flux2", "--lora_alpha", "8"])
    written = elsewhere / flux2_file.name
    expected = convert(load_file(flux2_file), {}, "comfyui", 8.0, "flux2")
    assert load_file(written).keys() == expected.keys()
    assert stat.S_IMODE(written.stat().st_mode) == 0o640
    assert capsys.readouterr().out == f"wrote {written} (comfyui)\n"
    assert sorted(path.name for path in elsewhere.iterdir()) == [flux2_file.name]
