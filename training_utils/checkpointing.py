"""Checkpoints that resume exactly and load as models: accelerate's state plus the trained weights and the EMA,
atomically and verified.

A checkpoint folder holds what ``accelerator.save_state`` writes (optimizer, lr scheduler,
sampler, RNG states) and, through its save hook, the trained weights in the layout of the run's final output
(its `export`: ``pytorch_lora_weights.safetensors`` for a LoRA, ``controlnet/`` or ``unet/`` for a whole model,
which the stock diffusers calls load), the EMA's weights in the same layout under ``ema/``, each process's
random state (`random_state`) and ``training_state.json``; last, a manifest of every file's size and
hash (`manifest`). The loadable files are the only copy of the trained tensors: resuming reads them back.
A checkpoint is written under a temporary name and renamed when complete, so a folder named
``checkpoint-<step>`` is always whole, and a write that fails stops the run with the previous checkpoint
intact. Resuming checks the manifest before loading anything: ``latest`` skips a damaged checkpoint for
the newest whole one, and a named one that is damaged is an error.
"""

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object
from safetensors.torch import load_file

from . import random_state
from .accelerator import end_training
from .errors import WRITE_ERRORS, WRITE_FAILED_EXIT_CODE, RunStopped, UsageError, WriteFailed, few, write_failure
from .manifest import MANIFEST_FILE, check_manifest, write_manifest
from .pipeline import trainable_parameters

logger = logging.getLogger(__name__)

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
EMA_FOLDER = "ema"
POSTHOC_FILE = "posthoc_ema.safetensors"
STATE_FILE = "training_state.json"
RANDOM_STATE_FILE = "random_state_{}.safetensors"
# Checkpoints from format 2 on hold a manifest and their own random states; from format 3 on, the trained
# weights in the final output's layout (before, they and the EMA were in the two files named here).
CHECKPOINT_FORMAT = 3
OUTPUT_LAYOUT_FORMAT = 3
EARLIER_TRAINED_FILE = "trained_parameters.safetensors"
EARLIER_EMA_FILE = "ema.safetensors"
# accelerate writes with torch.save, which reports a failed write as a RuntimeError.
CHECKPOINT_WRITE_ERRORS = (*WRITE_ERRORS, RuntimeError)

# The flags that leave the training trajectory alone (where outputs go, what is logged and validated, checkpoint
# cadence, how long to go on, memory and loading options); every other flag is recorded in each checkpoint, and
# resuming with another value is refused unless --resume_with_changed_args.
TRAJECTORY_FREE_FLAGS = {
    "output_dir", "logging_dir", "report_to", "tracker_project_name", "push_to_hub", "hub_token", "hub_model_id",
    "validation_prompt", "validation_image", "num_validation_images", "validation_steps", "validation_epochs",
    "validation_inference_steps", "validation_height", "validation_width", "validation_sigma_rels",
    "checkpointing_steps", "checkpoints_total_limit",
    "resume_from_checkpoint", "resume_with_changed_args", "max_train_steps", "num_train_epochs",
    "dataloader_num_workers", "feature_cache_dir", "offload", "cache_dir", "skip_corrupt_images",
    "gradient_checkpointing", "torch_compile", "ema_posthoc_snapshot_steps", "sample_batch_size",
    "class_inference_steps",
}


def trajectory_flags(args):
    """The run's flags that decide its training trajectory, as JSON values by flag name."""
    return {name: json.loads(json.dumps(value, default=str)) for name, value in sorted(vars(args).items())
            if name not in TRAJECTORY_FREE_FLAGS}


