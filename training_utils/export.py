"""How trained weights are written: LoRA files or model folders, atomically, and checked once written (`writing`).

LoRA files are what any pipeline's ``load_lora_weights`` loads; model folders what ``from_pretrained``
loads. Every file is read back to check that it holds exactly what was meant.

A run describes what it trains once, as a `LoraExport`, a `ModelExport` or a `PipelineExport`. With it the
script saves its outputs (`save_with_ema`: the raw weights, then the EMA's, swapped into the live modules),
and the post-hoc EMA synthesis writes its tensors in the same layout, from the description the run left in
``posthoc_ema/format.json`` (`export_from_description`).

Reading the files back replaces the upstream scripts' reload-and-render "final validation": the last
in-loop validation rendered the weights in memory, and the check proves the files hold exactly those.
"""

import dataclasses
import enum
import importlib
import inspect
from pathlib import Path

from peft.utils import get_peft_model_state_dict
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .convert_lora import DIFFUSERS, convert, save_converted
from .errors import few
from .pipeline import trainable_parameters
from .writing import save_model, save_pipeline, saved_tensors, verify_saved_tensors, write_atomically

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
# Components that a pipeline's ``save_lora_weights`` has no argument for but whose ``load_lora_weights`` loads a LoRA
# of another component's layout into, with a flag: Wan 2.2's low-noise expert, whose LoRA is a transformer LoRA that
# ``load_lora_weights(path, load_into_transformer_2=True)`` loads. Written as that component's; beside a LoRA of
# that component, in a subfolder named after it (`lora_folder`).
SAVED_AS = {"transformer_2": "transformer"}
TENSORS_NAME = "posthoc_ema_weights.safetensors"


def converted_name(layout):
    """The file name of a LoRA in another layout than diffusers', beside ``pytorch_lora_weights.safetensors``."""
    return f"pytorch_lora_weights_{layout}.safetensors"


def save_with_ema(export, output_dir, ema=None):
    """The raw weights into ``output_dir`` (``export.save``) and, with an EMA, the EMA's into ``output_dir/ema``
    (``export.save_ema``, with the EMA weights swapped into the live modules, so that both have the same keys,
    shapes and metadata). Returns ``{"raw": path, "ema": path}``. Both, in every layout, are written and checked in
    one staging folder and moved into place together (`writing.write_atomically`): a stop or a failure meanwhile
    leaves the outputs there before whole, never raw weights of one step beside an EMA of another."""
    written = {}

    def write(staging):
        written["raw"] = export.save(staging).relative_to(staging)
        if ema is not None:
            with ema.swapped_in():
                written["ema"] = export.save_ema(Path(staging) / "ema").relative_to(staging)

    write_atomically(output_dir, write)
    return {variant: Path(output_dir) / path for variant, path in written.items()}


class Export:
    """What every export does. ``trained`` maps component names ("unet", "text_encoder", ...) to the live
    modules, or is None for an export made from a description, which can only `write` tensors."""

    kind = None

    def __init__(self, trained=None):
        self.trained = trained

    def description(self):
        """A JSON-ready dict that `export_from_description` turns back into an equal export."""
        return {"kind": self.kind}

    def write(self, tensors, directory):
        """Write ``tensors``, keyed like the run's trained parameters (``<component>.<parameter name>``)."""
        raise NotImplementedError

    def save(self, directory):
        """Write the live trained weights into ``directory``; returns the written path."""
        return self.write(trainable_parameters(self.trained), directory)

    def save_ema(self, directory):
        """Write the live weights (the EMA's, swapped in by `save_with_ema`) as the EMA output's layout has them."""
        return self.save(directory)

    def save_checkpoint(self, directory):
        """Write the live trained weights into a checkpoint folder, loadable as the final output is. These files
        are the checkpoint's only copy of the weights: resuming reads them back with `read_checkpoint`."""
        return self.save(directory)

    def read_checkpoint(self, directory):
        """The trained tensors that `save_checkpoint` wrote into ``directory``, keyed like the trained parameters
        (``<component>.<parameter name>``)."""
        raise NotImplementedError


