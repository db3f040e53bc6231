"""What ComfyUI applies of a LoRA file, re-implemented for the tests from its source (``comfy/lora.py``
``load_lora``, ``comfy/weight_adapter/{lora,lokr,loha,base}.py`` ``calculate_weight`` and ``weight_decompose``), at
strength 1 and in float32; and LyCORIS's own DoRA (``lycoris/modules/locon.py`` ``apply_weight_decompose``, with
``wd_on_out``), which A1111's LyCORIS and peft agree with.

`module_weights` reads a file's modules as ``load_lora`` does: every tensor of a module under its key prefix (the
``.alpha``, the ``.dora_scale``, then the first adapter whose tensors are there), and says which keys it did not read
(ComfyUI logs each as "lora key not loaded" and ignores it).
"""

import torch

LORA_PAIRS = (("lora_up.weight", "lora_down.weight"), ("lora_B.weight", "lora_A.weight"))
LOKR = ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


def module_weights(tensors):
    """``({module prefix: {tensor name: tensor}}, unread keys)``: the modules as ComfyUI's loader reads them."""
    prefixes = {key.rsplit(".", 1)[0] for key in tensors if key.endswith((".alpha", ".diff", ".lokr_w1", ".lokr_w1_a",
                                                                          ".hada_w1_a"))}
    prefixes |= {key[:-len(f".{up}")] for key in tensors for up, _ in LORA_PAIRS if key.endswith(f".{up}")}
    modules, read = {}, set()
    for prefix in prefixes:
        lora = [name for pair in LORA_PAIRS for name in pair]
        names = [name for name in ("alpha", "dora_scale", "diff", *LOKR, *LOHA, *lora) if f"{prefix}.{name}" in tensors]
        modules[prefix] = {name: tensors[f"{prefix}.{name}"] for name in names}
        read |= {f"{prefix}.{name}" for name in names}
    return modules, sorted(set(tensors) - read)


def delta_shape(module):
    """The shape of the weight a module changes, as its tensors give it (a linear layer's)."""
    if "diff" in module:
        return module["diff"].shape
    if "hada_w1_a" in module:
        return module["hada_w1_a"].shape[0], module["hada_w1_b"].shape[1]
    if any(name in module for name in LOKR):
        factors = [module[f"lokr_w{i}"].shape if f"lokr_w{i}" in module
                   else (module[f"lokr_w{i}_a"].shape[0], module[f"lokr_w{i}_b"].shape[1]) for i in (1, 2)]
        return factors[0][0] * factors[1][0], factors[0][1] * factors[1][1]
    up, down = next((module[up], module[down]) for up, down in LORA_PAIRS if up in module)
    return up.shape[0], down.shape[1]


def comfyui_weight(module, weight, dora="comfyui"):
    """The weight ComfyUI makes of ``weight`` with ``module`` (`module_weights`' tensors) at strength 1. A DoRA's rows
    are rescaled by the base weight's norms as ComfyUI does (``dora="comfyui"``), or by the merged weight's as
    LyCORIS does (``dora="lycoris"``)."""
    weight = weight.float()
    if "diff" in module:
        return weight + module["diff"].float()
    alpha, dora_scale = module.get("alpha"), module.get("dora_scale")
    alpha = None if alpha is None else alpha.item()
    dim = None
    if any(name in module for name in LOKR):
        w1 = module["lokr_w1"] if "lokr_w1" in module else module["lokr_w1_a"] @ module["lokr_w1_b"]
        if "lokr_w1" not in module:
            dim = module["lokr_w1_b"].shape[0]
        w2 = module["lokr_w2"] if "lokr_w2" in module else module["lokr_w2_a"] @ module["lokr_w2_b"]
        if "lokr_w2" not in module:
            dim = module["lokr_w2_b"].shape[0]
        scale = alpha / dim if alpha is not None and dim is not None else 1.0
        diff = torch.kron(w1, w2).reshape(weight.shape)
    elif "hada_w1_a" in module:
        scale = alpha / module["hada_w1_b"].shape[0] if alpha is not None else 1.0
        diff = ((module["hada_w1_a"] @ module["hada_w1_b"]) * (module["hada_w2_a"] @ module["hada_w2_b"]))
        diff = diff.reshape(weight.shape)
    else:
        up, down = next((module[up], module[down]) for up, down in LORA_PAIRS if up in module)
        scale = alpha / down.shape[0] if alpha is not None else 1.0
        diff = (up.flatten(1) @ down.flatten(1)).reshape(weight.shape)
    if dora_scale is None:
        return weight + scale * diff
    assert dora_scale.shape == (weight.shape[0], 1), "a dora_scale of the output rows, as peft's magnitude is"
    merged = weight + scale * diff
    # ComfyUI's weight_decompose: dora_scale of the output rows divides by the base weight's row norms.
    rows = weight if dora == "comfyui" else merged
    norm = rows.reshape(rows.shape[0], -1).norm(dim=1, keepdim=True) + torch.finfo(torch.float32).eps
    return merged * (dora_scale / norm)
