"""Adapters on a pipeline's models: which modules they adapt, and adding them.

`adapters` makes peft's config from the flags; `adapter_export` writes the trained adapters.
"""

import torch
from peft import LoraConfig, inject_adapter_in_model

from ..errors import require
from .config import check_oft_block_size

# The query, key, value and output projections of diffusers' `Attention`, in UNets and transformers alike.
ATTENTION_PROJECTIONS = ["to_k", "to_q", "to_v", "to_out.0"]
# The same projections in transformers' CLIP text encoders.
CLIP_ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def add_adapter(model, config):
    """Add a trainable adapter named "default" (any peft config: LoRA, LoKr, LoHa, OFT) to ``model``; only its
    tensors require grad. Returns ``config``.

    Diffusers models take it through their own ``add_adapter``; text encoders through peft directly (transformers 5
    refuses ``add_adapter`` with the peft releases available here).
    """
    check_oft_block_size(model, config)
    model.requires_grad_(False)
    if hasattr(model, "add_adapter") and hasattr(model, "set_adapters"):
        model.add_adapter(config)
    else:
        inject_adapter_in_model(config, model)
    return config


def add_lora(model, rank, target_modules, alpha=None, dropout=0.0):
    """`add_adapter` of a LoRA of ``rank`` and ``alpha`` (default: the rank) on ``target_modules``."""
    return add_adapter(model, LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, lora_dropout=dropout,
                                         init_lora_weights="gaussian", target_modules=target_modules))


def linear_layers_named(model, names, flag="--lora_layers"):
    """The full names of ``model``'s linear layers named by ``names``: each a layer's name or the end of one, e.g.
    "to_q", "attn.to_out" or "single_transformer_blocks.0.attn.to_qkv_mlp_proj" (a module that is not a linear
    layer, such as a ``to_out`` list of a linear layer and a dropout, is passed over). Checked against the loaded
    model: a name that matches no linear layer stops the run with one line naming ``flag``."""
    linear = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    targets = {}
    for name in names:
        matches = [full_name for full_name in linear if full_name == name or full_name.endswith(f".{name}")]
        require(matches, flag, name, "the name, or the end of the name, of one of the model's linear layers")
        targets.update(dict.fromkeys(matches))
    return list(targets)
