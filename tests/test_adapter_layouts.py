"""Each adapter in the UI tools' layouts (training_utils.adapters.layouts, through convert_lora): every module's keys
are those ComfyUI's loader reads, none left unread, with the alpha it trained with; and what ComfyUI applies
(`comfyui`, re-implemented from its source) is exactly the weight peft's adapter makes, for the UNet families' kohya
files and each transformer family's ComfyUI layout, fused layers included. DoRA is exact under LyCORIS's convention
(the merged weight's norms); ComfyUI's own (the base weight's) differs, and is measured."""

import copy

import pytest
import torch
from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
from peft import LoHaConfig, LoKrConfig, LoraConfig, OFTConfig
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from comfyui import comfyui_weight, delta_shape, module_weights
from training_utils.adapters.convert import target_of, write_converted
from training_utils.adapters.export import adapter_export, converted_name
from training_utils.adapters.injection import ATTENTION_PROJECTIONS, CLIP_ATTENTION_PROJECTIONS, add_adapter
from training_utils.errors import UsageError
from training_utils.families.registry import family_of
from training_utils.pipeline import trainable_parameters
from test_export import perturb
from transformer_layouts import TRANSFORMERS

ADAPTERS = ["dora", "lokr", "loha", "oft"]
RANK, ALPHA = 4, 6.0
# OFT's blocks: it goes on the layers whose input width they divide (another block size is refused).
OFT_BLOCK_SIZE = 4
# Per-module rank and alpha (fused q, k and v parts differ in both); LoKr's first factors low-rank where small enough.
RANK_PATTERN, ALPHA_PATTERN = {"to_v": 2}, {"to_k": 2.0}
# What ComfyUI's loader reads of a module of each kind (``comfy/weight_adapter``), besides the ".alpha".
READ = {"dora": {"lora_down.weight", "lora_up.weight", "lora_A.weight", "lora_B.weight", "dora_scale"},
        "lokr": {"lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b"},
        "loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"}, "oft": {"diff"}}


def config(adapter, targets, patterns=True):
    patterns = {"rank_pattern": RANK_PATTERN, "alpha_pattern": ALPHA_PATTERN} if patterns else {}
    return {"dora": lambda: LoraConfig(r=RANK, lora_alpha=ALPHA, use_dora=True, target_modules=targets, **patterns),
            "lokr": lambda: LoKrConfig(r=RANK, alpha=ALPHA, decompose_both=True, target_modules=targets, **patterns),
            "loha": lambda: LoHaConfig(r=RANK, alpha=ALPHA, target_modules=targets, **patterns),
            "oft": lambda: OFTConfig(oft_block_size=OFT_BLOCK_SIZE, target_modules=targets)}[adapter]()


def peft_weights(model):
    """``{module path: (base weight, the weight peft's adapter makes of it)}``, the latter by peft's own merge."""
    weights = {}
    for name, layer in model.named_modules():
        if isinstance(layer, BaseTunerLayer):
            merged = copy.deepcopy(layer)
            merged.merge()
            weights[name] = (layer.get_base_layer().weight.detach().float(), merged.get_base_layer().weight.detach())
    return weights


def assert_alphas_are_the_trained_ones(modules, adapter, alpha_of):
    """Each module's ``.alpha``: the alpha of ``alpha_of(prefix)`` (its trained alpha; a fused module's grows with its
    rank), none for OFT's differences."""
    for prefix, module in modules.items():
        names = set(module) - {"alpha"}
        assert names <= READ[adapter] or names == {"diff"}, (prefix, names)
        if "diff" in module:
            assert "alpha" not in module, prefix
        else:
            assert module["alpha"].item() == pytest.approx(alpha_of(prefix, module)), prefix


UNET_PIPELINES = {"sd": StableDiffusionPipeline, "sdxl": StableDiffusionXLPipeline}