def complete_checkpoints(output_dir):
    """``[(step, path)]`` of the complete checkpoints under ``output_dir``, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        match = CHECKPOINT_PATTERN.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def resolve_checkpoint(value, output_dir):
    """The checkpoint folder that ``--resume_from_checkpoint value`` means, or None to start fresh.

    "latest" is the newest complete checkpoint under ``output_dir`` (None when there is none);
    anything else is a path, or a name under ``output_dir``, and must exist.
    """
    if value is None:
        return None
    if value == "latest":
        checkpoints = complete_checkpoints(output_dir)
        return checkpoints[-1][1] if checkpoints else None
    for candidate in (Path(value), Path(output_dir) / value):
        if (candidate / STATE_FILE).is_file():
            return candidate
    raise UsageError("--resume_from_checkpoint", value,
                     f'"latest", or a checkpoint folder (a path, or a name under {output_dir}) holding {STATE_FILE}')


def checkpoint_problem(path):
    """What makes the checkpoint folder ``path`` unfit to resume from, or None. A checkpoint written before
    checkpoints held a manifest is taken as it is, with a warning."""
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError) as error:
        return f"{STATE_FILE} is unreadable ({error})"
    if state.get("format", 1) < CHECKPOINT_FORMAT and not (Path(path) / MANIFEST_FILE).exists():
        logger.warning(f"{path} has no manifest (it was written before checkpoints were verified): "
                       f"resuming from it unverified")
        return None
    return check_manifest(path)


def choose_checkpoint(value, output_dir):
    """The checkpoint ``--resume_from_checkpoint value`` resumes from, checked whole, or None to start fresh.

    "latest" passes over damaged checkpoints, saying why, to the newest whole one; a named checkpoint that is
    damaged is an error, as is a folder of checkpoints none of which is whole."""
    if value != "latest":
        path = resolve_checkpoint(value, output_dir)
        problem = path and checkpoint_problem(path)
        if problem:
            raise UsageError("--resume_from_checkpoint", value, f"a whole checkpoint: in {path}, {problem}")
        return path
    checkpoints = complete_checkpoints(output_dir)
    for _, path in reversed(checkpoints):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        logger.warning(f"not resuming from {path}: {problem}; trying the one before")
    if checkpoints:
        raise UsageError("--resume_from_checkpoint", value,
                         f"a whole checkpoint under {output_dir}: none of the {len(checkpoints)} there is")
    return None


def check_resume_from_checkpoint(value, output_dir):
    """Fail before anything loads if ``--resume_from_checkpoint`` names a checkpoint that does not exist
    ("latest" may find none: the run then starts fresh)."""
    if value not in (None, "latest"):
        resolve_checkpoint(value, output_dir)


class Checkpointer:
    """Saves and loads checkpoints of one run.

    ``export`` (`export.Export`) describes what the run trains and writes it as the final output does;
    ``ema`` is the `EMA` over its trained parameters and ``posthoc`` the `PostHocEMA`, or None. Registers
    accelerate hooks so ``save_state``/``load_state`` store these instead of whole models.
    """

    def __init__(self, accelerator, output_dir, export, ema=None, total_limit=None, posthoc=None,
                 trajectory=None, allow_changed_trajectory=False):
        self.accelerator = accelerator
        self.trajectory = trajectory or {}
        self.allow_changed_trajectory = allow_changed_trajectory
        self.output_dir = Path(output_dir)
        self.export = export
        self.parameters = trainable_parameters(export.trained)
        self.ema = ema
        self.posthoc = posthoc
        self.total_limit = total_limit
        self._saving_state = None
        self.loaded_state = None
        accelerator.register_save_state_pre_hook(self._save_hook)
        accelerator.register_load_state_pre_hook(self._load_hook)

    def save(self, step, state=None):
        """Write ``checkpoint-<step>`` atomically on all processes, then prune old ones. Returns its path.
        ``state`` (JSON values by name) goes into ``training_state.json`` beside the step; `loaded_state`
        gives it back on resume. A write that fails on any process stops the run, every process alike,
        leaving the previous checkpoints as they were."""
        final = self.output_dir / f"checkpoint-{step}"
        staging = self.output_dir / f".checkpoint-{step}.incomplete"
        failure = None
        if self.accelerator.is_main_process:
            failure = attempt(lambda: shutil.rmtree(staging) if staging.exists() else None)
        self.accelerator.wait_for_everyone()
        self._saving_state = {"format": CHECKPOINT_FORMAT, "global_step": step,
                              "processes": self.accelerator.num_processes, **(state or {}),
                              **({"trajectory": self.trajectory} if self.trajectory else {})}
        failure = self._first_failure(failure or attempt(lambda: self.accelerator.save_state(str(staging))))
        if failure is None and self.accelerator.is_main_process:
            failure = attempt(lambda: self._publish(staging, final))
        failure = self._first_failure(failure)
        if failure is not None:
            if self.accelerator.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)
            end_training(self.accelerator)
            previous = complete_checkpoints(self.output_dir)
            kept = f"{previous[-1][1]} is the latest whole checkpoint" if previous else "no checkpoint was written"
            raise RunStopped(f"could not write {final}: {failure}; {kept}", WRITE_FAILED_EXIT_CODE)
        if self.accelerator.is_main_process:
            self.prune()
            logger.info(f"saved {final}")
        self.accelerator.wait_for_everyone()
        return final

    def _publish(self, staging, final):
        """The manifest, written last, then the rename that makes the checkpoint whole."""
        write_manifest(staging)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)

    def _first_failure(self, failure):
        """The first process's failure (a message), or None: every process learns whether any failed."""
        if self.accelerator.num_processes == 1:
            return failure
        return next((message for message in gather_object([failure]) if message is not None), None)

    def prune(self):
        """Keep the newest ``total_limit`` complete checkpoints; folders that vanish meanwhile are fine."""
        if self.total_limit is None:
            return
        for _, path in complete_checkpoints(self.output_dir)[: -self.total_limit]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path):
        """Restore a checkpoint folder into the live run, the random states included; returns its global step.
        A checkpoint of a run with other trajectory flags is refused before anything loads from it."""
        self.loaded_state = json.loads((Path(path) / STATE_FILE).read_text())
        self._check_trajectory(path, self.loaded_state.get("trajectory", {}))
        self.accelerator.load_state(str(path))
        process = self.accelerator.process_index
        if self.loaded_state.get("format", 1) >= CHECKPOINT_FORMAT:
            saved_by = self.loaded_state["processes"]
            if saved_by != self.accelerator.num_processes:
                raise UsageError("--resume_from_checkpoint", str(path),
                                 f"a run on as many processes as the checkpoint's {saved_by} "
                                 f"(this one has {self.accelerator.num_processes}): each process resumes its own "
                                 f"random state")
            random_state.restore(random_state.load(Path(path) / RANDOM_STATE_FILE.format(process)))
        elif not (Path(path) / f"random_states_{process}.pkl").is_file():
            raise UsageError("--resume_from_checkpoint", str(path),
                             f"a checkpoint holding random_states_{process}.pkl (without it the run would go on with "
                             f"other random numbers)")
        return self.loaded_state["global_step"]

    def _check_trajectory(self, path, saved):
        """Refuse a checkpoint whose run had other trajectory flags (``saved``), unless told to go on (then say so)."""
        changed = [name for name in self.trajectory if name in saved and saved[name] != self.trajectory[name]]
        if not changed:
            return
        described = "; ".join(f"--{name} was {saved[name]!r}, now {self.trajectory[name]!r}" for name in changed)
        if not self.allow_changed_trajectory:
            raise UsageError("--resume_from_checkpoint", str(path),
                             f"the flags the checkpoint was trained with ({described}), or --resume_with_changed_args "
                             f"to go on anyway")
        logger.warning(f"resuming with changed flags ({described}): the run is no longer exact")

    def resume(self, value):
        """Restore what ``--resume_from_checkpoint value`` names; returns the step to continue from (0 if none).
        The main process checks the checkpoints (`choose_checkpoint`) and tells the others which one to load."""
        choice = [None]
        if self.accelerator.is_main_process:
            try:
                choice = [("path", choose_checkpoint(value, self.output_dir))]
            except UsageError as error:
                choice = [("error", error)]
        if self.accelerator.num_processes > 1:
            broadcast_object_list(choice)
        kind, checkpoint = choice[0]
        if kind == "error":
            raise checkpoint
        if checkpoint is None:
            if value:
                self.accelerator.print(f"no checkpoint in {self.output_dir}; starting a new run")
            return 0
        step = self.load(checkpoint)
        self.accelerator.print(f"resumed from {checkpoint} at step {step}")
        return step

    def _save_hook(self, models, weights, output_dir):
        # The export's files replace accelerate's whole-model weights: adapters stay adapter-sized.
        weights.clear()
        output_dir = Path(output_dir)
        random_state.save(random_state.capture(), output_dir / RANDOM_STATE_FILE.format(self.accelerator.process_index))
        if not self.accelerator.is_main_process:
            return
        self.export.save_checkpoint(output_dir)
        state = dict(self._saving_state)
        if self.ema is not None:
            with self.ema.swapped_in():
                self.export.save_checkpoint(output_dir / EMA_FOLDER)
            state["ema_step"] = self.ema.step
        if self.posthoc is not None:
            self.posthoc.save(output_dir / POSTHOC_FILE)
        (output_dir / STATE_FILE).write_text(json.dumps(state))

    def _load_hook(self, models, input_dir):
        models.clear()
        input_dir = Path(input_dir)
        earlier_layout = self.loaded_state.get("format", 1) < OUTPUT_LAYOUT_FORMAT
        has_ema = (input_dir / (EARLIER_EMA_FILE if earlier_layout else EMA_FOLDER)).exists()
        for flag, average, wanted, present in (
                ("--use_ema", "EMA", self.ema is not None, has_ema),
                ("--ema_posthoc_sigma_rels", "post-hoc EMA", self.posthoc is not None,
                 (input_dir / POSTHOC_FILE).is_file())):
            if wanted != present:
                raise UsageError("--resume_from_checkpoint", str(input_dir),
                                 f"a checkpoint made with the same {flag} as this run (its {average} is "
                                 f"{'missing' if wanted else 'present'})")
        if earlier_layout:
            saved = load_file(input_dir / EARLIER_TRAINED_FILE)
        else:
            saved = self.export.read_checkpoint(input_dir)
        with torch.no_grad():
            for name, tensor in self._checked(saved, input_dir).items():
                self.parameters[name].copy_(tensor)
        if self.ema is not None:
            if earlier_layout:
                self.ema.load(input_dir / EARLIER_EMA_FILE)
            else:
                shadows = self._checked(self.export.read_checkpoint(input_dir / EMA_FOLDER), input_dir / EMA_FOLDER)
                self.ema.load_state_dict({"shadows": shadows, "step": self.loaded_state["ema_step"]})
        if self.posthoc is not None:
            self.posthoc.load(input_dir / POSTHOC_FILE)

    def _checked(self, saved, where):
        """``saved`` if it holds exactly the trained parameters' names and shapes, else a one-line error."""
        missing, unexpected = self.parameters.keys() - saved.keys(), saved.keys() - self.parameters.keys()
        if missing or unexpected:
            raise UsageError("--resume_from_checkpoint", str(where),
                             f"a checkpoint of the same trained parameters (missing {few(sorted(missing), 3)}; "
                             f"unexpected {few(sorted(unexpected), 3)})")
        for name, parameter in self.parameters.items():
            if saved[name].shape != parameter.shape:
                raise UsageError("--resume_from_checkpoint", str(where),
                                 f"{name} of shape {tuple(parameter.shape)}, not {tuple(saved[name].shape)}")
        return saved


def attempt(write):
    """Run ``write()``; why it failed (`errors.write_failure`), or None."""
    try:
        write()
    except CHECKPOINT_WRITE_ERRORS as error:
        return write_failure(error)
    except WriteFailed as error:  # the export's files
        return error.failure
    return None


def resume_position(global_step, steps_per_epoch, gradient_accumulation_steps):
    """``(epoch, batches to skip in it)`` where a run restored at ``global_step`` continues."""
    epoch, step_in_epoch = divmod(global_step, steps_per_epoch)
    return epoch, step_in_epoch * gradient_accumulation_steps
