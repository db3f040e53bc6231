"""Post-hoc EMA during training (EDM2, Karras et al. 2024): power-function EMAs and their snapshots.

From the snapshots, an EMA of any other length can be synthesized after training (`.synthesis`, and the
command line of ``__main__``).

`PostHocEMA` keeps two or more power-function EMAs (`ema.PowerEMA`; their profiles: `.profiles`) of the trained
tensors and writes their fp32 shadows as snapshots into ``<output_dir>/posthoc_ema/``. A snapshot holds only the
trained tensors (for a LoRA, the adapter's size, not the model's), so for adapters this is nearly free.

Sharded (FSDP2), each process updates the shadows of its own part of each parameter, without communication (as
`ema.EMA` does); snapshots and checkpoints gather them whole, every process taking part, and the main process writes.

Files under ``<output_dir>/posthoc_ema/``:
    format.json
        how to write synthesized tensors, written once per run (`start`, or the first snapshot):
        {"format": "training_utils.posthoc_ema", "version": 1, **export.description()}, where the export
        (`export.LoraExport`, `ModelExport`, or plain tensors without one) is the run's own.
    snapshot-<step:08d>-gamma-<gamma:.6g>.safetensors
        one profile's fp32 shadows keyed by parameter name (``pipeline.trainable_parameters``),
        metadata {"format", "step", "gamma", "sigma_rel", "update_every"} (strings; floats as repr)
    sigma_rel-<value>/  (``sigma_rel-<value>-step-<S>/`` with an explicit ``--step``)
        what ``python -m training_utils.posthoc_ema`` (``__main__``) synthesizes: the export's files and
        ``synthesis.json``.
"""

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import List, Mapping, Optional, Sequence, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..ema import PowerEMA
from ..names import SNAPSHOT_DIR
from ..outputs.export import TensorsExport
from ..outputs.writing import write_atomically
from .profiles import sigma_rel_to_gamma

POSTHOC_FORMAT = "training_utils.posthoc_ema"
POSTHOC_STATE_FORMAT = "training_utils.posthoc_ema.state"
FORMAT_VERSION = 1
FORMAT_FILE = "format.json"
SNAPSHOT_PATTERN = re.compile(r"^snapshot-(\d+)-gamma-(.+)\.safetensors$")


def snapshot_name(step: int, gamma: float) -> str:
    return f"snapshot-{step:08d}-gamma-{gamma:.6g}.safetensors"


