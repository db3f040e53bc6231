"""Post-hoc EMA (EDM2, Karras et al. 2024): choose the EMA length after training.

During training, `PostHocEMA` keeps two or more power-function EMAs (`ema.PowerEMA`) of the
trained tensors and writes their fp32 shadows as snapshots into ``<output_dir>/posthoc_ema/``.
After training, ``python -m training_utils.posthoc_ema`` combines the snapshots linearly into
an EMA of any other length (sigma_rel) at any snapshot step, by EDM2's least-squares fit of
power-function profiles, and writes it in the script's own output format. A snapshot holds only
the trained tensors (for a LoRA, the adapter's size, not the model's), so for adapters this is
nearly free. `synthesize` returns ``{parameter name: tensor}``, which a validation sweep can copy
into the live parameters as they are.

Profiles. A power EMA with exponent gamma has single-step decay ``(1 - 1/t) ** (gamma + 1)``
(t in optimizer steps, from 1). Its shadow at step T averages the weights with the density
``p_T(tau) = (gamma + 1) tau**gamma / T**(gamma + 1)`` on [0, T] (exactly for the
piecewise-constant weights the updates sample; see `ema.PowerEMA`). Its relative standard
deviation is ``sigma_rel = sqrt((gamma + 1) / ((gamma + 2)**2 (gamma + 3)))``: EMA length as a
fraction of training time (0.05 -> gamma ~ 16.97, 0.10 -> gamma ~ 6.94).

Files under ``<output_dir>/posthoc_ema/``:
    format.json
        how to export synthesized tensors, written once per run (`start`, or the first snapshot):
        {"format": "training_utils.posthoc_ema", "version": 1, "kind": "lora" | "module" | "tensors", ...}
        lora:    "pipeline_module", "pipeline_class", "adapter_name",
                 "components": {component: {"lora_adapter_metadata": {peft LoraConfig as JSON}}}
        module:  "components": {component: {"class_module", "class_name", "config"}}
        tensors: nothing more (raw ``posthoc_ema_weights.safetensors`` keyed by parameter name)
    snapshot-<step:08d>-gamma-<gamma:.6g>.safetensors
        one profile's fp32 shadows keyed by parameter name (``pipeline.trainable_parameters``),
        metadata {"format", "step", "gamma", "sigma_rel", "update_every"} (strings; floats as repr)
    sigma_rel-<value>/  (``sigma_rel-<value>-step-<S>/`` with an explicit ``--step``)
        the synthesized weights: ``pytorch_lora_weights.safetensors`` (lora; ``pipe.load_lora_weights``
        loads it), a ``save_pretrained`` folder (module; one subfolder per component if several),
        or ``posthoc_ema_weights.safetensors`` (tensors); plus ``synthesis.json`` (coefficients, error).

Wiring into a script (``parameters = trainable_parameters(trained)`` as for `EMA`; the flags
``--ema_posthoc_sigma_rels S S [S ...]`` and ``--ema_posthoc_snapshot_steps N`` are the script's)::

    from training_utils.posthoc_ema import PostHocEMA, lora_export_format   # or module_export_format(trained)
    posthoc = PostHocEMA(parameters, args.ema_posthoc_sigma_rels, update_every=args.ema_update_every,
                         export_format=lora_export_format(StableDiffusionPipeline, trained))
    # checkpoint save hook: posthoc.save(dir / "posthoc_ema.safetensors"); load hook: posthoc.load(same path)
    posthoc.start(args.output_dir, global_step, write=accelerator.is_main_process)      # after resuming
    # in the loop, next to the EMA update:
    posthoc.on_step(global_step, max_train_steps, args.output_dir, args.ema_posthoc_snapshot_steps,
                    write=accelerator.is_main_process)

``start`` writes format.json and deletes snapshots newer than the (resumed) step: they belong to
a run that is being replaced. ``on_step`` updates every K steps, at snapshot steps and at the
final step, and snapshots every N steps and at the final step. After training::

    python -m training_utils.posthoc_ema --output_dir out --sigma_rel 0.08 0.12 [--step S]
"""

import dataclasses
import enum
import importlib
import json
import math
import os
import re
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .ema import PowerEMA, _few
from .export import verify_saved_tensors, write_atomically