class TensorsExport(Export):
    """The tensors as they are, keyed by parameter name, in one ``posthoc_ema_weights.safetensors``."""

    kind = "tensors"

    def write(self, tensors, directory):
        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in tensors.items()}
        write_atomically(directory, lambda staging: save_file(tensors, Path(staging, TENSORS_NAME)))
        return Path(directory) / TENSORS_NAME

    def read_checkpoint(self, directory):
        return load_file(Path(directory) / TENSORS_NAME)


class LoraExport(Export):
    """LoRA adapters on pipeline components, written as one ``pytorch_lora_weights.safetensors`` by
    ``pipeline_class.save_lora_weights``, so that ``pipe.load_lora_weights(directory)`` loads it, and beside it
    the same adapters in each other layout of ``formats`` (`convert_lora`: ``…_kohya.safetensors``,
    ``…_comfyui.safetensors``) for the UI tools.

    ``adapter_configs`` holds each component's peft ``LoraConfig`` as JSON; it goes into the file as the
    adapter metadata. `of` makes one from the live modules.
    """

    kind = "lora"

    def __init__(self, pipeline_class, adapter_configs, adapter_name="default", trained=None, formats=(DIFFUSERS,)):
        super().__init__(trained)
        self.pipeline_class = pipeline_class
        self.adapter_configs = adapter_configs
        self.adapter_name = adapter_name
        self.formats = list(formats)

    @classmethod
    def of(cls, pipeline_class, trained, formats=(DIFFUSERS,), adapter_name="default"):
        """The export of the adapters on ``trained`` ({component: module}). Checks now, on the live modules,
        that ``save_lora_weights`` takes each component and that the trained parameters are exactly what
        peft saves, so that `save` from the parameters writes what peft would."""
        accepted = inspect.signature(pipeline_class.save_lora_weights).parameters
        adapter_configs = {}
        for component, module in trained.items():
            if f"{SAVED_AS.get(component, component)}_lora_layers" not in accepted:
                raise ValueError(f"{pipeline_class.__name__}.save_lora_weights cannot save a LoRA for {component!r}")
            keys = {remove_adapter_name(name, adapter_name)
                    for name, parameter in module.named_parameters() if parameter.requires_grad}
            saved_by_peft = set(get_peft_model_state_dict(module, adapter_name=adapter_name))
            if keys != saved_by_peft:
                raise ValueError(f"{component}: the trained parameters are not what peft saves (only trained: "
                                 f"{few(sorted(keys - saved_by_peft))}; only saved: "
                                 f"{few(sorted(saved_by_peft - keys))})")
            adapter_configs[component] = as_json(module.peft_config[adapter_name].to_dict())
        return cls(pipeline_class, adapter_configs, adapter_name, trained, formats)

    def description(self):
        return {"kind": self.kind, "pipeline_module": importable_module(self.pipeline_class),
                "pipeline_class": self.pipeline_class.__name__, "adapter_name": self.adapter_name,
                "formats": self.formats, "components": {component: {"lora_adapter_metadata": config}
                                                        for component, config in self.adapter_configs.items()}}

    @classmethod
    def from_description(cls, description):
        pipeline_class = import_class(description["pipeline_module"], description["pipeline_class"])
        adapter_configs = {component: spec["lora_adapter_metadata"]
                           for component, spec in description["components"].items()}
        return cls(pipeline_class, adapter_configs, description.get("adapter_name", "default"),
                   formats=description.get("formats", [DIFFUSERS]))

    def lora_folder(self, directory, component):
        """Where ``component``'s LoRA file goes: ``directory``, or for a component written as another's
        (`SAVED_AS`) beside that one's LoRA, its subfolder."""
        saved_as = SAVED_AS.get(component, component)
        return Path(directory) / component if saved_as != component and saved_as in self.adapter_configs \
            else Path(directory)

    def write(self, tensors, directory):
        """Write the LoRA file(s), check them against ``tensors`` and convert them; returns the first file."""
        files = {}
        for component, layers in by_component(tensors, self.adapter_configs).items():
            files.setdefault(self.lora_folder(directory, component), {})[component] = layers
        return [self._write_file(layers, folder) for folder, layers in files.items()][0]

    def _write_file(self, components, directory):
        kwargs = {}
        for component, layers in components.items():
            saved_as = SAVED_AS.get(component, component)
            kwargs[f"{saved_as}_lora_layers"] = {remove_adapter_name(name, self.adapter_name):
                                                 tensor.detach().cpu().contiguous() for name, tensor in layers.items()}
            kwargs[f"{saved_as}_lora_adapter_metadata"] = dict(self.adapter_configs[component])
        write_atomically(directory, lambda staging: self.pipeline_class.save_lora_weights(
            staging, weight_name=LORA_WEIGHTS_NAME, **kwargs))
        path = Path(directory) / LORA_WEIGHTS_NAME
        expected = {f"{SAVED_AS.get(component, component)}.{key}": tensor for component in components
                    for key, tensor in kwargs[f"{SAVED_AS.get(component, component)}_lora_layers"].items()}
        # Read back once: checked against memory, then converted (the conversion needs the file's metadata).
        with safe_open(path, framework="pt") as file:
            saved, metadata = {key: file.get_tensor(key) for key in file.keys()}, file.metadata()
        verify_saved_tensors(saved, expected, path)
        converted = {converted_name(layout): convert(saved, metadata, layout, family=self.pipeline_class.__name__)
                     for layout in self.formats if layout != DIFFUSERS}
        if converted:
            def write_converted(staging):
                for name, tensors in converted.items():
                    save_converted(tensors, Path(staging) / name)

            write_atomically(directory, write_converted)
        return path

    def read_checkpoint(self, directory):
        """The file's tensors by the live parameter names; a key that no live parameter has stays as it is."""
        names, tensors = {}, {}
        for name in trainable_parameters(self.trained):
            component, _, key = name.partition(".")
            folder = self.lora_folder(directory, component)
            names[folder, f"{SAVED_AS.get(component, component)}.{remove_adapter_name(key, self.adapter_name)}"] = name
        for folder in dict.fromkeys(folder for folder, _ in names):
            tensors.update({names.get((folder, key), key): tensor
                            for key, tensor in load_file(folder / LORA_WEIGHTS_NAME).items()})
        return tensors