@pytest.mark.parametrize("adapter", ADAPTERS)
@pytest.mark.parametrize("family", sorted(UNET_PIPELINES))
def test_a_kohya_file_makes_the_weights_of_the_trained_adapter(tiny, family, adapter, tmp_path):
    pipe = UNET_PIPELINES[family].from_pretrained(tiny[family])
    add_adapter(pipe.unet, config(adapter, ATTENTION_PROJECTIONS, patterns=False))
    add_adapter(pipe.text_encoder, config(adapter, CLIP_ATTENTION_PROJECTIONS, patterns=False))
    trained = {"unet": pipe.unet, "text_encoder": pipe.text_encoder}
    perturb(trainable_parameters(trained), scale=0.2)
    adapter_export(UNET_PIPELINES[family], trained, ["diffusers", "kohya"]).save(tmp_path)
    modules, unread = module_weights(load_file(tmp_path / converted_name("kohya")))
    assert not unread
    assert_alphas_are_the_trained_ones(modules, adapter, lambda prefix, module: ALPHA)
    for component, model in trained.items():
        for path, (base, expected) in peft_weights(model).items():
            module = modules.pop(target_of(family_of(family), component, path).name)
            torch.testing.assert_close(comfyui_weight(module, base, dora="lycoris"), expected, msg=path)
    assert not modules


@pytest.fixture(scope="module", params=[(family, adapter) for family in sorted(TRANSFORMERS) for adapter in ADAPTERS],
                ids=lambda param: "-".join(param))
def transformer_adapter(request, tmp_path_factory):
    """``(family, adapter, transformer, folder)``: the adapter on every linear layer of a tiny transformer (OFT on
    those its blocks fit), with per-module ranks and alphas, saved with its ComfyUI layout."""
    family, adapter = request.param
    pipeline_class, build, _ = TRANSFORMERS[family]
    transformer = build()
    targets = [name for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)
               and (adapter != "oft" or module.in_features % OFT_BLOCK_SIZE == 0)]
    add_adapter(transformer, config(adapter, targets))
    perturb(trainable_parameters({"transformer": transformer}), scale=0.2)
    folder = tmp_path_factory.mktemp(f"{family}-{adapter}")
    adapter_export(pipeline_class, {"transformer": transformer}, ["diffusers", "comfyui"]).save(folder)
    return family, adapter, transformer, folder


def test_comfyui_makes_the_weights_of_the_trained_adapter_on_the_original_models_layers(transformer_adapter):
    family, adapter, transformer, folder = transformer_adapter
    converted = load_file(folder / converted_name("comfyui"))
    assert all(key.startswith("diffusion_model.") for key in converted)
    modules, unread = module_weights(converted)
    assert not unread
    # What ComfyUI adds to each of the original model's weights (a DoRA's before its rows are rescaled) and a DoRA's
    # magnitudes, taken back to diffusers' names by diffusers' converters (the magnitudes as one-column weights).
    deltas, magnitudes = {}, {}
    for prefix, module in modules.items():
        key = prefix.removeprefix("diffusion_model.") + ".weight"
        plain = {name: tensor for name, tensor in module.items() if name != "dora_scale"}
        deltas[key] = comfyui_weight(plain, torch.zeros(delta_shape(plain)))
        if "dora_scale" in module:
            magnitudes[key] = module["dora_scale"]
    to_diffusers = TRANSFORMERS[family][2]
    deltas, magnitudes = (to_diffusers(tensors) if tensors else {} for tensors in (deltas, magnitudes))
    weights = peft_weights(transformer)
    changed = {key.removesuffix(".weight") for key, delta in deltas.items() if key.endswith(".weight") and delta.any()}
    assert changed == weights.keys()
    for path, (base, expected) in weights.items():
        merged = base + deltas[f"{path}.weight"]
        if adapter == "dora":  # LyCORIS's convention: the merged weight's row norms
            norms = merged.norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps
            torch.testing.assert_close(merged * magnitudes[f"{path}.weight"] / norms, expected, msg=path)
            assert not torch.allclose(merged * magnitudes[f"{path}.weight"] / base.norm(dim=1, keepdim=True),
                                      expected), "ComfyUI's base-weight norms differ from peft's"
        else:
            torch.testing.assert_close(merged, expected, msg=path)