POSTHOC_FORMAT = "training_utils.posthoc_ema"
POSTHOC_STATE_FORMAT = "training_utils.posthoc_ema.state"
FORMAT_VERSION = 1
SNAPSHOT_DIR = "posthoc_ema"
FORMAT_FILE = "format.json"
SYNTHESIS_FILE = "synthesis.json"
TENSORS_FILE = "posthoc_ema_weights.safetensors"
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
SNAPSHOT_PATTERN = re.compile(r"^snapshot-(\d+)-gamma-(.+)\.safetensors$")
MAX_SIGMA_REL = 1 / math.sqrt(12)  # sigma_rel of gamma = 0 (a uniform average over [0, T])


# ---------------------------------------------------------------------------------------------
# sigma_rel <-> gamma, and the least-squares fit of profiles
# ---------------------------------------------------------------------------------------------

def gamma_to_sigma_rel(gamma: float) -> float:
    """Relative standard deviation of the power-function profile with exponent ``gamma`` (> 0)."""
    gamma = float(gamma)
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent gamma > 0 whose profile has relative standard deviation ``sigma_rel``.

    ``sigma_rel**-2 = (gamma + 2)**2 (gamma + 3) / (gamma + 1)`` is the cubic
    ``gamma**3 + 7 gamma**2 + (16 - s) gamma + (12 - s) = 0`` with ``s = sigma_rel**-2``; gamma is
    its largest real root. Valid for ``0 < sigma_rel < 1/sqrt(12)`` (ValueError otherwise).
    """
    sigma_rel = float(sigma_rel)
    if not 0 < sigma_rel < MAX_SIGMA_REL:
        raise ValueError(f"sigma_rel must satisfy 0 < sigma_rel < 1/sqrt(12) ~ {MAX_SIGMA_REL:.4f}, got {sigma_rel}")
    s = sigma_rel ** -2
    roots = np.roots([1.0, 7.0, 16.0 - s, 12.0 - s])
    gamma = float(max(root.real for root in roots if abs(root.imag) <= 1e-9 * max(1.0, abs(root))))
    # one Newton step on the defining equation polishes the root to float64 precision
    f = ((gamma + 7) * gamma + 16 - s) * gamma + 12 - s
    df = (3 * gamma + 14) * gamma + 16 - s
    return gamma - f / df if df != 0 else gamma


def profile_dot(t_a, gamma_a, t_b, gamma_b):
    """Inner product over tau of the power-function profiles p_a = (g_a+1) tau^g_a / t_a^(g_a+1) on
    [0, t_a] and p_b likewise (numpy broadcasting, float64).

    int_0^m (g_a+1)(g_b+1) tau^(g_a+g_b) / (t_a^(g_a+1) t_b^(g_b+1)) d tau,  m = min(t_a, t_b)
      = (g_a+1)(g_b+1) / (g_a+g_b+1) * m^(g_a+g_b+1) / (t_a^(g_a+1) t_b^(g_b+1))
      = (g_a+1)(g_b+1) / (g_a+g_b+1) * (t_a/t_b)^g_b / t_b    if t_a <= t_b (symmetrically otherwise),
    the last form free of overflow for large steps and exponents.
    """
    t_a, gamma_a, t_b, gamma_b = (np.asarray(x, dtype=np.float64) for x in (t_a, gamma_a, t_b, gamma_b))
    # if t_a <= t_b: m = t_a, value = c * t_a^(g_a+g_b+1) / (t_a^(g_a+1) t_b^(g_b+1)) = c * (t_a/t_b)^g_b / t_b
    # else, symmetrically: c * (t_b/t_a)^g_a / t_a
    c = (gamma_a + 1) * (gamma_b + 1) / (gamma_a + gamma_b + 1)
    a_first = t_a <= t_b
    ratio = np.where(a_first, t_a / t_b, t_b / t_a)
    exponent = np.where(a_first, gamma_b, gamma_a)
    return c * ratio ** exponent / np.maximum(t_a, t_b)


def solve_posthoc_coefficients(steps: Sequence[float], gammas: Sequence[float], target_step: float,
                               target_gammas: Union[float, Sequence[float]]):
    """Least-squares combination of snapshot profiles that best matches target profiles (L2 over tau).

    Solves ``A x = b`` with ``A[i, j] = <p_i, p_j>`` and ``b[i] = <p_i, p_target>`` (float64), then
    normalises x to sum to 1 (each profile integrates to 1, so the combination is an average).

    Returns ``(coefficients, relative_errors)``: coefficients of shape (len(steps), len(targets)),
    and for each target ``||sum_i x_i p_i - p_target|| / ||p_target||`` with the normalised x.
    """
    steps = np.asarray(steps, dtype=np.float64).reshape(-1)
    gammas = np.asarray(gammas, dtype=np.float64).reshape(-1)
    target_gammas = np.atleast_1d(np.asarray(target_gammas, dtype=np.float64))
    if steps.size == 0 or steps.shape != gammas.shape:
        raise ValueError("need one gamma per snapshot step, and at least one snapshot")
    if np.any(steps <= 0) or target_step <= 0:
        raise ValueError("snapshot and target steps must be > 0")
    target_steps = np.full_like(target_gammas, float(target_step))

    a = profile_dot(steps[:, None], gammas[:, None], steps[None, :], gammas[None, :])
    b = profile_dot(steps[:, None], gammas[:, None], target_steps[None, :], target_gammas[None, :])
    try:
        x = np.linalg.solve(a, b)
    except np.linalg.LinAlgError:  # duplicate profiles: any least-squares solution will do
        x = np.linalg.lstsq(a, b, rcond=None)[0]
    x = x / np.sum(x, axis=0, keepdims=True)

    target_norm2 = profile_dot(target_steps, target_gammas, target_steps, target_gammas)
    error2 = np.einsum("it,ij,jt->t", x, a, x) - 2 * np.einsum("it,it->t", x, b) + target_norm2
    errors = np.sqrt(np.maximum(error2, 0.0) / target_norm2)
    return x, errors


# ---------------------------------------------------------------------------------------------
# Training side: the profiles, their snapshots and their checkpoint state
# ---------------------------------------------------------------------------------------------

def _jsonable(value):
    """Plain JSON values for peft/diffusers configs: sets become sorted lists, enums their values."""
    if isinstance(value, Mapping):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(_jsonable(item) for item in value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(item) for item in value]
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _jsonable(dataclasses.asdict(value))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def remove_adapter_name(key: str, adapter_name: str = "default") -> str:
    """``...to_q.lora_A.default.weight`` -> ``...to_q.lora_A.weight``: a live parameter name to the key
    of a LoRA file (peft's rule: drop the adapter name where it precedes the last component, or ends the key)."""
    if key.endswith(f".{adapter_name}"):
        return key[: -len(adapter_name) - 1]
    head, _, suffix = key.rpartition(".")
    if head.endswith(f".{adapter_name}"):
        head = head[: -len(adapter_name) - 1]
    return f"{head}.{suffix}" if head else key


def lora_export_format(pipeline_class, trained: Mapping[str, torch.nn.Module], adapter_name: str = "default") -> dict:
    """The format.json description for LoRA adapters on ``trained`` ({component: module}) of ``pipeline_class``.

    Checks now, with the live modules, that the parameter names map to the keys peft writes, so the
    synthesized file is what ``save_lora`` would write for the same tensors.
    """
    from peft.utils import get_peft_model_state_dict

    components = {}
    for component, module in trained.items():
        if f"{component}_lora_layers" not in _parameters_of(pipeline_class.save_lora_weights):
            raise ValueError(f"{pipeline_class.__name__}.save_lora_weights cannot save a LoRA for component {component!r}")
        by_pointer = {param.data_ptr(): name for name, param in module.named_parameters() if param.requires_grad}
        for key, tensor in get_peft_model_state_dict(module, adapter_name=adapter_name).items():
            name = by_pointer.get(tensor.data_ptr())
            if name is not None and remove_adapter_name(name, adapter_name) != key:
                raise ValueError(f"parameter {component}.{name} is saved by peft as {key!r}, "
                                 f"not {remove_adapter_name(name, adapter_name)!r}")
        components[component] = {"lora_adapter_metadata": _jsonable(module.peft_config[adapter_name].to_dict())}
    return {"kind": "lora", "pipeline_module": _importable_module(pipeline_class),
            "pipeline_class": pipeline_class.__name__, "adapter_name": adapter_name, "components": components}


def module_export_format(trained: Mapping[str, torch.nn.Module]) -> dict:
    """The format.json description for whole trained diffusers modules ({component: module}, e.g.
    {"controlnet": controlnet}): class and config, so ``from_config`` + ``save_pretrained`` can export."""
    components = {}
    for component, module in trained.items():
        if not (hasattr(type(module), "from_config") and hasattr(module, "save_pretrained") and hasattr(module, "config")):
            raise TypeError(f"{type(module).__name__} is not a diffusers model (from_config/save_pretrained)")
        components[component] = {"class_module": _importable_module(type(module)),
                                 "class_name": type(module).__name__, "config": _jsonable(dict(module.config))}
    return {"kind": "module", "components": components}


def _importable_module(cls) -> str:
    """The shortest module path that exports ``cls`` ("diffusers" for diffusers' classes)."""
    top = cls.__module__.split(".")[0]
    try:
        if getattr(importlib.import_module(top), cls.__name__, None) is cls:
            return top
    except ImportError:
        pass
    return cls.__module__


def _parameters_of(function):
    import inspect

    return inspect.signature(function).parameters


def _full_format(export_format: Optional[Mapping]) -> dict:
    export_format = dict(export_format) if export_format is not None else {"kind": "tensors"}
    if export_format.get("kind") not in WRITERS:
        raise ValueError(f"export format kind must be one of {sorted(WRITERS)}, got {export_format.get('kind')!r}")
    return {"format": POSTHOC_FORMAT, "version": FORMAT_VERSION, **_jsonable(export_format)}


def snapshot_name(step: int, gamma: float) -> str:
    return f"snapshot-{step:08d}-gamma-{gamma:.6g}.safetensors"


class PostHocEMA:
    """Several power-function EMAs (`PowerEMA`) over the same named parameters, with snapshots.

    Args:
        parameters: name -> live parameter (``pipeline.trainable_parameters``); kept by reference.
        sigma_rels: at least two distinct EMA lengths, each in (0, 1/sqrt(12)) (EDM2: 0.05 0.10).
        update_every: update interval K in optimizer steps (interval-corrected, see `PowerEMA`).
        device: where the fp32 shadows live (default: each parameter's device).
        export_format: format.json content, from `lora_export_format` / `module_export_format`;
            None writes plain tensors.
    """

    def __init__(self, parameters: Mapping[str, torch.nn.Parameter], sigma_rels: Sequence[float],
                 update_every: int = 1, device=None, export_format: Optional[Mapping] = None):
        sigma_rels = [float(sigma_rel) for sigma_rel in sigma_rels]
        if len(sigma_rels) < 2 or len(set(sigma_rels)) != len(sigma_rels):
            raise ValueError(f"post-hoc EMA needs at least two distinct sigma_rels, got {sigma_rels}")
        self.sigma_rels = sigma_rels
        self.gammas = [sigma_rel_to_gamma(sigma_rel) for sigma_rel in sigma_rels]
        names = [snapshot_name(1, gamma) for gamma in self.gammas]
        if len(set(names)) != len(names):
            raise ValueError(f"sigma_rels {sigma_rels} are too close to tell their snapshots apart")
        self.update_every = update_every
        self.profiles = [PowerEMA(parameters, gamma, update_every=update_every, device=device)
                         for gamma in self.gammas]
        self.parameters = self.profiles[0].parameters
        self.export_format = _full_format(export_format)

    @property
    def step(self) -> int:
        """Optimizer step of the last update (0 before the first)."""
        return self.profiles[0].step

    @property
    def num_bytes(self) -> int:
        """Bytes held by all shadows; one snapshot file is ``num_bytes / len(sigma_rels)`` plus a header."""
        return sum(profile.num_bytes for profile in self.profiles)

    def is_due(self, step: int, last_step: Optional[int] = None) -> bool:
        """Whether the profiles' update interval (or the run's last step) falls on ``step``."""
        return self.profiles[0].is_due(step, last_step)

    @staticmethod
    def is_snapshot_due(step: int, every: Optional[int], last_step: Optional[int] = None) -> bool:
        """Snapshot every ``every`` optimizer steps (None or 0: never) and at the run's ``last_step``."""
        return bool(every) and step % every == 0 or step == last_step

    def update(self, step: int):
        """Update every profile as of optimizer step ``step`` (the first update copies)."""
        for profile in self.profiles:
            profile.update(step)

    def start(self, output_dir, step: int = 0, write: bool = True):
        """Call once before the training loop, after resuming at ``step`` (0 for a new run).

        Deletes snapshots taken after ``step`` (they come from a run this one replaces), checks that
        snapshots kept come from the same parameters, and writes format.json. ``write=False`` (not the
        main process) does nothing.
        """
        if not write:
            return
        directory = Path(output_dir) / SNAPSHOT_DIR
        for snapshot in read_snapshots(output_dir, strict=False):
            if snapshot.step > step:
                snapshot.path.unlink()
            else:
                with safe_open(snapshot.path, framework="pt") as file:
                    shapes = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}
                expected = {name: tuple(shadow.shape) for name, shadow in self.profiles[0].shadows.items()}
                if shapes != expected:
                    raise ValueError(f"{snapshot.path} holds other tensors than this run trains; "
                                     f"remove {directory} or use another output_dir")
        self._write_format(directory)

    def _write_format(self, directory: Path):
        text = json.dumps(self.export_format, indent=2, sort_keys=True) + "\n"
        path = directory / FORMAT_FILE
        if path.is_file() and path.read_text() == text:
            return
        write_atomically(directory, lambda staging: Path(staging, FORMAT_FILE).write_text(text))

    def snapshot(self, step: int, output_dir) -> List[Path]:
        """Write each profile's shadows to ``<output_dir>/posthoc_ema/snapshot-<step>-gamma-<g>.safetensors``
        atomically (and format.json, if missing). The profiles must have been updated at ``step``."""
        if step != self.step or step < 1:
            raise ValueError(f"snapshot at step {step} needs the profiles updated at that step (they are at {self.step})")
        directory = Path(output_dir) / SNAPSHOT_DIR
        if not (directory / FORMAT_FILE).is_file():
            self._write_format(directory)
        paths = []
        for sigma_rel, profile in zip(self.sigma_rels, self.profiles):
            tensors = {name: shadow.detach().to("cpu").contiguous() for name, shadow in profile.shadows.items()}
            metadata = {"format": POSTHOC_FORMAT, "step": str(step), "gamma": repr(profile.gamma),
                        "sigma_rel": repr(sigma_rel), "update_every": str(self.update_every)}
            name = snapshot_name(step, profile.gamma)
            write_atomically(directory, lambda staging: save_file(tensors, Path(staging, name), metadata=metadata))
            paths.append(directory / name)
        return paths

    def on_step(self, step: int, last_step: Optional[int], output_dir, snapshot_every: Optional[int],
                write: bool = True) -> List[Path]:
        """The loop's one call per optimizer step: update when due (every K steps, at snapshot steps and
        at ``last_step``), then snapshot when due (``write=False`` updates but writes nothing). Returns
        the snapshot paths written."""
        snapshot_due = self.is_snapshot_due(step, snapshot_every, last_step)
        if snapshot_due or self.is_due(step, last_step):
            self.update(step)
        return self.snapshot(step, output_dir) if snapshot_due and write else []

    def state_dict(self) -> dict:
        """``{"sigma_rels": [...], "profiles": [EMA.state_dict() ...]}`` (shadows by reference)."""
        return {"sigma_rels": list(self.sigma_rels), "profiles": [profile.state_dict() for profile in self.profiles]}

    def load_state_dict(self, state: Mapping):
        """Strict: the same sigma_rels in the same order, and each profile's names and shapes (ValueError)."""
        sigma_rels = [float(sigma_rel) for sigma_rel in state["sigma_rels"]]
        if sigma_rels != self.sigma_rels or len(state["profiles"]) != len(self.profiles):
            raise ValueError(f"post-hoc EMA state has sigma_rels {sigma_rels}, this run tracks {self.sigma_rels}")
        steps = {int(profile_state["step"]) for profile_state in state["profiles"]}
        if len(steps) != 1:
            raise ValueError(f"post-hoc EMA state has profiles at different steps {sorted(steps)}")
        for profile, profile_state in zip(self.profiles, state["profiles"]):
            profile.load_state_dict(profile_state)

    def save(self, path: Union[str, os.PathLike]):
        """All profiles' shadows and the step in one safetensors file (keys ``<profile index>/<name>``), atomically."""
        path = Path(path)
        tensors = {f"{index}/{name}": shadow.detach().to("cpu").contiguous()
                   for index, profile in enumerate(self.profiles) for name, shadow in profile.shadows.items()}
        metadata = {"format": POSTHOC_STATE_FORMAT, "step": str(self.step), "sigma_rels": json.dumps(self.sigma_rels)}
        write_atomically(path.parent, lambda staging: save_file(tensors, Path(staging, path.name), metadata=metadata))

    def load(self, path: Union[str, os.PathLike]):
        """Loads a file written by `save` (strict, as `load_state_dict`)."""
        with safe_open(os.fspath(path), framework="pt", device="cpu") as file:
            metadata = file.metadata() or {}
            if metadata.get("format") != POSTHOC_STATE_FORMAT:
                raise ValueError(f"{path} is not a post-hoc EMA state written by {POSTHOC_STATE_FORMAT}")
            sigma_rels = json.loads(metadata["sigma_rels"])
            profiles = [{"shadows": {}, "step": int(metadata["step"])} for _ in sigma_rels]
            for key in file.keys():
                index, _, name = key.partition("/")
                if not index.isdigit() or int(index) >= len(profiles):
                    raise ValueError(f"{path}: unexpected key {key!r}")
                profiles[int(index)]["shadows"][name] = file.get_tensor(key)
        self.load_state_dict({"sigma_rels": sigma_rels, "profiles": profiles})


