"""Convert a trained adapter's files into the layouts that UI tools load: kohya's and ComfyUI's.

    python -m training_utils.adapters.convert SRC DST.safetensors --to kohya|comfyui [--lora_alpha A]

SRC is a LoRA or DoRA as ``<Pipeline>.save_lora_weights`` writes it, one file: keys ``<component>.<module
path>.lora_A.weight``, ``.lora_B.weight`` (and DoRA's ``.lora_magnitude_vector``; component ``unet``, ``transformer``,
``text_encoder``, ``text_encoder_2``), and the safetensors metadata ``lora_adapter_metadata`` (diffusers'
``LORA_ADAPTER_METADATA_KEY``): a JSON object of each component's peft ``LoraConfig``, its fields keyed
``<component>.<field>`` (diffusers' ``_pack_dict_with_prefix``). Or SRC is a folder of adapters in peft's own format
(LoKr, LoHa, OFT; `adapters.export.PeftExport`): a subfolder per component holding ``adapter_config.json`` and
``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes them. Each module's tensors are written as the
tools apply its adapter kind (`adapter_layouts`); an OFT's weight difference needs the base weights, read from the
component folder its ``adapter_config.json`` names (``base_model_name_or_path``).

DST is the file to write, or a folder to write it into under SRC's name (as ``cp`` does); it is never SRC itself
(the same file, a link to it, or a file in SRC's folder of adapters), and an existing DST is replaced only once the
new file is whole.

Formats
- ``kohya`` (A1111/Forge, kohya sd-scripts; UNet families only: SD 1.x, SDXL): ``lora_unet_<diffusers module path,
  dots as underscores>`` (the names sd-scripts gives the diffusers UNet it wraps, and that ComfyUI maps through
  ``comfy.utils.unet_to_diffusers`` in ``comfy/lora.py`` ``model_lora_keys_unet``); text encoders ``lora_te_``
  (SD 1.x) or ``lora_te1_``/``lora_te2_`` (SDXL; sd-scripts ``networks/lora.py`` ``LORA_PREFIX_TEXT_ENCODER1/2``)
  followed by the CLIP module path under ``text_model.`` (``model_lora_keys_clip``'s
  ``lora_te1_text_model_encoder_layers_{}_{}``; transformers 5 dropped that level from ``CLIPTextModel``'s names,
  so it is put back). Tensors ``.lora_down.weight`` (peft's lora_A), ``.lora_up.weight`` (lora_B), ``.alpha``; the
  other adapters' under their LyCORIS names (`adapter_layouts`).
- ``comfyui`` (every family ComfyUI has a model of: not SANA): for the UNet families the kohya file. For the
  transformer families ComfyUI's own layout, ``diffusion_model.<module path in the original model>.lora_A.weight`` /
  ``.lora_B.weight`` / ``.alpha``: the "generic lora format" key that ``model_lora_keys_unet`` maps for every weight
  of ComfyUI's model, which is the original release's module tree. The renamings are those of ``comfy/utils.py``
  ``mmdit_to_diffusers`` (SD3), ``flux_to_diffusers`` and diffusers'
  ``convert_flux2_transformer_checkpoint_to_diffusers`` (FLUX.2), ``z_image_to_diffusers`` (Z-Image), diffusers'
  ``convert_lumina2_to_diffusers`` (Lumina 2, ComfyUI's NextDiT); Qwen-Image's module names are diffusers'
  (``comfy/ldm/qwen_image/model.py``), and so are HiDream's (diffusers' ``convert_hidream_transformer_to_diffusers``
  only strips the checkpoint's prefix). SD3's CLIP text encoders take the kohya names ``lora_te1_``/``lora_te2_``
  there too.

Fused layers: where the original model computes in one linear layer what diffusers splits (q, k and v into one
``qkv``), the generic key has no way to address a slice of it (ComfyUI's slice targets, ``(key, (dim, offset,
size))``, exist only for diffusers-named keys), so the parts' LoRAs are fused into one of rank ``r_q + r_k + r_v``:
``lora_A`` the parts' ``lora_A`` stacked, ``lora_B`` block-diagonal, each part's rows where the original's layer has
them (parts may differ in size: FLUX.1's single blocks fuse q, k and v with an MLP projection four times wider; a
part the LoRA does not train gets zero rows).
Its product is exactly the parts' products stacked. Where the original orders a modulation's outputs (shift,
scale) and diffusers (scale, shift) (``swap_scale_shift`` in ``comfy/utils.py``), ``lora_B``'s halves are swapped.

The alpha rule: kohya, A1111 and ComfyUI (``comfy/weight_adapter/lora.py``: ``alpha / lora_down.shape[0]``) scale
``up @ down`` by ``alpha / rank``, reading the alpha only from the ``.alpha`` tensor (they ignore safetensors
metadata; with no ``.alpha`` the scale is 1). peft scales by ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``), the module's ``lora_alpha`` coming from ``alpha_pattern`` where a pattern matches its name. So each
module's ``.alpha`` is peft's scale times its rank: the trained ``lora_alpha`` itself (``--lora_alpha`` for a file
without metadata). Upstream diffusers' ``convert_state_dict_to_kohya`` writes ``alpha = rank``, a wrong strength
whenever the two differ. A fused layer keeps ``alpha / rank``: its alpha grows with its rank.

A family's layout is its module's ``FAMILY`` (`training_utils.families`): its pipelines, its text encoders' kohya
prefixes and, for a transformer, the `Rename` rules of its original layout.
"""

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import UsageError, exit_on_usage_error, few, require
from ..families.layout import FORMATS
from ..families.registry import FAMILIES, family_of
from ..outputs.writing import write_atomically, write_problem
from ..parser import TrainingArgumentParser
from .base_weights import saved_base_weights
from .layouts import TENSOR_NAMES, AdaptedModule, kind_of, layout_tensors
from .peft_files import read_peft_adapters

