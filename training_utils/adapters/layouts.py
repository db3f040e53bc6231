"""How each adapter's module is written in the layouts of the UI tools (`convert_lora` names the modules).

The tools read the LyCORIS tensors (``comfy/weight_adapter/*.py``, A1111's ``extensions-builtin/Lora/network_*.py``,
Forge's ``backend/patcher/lora.py``), the strength always from the file, never from metadata:

- LoRA: ``lora_down``/``lora_up`` (kohya) or ``lora_A``/``lora_B`` (ComfyUI's generic keys) and ``alpha``, applied as
  ``alpha / rank * up @ down``;
- DoRA: the same and ``dora_scale``, peft's magnitude vector as a column (output rows, LyCORIS's ``wd_on_out``). The
  tools rescale each output row of ``W + delta`` to its magnitude: by the row's norm of ``W + delta`` in LyCORIS's
  own ``apply_weight_decompose`` (exactly peft's DoRA, but for an epsilon), by the base weight ``W``'s row norm in
  ComfyUI and Forge (``weight_decompose``; docs/ui-files.md gives how far apart the two are);
- LoKr: ``lokr_w1`` (or ``lokr_w1_a``/``lokr_w1_b``), ``lokr_w2`` (or ``lokr_w2_a``/``lokr_w2_b``) and ``alpha``,
  applied as ``kron(w1, w2)`` times ``alpha / rank`` when a factor is low-rank, times 1 when neither is; peft scales
  by ``alpha / rank`` in both cases, so where neither factor is low-rank the scale goes into ``lokr_w1``;
- LoHa: ``hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b`` and ``alpha``, applied as
  ``alpha / rank * (w1_a @ w1_b) * (w2_a @ w2_b)``;
- OFT: ``diff``, the exact weight difference the module makes. peft's OFT rotates a layer's input (``W R^T``);
  LyCORIS's ``oft_blocks`` rotate its output (``R W``), so no ``oft_blocks`` render a peft OFT, and none are written.

``alpha`` is the one the module trained with (peft's ``lora_alpha`` or ``alpha``, by its ``alpha_pattern``).

Where the original model fuses several diffusers layers into one (q, k and v), the parts become one module of the
fused layer, each in its rows: LoRA, DoRA and LoHa exactly in their own tensors, of the parts' ranks summed (the
first factors block-diagonal, the second stacked; a part without an adapter gets zero rows, but DoRA needs every part:
its rows would need the base weight's norms); LoKr and OFT, whose parts do not combine so, as the fused layer's
``diff``, the parts' weight differences stacked (the size of the layer). A weight difference is computed by peft:
its merge of the module into the base weight (zeros for LoKr, which does not depend on it), less that weight.
"""

import math
from dataclasses import dataclass, replace

import torch
from peft import PeftConfig, inject_adapter_in_model
from peft.utils import set_peft_model_state_dict

from ..errors import require

