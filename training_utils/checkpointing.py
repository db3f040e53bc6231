"""Checkpoints that resume exactly: accelerate's state plus our trained tensors and EMA, atomically.

A checkpoint folder holds what ``accelerator.save_state`` writes (optimizer, lr scheduler,
sampler, RNG states) and, through its save hook, ``trained_parameters.safetensors`` (the trained
tensors by name, so adapters cost megabytes, not a model), ``ema.safetensors`` and
``training_state.json``. It is written under a temporary name and renamed when complete, so a
folder named ``checkpoint-<step>`` is always whole.
"""

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .errors import UsageError

logger = logging.getLogger(__name__)

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
TRAINED_FILE = "trained_parameters.safetensors"
EMA_FILE = "ema.safetensors"
POSTHOC_FILE = "posthoc_ema.safetensors"
STATE_FILE = "training_state.json"


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


def check_resume_from_checkpoint(value, output_dir):
    """Fail before anything loads if ``--resume_from_checkpoint`` names a checkpoint that does not exist
    ("latest" may find none: the run then starts fresh)."""
    if value not in (None, "latest"):
        resolve_checkpoint(value, output_dir)


class Checkpointer:
    """Saves and loads checkpoints of one run.

    ``parameters`` are the trained tensors by name (``pipeline.trainable_parameters``); ``ema``
    is the `EMA` over them and ``posthoc`` the `PostHocEMA`, or None. Registers accelerate hooks
    so ``save_state``/``load_state`` store these instead of whole models.
    """

    def __init__(self, accelerator, output_dir, parameters, ema=None, total_limit=None, posthoc=None):
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.parameters = parameters
        self.averages = {EMA_FILE: ema, POSTHOC_FILE: posthoc}
        self.total_limit = total_limit
        self._saving_state = None
        self.loaded_state = None
        accelerator.register_save_state_pre_hook(self._save_hook)
        accelerator.register_load_state_pre_hook(self._load_hook)

    def save(self, step, state=None):
        """Write ``checkpoint-<step>`` atomically on all processes, then prune old ones. Returns its path.
        ``state`` (JSON values by name) goes into ``training_state.json`` beside the step; `loaded_state`
        gives it back on resume."""
        final = self.output_dir / f"checkpoint-{step}"
        staging = self.output_dir / f".checkpoint-{step}.incomplete"
        if self.accelerator.is_main_process and staging.exists():
            shutil.rmtree(staging)
        self.accelerator.wait_for_everyone()
        self._saving_state = {"global_step": step, **(state or {})}
        self.accelerator.save_state(str(staging))
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            self.prune()
            logger.info(f"saved {final}")
        self.accelerator.wait_for_everyone()
        return final

    def prune(self):
        """Keep the newest ``total_limit`` complete checkpoints; folders that vanish meanwhile are fine."""
        if self.total_limit is None:
            return
        for _, path in complete_checkpoints(self.output_dir)[: -self.total_limit]:
            shutil.rmtree(path, ignore_errors=True)

    def load(self, path):
        """Restore a checkpoint folder into the live run; returns its global step."""
        self.accelerator.load_state(str(path))
        return self.loaded_state["global_step"]

    def resume(self, value):
        """Restore what ``--resume_from_checkpoint value`` names; returns the step to continue from (0 if none)."""
        checkpoint = resolve_checkpoint(value, self.output_dir)
        if checkpoint is None:
            if value:
                self.accelerator.print(f"no checkpoint in {self.output_dir}; starting a new run")
            return 0
        step = self.load(checkpoint)
        self.accelerator.print(f"resumed from {checkpoint} at step {step}")
        return step

    def _save_hook(self, models, weights, output_dir):
        # Our files replace accelerate's whole-model weights: adapters stay adapter-sized.
        weights.clear()
        if not self.accelerator.is_main_process:
            return
        output_dir = Path(output_dir)
        save_file({name: p.detach().cpu().contiguous() for name, p in self.parameters.items()},
                  output_dir / TRAINED_FILE)
        for file_name, average in self.averages.items():
            if average is not None:
                average.save(output_dir / file_name)
        (output_dir / STATE_FILE).write_text(json.dumps(self._saving_state))

    def _load_hook(self, models, input_dir):
        models.clear()
        input_dir = Path(input_dir)
        for file_name, average in self.averages.items():
            if (average is not None) != (input_dir / file_name).is_file():
                raise UsageError("--resume_from_checkpoint", str(input_dir),
                                 f"a checkpoint made with the same --use_ema/--ema_posthoc_sigma_rels as this run "
                                 f"({file_name} {'missing' if average is not None else 'present'})")
        saved = load_file(input_dir / TRAINED_FILE)
        missing, unexpected = self.parameters.keys() - saved.keys(), saved.keys() - self.parameters.keys()
        if missing or unexpected:
            raise UsageError("--resume_from_checkpoint", str(input_dir),
                             f"a checkpoint of the same trained parameters (missing {sorted(missing)[:3]}, "
                             f"unexpected {sorted(unexpected)[:3]})")
        for name, parameter in self.parameters.items():
            if saved[name].shape != parameter.shape:
                raise UsageError("--resume_from_checkpoint", str(input_dir),
                                 f"{name} of shape {tuple(parameter.shape)}, not {tuple(saved[name].shape)}")
        with torch.no_grad():
            for name, parameter in self.parameters.items():
                parameter.copy_(saved[name])
        for file_name, average in self.averages.items():
            if average is not None:
                average.load(input_dir / file_name)
        self.loaded_state = json.loads((input_dir / STATE_FILE).read_text())


def resume_position(global_step, steps_per_epoch, gradient_accumulation_steps):
    """``(epoch, batches to skip in it)`` where a run restored at ``global_step`` continues."""
    epoch, step_in_epoch = divmod(global_step, steps_per_epoch)
    return epoch, step_in_epoch * gradient_accumulation_steps