# ---------------------------------------------------------------------------------------------
# After training: read snapshots, synthesize, export
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Snapshot:
    path: Path
    step: int
    gamma: float
    sigma_rel: float


def read_snapshots(output_dir, strict: bool = True) -> List[Snapshot]:
    """The snapshots in ``<output_dir>/posthoc_ema/`` (headers only), sorted by step then gamma.

    ``strict``: a file named like a snapshot but without our metadata is an error (else skipped).
    """
    directory = Path(output_dir) / SNAPSHOT_DIR
    found = []
    if not directory.is_dir():
        return found
    for path in directory.iterdir():
        if not SNAPSHOT_PATTERN.match(path.name) or not path.is_file():
            continue
        with safe_open(path, framework="pt") as file:
            metadata = file.metadata() or {}
        if metadata.get("format") != POSTHOC_FORMAT or not {"step", "gamma", "sigma_rel"} <= metadata.keys():
            if strict:
                raise ValueError(f"{path} is not a post-hoc EMA snapshot written by {POSTHOC_FORMAT}")
            continue
        found.append(Snapshot(path, int(metadata["step"]), float(metadata["gamma"]), float(metadata["sigma_rel"])))
    return sorted(found, key=lambda snapshot: (snapshot.step, snapshot.gamma))


def read_format(output_dir) -> dict:
    """``posthoc_ema/format.json``, or the plain-tensors format when there is none."""
    path = Path(output_dir) / SNAPSHOT_DIR / FORMAT_FILE
    if not path.is_file():
        return _full_format(None)
    export_format = json.loads(path.read_text())
    if export_format.get("format") != POSTHOC_FORMAT:
        raise ValueError(f"{path} is not a post-hoc EMA format description")
    return export_format


