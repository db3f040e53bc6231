"""How trained weights are written: adapters or model folders, atomically, and checked once written (`writing`).

Adapters are written where their loaders read them (`adapter_export`: ``load_lora_weights``, peft, the UI tools);
model folders are what ``from_pretrained`` loads. Every file is read back to check that it holds exactly what was
meant.

A run describes what it trains once, as an `adapters.export.LoraExport` or ``PeftExport``, a `ModelExport` or a
`PipelineExport`. With it the script saves its outputs (`save_with_ema`: the raw weights, then the EMA's, swapped
into the live modules), and the post-hoc EMA synthesis writes its tensors in the same layout, from the description
the run left in ``posthoc_ema/format.json`` (`posthoc_ema.synthesis.export_from_description`).

Reading the files back replaces the upstream scripts' reload-and-render "final validation": the last
in-loop validation rendered the weights in memory, and the check proves the files hold exactly those.
"""

import dataclasses
import enum
import importlib
from pathlib import Path

import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file, save_file

from ..errors import few
from ..pipeline import trainable_parameters
from .pipeline_folder import save_pipeline
from .writing import save_model, saved_tensors, write_atomically

TENSORS_NAME = "posthoc_ema_weights.safetensors"


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

    def write_checkpoint(self, tensors, directory):
        """What `save_checkpoint` writes, from ``tensors`` keyed like the trained parameters instead of the live
        modules (a sharded run's, gathered whole)."""
        return self.write(tensors, directory)

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


class ModelExport(Export):
    """Whole trained diffusers (or transformers) models, each written by ``save_pretrained``: into the folder for one
    component, into a subfolder per component for several; ``from_pretrained`` loads them.

    ``configs`` holds each component's class and config, so that `write` can rebuild the model around
    synthesized tensors (`model_from_config`). `of` makes one from the live modules.
    """

    kind = "module"

    def __init__(self, configs, trained=None):
        super().__init__(trained)
        self.configs = configs

    @classmethod
    def of(cls, trained):
        configs = {}
        for component, module in trained.items():
            if not (hasattr(module, "save_pretrained") and hasattr(module, "config")
                    and (hasattr(module, "from_config") or hasattr(module, "config_class"))):
                raise TypeError(f"{type(module).__name__} is not a diffusers or transformers model "
                                "(from_config or config_class, save_pretrained)")
            config = dict(module.config) if hasattr(module, "from_config") else module.config.to_dict()
            configs[component] = {"class_module": importable_module(type(module)),
                                  "class_name": type(module).__name__, "config": as_json(config)}
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
        return self._write(tensors, lambda component: self.folder(directory, component), directory)

    def write_checkpoint(self, tensors, directory):
        """Each model in its component's folder, as `save_checkpoint` writes them."""
        return self._write(tensors, lambda component: Path(directory) / component, directory)

    def _write(self, tensors, folder_of, directory):
        for component, state in by_component(tensors, self.configs).items():
            spec = self.configs[component]
            # Its parameters made on the meta device: no weights initialised only to be replaced, and no random
            # numbers drawn (a sharded run's checkpoint is written so mid-run, and the run must go on with the RNG as
            # it was). Its buffers are made as its config makes them: those saved beside the weights (SD3's
            # positional embedding) are not trained, and not among ``tensors``.
            with init_empty_weights(include_buffers=False):
                module = model_from_config(import_class(spec["class_module"], spec["class_name"]), spec["config"])
            expected = module.state_dict()
            state = {**{name: tensor for name, tensor in expected.items() if not tensor.is_meta}, **state}
            missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
            if missing or unexpected:
                raise ValueError(f"{component}: the tensors do not cover {spec['class_name']}'s state dict "
                                 f"(missing {few(sorted(missing))}; unexpected {few(sorted(unexpected))})")
            module.load_state_dict({name: tensor.to(expected[name].dtype) for name, tensor in state.items()},
                                   assign=True)
            save_model(module, folder_of(component))
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
    loads (the trained models written anew, the others' files linked: `pipeline_folder.save_pipeline`), and the
    EMA's as the trained models alone, each in its component's folder (``ema/unet``) as in the pipeline. Post-hoc
    syntheses are written as by `ModelExport`."""

    def __init__(self, pipe, trained):
        super().__init__(ModelExport.of(trained).configs, trained)
        self.pipe = pipe

    def save(self, directory):
        save_pipeline(self.pipe, directory, trained=self.trained)
        return self.component_folder(directory)

    def save_ema(self, directory):
        self.save_checkpoint(directory)
        return self.component_folder(directory)

    def component_folder(self, directory):
        """Where the trained model is, for one trained component; else ``directory``."""
        return Path(directory) / next(iter(self.trained)) if len(self.trained) == 1 else Path(directory)


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


def model_from_config(model_class, config):
    """A diffusers model (``from_config``) or a transformers one (its ``config_class``) made from its config dict."""
    if hasattr(model_class, "from_config"):
        return model_class.from_config(config)
    return model_class(model_class.config_class.from_dict(config))


def import_class(module_name, class_name):
    return getattr(importlib.import_module(module_name), class_name)