class ModelExport(Export):
    """Whole trained diffusers models, each written by ``save_pretrained``: into the folder itself for one
    component, into a subfolder per component for several; ``from_pretrained`` loads them.

    ``configs`` holds each component's class and config, so that `write` can rebuild the model around
    synthesized tensors with ``from_config``. `of` makes one from the live modules.
    """

    kind = "module"

    def __init__(self, configs, trained=None):
        super().__init__(trained)
        self.configs = configs

    @classmethod
    def of(cls, trained):
        configs = {}
        for component, module in trained.items():
            if not all(hasattr(module, name) for name in ("from_config", "save_pretrained", "config")):
                raise TypeError(f"{type(module).__name__} is not a diffusers model (from_config/save_pretrained)")
            configs[component] = {"class_module": importable_module(type(module)),
                                  "class_name": type(module).__name__, "config": as_json(dict(module.config))}
        return cls(configs, trained)

    def description(self):
        return {"kind": self.kind, "components": self.configs}

    @classmethod
    def from_description(cls, description):
        return cls(description["components"])

    def folder(self, directory, component):
        return Path(directory) / component if len(self.configs) > 1 else Path(directory)

    def write(self, tensors, directory):
        """Rebuild each model with ``from_config`` around ``tensors``, which must cover its whole state dict."""
        for component, state in by_component(tensors, self.configs).items():
            spec = self.configs[component]
            module = import_class(spec["class_module"], spec["class_name"]).from_config(spec["config"])
            expected = module.state_dict()
            missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
            if missing or unexpected:
                raise ValueError(f"{component}: the tensors do not cover {spec['class_name']}'s state dict "
                                 f"(missing {few(sorted(missing))}; unexpected {few(sorted(unexpected))})")
            module.load_state_dict({name: tensor.to(expected[name].dtype) for name, tensor in state.items()})
            save_model(module, self.folder(directory, component))
        return Path(directory)

    def save(self, directory):
        for component, module in self.trained.items():
            save_model(module, self.folder(directory, component))
        return Path(directory)

    def save_checkpoint(self, directory):
        """Each trained model in its component's folder (``checkpoint-N/controlnet``), however many there are."""
        for component, module in self.trained.items():
            save_model(module, Path(directory) / component)
        return Path(directory)

    def read_checkpoint(self, directory):
        """The trained parameters of each model's folder; the rest of its state (buffers, frozen weights) is not
        trained and stays out."""
        trained = trainable_parameters(self.trained)
        return {f"{component}.{key}": tensor for component in self.trained
                for key, tensor in saved_tensors(Path(directory) / component).items()
                if f"{component}.{key}" in trained}


