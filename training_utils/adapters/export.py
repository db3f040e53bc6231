"""Trained adapters written where users load them, checked once written: the adapter kinds of `export.Export`.

- LoRA and DoRA (`LoraExport`): one ``pytorch_lora_weights.safetensors`` written by ``<Pipeline>.save_lora_weights``,
  which ``pipe.load_lora_weights(directory)`` loads;
- LoKr, LoHa and OFT (`PeftExport`), which ``load_lora_weights`` does not read: peft's own format, a folder per
  component (`peft_files`), which ``PeftModel.from_pretrained(pipe.unet, directory + "/unet")`` loads;
- beside either, the same adapters in each layout of ``formats`` for the UI tools (`convert_lora`):
  ``pytorch_lora_weights_kohya.safetensors``, ``…_comfyui.safetensors``.

`adapter_export` makes the one that fits the live modules' adapter. Its ``adapter_configs`` hold each component's
peft config as JSON: the file's adapter metadata, or each folder's ``adapter_config.json``. Making one converts the
fresh adapter into the asked layouts once, so that a layout that cannot hold it stops the run before training.
"""

import inspect
import json
from pathlib import Path

from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from ..errors import few
from ..names import LORA_WEIGHTS_NAME, SAVED_AS
from ..outputs.export import Export, as_json, by_component, import_class, importable_module
from ..outputs.hub import LORA_HOW_TO_LOAD, MODEL_LORA_HOW_TO_LOAD, PEFT_HOW_TO_LOAD
from ..outputs.writing import verify_saved_tensors, write_atomically
from ..pipeline import trainable_parameters
from .base_weights import live_base_weights, saved_base_weights
from .convert import DIFFUSERS, METADATA_KEY, convert_adapter, save_converted
from .peft_files import read_peft_adapter, write_peft_adapter

# The adapters that diffusers' load_lora_weights reads (peft's LoraConfig), and what every other one is called.
LORA_TITLES = {False: "LoRA", True: "DoRA"}
PEFT_TITLES = {"LOKR": "LoKr", "LOHA": "LoHa", "OFT": "OFT"}


def converted_name(layout):
    """The file name of an adapter in another layout than its own, beside it."""
    return f"pytorch_lora_weights_{layout}.safetensors"


def adapter_export(pipeline_class, trained, formats=(DIFFUSERS,), adapter_name="default", lora_export=None):
    """The export of the adapters on ``trained`` ({component: module}): ``lora_export`` (by default `LoraExport`;
    `ModelLoraExport` where the pipeline has no LoRA loader) for LoRA and DoRA, `PeftExport` for the others."""
    peft_types = {str(module.peft_config[adapter_name].peft_type.value) for module in trained.values()}
    export_class = (lora_export or LoraExport) if peft_types == {"LORA"} else PeftExport
    return export_class.of(pipeline_class, trained, formats, adapter_name)


def peft_saved_keys(module, adapter_name="default"):
    """The keys peft saves of ``module``'s adapter (``get_peft_model_state_dict``), a DoRA magnitude's with the
    ``.weight`` that its parameter's name has: diffusers hands text-encoder adapters to transformers' ``load_adapter``,
    which (transformers 5) reads the magnitude only so, where peft's own loading takes both."""
    return {f"{key}.weight" if key.endswith(".lora_magnitude_vector") else key
            for key in get_peft_model_state_dict(module, adapter_name=adapter_name)}


def remove_adapter_name(key, adapter_name="default"):
    """``...to_q.lora_A.default.weight`` -> ``...to_q.lora_A.weight``: peft's rule, the adapter name dropped where it
    precedes the last component, or ends the key."""
    if key.endswith(f".{adapter_name}"):
        return key[: -len(adapter_name) - 1]
    head, _, suffix = key.rpartition(".")
    if head.endswith(f".{adapter_name}"):
        head = head[: -len(adapter_name) - 1]
    return f"{head}.{suffix}" if head else key