class PostHocEMA:
    """Several power-function EMAs (`PowerEMA`) over the same named parameters, with snapshots.

    Args:
        parameters: name -> live parameter (``pipeline.trainable_parameters``); kept by reference.
        sigma_rels: at least two distinct EMA lengths, each in (0, 1/sqrt(12)) (EDM2: 0.05 0.10).
        update_every: update interval K in optimizer steps (interval-corrected, see `PowerEMA`).
        device: where the fp32 shadows live (default: each parameter's device).
        export: how the synthesis writes its results (the run's `export.LoraExport`, `ModelExport`, ...);
            None writes plain tensors.
    """

    def __init__(self, parameters: Mapping[str, torch.nn.Parameter], sigma_rels: Sequence[float],
                 update_every: int = 1, device=None, export=None):
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
        self.format = {"format": POSTHOC_FORMAT, "version": FORMAT_VERSION,
                       **(export or TensorsExport()).description()}

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

    def rebind(self, parameters: Mapping[str, torch.nn.Parameter]):
        """Track ``parameters`` in place of the live parameters given so far (`ema.EMA.rebind`)."""
        for profile in self.profiles:
            profile.rebind(parameters)
        self.parameters = self.profiles[0].parameters

    def whole_shadows(self) -> List[dict]:
        """Each profile's whole shadows (`ema.EMA.whole_shadows`: sharded, every process must call this)."""
        return [profile.whole_shadows() for profile in self.profiles]

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
                expected = {name: tuple(parameter.shape) for name, parameter in self.parameters.items()}
                if shapes != expected:
                    raise ValueError(f"{snapshot.path} holds other tensors than this run trains; "
                                     f"remove {directory} or use another output_dir")
        self._write_format(directory)

    def _write_format(self, directory: Path):
        text = json.dumps(self.format, indent=2, sort_keys=True) + "\n"
        path = directory / FORMAT_FILE
        if path.is_file() and path.read_text() == text:
            return
        write_atomically(directory, lambda staging: Path(staging, FORMAT_FILE).write_text(text))

    def snapshot(self, step: int, output_dir, shadows: Optional[List[dict]] = None) -> List[Path]:
        """Write each profile's shadows (or ``shadows``, as `whole_shadows` gives them) to
        ``<output_dir>/posthoc_ema/snapshot-<step>-gamma-<g>.safetensors`` atomically (and format.json, if
        missing). The profiles must have been updated at ``step``."""
        if step != self.step or step < 1:
            raise ValueError(f"snapshot at step {step} needs the profiles updated at that step "
                             f"(they are at {self.step})")
        directory = Path(output_dir) / SNAPSHOT_DIR
        if not (directory / FORMAT_FILE).is_file():
            self._write_format(directory)
        paths = []
        for sigma_rel, profile, wholes in zip(self.sigma_rels, self.profiles, shadows or self.whole_shadows()):
            tensors = {name: shadow.detach().to("cpu").contiguous() for name, shadow in wholes.items()}
            metadata = {"format": POSTHOC_FORMAT, "step": str(step), "gamma": repr(profile.gamma),
                        "sigma_rel": repr(sigma_rel), "update_every": str(self.update_every)}
            name = snapshot_name(step, profile.gamma)
            write_atomically(directory, lambda staging: save_file(tensors, Path(staging, name), metadata=metadata))
            paths.append(directory / name)
        return paths

    def on_step(self, step: int, last_step: Optional[int], output_dir, snapshot_every: Optional[int],
                write: bool = True) -> List[Path]:
        """The loop's one call per optimizer step: update when due (every K steps, at snapshot steps and
        at ``last_step``), then snapshot when due (``write=False`` updates but writes nothing; every process calls
        this, since sharded shadows are gathered for a snapshot). Returns the snapshot paths written."""
        snapshot_due = self.is_snapshot_due(step, snapshot_every, last_step)
        if snapshot_due or self.is_due(step, last_step):
            self.update(step)
        if not snapshot_due:
            return []
        shadows = self.whole_shadows()
        return self.snapshot(step, output_dir, shadows) if write else []

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

    def save(self, path: Union[str, os.PathLike], shadows: Optional[List[dict]] = None):
        """All profiles' shadows (or ``shadows``, as `whole_shadows` gives them) and the step in one safetensors
        file (keys ``<profile index>/<name>``), atomically."""
        path = Path(path)
        tensors = {f"{index}/{name}": shadow.detach().to("cpu").contiguous()
                   for index, wholes in enumerate(shadows or self.whole_shadows()) for name, shadow in wholes.items()}
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


def make_posthoc_ema(args, parameters, accelerator, export):
    """The `PostHocEMA` of ``parameters`` that ``--ema_posthoc_sigma_rels`` asks for, or None; ``export`` is the
    run's own (`export.LoraExport`, ...), so that syntheses are written as the run's outputs are."""
    if not args.ema_posthoc_sigma_rels:
        return None
    return PostHocEMA(parameters, args.ema_posthoc_sigma_rels, update_every=args.ema_update_every,
                      device="cpu" if args.ema_device == "cpu" else accelerator.device, export=export)


def posthoc_snapshot_steps(args, max_train_steps):
    """``--ema_posthoc_snapshot_steps``, or about 20 snapshots over the run: EDM2's least-squares fit
    needs a couple dozen to reconstruct other lengths well."""
    return args.ema_posthoc_snapshot_steps or max(1, max_train_steps // 20)