@dataclasses.dataclass
class Synthesis:
    sigma_rel: float
    gamma: float
    step: int
    snapshots: List[Snapshot]
    coefficients: List[float]
    relative_error: float
    tensors: Dict[str, torch.Tensor]


@torch.no_grad()
def synthesize(output_dir, sigma_rels: Sequence[float], step: Optional[int] = None) -> List[Synthesis]:
    """EMAs of lengths ``sigma_rels`` at optimizer step ``step`` (default: the last snapshot's), from the
    snapshots in ``<output_dir>/posthoc_ema/`` taken at or before ``step``.

    Each result's tensors are keyed like the EMA's parameter names, fp32, combined in float64 from
    the snapshots read one at a time (memory: one snapshot plus one float64 accumulator per target).
    """
    gammas = [sigma_rel_to_gamma(sigma_rel) for sigma_rel in sigma_rels]
    snapshots = read_snapshots(output_dir)
    if not snapshots:
        raise ValueError(f"no post-hoc EMA snapshots in {Path(output_dir) / SNAPSHOT_DIR}")
    step = snapshots[-1].step if step is None else int(step)
    used = [snapshot for snapshot in snapshots if snapshot.step <= step]
    if not used:
        raise ValueError(f"no snapshot at or before step {step} (the first is at step {snapshots[0].step})")
    coefficients, errors = solve_posthoc_coefficients(
        [snapshot.step for snapshot in used], [snapshot.gamma for snapshot in used], step, gammas)

    accumulators = [dict() for _ in gammas]
    reference = None
    for index, snapshot in enumerate(used):
        tensors = load_file(snapshot.path)
        shapes = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
        if reference is None:
            reference = shapes
        elif shapes != reference:
            raise ValueError(f"{snapshot.path} holds other tensors than {used[0].path}")
        for accumulator, coefficient in zip(accumulators, coefficients[index]):
            for name, tensor in tensors.items():
                if name in accumulator:
                    accumulator[name].add_(tensor.double(), alpha=float(coefficient))
                else:
                    accumulator[name] = tensor.double() * float(coefficient)
    return [
        Synthesis(float(sigma_rel), gamma, step, used, [float(c) for c in coefficients[:, target]],
                  float(errors[target]), {name: value.float() for name, value in accumulators[target].items()})
        for target, (sigma_rel, gamma) in enumerate(zip(sigma_rels, gammas))
    ]