DIFFUSERS = "diffusers"  # the layout converted from, which load_lora_weights reads
FORMAT_USERS = {"kohya": "A1111, Forge, kohya tools; SD 1.x and SDXL", "comfyui": "ComfyUI"}
METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY
DOWN, UP = "lora_A.weight", "lora_B.weight"  # peft's tensors, as diffusers files and ComfyUI's layout name them
KOHYA_DOWN, KOHYA_UP = "lora_down.weight", "lora_up.weight"
# transformers 5's CLIPTextModel lost the `text_model.` level above these; the tools' names still have it.
CLIP_TEXT_MODEL_CHILDREN = ("embeddings.", "encoder.", "final_layer_norm.")


@dataclass(frozen=True)
class Target:
    """Where a module's LoRA goes in the output: the module name, the tensor suffixes, and the row block it fills
    of a fused layer."""

    name: str
    down_suffix: str
    up_suffix: str
    part: int = 0
    sizes: tuple = (1,)
    swap_halves: Callable | None = None


def convert(tensors, metadata, to, lora_alpha=None, family=None):
    """The tensors of a diffusers-format LoRA or DoRA (``tensors``, with the file's safetensors ``metadata``) in format
    ``to``: `convert_adapter` with the metadata's configs."""
    return convert_adapter(tensors, adapter_configs(metadata), to, lora_alpha, family)


