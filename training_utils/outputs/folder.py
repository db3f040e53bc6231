"""The run's output folder: another run's outputs are never written over, and a killed writer's leftovers are removed.

Before any weights load (`check_output_dir`), a run that does not resume refuses a folder holding what runs write
(`run_outputs`: checkpoints, weights, validation images, the model card) unless ``--overwrite_output_dir``, which
clears those first; so does ``--resume_from_checkpoint latest`` in a folder without checkpoints, unless the run
last in it did not complete (its ``run_status.json`` says so): that run is being started over. Only a run's folder
(`a_runs_folder`: one holding ``run_status.json``, which a run writes before anything else) is ever cleared: files
of those names elsewhere are not ours. The folder must be one this run can write, apart from every model folder
the run reads (not that folder, inside it, or holding it). When the run starts (`prepare_output_dir`, the first
process) the staging folders of writes that were killed are removed, and the folder becomes the run's
(`run_status.RunRecord.take_folder`), unless the run resumes from a checkpoint: then it does once the checkpoint is
accepted, so that a refused resume leaves the status of the run before as it was.
"""

import json
import logging
import os
import shutil
from pathlib import Path

from ..errors import few, require
from ..names import LORA_WEIGHTS_NAME, PEFT_CONFIG_NAME, SAVED_AS, STAGING_PREFIX, STATUS_FILE
from .checkpoint_folders import CHECKPOINT_PATTERN, complete_checkpoints
from .run_status import COMPLETED, read_status
from .writing import write_problem

logger = logging.getLogger(__name__)

# What the scripts write at the top of an output folder, besides checkpoints and a full pipeline's components.
OUTPUT_NAMES = ("ema", "posthoc_ema", "validation", "README.md", "model_index.json", "config.json")
OUTPUT_FILE_PREFIXES = ("pytorch_lora_weights", "diffusion_pytorch_model")
# Staging folders of checkpoints before they shared the prefix of every other write.
EARLIER_CHECKPOINT_STAGING = ".checkpoint-*.incomplete"