def _import(module_name: str, class_name: str):
    return getattr(importlib.import_module(module_name), class_name)


def _by_component(tensors: Mapping[str, torch.Tensor], components) -> Dict[str, Dict[str, torch.Tensor]]:
    grouped = {component: {} for component in components}
    stray = []
    for name, tensor in tensors.items():
        component, _, key = name.partition(".")
        if component in grouped:
            grouped[component][key] = tensor
        else:
            stray.append(name)
    if stray:
        raise ValueError(f"tensors of no component in format.json ({', '.join(components)}): {_few(sorted(stray))}")
    return grouped


def write_lora(tensors: Mapping[str, torch.Tensor], export_format: Mapping, directory) -> Path:
    """``pytorch_lora_weights.safetensors`` via ``<pipeline class>.save_lora_weights``, atomically, read back and checked."""
    pipeline_class = _import(export_format["pipeline_module"], export_format["pipeline_class"])
    adapter_name = export_format.get("adapter_name", "default")
    kwargs = {}
    for component, layers in _by_component(tensors, export_format["components"]).items():
        kwargs[f"{component}_lora_layers"] = {remove_adapter_name(key, adapter_name): tensor.contiguous()
                                              for key, tensor in layers.items()}
        kwargs[f"{component}_lora_adapter_metadata"] = dict(
            export_format["components"][component]["lora_adapter_metadata"])
    write_atomically(directory, lambda staging: pipeline_class.save_lora_weights(
        staging, weight_name=LORA_WEIGHTS_NAME, **kwargs))
    path = Path(directory) / LORA_WEIGHTS_NAME
    expected = {f"{component}.{key}": tensor for component in export_format["components"]
                for key, tensor in kwargs[f"{component}_lora_layers"].items()}
    verify_saved_tensors(load_file(path), expected, path)
    return path