def convert_adapter(tensors, configs, to, lora_alpha=None, family=None, base_weights=None):
    """The tensors of an adapter in format ``to``. ``tensors`` are keyed ``<component>.<module path>.<peft's tensor
    name>``, ``configs`` are each component's peft config (a dict). The family is detected from the keys unless
    ``family`` (a family or pipeline class name) is given; ``lora_alpha`` is the trained alpha of LoRA components the
    configs do not describe; ``base_weights(component, path)`` gives a module's base weight (`base_weights`), which
    an OFT's difference needs. Raises `UsageError` for a format that does not apply, keys it cannot place, or a
    missing alpha."""
    require(to in FORMATS, "--to", to, f"one of {', '.join(FORMATS)}")
    keys = split_keys(tensors)
    chosen = chosen_family(family, keys)
    require(to in chosen.formats, "--to", to,
            f"{' or '.join(chosen.formats)} for a {chosen.title} LoRA ({to} applies to the "
            f"{', '.join(f.title for f in FAMILIES.values() if to in f.formats)} families)")
    modules = {(component, path): adapted_module(component, path, {name: tensors[key] for name, key in names.items()},
                                                 configs, lora_alpha, base_weights)
               for (component, path), names in keys.items()}
    targets = {key: target_of(chosen, *key) for key in modules}
    return assemble(modules, targets)


def split_keys(tensors):
    """``{(component, module path): {peft's tensor name: key}}``, each module's tensors those of one adapter kind
    (`adapters.layouts.TENSOR_NAMES`); any other key is refused."""
    known = sorted({name for names in TENSOR_NAMES.values() for name in names}, key=len, reverse=True)
    modules, unknown = {}, []
    for key in tensors:
        component, _, rest = key.partition(".")
        name = next((name for name in known if rest.endswith(f".{name}")), None)
        if not component or name is None:
            unknown.append(key)
            continue
        modules.setdefault((component, rest[:-len(name) - 1]), {})[name] = key
    incomplete = [f"{component}.{path}" for (component, path), names in modules.items() if kind_of(set(names)) is None]
    if unknown or incomplete:
        unexpected = few(sorted(unknown) + sorted(incomplete))
        raise UsageError(None, None, "not an adapter of peft's LoRA, DoRA, LoKr, LoHa or OFT tensors (no bias or "
                                     f"embedding adapters): unexpected keys {unexpected}")
    return modules


def adapted_module(component, path, tensors, configs, lora_alpha, base_weights):
    """The `AdaptedModule` of ``path`` in ``component``: its kind (by its tensors), peft's rank, alpha and scale for
    it (`peft_scale`) and, for OFT, how to read its base weight."""
    kind = kind_of(set(tensors))
    config = configs.get(component)
    if kind == "oft":
        require(base_weights is not None, None, None, f"the base weights of {component} (OFT's difference needs them)")
        return AdaptedModule(kind, tensors, config=config, base_weight=lambda: base_weights(component, path))
    if kind in ("lora", "dora"):
        rank = tensors["lora_A.weight"].shape[0]
        scale = peft_scale(configs, component, path, rank, lora_alpha)
        return AdaptedModule(kind, tensors, scale, rank, scale * rank, config)
    require(config is not None, None, None, f"the adapter config of {component} (its alpha and rank)")
    rank = pattern_value(config.get("rank_pattern") or {}, path, config["r"])
    alpha = pattern_value(config.get("alpha_pattern") or {}, path, config["alpha"])
    return AdaptedModule(kind, tensors, alpha / rank, rank, alpha, config)


def chosen_family(name, keys):
    """The family ``name`` names, or the one the keys fit; of several that fit, any one, if they all convert the
    keys alike."""
    if name is not None:
        family = family_of(name)
        require(family is not None, "--family", name, f"one of {', '.join(FAMILIES)} or a pipeline class of one")
        unplaced = [f"{component}.{path}" for component, path in keys if not fits(family, component, path)]
        require(not unplaced, "--family", name, f"a family whose models have {few(unplaced)}")
        return family
    components = {component for component, _ in keys}
    fitting = [family for family in FAMILIES.values() if all(fits(family, *key) for key in keys)]
    require(fitting, None, None, f"no known family has LoRA modules {few([f'{c}.{p}' for c, p in keys])} "
                                 f"(components {', '.join(sorted(components))})")
    likeliest = fitting
    if components - {family.denoiser for family in FAMILIES.values()}:
        # Trainers that train text encoders train them all: of the families that fit a file with text encoders
        # (a UNet and one text encoder fit SD 1.x and SDXL), those with no text encoder beyond the file's.
        fewest_extra = min(len(family.components - components) for family in fitting)
        likeliest = [family for family in fitting if len(family.components - components) == fewest_extra]
    plans = {family.name: [target_of(family, *key) for key in keys] for family in likeliest}
    require(all(plan == plans[likeliest[0].name] for plan in plans.values()), None, None,
            f"the keys fit the families {', '.join(plans)}, which convert them differently: pass --family")
    return likeliest[0]


