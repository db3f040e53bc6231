"""The frozen base weights under an adapter, where a layout needs them: an OFT's weight difference is its rotation
applied to the base weight (`adapters.layouts.peft_delta`).

During a run they are the live modules' (`live_base_weights`, dequantised where the base is quantised: the weights
the adapter trained on); afterwards (the post-hoc EMA synthesis, ``convert_lora``) the ones on disk, in the component
folder each adapter's peft config names as its base (`saved_base_weights`).
"""

import functools
from pathlib import Path

from peft.utils.integrations import dequantize_module_weight
from safetensors import safe_open

from ..errors import UsageError, require


def live_base_weights(trained):
    """``base_weight(component, path)``: the weight of the base layer under the adapter at ``path`` of the live
    module ``trained[component]``, dequantised, on its device."""
    def base_weight(component, path):
        return dequantize_module_weight(trained[component].get_submodule(path).get_base_layer()).detach()

    return base_weight


def saved_base_weights(configs):
    """``base_weight(component, path)``: the weight ``<path>.weight`` in the safetensors files of the folder that
    ``configs[component]`` names (``base_model_name_or_path``); a CLIP text encoder's under ``text_model.`` too, as
    checkpoints written before transformers 5 name them."""
    def base_weight(component, path):
        folder = (configs.get(component) or {}).get("base_model_name_or_path")
        require(folder and Path(folder).is_dir(), "base_model_name_or_path", folder,
                f"the folder of {component}'s base model, with its safetensors weights (OFT's difference needs them)")
        files = tensor_files(folder)
        for key in (f"{path}.weight", f"text_model.{path}.weight"):
            if key in files:
                with safe_open(files[key], framework="pt") as file:
                    return file.get_tensor(key)
        raise UsageError("base_model_name_or_path", folder, f"a model with the weight {path}.weight")

    return base_weight


@functools.lru_cache(maxsize=8)
def tensor_files(folder):
    """``{tensor key: file}`` of the safetensors files in ``folder``: a key's plain file before a variant's
    (``model.fp16.safetensors``)."""
    files = {}
    for path in sorted(Path(folder).glob("*.safetensors"), key=lambda path: (path.name.count(".") > 1, path.name)):
        with safe_open(path, framework="pt") as file:
            for key in file.keys():
                files.setdefault(key, path)
    return files