class PipelineExport(ModelExport):
    """A full fine-tune's outputs: the raw weights as the whole pipeline, which ``from_pretrained(output_dir)``
    loads, and the EMA's as the trained models alone, each in its component's folder (``ema/unet``) as in the
    pipeline. Post-hoc syntheses are written as by `ModelExport`."""

    def __init__(self, pipe, trained):
        super().__init__(ModelExport.of(trained).configs, trained)
        self.pipe = pipe

    def save(self, directory):
        save_pipeline(self.pipe, directory)
        return self.component_folder(directory)

    def save_ema(self, directory):
        self.save_checkpoint(directory)
        return self.component_folder(directory)

    def component_folder(self, directory):
        """Where the trained model is, for one trained component; else ``directory``."""
        return Path(directory) / next(iter(self.trained)) if len(self.trained) == 1 else Path(directory)


EXPORTS = {export.kind: export for export in (TensorsExport, LoraExport, ModelExport)}


def export_from_description(description):
    """The export that ``description`` (an export's `description`, e.g. from format.json) describes;
    None describes plain tensors."""
    if description is None:
        return TensorsExport()
    kind = description.get("kind")
    if kind not in EXPORTS:
        raise ValueError(f"export kind must be one of {sorted(EXPORTS)}, got {kind!r}")
    return EXPORTS[kind]() if kind == TensorsExport.kind else EXPORTS[kind].from_description(description)


def by_component(tensors, components):
    """``{component: {parameter name: tensor}}`` from tensors keyed ``<component>.<parameter name>``."""
    grouped = {component: {} for component in components}
    stray = []
    for name, tensor in tensors.items():
        component, _, key = name.partition(".")
        if component in grouped:
            grouped[component][key] = tensor
        else:
            stray.append(name)
    if stray:
        raise ValueError(f"tensors of no exported component ({', '.join(components)}): {few(sorted(stray))}")
    return grouped


def remove_adapter_name(key, adapter_name="default"):
    """``...to_q.lora_A.default.weight`` -> ``...to_q.lora_A.weight``: a live parameter name to the key of a
    LoRA file (peft's rule: drop the adapter name where it precedes the last component, or ends the key)."""
    if key.endswith(f".{adapter_name}"):
        return key[: -len(adapter_name) - 1]
    head, _, suffix = key.rpartition(".")
    if head.endswith(f".{adapter_name}"):
        head = head[: -len(adapter_name) - 1]
    return f"{head}.{suffix}" if head else key


def as_json(value):
    """Plain JSON values for peft/diffusers configs: sets become sorted lists, enums their values."""
    if isinstance(value, dict):
        return {str(key): as_json(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(as_json(item) for item in value)
    if isinstance(value, (list, tuple)):
        return [as_json(item) for item in value]
    if isinstance(value, enum.Enum):
        return as_json(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return as_json(dataclasses.asdict(value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def importable_module(cls):
    """The shortest module path that exports ``cls`` ("diffusers" for diffusers' classes)."""
    top = cls.__module__.split(".")[0]
    try:
        if getattr(importlib.import_module(top), cls.__name__, None) is cls:
            return top
    except ImportError:
        pass
    return cls.__module__


def import_class(module_name, class_name):
    return getattr(importlib.import_module(module_name), class_name)