def fits(family, component, path):
    """Whether ``family``'s models have the module ``path`` of ``component`` (any path, for a UNet)."""
    if component == family.denoiser:
        return family.denoiser == "unet" or rename_of(family, path) is not None
    return component in family.text_encoders


def rename_of(family, path):
    """The rule of ``family``'s original layout that ``path`` matches, with the match; None if none does."""
    for rule in family.original_layout:
        match = re.fullmatch(rule.pattern, path)
        if match:
            return rule, match
    return None


def target_of(family, component, path):
    if component in family.text_encoders:
        return Target(kohya_name(family.text_encoders[component], clip_path(path)), KOHYA_DOWN, KOHYA_UP)
    if family.denoiser == "unet":
        return Target(kohya_name("lora_unet", path), KOHYA_DOWN, KOHYA_UP)
    rule, match = rename_of(family, path)
    return Target(f"diffusion_model.{match.expand(rule.original)}", DOWN, UP, rule.part, rule.sizes,
                  rule.swap_halves)


def kohya_name(prefix, path):
    return f"{prefix}_{path.replace('.', '_')}"


def clip_path(path):
    """A CLIP text encoder's module path as the tools know it: under ``text_model.``."""
    return f"text_model.{path}" if path.startswith(CLIP_TEXT_MODEL_CHILDREN) else path


def adapter_configs(metadata):
    """``{component: {LoraConfig field: value}}`` from the file's safetensors metadata; {} without it."""
    raw = (metadata or {}).get(METADATA_KEY)
    configs = {}
    for key, value in (json.loads(raw) if raw else {}).items():
        component, _, name = key.partition(".")
        configs.setdefault(component, {})[name] = value
    return configs


def peft_scale(configs, component, path, rank, lora_alpha):
    """peft's scale for the module ``path`` of ``component`` (``LoraLayer.update_layer``): its alpha over its rank,
    or over the rank's square root with ``use_rslora``. The rank is the tensors' (``rank_pattern`` made it so)."""
    config = configs.get(component)
    if config is None:
        require(lora_alpha is not None, None, None,
                f"the file has no adapter metadata for {component}: pass --lora_alpha, the alpha it was trained with")
        alpha, rslora = lora_alpha, False
    else:
        alpha = pattern_value(config.get("alpha_pattern") or {}, path, config["lora_alpha"])
        require(lora_alpha is None or lora_alpha == config["lora_alpha"], "--lora_alpha", lora_alpha,
                f"nothing, or the file's own lora_alpha for {component} ({config['lora_alpha']})")
        rslora = config.get("use_rslora", False)
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def pattern_value(patterns, path, default):
    """The value of the first of ``patterns`` that matches the end of the module path, as peft's ``get_pattern_key``
    matches ``rank_pattern``/``alpha_pattern`` keys; ``default`` if none does."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", path):
            return value
    return default


def assemble(modules, targets):
    """The output tensors: each target's, as the tools apply its adapter (`adapters.layouts.layout_tensors`), fusing
    the modules that share a target."""
    grouped = {}
    for key, target in targets.items():
        grouped.setdefault(target.name, []).append((target, modules[key]))
    converted = {}
    for name, pieces in grouped.items():
        for suffix, tensor in layout_tensors(pieces).items():
            converted[f"{name}.{suffix}"] = tensor.contiguous()
    return converted


def read_lora(path):
    """The tensors and safetensors metadata of the LoRA file ``path`` (never unpickled)."""
    try:
        with safe_open(path, framework="pt") as file:
            return {key: file.get_tensor(key) for key in file.keys()}, file.metadata()
    except (OSError, SafetensorError) as error:
        raise UsageError("SRC", str(path), f"a readable safetensors LoRA file ({error})") from None


def read_adapter(path):
    """``(tensors, configs, base_weights)`` of a LoRA file or a folder of peft adapters, as `convert_adapter` takes
    them; the base weights are those the adapters' configs name (None for a file)."""
    if Path(path).is_dir():
        tensors, configs = read_peft_adapters(path)
        return tensors, configs, saved_base_weights(configs)
    tensors, metadata = read_lora(path)
    return tensors, adapter_configs(metadata), None