def write_module(tensors: Mapping[str, torch.Tensor], export_format: Mapping, directory) -> Path:
    """A ``save_pretrained`` folder per component (the folder itself for one component), built with
    ``from_config`` and the synthesized tensors, which must cover the module's whole state dict."""
    from .export import save_model

    components = export_format["components"]
    for component, state in _by_component(tensors, components).items():
        spec = components[component]
        module = _import(spec["class_module"], spec["class_name"]).from_config(spec["config"])
        expected = module.state_dict()
        missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
        if missing or unexpected:
            raise ValueError(f"{component}: the snapshots do not cover {spec['class_name']}'s state dict "
                             f"(missing {_few(sorted(missing))}; unexpected {_few(sorted(unexpected))})")
        module.load_state_dict({name: tensor.to(expected[name].dtype) for name, tensor in state.items()})
        save_model(module, Path(directory) / component if len(components) > 1 else directory)
    return Path(directory)


def write_tensors(tensors: Mapping[str, torch.Tensor], export_format: Mapping, directory) -> Path:
    """The tensors as they are, keyed by parameter name, in ``posthoc_ema_weights.safetensors``."""
    tensors = {name: tensor.contiguous() for name, tensor in tensors.items()}
    write_atomically(directory, lambda staging: save_file(tensors, Path(staging, TENSORS_FILE)))
    return Path(directory) / TENSORS_FILE