class AdapterExport(Export):
    """What both adapter exports do: check the live adapters against what peft saves, describe them, write them in
    their own format (`write_files`, `read_files`) and in the UI layouts, and read a checkpoint back."""

    config_field = None  # where `description` keeps a component's config

    def __init__(self, pipeline_class, adapter_configs, adapter_name="default", trained=None, formats=(DIFFUSERS,)):
        super().__init__(trained)
        self.pipeline_class = pipeline_class
        self.adapter_configs = adapter_configs
        self.adapter_name = adapter_name
        self.formats = list(formats)

    @classmethod
    def of(cls, pipeline_class, trained, formats=(DIFFUSERS,), adapter_name="default"):
        """The export of the adapters on ``trained`` ({component: module}). Checks now, on the live modules, that the
        trained parameters are exactly what peft saves, so that `write` from the parameters writes what peft would,
        and that each asked layout holds the fresh adapters."""
        adapter_configs = {}
        for component, module in trained.items():
            cls.check_component(pipeline_class, component)
            keys = {remove_adapter_name(name, adapter_name)
                    for name, parameter in module.named_parameters() if parameter.requires_grad}
            saved_by_peft = cls.saved_keys(module, adapter_name)
            if keys != saved_by_peft:
                raise ValueError(f"{component}: the trained parameters are not what peft saves (only trained: "
                                 f"{few(sorted(keys - saved_by_peft))}; only saved: "
                                 f"{few(sorted(saved_by_peft - keys))})")
            adapter_configs[component] = cls.config_of(module.peft_config[adapter_name], module)
        export = cls(pipeline_class, adapter_configs, adapter_name, trained, formats)
        export.converted(export.layers(trainable_parameters(trained)))
        return export

    @classmethod
    def check_component(cls, pipeline_class, component):
        """Raise if ``component`` cannot be written (a pipeline's LoRA loader knows only some)."""

    @classmethod
    def saved_keys(cls, module, adapter_name="default"):
        """The keys written of ``module``'s trained parameters: peft's (`peft_saved_keys`)."""
        return peft_saved_keys(module, adapter_name)

    @classmethod
    def config_of(cls, config, module):
        return as_json(config.to_dict())

    @property
    def title(self):
        """What the adapter is called: "LoRA", "DoRA", "LoKr", "LoHa" or "OFT"."""
        raise NotImplementedError

    @property
    def loading_code(self):
        """The model card's loading code, a `hub.how_to_load` template."""
        raise NotImplementedError

    def description(self):
        return {"kind": self.kind, "pipeline_module": importable_module(self.pipeline_class),
                "pipeline_class": self.pipeline_class.__name__, "adapter_name": self.adapter_name,
                "formats": self.formats, "components": {component: {self.config_field: config}
                                                        for component, config in self.adapter_configs.items()}}

    @classmethod
    def from_description(cls, description):
        pipeline_class = import_class(description["pipeline_module"], description["pipeline_class"])
        adapter_configs = {component: spec[cls.config_field] for component, spec in description["components"].items()}
        return cls(pipeline_class, adapter_configs, description.get("adapter_name", "default"),
                   formats=description.get("formats", [DIFFUSERS]))

    def layers(self, tensors):
        """``{component: {file key: tensor on the CPU}}`` from tensors keyed like the trained parameters."""
        return {component: {remove_adapter_name(name, self.adapter_name): tensor.detach().cpu().contiguous()
                            for name, tensor in layers.items()}
                for component, layers in by_component(tensors, self.adapter_configs).items()}

    def write(self, tensors, directory):
        layers = self.layers(tensors)
        write_atomically(directory, lambda staging: self.write_files(staging, layers))
        # Read back once: checked against memory, then converted.
        saved = self.read_files(directory)
        expected = {f"{component}.{key}": tensor for component, keys in layers.items() for key, tensor in keys.items()}
        verify_saved_tensors(saved, expected, directory)
        converted = self.converted(layers)
        if converted:
            def write_converted(staging):
                for name, tensors in converted.items():
                    (Path(staging) / name).parent.mkdir(parents=True, exist_ok=True)
                    save_converted(tensors, Path(staging) / name)

            write_atomically(directory, write_converted)
        return self.path(directory)

    def files(self):
        """``{folder: {component: its name in the file}}``: the files the adapters are written into, one per folder
        relative to the output; a component written as another's (`SAVED_AS`) beside that one gets a folder of its
        own."""
        files = {}
        for component in self.adapter_configs:
            saved_as = SAVED_AS.get(component, component)
            folder = component if saved_as != component and saved_as in self.adapter_configs else ""
            files.setdefault(folder, {})[component] = saved_as
        return files

    def converted(self, layers):
        """``{file path: tensors}`` of the layers in each asked layout, a file per folder of `files`; the base
        weights, where one needs them, are the live modules' or, for an export made from a description, those its
        configs name."""
        base_weights = (live_base_weights(self.trained) if self.trained is not None
                        else saved_base_weights(self.adapter_configs))
        converted = {}
        for folder, names in self.files().items():
            component_of = {name: component for component, name in names.items()}
            tensors = {f"{name}.{key}": tensor for component, name in names.items()
                       for key, tensor in layers[component].items()}
            configs = {name: self.adapter_configs[component] for component, name in names.items()}

            def base_weight(name, path, component_of=component_of):  # by the file's names
                return base_weights(component_of[name], path)

            for layout in self.formats:
                if layout != DIFFUSERS:
                    converted[str(Path(folder) / converted_name(layout))] = convert_adapter(
                        tensors, configs, layout, family=self.pipeline_class.__name__, base_weights=base_weight)
        return converted

    def read_checkpoint(self, directory):
        """The files' tensors by the live parameter names; a key that no live parameter has stays as it is."""
        names = {}
        for name in trainable_parameters(self.trained):
            component, _, key = name.partition(".")
            names[f"{component}.{remove_adapter_name(key, self.adapter_name)}"] = name
        return {names.get(key, key): tensor for key, tensor in self.read_files(directory).items()}

    def write_files(self, staging, layers):
        """Write ``layers`` ({component: {peft's key: tensor}}) in the adapter's own format into ``staging``."""
        raise NotImplementedError

    def read_files(self, directory):
        """The tensors `write_files` wrote into ``directory``, keyed ``<component>.<peft's key>``."""
        raise NotImplementedError

    def path(self, directory):
        """What `write` returns: the written file or folder."""
        raise NotImplementedError


