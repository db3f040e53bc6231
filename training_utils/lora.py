"""LoRA adapters: which modules they adapt, and adding them to a pipeline's models.

`export.LoraExport` writes them so that any pipeline's ``load_lora_weights`` loads them.
"""

from peft import LoraConfig, inject_adapter_in_model

# The query, key, value and output projections of diffusers' `Attention`, in UNets and transformers alike.
ATTENTION_PROJECTIONS = ["to_k", "to_q", "to_v", "to_out.0"]
# The same projections in transformers' CLIP text encoders.
CLIP_ATTENTION_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "out_proj"]


def add_lora(model, rank, target_modules, alpha=None, dropout=0.0):
    """Add a trainable LoRA adapter named "default" to ``model``; only its tensors require grad.

    Diffusers models take it through their own ``add_adapter``; text encoders through peft
    directly (transformers 5 refuses ``add_adapter`` with the peft releases available here).
    """
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else rank,
        lora_dropout=dropout,
        init_lora_weights="gaussian",
        target_modules=target_modules,
    )
    model.requires_grad_(False)
    if hasattr(model, "add_adapter") and hasattr(model, "set_adapters"):
        model.add_adapter(config)
    else:
        inject_adapter_in_model(config, model)
    return config