def write_converted(src_path, dst_path, to, lora_alpha=None, family=None):
    """Convert the adapter of ``src_path`` (`read_adapter`) to format ``to`` (see `convert_adapter`) into
    ``dst_path`` (`destination`), atomically; returns the written file."""
    target = destination(src_path, dst_path)
    tensors, configs, base_weights = read_adapter(src_path)
    converted = convert_adapter(tensors, configs, to, lora_alpha, family, base_weights)
    write_atomically(target.parent, lambda staging: save_converted(converted, Path(staging) / target.name))
    return target


def destination(src_path, dst_path):
    """The file that ``DST`` names, ``dst_path`` or, for a folder, SRC's name in it (a folder of adapters: its name
    with ``.safetensors``); refused in one line if it is no ``.safetensors`` path, cannot be written, is SRC itself
    (the same file, or a link to it), or lies in SRC's folder of adapters."""
    src, dst = Path(src_path), Path(dst_path)
    require(src.exists(), "SRC", str(src), "an existing .safetensors file or folder of peft adapters")
    target = dst / (src.name if src.is_file() else f"{src.name}.safetensors") if dst.is_dir() else dst
    require(target.suffix == ".safetensors", "DST", str(dst), "a .safetensors file to write, or a folder to write it "
            "into")
    require(not (target.exists() and os.path.samefile(src, target)), "DST", str(dst),
            f"a file other than SRC: {target} is SRC itself{' (a link to it)' if target.is_symlink() else ''}, which "
            f"the converted LoRA would overwrite")
    require(not (src.is_dir() and target.resolve().is_relative_to(src.resolve())), "DST", str(dst),
            f"a file outside SRC's folder of adapters ({src})")
    problem = write_problem(target.parent)
    require(problem is None, "DST", str(dst), f"a file this user can write ({problem})")
    return target


def save_converted(converted, path):
    """Write `convert`'s tensors as a safetensors file (the tools read no metadata but the format)."""
    save_file(converted, str(path), metadata={"format": "pt"})


def main(argv=None):
    parser = TrainingArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", metavar="SRC", help="a diffusers-format LoRA or DoRA .safetensors (save_lora_weights'), "
                                                   "or a folder of peft adapters (LoKr, LoHa, OFT)")
    parser.add_argument("dst", metavar="DST", help="the .safetensors file to write")
    parser.add_argument("--to", required=True, choices=FORMATS, help="kohya (SD 1.x, SDXL) or comfyui (any family)")
    parser.add_argument("--lora_alpha", type=float, default=None,
                        help="the alpha the LoRA was trained with, for a file without adapter metadata")
    parser.add_argument("--family", default=None,
                        help=f"the model family ({', '.join(FAMILIES)}) where the keys fit several")
    args = parser.parse_args(argv)
    with exit_on_usage_error():
        require(args.lora_alpha is None or 0 < args.lora_alpha < math.inf, "--lora_alpha", args.lora_alpha,
                "a positive number")
        path = write_converted(args.src, args.dst, args.to, args.lora_alpha, args.family)
        print(f"wrote {path} ({args.to})")


if __name__ == "__main__":
    main()
