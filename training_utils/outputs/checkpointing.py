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

Sharded (FSDP2), accelerate writes the optimizer with ``torch.distributed.checkpoint``, each process its own shard
(``optimizer_0/``), but not the model (`sharding.fsdp2.without_model_state`): the frozen base is the pretrained one, and
the trained weights, the EMA and the post-hoc EMA are gathered whole, every process taking part, and written once by
the main process in the final output's layout, so a checkpoint holds what trains only (a LoRA's is MBs) and still
loads as a model. The manifest covers every process's files. A sharded checkpoint resumes
bitwise on as many processes as wrote it; on another number it loads resharded, which is no longer exact, and only
with --resume_with_changed_args.
"""

import json
import logging
import os
import shutil
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list, gather_object
from safetensors.torch import load_file

from .. import random_state
from ..accelerator import end_training
from ..errors import WRITE_ERRORS, WRITE_FAILED_EXIT_CODE, RunStopped, UsageError, WriteFailed, few
from ..names import EMA_FOLDER, STAGING_PREFIX, STATE_FILE
from ..pipeline import trainable_parameters
from ..sharding.fsdp2 import any_sharded, local_part, local_tensor, whole_tensors, without_model_state
from .checkpoint_folders import (CHECKPOINT_FORMAT, check_same_trained_tensors, choose_checkpoint, complete_checkpoints,
                                 recorded_trajectory)
from .manifest import write_manifest
from .stop_signals import SIGNALS
from .writing import failure_cause, give_normal_permissions, save_model, saved_tensors

logger = logging.getLogger(__name__)

POSTHOC_FILE = "posthoc_ema.safetensors"
RANDOM_STATE_FILE = "random_state_{}.safetensors"
# From format 3 on, checkpoints hold the trained weights in the final output's layout (before, they and the EMA
# were in the two files named here).
OUTPUT_LAYOUT_FORMAT = 3
EARLIER_TRAINED_FILE = "trained_parameters.safetensors"
EARLIER_EMA_FILE = "ema.safetensors"
# accelerate writes with torch.save, which reports a failed write as a RuntimeError.
CHECKPOINT_WRITE_ERRORS = (*WRITE_ERRORS, RuntimeError)


class Checkpointer:
    """Saves and loads checkpoints of one run.

    ``export`` (`export.Export`) describes what the run trains and writes it as the final output does;
    ``ema`` is the `EMA` over its trained parameters and ``posthoc`` the `PostHocEMA`, or None. ``spellings``
    (`parser.ParsedArgs.spellings`) name a changed trajectory flag as the user typed it. Registers accelerate hooks
    so ``save_state``/``load_state`` store these instead of whole models. ``companions`` (``{name: module}``) train
    beside what ``export`` writes but are not the run's output (a GAN's discriminator): each is saved whole (its
    buffers too) by ``save_pretrained`` into the checkpoint's ``<name>/`` and restored whole from it.
    """

    def __init__(self, accelerator, output_dir, export, ema=None, total_limit=None, posthoc=None,
                 trajectory=None, allow_changed_trajectory=False, spellings=None, companions=None):
        self.accelerator = accelerator
        self.trajectory = trajectory or {}
        self.spellings = spellings or {}
        self.allow_changed_trajectory = allow_changed_trajectory
        self.output_dir = Path(output_dir)
        self.export = export
        self.parameters = trainable_parameters(export.trained)
        self.ema = ema
        self.posthoc = posthoc
        self.companions = dict(companions or {})
        self.total_limit = total_limit
        self._saving_state = None
        self.loaded_state = None
        self.resharded = False  # loaded from a checkpoint of another number of processes
        accelerator.register_save_state_pre_hook(self._save_hook)
        accelerator.register_load_state_pre_hook(self._load_hook)

    def save(self, step, state=None):
        """Write ``checkpoint-<step>`` atomically on all processes, then prune old ones. Returns its path.
        ``state`` (JSON values by name) goes into ``training_state.json`` beside the step; `loaded_state`
        gives it back on resume. A write that fails on any process stops the run, every process alike, in one
        line saying why (`writing.failure_cause`), leaving the previous checkpoints as they were."""
        final = self.output_dir / f"checkpoint-{step}"
        staging = self.output_dir / f"{STAGING_PREFIX}checkpoint-{step}"
        failure = None
        if self.accelerator.is_main_process:
            failure = attempt(lambda: shutil.rmtree(staging) if staging.exists() else None, self.output_dir)
        self.accelerator.wait_for_everyone()
        self._saving_state = {"format": CHECKPOINT_FORMAT, "global_step": step,
                              "processes": self.accelerator.num_processes,
                              **({"sharded": True} if self.accelerator.is_fsdp2 else {}), **(state or {}),
                              **({"trajectory": self.trajectory} if self.trajectory else {})}
        failure = self._first_failure(failure or attempt(lambda: self._save_state(staging), staging))
        if failure is None and self.accelerator.is_main_process:
            failure = attempt(lambda: self._publish(staging, final), staging)
        failure = self._first_failure(failure)
        if failure is not None:
            if self.accelerator.is_main_process:
                shutil.rmtree(staging, ignore_errors=True)
            end_training(self.accelerator)
            previous = complete_checkpoints(self.output_dir)
            kept = f"{previous[-1][1]} is the latest whole checkpoint" if previous else "no checkpoint was written"
            raise RunStopped(f"could not write {final}: {failure}; {kept}", WRITE_FAILED_EXIT_CODE, "write failed")
        if self.accelerator.is_main_process:
            self.prune()
            logger.info(f"saved {final}")
        self.accelerator.wait_for_everyone()
        return final

    def _save_state(self, staging):
        with without_model_state(self.accelerator):
            self.accelerator.save_state(str(staging))

    def _publish(self, staging, final):
        """The permissions the umask gives, the manifest, written last, then the rename that makes the checkpoint
        whole (a stop signal waits for it: `stop_signals`)."""
        give_normal_permissions(staging)
        write_manifest(staging)
        with SIGNALS.deferred():
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)

    def _first_failure(self, failure):
        """The first process's failure (a message), or None: every process learns whether any failed."""
        if self.accelerator.num_processes == 1:
            return failure
        return next((message for message in gather_object([failure]) if message is not None), None)

    def prune(self):
        """Keep the newest ``total_limit`` of this run's complete checkpoints (`own_checkpoints`); those that another
        trajectory wrote are never removed. Folders that vanish meanwhile are fine."""
        if self.total_limit is None:
            return
        for _, path in self.own_checkpoints()[: -self.total_limit]:
            shutil.rmtree(path, ignore_errors=True)

    def own_checkpoints(self):
        """``[(step, path)]`` of the complete checkpoints in the output folder that this run's trajectory wrote:
        those recording the trajectory flags it has, oldest first."""
        return [(step, path) for step, path in complete_checkpoints(self.output_dir)
                if recorded_trajectory(path) == self.trajectory]

    def load(self, path):
        """Restore a checkpoint folder into the live run, the random states included; returns its global step.
        A checkpoint of a run with other trajectory flags is refused before anything loads from it."""
        self.loaded_state = json.loads((Path(path) / STATE_FILE).read_text())
        self._check_trajectory(path, self.loaded_state.get("trajectory", {}))
        same_processes = self._check_processes(path)
        self.resharded = not same_processes
        with without_model_state(self.accelerator):
            self.accelerator.load_state(str(path))
        process = self.accelerator.process_index
        if self.loaded_state.get("format", 1) >= CHECKPOINT_FORMAT:
            if same_processes:
                random_state.restore(random_state.load(Path(path) / RANDOM_STATE_FILE.format(process)))
        elif not (Path(path) / f"random_states_{process}.pkl").is_file():
            raise UsageError("--resume_from_checkpoint", str(path),
                             f"a checkpoint holding random_states_{process}.pkl (without it the run would go on with "
                             f"other random numbers)")
        return self.loaded_state["global_step"]

    def _check_processes(self, path):
        """Whether the checkpoint was written by as many processes as this run has. If not, it is refused unless
        --resume_with_changed_args is given: then it loads resharded (sharded state through
        ``torch.distributed.checkpoint``), each process's random state not its own, and the run is no longer exact."""
        sharded = self.loaded_state.get("sharded", False)
        if sharded != self.accelerator.is_fsdp2:
            raise UsageError("--resume_from_checkpoint", str(path),
                             f"a run launched as the checkpoint's was, {'sharded' if sharded else 'unsharded'} "
                             f"(accelerate launch {'--use_fsdp --fsdp_version 2' if sharded else 'without --use_fsdp'}"
                             f"): accelerate's state in it is {'sharded' if sharded else 'whole'}")
        saved_by = self.loaded_state.get("processes", self.accelerator.num_processes)
        if saved_by == self.accelerator.num_processes:
            return True
        if not self.allow_changed_trajectory:
            raise UsageError("--resume_from_checkpoint", str(path),
                             f"a run on as many processes as the checkpoint's {saved_by} (this one has "
                             f"{self.accelerator.num_processes}): each process resumes its own shard and random "
                             f"state; or --resume_with_changed_args to load it resharded, no longer exact")
        logger.warning(f"resuming a checkpoint of {saved_by} processes on {self.accelerator.num_processes}, "
                       f"resharded: the run is no longer exact")
        return False

    def _check_trajectory(self, path, saved):
        """Refuse a checkpoint whose run had other trajectory flags (``saved``), unless told to go on (then say so),
        and even then if the folder holds later checkpoints of that run, which this one's could replace."""
        changed = [name for name in self.trajectory if name in saved and saved[name] != self.trajectory[name]]
        if not changed:
            return
        described = "; ".join(f"{self.spellings.get(name, f'--{name}')} was {saved[name]!r}, now "
                              f"{self.trajectory[name]!r}" for name in changed)
        if not self.allow_changed_trajectory:
            raise UsageError("--resume_from_checkpoint", str(path),
                             f"the flags the checkpoint was trained with ({described}), or --resume_with_changed_args "
                             f"to go on anyway")
        check_same_trained_tensors(path, saved, self.trajectory, self.spellings)
        later = [other.name for step, other in complete_checkpoints(self.output_dir)
                 if step > self.loaded_state["global_step"] and recorded_trajectory(other) != self.trajectory]
        if later:
            raise UsageError("--resume_from_checkpoint", str(path),
                             f"no later checkpoints of the run before the change in {self.output_dir} (it holds "
                             f"{few(later)}, which this run's checkpoints could replace): move them, or use another "
                             f"--output_dir")
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
        if any_sharded(self.parameters):
            self._save_sharded(output_dir)
            return
        if not self.accelerator.is_main_process:
            return
        self.export.save_checkpoint(output_dir)
        for name, module in self.companions.items():
            save_model(module, output_dir / name)
        state = dict(self._saving_state)
        if self.ema is not None:
            with self.ema.swapped_in():
                self.export.save_checkpoint(output_dir / EMA_FOLDER)
            state["ema_step"] = self.ema.step
        if self.posthoc is not None:
            self.posthoc.save(output_dir / POSTHOC_FILE)
        (output_dir / STATE_FILE).write_text(json.dumps(state))

    def _save_sharded(self, output_dir):
        """The trained weights and the averages gathered whole on every process, written by the main process."""
        trained = whole_tensors({name: local_tensor(parameter.detach()) for name, parameter in self.parameters.items()},
                                self.parameters)
        ema = self.ema.whole_shadows() if self.ema is not None else None
        posthoc = self.posthoc.whole_shadows() if self.posthoc is not None else None
        if not self.accelerator.is_main_process:
            return
        self.export.write_checkpoint(trained, output_dir)
        state = dict(self._saving_state)
        if ema is not None:
            self.export.write_checkpoint(ema, output_dir / EMA_FOLDER)
            state["ema_step"] = self.ema.step
        if posthoc is not None:
            self.posthoc.save(output_dir / POSTHOC_FILE, posthoc)
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
                parameter = self.parameters[name]
                local_tensor(parameter).copy_(local_part(tensor, parameter))
        if self.ema is not None:
            if earlier_layout:
                self.ema.load(input_dir / EARLIER_EMA_FILE)
            else:
                shadows = self._checked(self.export.read_checkpoint(input_dir / EMA_FOLDER), input_dir / EMA_FOLDER)
                self.ema.load_state_dict({"shadows": shadows, "step": self.loaded_state["ema_step"]})
        if self.posthoc is not None:
            self.posthoc.load(input_dir / POSTHOC_FILE)
        for name, module in self.companions.items():
            self._load_companion(module, input_dir / name)

    def _load_companion(self, module, folder):
        """``module``'s whole state from ``folder``, as `_save_hook` wrote it; a checkpoint without it, or with other
        tensors, is refused in one line."""
        saved = saved_tensors(folder) if folder.is_dir() else {}
        expected = module.state_dict()
        if saved.keys() != expected.keys() or any(saved[key].shape != expected[key].shape for key in saved):
            raise UsageError("--resume_from_checkpoint", str(folder),
                             f"a checkpoint holding this run's {folder.name} whole (missing "
                             f"{few(sorted(expected.keys() - saved.keys()), 3)}; unexpected "
                             f"{few(sorted(saved.keys() - expected.keys()), 3)})")
        module.load_state_dict(saved)

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


def attempt(write, directory):
    """Run ``write()``, which writes into ``directory``; why it failed, in words (`writing.failure_cause`), or None."""
    try:
        write()
    except CHECKPOINT_WRITE_ERRORS as error:
        return failure_cause(error, directory)
    except WriteFailed as error:  # the export's files
        return error.failure
    return None


def resume_position(global_step, steps_per_epoch, gradient_accumulation_steps):
    """``(epoch, batches to skip in it)`` where a run restored at ``global_step`` continues."""
    epoch, step_in_epoch = divmod(global_step, steps_per_epoch)
    return epoch, step_in_epoch * gradient_accumulation_steps