def test_comfyui_modules_hold_the_alpha_each_trained_with(transformer_adapter):
    family, adapter, _, folder = transformer_adapter
    modules, _ = module_weights(load_file(folder / converted_name("comfyui")))

    def trained_alpha(prefix, module):
        rank = module.get("hada_w1_b", module.get("lora_A.weight", module.get("lora_down.weight")))
        if prefix.endswith(("qkv", "linear1")) and rank is not None and adapter != "lokr":
            return ALPHA / RANK * rank.shape[0]  # fused: to_q's strength, at the parts' summed rank
        to_k = prefix.endswith((".to_k", ".attn.wk"))  # Krea 2's original name: wk
        return ALPHA_PATTERN["to_k"] if to_k else ALPHA

    assert_alphas_are_the_trained_ones(modules, adapter, trained_alpha)
    kinds = {name for module in modules.values() for name in module}
    assert kinds & READ[adapter], kinds


def test_a_lokr_of_whole_factors_takes_its_scale_into_the_first_factor():
    # The tools apply a LoKr whose factors are both whole at scale 1, whatever its alpha; peft at alpha / rank.
    transformer = TRANSFORMERS["qwen_image"][1]()
    add_adapter(transformer, LoKrConfig(r=16, alpha=4.0, target_modules=["img_in"]))
    perturb(trainable_parameters({"transformer": transformer}), scale=0.2)
    export = adapter_export(TRANSFORMERS["qwen_image"][0], {"transformer": transformer}, ["diffusers", "comfyui"])
    converted = export.converted(export.layers(trainable_parameters({"transformer": transformer})))
    module = module_weights(converted[converted_name("comfyui")])[0]["diffusion_model.img_in"]
    assert set(module) == {"lokr_w1", "lokr_w2", "alpha"} and module["alpha"].item() == 4.0
    torch.testing.assert_close(module["lokr_w1"], transformer.img_in.lokr_w1["default"].detach() * 4.0 / 16)
    base, expected = peft_weights(transformer)["img_in"]
    torch.testing.assert_close(comfyui_weight(module, base), expected)


@pytest.mark.parametrize("adapter", ["lokr", "oft"])
def test_a_difference_is_computed_from_a_random_state_of_its_own_never_the_runs(adapter):
    # peft's layers draw initial values as they are made; a checkpoint has just saved the run's random state, which
    # its resume continues from, so the conversion that follows must not draw from it.
    transformer = TRANSFORMERS["flux2"][1]()
    add_adapter(transformer, config(adapter, ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k"],
                                    patterns=False))
    trained = {"transformer": transformer}
    perturb(trainable_parameters(trained), scale=0.2)
    random_state = torch.get_rng_state()
    export = adapter_export(TRANSFORMERS["flux2"][0], trained, ["diffusers", "comfyui"])
    (converted,) = export.converted(export.layers(trainable_parameters(trained))).values()
    assert set(converted) == {"diffusion_model.double_blocks.0.img_attn.qkv.diff"}  # LoKr and OFT fuse as differences
    assert torch.equal(torch.get_rng_state(), random_state)


def test_the_command_converts_a_folder_of_peft_adapters_with_the_base_weights_it_names(tiny, tmp_path):
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    add_adapter(pipe.unet, config("oft", ATTENTION_PROJECTIONS))
    perturb(trainable_parameters({"unet": pipe.unet}), scale=0.2)
    adapter_export(StableDiffusionPipeline, {"unet": pipe.unet}, ["diffusers", "comfyui"]).save(tmp_path / "run")
    write_converted(tmp_path / "run", tmp_path / "converted.safetensors", "comfyui")
    written, in_run = (load_file(path) for path in (tmp_path / "converted.safetensors",
                                                    tmp_path / "run" / converted_name("comfyui")))
    assert written.keys() == in_run.keys()
    for key in written:  # the base weights read from disk are those the run held
        torch.testing.assert_close(written[key], in_run[key], rtol=0, atol=1e-6)
    config_file = tmp_path / "run" / "unet" / "adapter_config.json"
    config_file.write_text(config_file.read_text().replace(str(tiny["sd"]), str(tmp_path / "gone")))
    with pytest.raises(UsageError, match="base_model_name_or_path=.*gone/unet.*: expected the folder of unet's base"):
        write_converted(tmp_path / "run", tmp_path / "again.safetensors", "comfyui")
