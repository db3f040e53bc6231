"""Adapters in peft's own format: a folder per component holding ``adapter_config.json`` and
``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes them, so that ``PeftModel.from_pretrained(
pipe.unet, folder)`` loads one into the pipeline's module (in place). The tensors are keyed as peft's state dicts
(``get_peft_model_state_dict``) under ``base_model.model.``, the name ``PeftModel`` gives the model it wraps.
"""

import json
from pathlib import Path

from peft.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import UsageError

PREFIX = "base_model.model."


def write_peft_adapter(folder, config, tensors):
    """Write one component's adapter: ``config`` (its peft config, a JSON dict) and ``tensors`` (keyed as
    ``get_peft_model_state_dict`` keys them) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
    save_file({f"{PREFIX}{key}": tensor.contiguous() for key, tensor in tensors.items()},
              str(folder / SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    return folder / SAFETENSORS_WEIGHTS_NAME


def read_peft_adapter(folder):
    """``(config, tensors)`` of the adapter `write_peft_adapter` wrote into ``folder`` (JSON and safetensors, never
    unpickled), the tensors keyed as peft's state dicts."""
    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
        with safe_open(folder / SAFETENSORS_WEIGHTS_NAME, framework="pt") as file:
            tensors = {key.removeprefix(PREFIX): file.get_tensor(key) for key in file.keys()}
    except (OSError, ValueError, SafetensorError) as error:
        raise UsageError("SRC", str(folder), f"a peft adapter folder ({CONFIG_NAME}, {SAFETENSORS_WEIGHTS_NAME}): "
                                             f"{error}") from None
    return config, tensors


def read_peft_adapters(directory):
    """``(tensors, configs)`` of the adapters in ``directory``'s component folders: the tensors keyed
    ``<component>.<peft's key>``, the configs by component."""
    folders = sorted(path.parent for path in Path(directory).glob(f"*/{CONFIG_NAME}"))
    if not folders:
        raise UsageError("SRC", str(directory), f"a folder of peft adapters, a subfolder with {CONFIG_NAME} per "
                                                f"component")
    tensors, configs = {}, {}
    for folder in folders:
        configs[folder.name], component_tensors = read_peft_adapter(folder)
        tensors.update({f"{folder.name}.{key}": tensor for key, tensor in component_tensors.items()})
    return tensors, configs
