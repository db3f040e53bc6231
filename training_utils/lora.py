"""LoRA adapters: add them, and save them so that any pipeline's ``load_lora_weights`` loads them.

Nothing here names a pipeline class or a component: the ``<component>_lora_layers`` arguments
of ``save_lora_weights`` are derived from the components that were trained.
"""

import inspect
from pathlib import Path

from peft import LoraConfig, inject_adapter_in_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file

from .export import verify_saved_tensors, write_atomically

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"

# Attention projections of diffusers' UNets/transformers and of CLIP/T5 text encoders.
UNET_TARGET_MODULES = ["to_k", "to_q", "to_v", "to_out.0"]
TEXT_ENCODER_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "out_proj"]


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


def lora_layers(trained):
    """``save_lora_weights`` keyword arguments for the trained components: layers and adapter metadata.

    Values are detached copies of the live tensors (state-dict views would change with training).
    """
    kwargs = {}
    for name, module in trained.items():
        state = get_peft_model_state_dict(module)
        kwargs[f"{name}_lora_layers"] = {key: tensor.detach().clone() for key, tensor in state.items()}
        kwargs[f"{name}_lora_adapter_metadata"] = module.peft_config["default"].to_dict()
    return kwargs


def save_lora(pipeline_class, directory, trained):
    """Write ``pytorch_lora_weights.safetensors`` for ``trained`` into ``directory`` atomically, then
    read it back and check it holds exactly the in-memory adapter tensors.

    ``trained`` maps pipeline component names ("unet", "text_encoder", "transformer", ...) to
    modules carrying a LoRA adapter. Returns the written file's path.
    """
    kwargs = lora_layers(trained)
    accepted = inspect.signature(pipeline_class.save_lora_weights).parameters
    for name in trained:
        if f"{name}_lora_layers" not in accepted:
            raise ValueError(f"{pipeline_class.__name__}.save_lora_weights cannot save a LoRA for component {name!r}")
    path = Path(directory) / LORA_WEIGHTS_NAME
    write_atomically(directory, lambda staging: pipeline_class.save_lora_weights(
        staging, weight_name=LORA_WEIGHTS_NAME, **kwargs))
    expected = {
        f"{name}.{key}": tensor for name in trained for key, tensor in kwargs[f"{name}_lora_layers"].items()
    }
    verify_saved_tensors(load_file(path), expected, path)
    return path


def save_lora_with_ema(pipeline_class, output_dir, trained, ema=None):
    """The raw LoRA into ``output_dir`` and, with an EMA, the EMA LoRA into ``output_dir/ema``.

    The EMA file is written from the live modules with the EMA weights swapped in, so it has the
    raw file's keys, shapes and adapter metadata. Returns the written paths.
    """
    paths = {"raw": save_lora(pipeline_class, output_dir, trained)}
    if ema is not None:
        with ema.swapped_in():
            paths["ema"] = save_lora(pipeline_class, Path(output_dir) / "ema", trained)
    return paths