WRITERS = {"lora": write_lora, "module": write_module, "tensors": write_tensors}


def write_synthesis(result: Synthesis, export_format: Mapping, directory) -> Path:
    """Write one `Synthesis` with the writer that format.json names, plus ``synthesis.json``."""
    path = WRITERS[export_format["kind"]](result.tensors, export_format, directory)
    record = {"sigma_rel": result.sigma_rel, "gamma": result.gamma, "step": result.step,
              "relative_error": result.relative_error,
              "snapshots": [{"file": s.path.name, "step": s.step, "gamma": s.gamma, "coefficient": c}
                            for s, c in zip(result.snapshots, result.coefficients)]}
    Path(directory, SYNTHESIS_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return path


def output_folder(output_dir, sigma_rel: float, step: Optional[int] = None) -> Path:
    name = f"sigma_rel-{sigma_rel:g}" + (f"-step-{step}" if step is not None else "")
    return Path(output_dir) / SNAPSHOT_DIR / name


def main(argv=None):
    from .args import TrainingArgumentParser, UsageError, exit_on_usage_error

    parser = TrainingArgumentParser(description="Synthesize post-hoc EMAs from the snapshots of a training run.")
    parser.add_argument("--output_dir", required=True, help="the training run's output_dir (snapshots in posthoc_ema/)")
    parser.add_argument("--sigma_rel", type=float, nargs="+", required=True,
                        help="EMA lengths to synthesize, each in (0, 1/sqrt(12))")
    parser.add_argument("--step", type=int, default=None,
                        help="the optimizer step to synthesize at (default: the last snapshot's); "
                             "later snapshots are ignored")
    args = parser.parse_args(argv)
    with exit_on_usage_error():
        for sigma_rel in args.sigma_rel:
            if not 0 < sigma_rel < MAX_SIGMA_REL:
                raise UsageError("--sigma_rel", sigma_rel, f"a value in (0, {MAX_SIGMA_REL:.4f})")
        snapshots = read_snapshots(args.output_dir)
        if not snapshots:
            raise UsageError("--output_dir", args.output_dir, f"a training output folder with {SNAPSHOT_DIR}/snapshot-*.safetensors")
        if args.step is not None and not snapshots[0].step <= args.step:
            raise UsageError("--step", args.step, f"a step at or after the first snapshot's ({snapshots[0].step})")
        export_format = read_format(args.output_dir)
        for result in synthesize(args.output_dir, args.sigma_rel, args.step):
            directory = output_folder(args.output_dir, result.sigma_rel, args.step)
            path = write_synthesis(result, export_format, directory)
            print(f"sigma_rel {result.sigma_rel:g} (gamma {result.gamma:.4f}) at step {result.step}: "
                  f"relative profile error {result.relative_error:.3e}")
            for snapshot, coefficient in zip(result.snapshots, result.coefficients):
                print(f"  {coefficient:+.6f}  {snapshot.path.name}  (step {snapshot.step}, sigma_rel {snapshot.sigma_rel:g})")
            print(f"  wrote {path}")


if __name__ == "__main__":
    main()