# peft's tensor names per adapter kind, as its state dicts and files name them.
TENSOR_NAMES = {
    "lora": ("lora_A.weight", "lora_B.weight"),
    "dora": ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector.weight", "lora_magnitude_vector"),
    "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"),
    "oft": ("oft_R.weight",),
}
# Whether a module's tensor names (a set of the kind's) make a whole adapter of each kind.
COMPLETE = {
    "lora": lambda names: names == {"lora_A.weight", "lora_B.weight"},
    "dora": lambda names: len(names) == 3 and {"lora_A.weight", "lora_B.weight"} <= names,  # and one magnitude
    "lokr": lambda names: all(f"lokr_w{factor}" in names or {f"lokr_w{factor}_a", f"lokr_w{factor}_b"} <= names
                              for factor in (1, 2)),
    "loha": lambda names: {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"} <= names,
    "oft": lambda names: names == {"oft_R.weight"},
}


def kind_of(names):
    """The adapter kind whose tensors are ``names`` (a set of peft's tensor names), or None."""
    return next((kind for kind, complete in COMPLETE.items() if names <= set(TENSOR_NAMES[kind]) and complete(names)),
                None)


def magnitude(tensors):
    """A DoRA module's magnitude vector, keyed as our files and transformers key it or as peft's state dicts do."""
    return tensors.get("lora_magnitude_vector.weight", tensors.get("lora_magnitude_vector"))


@dataclass(frozen=True)
class AdaptedModule:
    """One adapted module as peft trained it: its kind, its tensors by peft's names, peft's scale, rank and alpha for
    it (None for OFT), its component's peft config, and its base layer's weight (a function, called only for what
    depends on it: OFT's difference)."""

    kind: str
    tensors: dict
    scale: float = None
    rank: int = None
    alpha: float = None
    config: dict = None
    base_weight: object = None


def layout_tensors(pieces):
    """The tensors of one module of the layout, by suffix (``lokr_w1``, ``alpha``, ...), from ``pieces``: its
    ``(target, module)`` pairs, one, or the parts of a fused layer (`adapters.convert.Target`)."""
    target, module = pieces[0]
    require(all(piece.kind == module.kind for _, piece in pieces), None, None,
            f"{target.name} fuses parts of different adapter kinds")
    if len(target.sizes) == 1:
        return SINGLE[module.kind](target, module)
    return FUSED[module.kind](pieces)


def lora(target, module):
    down, up = module.tensors["lora_A.weight"], module.tensors["lora_B.weight"]
    return {target.down_suffix: down, target.up_suffix: swapped(target, up, down.shape[1]),
            "alpha": torch.tensor(module.scale * module.rank, dtype=torch.float32)}


def dora(target, module):
    columns = module.tensors["lora_A.weight"].shape[1]
    magnitudes = swapped(target, magnitude(module.tensors), columns)
    return {**lora(target, module), "dora_scale": magnitudes[:, None]}


def lokr(target, module):
    if target.swap_halves is not None:  # rows of a Kronecker product do not swap by halves: its difference does
        return difference(target, module)
    tensors = dict(module.tensors)
    if "lokr_w1_a" not in tensors and "lokr_w2_a" not in tensors:  # the tools apply a factor-only LoKr at scale 1
        tensors["lokr_w1"] = tensors["lokr_w1"] * module.scale
    return {**tensors, "alpha": torch.tensor(module.alpha, dtype=torch.float32)}


def loha(target, module):
    tensors = dict(module.tensors)
    columns = tensors["hada_w1_b"].shape[1]
    for name in ("hada_w1_a", "hada_w2_a"):  # the output rows of both products
        tensors[name] = swapped(target, tensors[name], columns)
    return {**tensors, "alpha": torch.tensor(module.alpha, dtype=torch.float32)}


def difference(target, module):
    delta = peft_delta(module)
    return {"diff": swapped(target, delta, delta.shape[1])}


def swapped(target, rows, columns):
    """``rows`` (a tensor of a layer's output rows, of ``columns`` inputs) with its halves swapped where the original
    model orders them the other way round (`layout.Rename.swap_halves`)."""
    if target.swap_halves is None or not target.swap_halves(rows.shape[0], columns):
        return rows
    first, second = rows.chunk(2, dim=0)
    return torch.cat([second, first])


def row_blocks(pieces, rows_of):
    """``(offsets, parts)`` of a fused layer: each part's first row (the last item is the layer's height) and its
    module by part index. The parts' sizes are the target's relative ones times what the present parts have per unit
    (``rows_of(module)``), which they must agree on."""
    sizes = pieces[0][0].sizes
    by_part = {target.part: module for target, module in pieces}
    first = min(by_part)
    unit = rows_of(by_part[first]) // sizes[first]
    require(all(rows_of(module) == unit * sizes[part] for part, module in by_part.items()), None, None,
            f"fusing {pieces[0][0].name} needs linear parts whose rows are as {':'.join(map(str, sizes))}")
    return [unit * sum(sizes[:part]) for part in range(len(sizes) + 1)], by_part


def block_diagonal(offsets, by_part, first, factors, ratios):
    """The fused first factor: each part's ``factors[part]`` (rows x rank) in its rows and its own rank columns,
    times ``ratios[part]``; zeros elsewhere."""
    columns = sum(factor.shape[1] for factor in factors.values())
    fused = torch.zeros(offsets[-1], columns, dtype=factors[first].dtype)
    column = 0
    for part in sorted(by_part):
        factor = factors[part]
        fused[offsets[part]:offsets[part + 1], column:column + factor.shape[1]] = factor * ratios[part]
        column += factor.shape[1]
    return fused


def fused_lora(pieces, magnitudes=False):
    """One LoRA for the parts: ``down`` stacked, ``up`` block-diagonal, so that ``up @ down`` stacks the parts'
    products. Its scale is the first present part's; the other parts' ``up`` absorb the ratio of their scale to it
    (1 where, as usual, all parts share alpha and rank)."""
    target = pieces[0][0]
    offsets, by_part = row_blocks(pieces, lambda module: module.tensors["lora_B.weight"].shape[0])
    first = min(by_part)
    ratios = {part: module.scale / by_part[first].scale for part, module in by_part.items()}
    down = torch.cat([by_part[part].tensors["lora_A.weight"] for part in sorted(by_part)])
    up = block_diagonal(offsets, by_part, first, {part: m.tensors["lora_B.weight"] for part, m in by_part.items()},
                        ratios)
    fused = {target.down_suffix: down, target.up_suffix: up,
             "alpha": torch.tensor(by_part[first].scale * down.shape[0], dtype=torch.float32)}
    if magnitudes:
        require(len(by_part) == len(target.sizes), None, None,
                f"DoRA on every part that {target.name} fuses, or on none (a part without it would need the base "
                f"weight's norms)")
        fused["dora_scale"] = torch.cat([magnitude(by_part[part].tensors) for part in sorted(by_part)])[:, None]
    return fused


def fused_loha(pieces):
    """One LoHa for the parts: both products' first factors block-diagonal, their second factors stacked, so that
    each product stacks the parts' products (the Hadamard product of stacked rows is the rows' products stacked).
    Scale and ratios as `fused_lora`'s, the ratios taken into the first product."""
    offsets, by_part = row_blocks(pieces, lambda module: module.tensors["hada_w1_a"].shape[0])
    first = min(by_part)
    ratios = {part: module.scale / by_part[first].scale for part, module in by_part.items()}
    ones = dict.fromkeys(by_part, 1.0)
    fused = {}
    for a, b, part_ratios in (("hada_w1_a", "hada_w1_b", ratios), ("hada_w2_a", "hada_w2_b", ones)):
        fused[a] = block_diagonal(offsets, by_part, first, {part: m.tensors[a] for part, m in by_part.items()},
                                  part_ratios)
        fused[b] = torch.cat([by_part[part].tensors[b] for part in sorted(by_part)])
    fused["alpha"] = torch.tensor(by_part[first].scale * fused["hada_w1_b"].shape[0], dtype=torch.float32)
    return fused


def fused_difference(pieces):
    """The fused layer's weight difference: each part's in its rows, zeros for a part without an adapter."""
    deltas = {target.part: peft_delta(module) for target, module in pieces}
    offsets, by_part = row_blocks([(target, deltas[target.part]) for target, _ in pieces], lambda delta: delta.shape[0])
    fused = torch.zeros(offsets[-1], *deltas[min(deltas)].shape[1:], dtype=torch.float32)
    for part, delta in by_part.items():
        fused[offsets[part]:offsets[part + 1]] = delta
    return {"diff": fused}


def peft_delta(module):
    """The weight difference the module makes, computed by peft: a linear layer with the module's base weight (zeros
    for LoKr, whose difference does not depend on it) takes the module's adapter and tensors, and peft merges them
    into it; the merged weight less the base weight. On the base weight's device; returned on the CPU."""
    base = torch.zeros(lokr_shape(module.tensors)) if module.kind == "lokr" else module.base_weight().float()
    # Making the layers draws their initial values: from a random state of their own, not the run's (which a
    # checkpoint has just saved, and which its resume must continue from).
    with torch.random.fork_rng(devices=[base.device] if base.device.type == "cuda" else []):
        layer = torch.nn.utils.skip_init(torch.nn.Linear, base.shape[1], base.shape[0], bias=False, device=base.device)
        layer.weight.data = base.clone()
        holder = torch.nn.ModuleDict({"layer": layer})
        inject_adapter_in_model(layer_config(module), holder)
    set_peft_model_state_dict(holder, {f"layer.{name}": tensor.to(base.device, torch.float32)
                                       for name, tensor in module.tensors.items()})
    holder.layer.merge()
    return (holder.layer.get_base_layer().weight.detach() - base).cpu()


def lokr_shape(tensors):
    """The shape of a LoKr module's layer: its two factors' rows and columns multiplied."""
    (rows_1, columns_1), (rows_2, columns_2) = (
        tensors[f"lokr_w{factor}"].shape if f"lokr_w{factor}" in tensors
        else (tensors[f"lokr_w{factor}_a"].shape[0], tensors[f"lokr_w{factor}_b"].shape[1]) for factor in (1, 2))
    return rows_1 * rows_2, columns_1 * columns_2


def layer_config(module):
    """The module's component config for one layer named "layer", with the module's own rank and alpha (its
    patterns resolved) or, for OFT, its block size (read from its tensor: peft may have adjusted it to the layer)."""
    patterns = {key: {} for key in ("rank_pattern", "alpha_pattern") if key in module.config}
    config = PeftConfig.from_peft_type(**{**module.config, **patterns, "target_modules": ["layer"],
                                          "layers_to_transform": None, "layers_pattern": None, "exclude_modules": None,
                                          "inference_mode": True})
    if module.kind == "oft":
        elements = module.tensors["oft_R.weight"].shape[1]  # block_size * (block_size - 1) / 2
        return replace(config, r=0, oft_block_size=round((1 + math.sqrt(1 + 8 * elements)) / 2))
    return replace(config, r=module.rank, alpha=module.alpha)


SINGLE = {"lora": lora, "dora": dora, "lokr": lokr, "loha": loha, "oft": difference}
FUSED = {"lora": fused_lora, "dora": lambda pieces: fused_lora(pieces, magnitudes=True), "loha": fused_loha,
         "lokr": fused_difference, "oft": fused_difference}