def run_outputs(folder):
    """The names of what runs write at the top of ``folder`` (sorted; none if it does not exist): checkpoints,
    LoRA files, adapter folders (`adapter_folder`), ControlNet or pipeline files and their components, EMA and
    post-hoc EMA, validation, model card. Tracker logs, ``run_status.json`` and staging folders are not among them:
    they hold nothing of a result."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    names = {*OUTPUT_NAMES, *pipeline_components(folder)}
    return sorted(path.name for path in folder.iterdir()
                  if path.name in names or path.name.startswith(OUTPUT_FILE_PREFIXES)
                  or (CHECKPOINT_PATTERN.match(path.name) and path.is_dir())
                  or adapter_folder(path))


def adapter_folder(path):
    """Whether ``path`` is a component's adapter in a folder of its own: peft's format (LoKr, LoHa, OFT), or a LoRA
    written as another component's beside that one's (Wan 2.2's low-noise expert, `adapters.export.SAVED_AS`)."""
    return (path / PEFT_CONFIG_NAME).is_file() or (path.name in SAVED_AS and (path / LORA_WEIGHTS_NAME).is_file())


def pipeline_components(folder):
    """The component folders that ``folder/model_index.json`` (a saved pipeline's) lists."""
    try:
        index = json.loads((Path(folder) / "model_index.json").read_text())
    except (OSError, ValueError):
        return []
    return [name for name, value in index.items() if not name.startswith("_") and isinstance(value, list)]


def a_runs_folder(folder):
    """Whether ``folder`` is one that a run of these scripts wrote into: it holds ``run_status.json``."""
    return (Path(folder) / STATUS_FILE).is_file()


def check_output_dir(args):
    """Refuse, in one line, an ``--output_dir`` that this run cannot write, that is not apart from a model folder
    it reads, or that holds another run's outputs (see the module's docstring)."""
    output_dir, resume = args.output_dir, args.resume_from_checkpoint
    require(not Path(output_dir).is_file(), "--output_dir", output_dir, "a folder (or a path where one can be made), "
            "not a file")
    for flag, model_folder in model_folders(args).items():
        require(not overlapping(output_dir, model_folder), "--output_dir", output_dir,
                f"a folder apart from the model folder of {flag} ({model_folder}): not that folder, inside it or "
                f"holding it, where this run's outputs would mix with the model's files")
    problem = write_problem(output_dir)
    require(problem is None, "--output_dir", output_dir, f"a folder this run can write ({problem})")
    require(not (args.overwrite_output_dir and resume), "--overwrite_output_dir", True,
            "no --resume_from_checkpoint with it (clearing the folder would remove the checkpoints to resume from)")
    outputs = run_outputs(output_dir)
    if not outputs:
        return
    ours = a_runs_folder(output_dir)
    require(ours or not args.overwrite_output_dir, "--overwrite_output_dir", True,
            f"an --output_dir that runs of these scripts wrote into (with {STATUS_FILE}); {output_dir} holds "
            f"{few(outputs)} without one, which --overwrite_output_dir never removes: choose another --output_dir")
    if args.overwrite_output_dir:
        return
    clear = "--overwrite_output_dir to clear the folder first" if ours else "choose another --output_dir"
    require(resume is not None, "--output_dir", output_dir,
            f"a folder without another run's outputs (it holds {few(outputs)}): pass --resume_from_checkpoint "
            f"latest to continue that run, or {clear}")
    status = read_status(output_dir)
    require(resume != "latest" or complete_checkpoints(output_dir) or (status or {}).get("reason") not in
            (None, COMPLETED), "--resume_from_checkpoint", resume,
            f"a checkpoint in {output_dir} to resume from: it holds {few(outputs)} of a run that "
            f"{'completed' if status else 'left no run_status.json'}, but no checkpoint; "
            f"{'pass --overwrite_output_dir to clear the folder first, or ' if ours else ''}choose another "
            f"--output_dir")


def resumes_a_checkpoint(args):
    """Whether the run will resume from a checkpoint, once the loop accepts it: ``--resume_from_checkpoint`` names
    one, or says latest in a folder that holds one."""
    resume = args.resume_from_checkpoint
    return resume is not None and (resume != "latest" or bool(complete_checkpoints(args.output_dir)))


def model_folders(args):
    """The model folders on this machine that the run reads, by flag: the ``--*_name_or_path`` flags naming one."""
    return {f"--{flag}": value for flag, value in sorted(vars(args).items())
            if flag.endswith("name_or_path") and isinstance(value, str) and Path(value).expanduser().is_dir()}


def overlapping(folder, other):
    """Whether ``folder`` is ``other``, is inside it or holds it, however each is named (relative, through a link,
    in another case on a file system that ignores case): the folders themselves are compared, not their names."""
    return identity(other) in identities_upwards(folder) or identity(folder) in identities_upwards(other)


def identity(path):
    """(device, inode) of the folder ``path``, or None if there is none."""
    try:
        status = os.stat(Path(path).expanduser())
    except OSError:
        return None
    return status.st_dev, status.st_ino


def identities_upwards(path):
    """The identities of ``path`` and of every folder above it."""
    path = Path(path).expanduser().resolve()
    return {identity(folder) for folder in (path, *path.parents)} - {None}


def prepare_output_dir(args, run):
    """Make the output folder ready for the run, on the first process before anything is written: with
    ``--overwrite_output_dir`` what runs write there is removed first (tracker logs and status too), from a run's
    folder only (`a_runs_folder`); the staging folders of writes that were killed are removed. The folder becomes
    ``run``'s (`run_status.RunRecord`), unless the run resumes from a checkpoint: the loop makes it the run's once it
    has accepted the checkpoint (`loop.TrainingLoop`)."""
    output_dir = Path(args.output_dir)
    if args.overwrite_output_dir and a_runs_folder(output_dir):
        records = [name for name in (args.logging_dir, STATUS_FILE) if inside(output_dir / name, output_dir)]
        cleared = [*run_outputs(output_dir), *(name for name in records if (output_dir / name).exists())]
        for name in cleared:
            remove(output_dir / name)
        if cleared:
            logger.info(f"--overwrite_output_dir: removed {few(cleared)} from {output_dir}")
    staging = [*output_dir.rglob(f"{STAGING_PREFIX}*"), *output_dir.glob(EARLIER_CHECKPOINT_STAGING)]
    for path in staging:
        remove(path)
    if staging:
        logger.info(f"removed what {len(staging)} interrupted write(s) left: {few([str(path) for path in staging])}")
    output_dir.mkdir(parents=True, exist_ok=True)
    if not resumes_a_checkpoint(args):
        run.take_folder(args.output_dir)


def inside(path, folder):
    """Whether ``path`` is under ``folder`` (not the folder itself), once ``..`` and links are resolved."""
    path, folder = Path(path).resolve(), Path(folder).resolve()
    return path != folder and path.is_relative_to(folder)


def remove(path):
    """Remove the file or folder ``path``; one that is already gone is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