class LoraExport(AdapterExport):
    """LoRA or DoRA adapters on pipeline components, written as one ``pytorch_lora_weights.safetensors`` by
    ``pipeline_class.save_lora_weights`` with each component's config as its adapter metadata, so that
    ``pipe.load_lora_weights(directory)`` loads it."""

    kind = "lora"
    config_field = "lora_adapter_metadata"

    @classmethod
    def check_component(cls, pipeline_class, component):
        saved_as = SAVED_AS.get(component, component)
        if f"{saved_as}_lora_layers" not in inspect.signature(pipeline_class.save_lora_weights).parameters:
            raise ValueError(f"{pipeline_class.__name__}.save_lora_weights cannot save a LoRA for {component!r}")

    @property
    def title(self):
        return LORA_TITLES[any(config.get("use_dora") for config in self.adapter_configs.values())]

    @property
    def loading_code(self):
        return LORA_HOW_TO_LOAD

    def write_files(self, staging, layers):
        for folder, names in self.files().items():
            kwargs = {}
            for component, name in names.items():
                kwargs[f"{name}_lora_layers"] = layers[component]
                kwargs[f"{name}_lora_adapter_metadata"] = dict(self.adapter_configs[component])
            self.pipeline_class.save_lora_weights(Path(staging) / folder, weight_name=LORA_WEIGHTS_NAME, **kwargs)

    def read_files(self, directory):
        tensors = {}
        for folder, names in self.files().items():
            component_of = {name: component for component, name in names.items()}
            for key, tensor in load_file(Path(directory) / folder / LORA_WEIGHTS_NAME).items():
                name, _, rest = key.partition(".")
                tensors[f"{component_of.get(name, name)}.{rest}"] = tensor
        return tensors

    def path(self, directory):
        return Path(directory) / LORA_WEIGHTS_NAME


class ModelLoraExport(LoraExport):
    """A LoRA on the one trained model of a pipeline that has no LoRA loader (Kandinsky 2.2's prior pipeline): one
    ``pytorch_lora_weights.safetensors`` as the model's own ``save_lora_adapter`` writes it (peft's keys, no component
    prefix, the config as metadata), which ``pipe.<component>.load_lora_adapter(directory, prefix=None,
    use_safetensors=True)`` loads. No UI layouts."""

    kind = "model_lora"

    @classmethod
    def check_component(cls, pipeline_class, component):
        """Any component: the model loads its adapter itself."""

    @property
    def loading_code(self):
        return MODEL_LORA_HOW_TO_LOAD.replace("{component}", next(iter(self.adapter_configs)))

    def write_files(self, staging, layers):
        ((component, tensors),) = layers.items()
        metadata = {"format": "pt", METADATA_KEY: json.dumps(self.adapter_configs[component], indent=2,
                                                             sort_keys=True)}
        save_file(tensors, Path(staging) / LORA_WEIGHTS_NAME, metadata=metadata)

    def read_files(self, directory):
        (component,) = self.adapter_configs
        return {f"{component}.{key}": tensor for key, tensor in load_file(self.path(directory)).items()}


class PeftExport(AdapterExport):
    """LoKr, LoHa or OFT adapters on pipeline components, in peft's own format: ``<component>/adapter_config.json``
    and ``<component>/adapter_model.safetensors`` (`peft_files`), which ``PeftModel.from_pretrained(
    getattr(pipe, component), directory + "/" + component)`` loads. Each config names the component's folder of the
    base model (``base_model_name_or_path``, as peft's own saving does), whose weights an OFT's difference in the UI
    layouts needs when there are no live modules (`base_weights.saved_base_weights`)."""

    kind = "peft"
    config_field = "adapter_config"

    @classmethod
    def config_of(cls, config, module):
        """The config as ``PeftModel.save_pretrained`` saves it: for inference, naming the base model's folder and
        class."""
        base = getattr(getattr(module, "config", None), "_name_or_path", None)
        return {**super().config_of(config, module), "base_model_name_or_path": base, "inference_mode": True,
                "auto_mapping": {"base_model_class": type(module).__name__, "parent_library": type(module).__module__}}

    @property
    def title(self):
        return PEFT_TITLES[next(iter(self.adapter_configs.values()))["peft_type"]]

    @property
    def loading_code(self):
        return PEFT_HOW_TO_LOAD.replace("{components}", repr(list(self.adapter_configs)))

    def write_files(self, staging, layers):
        for component, tensors in layers.items():
            write_peft_adapter(Path(staging) / component, self.adapter_configs[component], tensors)

    def read_files(self, directory):
        tensors = {}
        for component in self.adapter_configs:
            _, component_tensors = read_peft_adapter(Path(directory) / component)
            tensors.update({f"{component}.{key}": tensor for key, tensor in component_tensors.items()})
        return tensors

    def path(self, directory):
        return Path(directory)
