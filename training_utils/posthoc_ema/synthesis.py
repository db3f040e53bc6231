"""Post-hoc EMA after training: EMAs of any length synthesized from the snapshots a run took (EDM2).

The snapshots of `PostHocEMA` combine linearly, by the least-squares fit of their profiles,
into an EMA of another length (sigma_rel) at any snapshot step. `synthesize` returns the tensors keyed
like the run's trained parameters (a validation sweep copies them into the live parameters as they are);
`write_synthesis` writes them as the run writes its outputs (``posthoc_ema/format.json``).
"""

import dataclasses
import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from safetensors.torch import load_file

from . import FORMAT_FILE, POSTHOC_FORMAT, Snapshot, read_snapshots
from ..adapters.export import LoraExport, ModelLoraExport, PeftExport
from ..custom_diffusion import CustomDiffusionExport
from ..embeddings import EmbeddingExport
from ..names import SNAPSHOT_DIR
from ..outputs.export import ModelExport, TensorsExport
from ..pivotal import PivotalExport
from .profiles import sigma_rel_to_gamma, solve_posthoc_coefficients

SYNTHESIS_FILE = "synthesis.json"
# The exports a run's description may name, by kind.
EXPORTS = {export.kind: export for export in (TensorsExport, LoraExport, ModelLoraExport, PeftExport, ModelExport,
                                              EmbeddingExport, CustomDiffusionExport, PivotalExport)}


def export_from_description(description):
    """The export that ``description`` (an export's `description`, e.g. from format.json) describes; None describes
    plain tensors."""
    if description is None:
        return TensorsExport()
    kind = description.get("kind")
    if kind not in EXPORTS:
        raise ValueError(f"export kind must be one of {sorted(EXPORTS)}, got {kind!r}")
    return EXPORTS[kind]() if kind == TensorsExport.kind else EXPORTS[kind].from_description(description)


def read_export(output_dir):
    """The export that ``posthoc_ema/format.json`` describes (the run's own), or plain tensors without one."""
    path = Path(output_dir) / SNAPSHOT_DIR / FORMAT_FILE
    if not path.is_file():
        return export_from_description(None)
    description = json.loads(path.read_text())
    if description.pop("format", None) != POSTHOC_FORMAT:
        raise ValueError(f"{path} is not a post-hoc EMA format description")
    description.pop("version", None)
    return export_from_description(description)


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


def write_synthesis(result: Synthesis, export, directory) -> Path:
    """Write one `Synthesis` with ``export`` (`read_export`), plus ``synthesis.json`` (coefficients, error)."""
    path = export.write(result.tensors, directory)
    record = {"sigma_rel": result.sigma_rel, "gamma": result.gamma, "step": result.step,
              "relative_error": result.relative_error,
              "snapshots": [{"file": s.path.name, "step": s.step, "gamma": s.gamma, "coefficient": c}
                            for s, c in zip(result.snapshots, result.coefficients)]}
    Path(directory, SYNTHESIS_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return path


def output_folder(output_dir, sigma_rel: float, step: Optional[int] = None) -> Path:
    name = f"sigma_rel-{sigma_rel:g}" + (f"-step-{step}" if step is not None else "")
    return Path(output_dir) / SNAPSHOT_DIR / name
