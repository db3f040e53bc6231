"""The bookkeeping around the optimizer steps that every script shares.

What a script computes in a step (its loss, its conditioning) stays in the script; what happens
between steps is the same everywhere and lives here::

    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)   # resumes if asked
    for batch in loop:                      # epochs, resuming mid-epoch, stops at max_train_steps
        with accelerator.accumulate(model):
            loss = ...                      # the script's own step
            loop.backward_and_step(loss)    # then, when due: EMA, snapshots, checkpoint, validation

Preemption (SIGTERM, or SIGINT as from Ctrl-C; `stop_signals`) lets the current step finish, the last one
too, writes a checkpoint and stops the run with `PREEMPTED_EXIT_CODE`; a non-finite loss stops it before
anything is written from the broken weights, keeping the last good checkpoint. The loop keeps the step
that ``run_status.json`` reports in the script's ``run`` (`run_status.RunRecord`), and makes the output folder the
run's once a checkpoint to resume from is accepted. A batch holding an image that
cannot be read stops the run with `UNREADABLE_EXIT_CODE` after checkpointing the last completed
step (as it was when that step ended, also mid-accumulation), or with ``--skip_corrupt_images``
trains on the readable sample put in its place and counts it (``skipped_images`` in the logs).

Sharded (FSDP2: `sharding`), the EMA and post-hoc EMA made before ``accelerator.prepare`` follow the parameters
that prepare put in place, each process keeping its own part; when the last batch is done, the trained parameters
are gathered whole on every process, so that what the script writes after the loop is whole (a full fine-tune's
models become plain models again, which ``save_pretrained`` writes as the stock class).
"""

import contextlib
import hashlib
import logging
import math
import sys
from pathlib import Path

import torch
from accelerate.utils import gather_object
from tqdm.auto import tqdm

from . import random_state
from .accelerator import end_training
from .adapters.export import AdapterExport
from .compile import compilation_count
from .data.datasets import BatchWithUnreadable, epoch_batches
from .errors import NON_FINITE_EXIT_CODE, PREEMPTED_EXIT_CODE, UNREADABLE_EXIT_CODE, RunStopped, UsageError
from .names import VALIDATION_DIR
from .outputs.checkpoint_folders import complete_checkpoints, trajectory_flags
from .outputs.checkpointing import Checkpointer, resume_position
from .outputs.stop_signals import SIGNALS
from .outputs.writing import stopping_on_write_errors
from .pipeline import trainable_parameters
from .posthoc_ema import posthoc_snapshot_steps
from .sharding.fsdp2 import (any_sharded, describe_held_bytes, held_bytes, plain_modules, sharded_units,
                             unshard_trained, whole_bytes)
from .validation import validation_due

logger = logging.getLogger(__name__)


def bucket_layout(dataloader):
    """A digest of each sample's aspect-ratio bucket (`data.TrainDataset.shapes`), or None without buckets."""
    shapes = getattr(dataloader.dataset, "shapes", None)
    return None if shapes is None else hashlib.blake2b(repr(shapes).encode(), digest_size=16).hexdigest()


class TrainingLoop:
    """Iterates the batches of a run, steps the optimizer, and does everything due after each step.

    It owns the run's `Checkpointer` (what ``export`` writes of the trained weights, and the ``ema`` and
    ``posthoc`` EMA, are what checkpoints hold besides accelerate's state) and resumes from ``--resume_from_checkpoint``
    when made, so build it after ``accelerator.prepare``; once the checkpoint is accepted the output folder is
    ``run``'s (`run_status.RunRecord.take_folder`), and ``run.last_step`` follows the steps. ``global_step`` is the
    number of completed optimizer steps; ``records`` holds the last validation's records as the model card shows them.
    ``companions`` are modules that train beside the exported ones without being the run's output (a GAN's
    discriminator): checkpoints hold them whole (`Checkpointer`).
    """

    def __init__(self, accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                 steps_per_epoch, ema=None, posthoc=None, validator=None, companions=None):
        self.accelerator = accelerator
        self.args = args
        self.run = run
        self.dataloader = dataloader
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.export = export
        trained = trainable_parameters(export.trained)
        self.parameters = list(trained.values())
        self.sharded = any_sharded(trained)
        for average in (ema, posthoc):
            if average is not None:
                average.rebind(trained)
        if self.sharded:
            held = gather_object([held_bytes(export.trained, (ema, posthoc))])
            logger.info(describe_held_bytes(held, whole_bytes(export.trained, (ema, posthoc))))
            logger.info("FSDP2 units: " + ", ".join(f"{count} {name}" for name, count in
                                                    sharded_units(export.trained).items()))
        self.max_train_steps = max_train_steps
        self.steps_per_epoch = steps_per_epoch
        self.ema = ema
        self.posthoc = posthoc
        self.validator = validator
        self.records = []
        self._loss = 0.0
        self._progress = None
        self._skipped_images = 0
        # The accumulation counter and RNG states when the current optimizer step began: a checkpoint
        # taken mid-accumulation must hold them as they were, or a resumed run would draw other noise.
        self._at_step_start = True
        self._step_start = None
        self.checkpointer = Checkpointer(accelerator, args.output_dir, export, ema, args.checkpoints_total_limit,
                                         posthoc, trajectory_flags(args), args.resume_with_changed_args,
                                         getattr(args, "spellings", None), companions)
        self.global_step = self.checkpointer.resume(args.resume_from_checkpoint)
        # Images skipped on all processes up to the last completed step, counting those before a resume;
        # the main process's own count starts from it, since the logged count is the sum over processes.
        self._skipped_total = self.checkpointer.loaded_state.get("skipped_images", 0) if self.global_step else 0
        if accelerator.is_main_process:
            self._skipped_images = self._skipped_total
        self._bucket_layout = bucket_layout(dataloader)
        saved = self.checkpointer.loaded_state if self.global_step else {}
        # On another number of processes (--resume_with_changed_args) the epoch length changes with it: the run goes on
        # from the step it resumed at, in the new epochs.
        if saved.get("steps_per_epoch") not in (None, steps_per_epoch) and not self.checkpointer.resharded:
            raise UsageError("--resume_from_checkpoint", args.resume_from_checkpoint,
                             f"the data the checkpoint was trained on: it had {saved['steps_per_epoch']} steps per "
                             f"epoch, this run's data has {steps_per_epoch}, so the data position cannot be resumed")
        if saved.get("bucket_layout", self._bucket_layout) != self._bucket_layout:
            raise UsageError("--resume_from_checkpoint", args.resume_from_checkpoint,
                             "the data the checkpoint was trained on: its images fell into other aspect-ratio buckets, "
                             "so the batches it trained would not be those of this run")
        run.last_step = self.global_step
        run.take_folder(args.output_dir)

    def _checkpoint_state(self, skipped_images):
        """What a checkpoint records of the loop: skipped images, and what its data position depends on (the epoch
        length, and with aspect-ratio buckets each sample's bucket)."""
        state = {"skipped_images": skipped_images, "steps_per_epoch": self.steps_per_epoch}
        return state if self._bucket_layout is None else {**state, "bucket_layout": self._bucket_layout}

    def __iter__(self):
        first_epoch, batches_to_skip = resume_position(self.global_step, self.steps_per_epoch,
                                                       self.args.gradient_accumulation_steps)
        num_epochs = math.ceil(self.max_train_steps / self.steps_per_epoch)
        if self.validator is not None and self.global_step == 0:  # the progress grids' step 0, before any training
            self.validator.draw_base()
        self._progress = tqdm(total=self.max_train_steps, initial=self.global_step,
                              disable=not self.accelerator.is_local_main_process)
        if self.posthoc is not None:
            self.posthoc.start(self.args.output_dir, self.global_step, write=self.accelerator.is_main_process)
        with SIGNALS.deferred(), self._progress_closed_on_stop():
            for epoch in range(first_epoch, num_epochs):
                skip = batches_to_skip if epoch == first_epoch else 0
                for batch in epoch_batches(self.accelerator, self.dataloader, epoch, skip):
                    if self.global_step >= self.max_train_steps:
                        break
                    if self._at_step_start and self.args.gradient_accumulation_steps > 1:
                        # Only a step of several micro-batches can stop part-way (`_stop_on_unreadable`).
                        self._step_start = (self.accelerator.step, random_state.capture())
                    batch = self._readable(batch)
                    self._at_step_start = False
                    yield batch
        self._progress.close()
        if self.sharded:
            self._unshard()

    def _unshard(self):
        """Whole trained parameters and averages on every process, for the outputs written after the loop."""
        unshard_trained(self.export.trained)
        if not isinstance(self.export, AdapterExport):
            plain_modules(self.export.trained)  # a full fine-tune's models are saved whole by save_pretrained
        trained = trainable_parameters(self.export.trained)
        for average in (self.ema, self.posthoc):
            if average is not None:
                average.rebind(trained)

    @contextlib.contextmanager
    def _progress_closed_on_stop(self):
        """Close the progress bar before a stop propagates, so that it is drawn for the last time before the stop
        is reported: the reason, not the bar, is the last line on the terminal."""
        try:
            yield
        except RunStopped:
            self._progress.close()
            raise

    def backward_and_step(self, loss, optimizer=None, lr_scheduler=None, parameters=None):
        """Backpropagate ``loss``, clip, step the optimizer and the lr schedule (accelerate holds the step
        back while accumulating), and after a completed optimizer step do what is due: logging, EMA
        updates, checkpoint, validation, preemption. Call inside ``accelerator.accumulate(...)``.
        A run whose steps take turns between models, each with its own optimizer (a GAN's generator and
        discriminator), gives the step's ``optimizer``, ``lr_scheduler`` and ``parameters`` (those clipped); by
        default the loop's own. Returns True when an optimizer step completed."""
        with self._progress_closed_on_stop():
            return self._backward_and_step(loss, optimizer or self.optimizer, lr_scheduler or self.lr_scheduler,
                                           self.parameters if parameters is None else parameters)

    def _backward_and_step(self, loss, optimizer, lr_scheduler, parameters):
        self.accelerator.backward(loss)
        if self.accelerator.sync_gradients:
            self.accelerator.clip_grad_norm_(parameters, self.args.max_grad_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        # Summed on the device and read once per optimizer step, not per micro-batch, so that the accelerator
        # need not be waited for (multi-process runs also reduce an unreadable-image flag per micro-batch).
        self._loss = self._loss + loss.detach().float() / self.args.gradient_accumulation_steps
        if not self.accelerator.sync_gradients:
            return False

        self.global_step += 1
        self._at_step_start = True
        step = self.global_step
        loss, preempted, skipped_images = self._shared_status()
        self._loss, self._skipped_total = 0.0, skipped_images
        if not math.isfinite(loss):
            end_training(self.accelerator)
            checkpoints = complete_checkpoints(self.args.output_dir)
            kept = f"{checkpoints[-1][1]} is the last checkpoint" if checkpoints else "no checkpoint was written"
            raise RunStopped(f"the loss is {loss} at step {step}; stopped before writing anything from these weights "
                             f"({kept})", NON_FINITE_EXIT_CODE, "non-finite loss")
        self.run.last_step = step
        logs = {"train_loss": loss, "lr": lr_scheduler.get_last_lr()[0]}
        if skipped_images:
            logs["skipped_images"] = skipped_images
        self.accelerator.log(logs, step=step)
        self._progress.update(1)
        self._progress.set_postfix(loss=f"{loss:.4g}")

        if self.ema is not None and self.ema.is_due(step, self.max_train_steps):
            self.ema.update(step)
        if self.posthoc is not None:
            self.posthoc.on_step(step, self.max_train_steps, self.args.output_dir,
                                 posthoc_snapshot_steps(self.args, self.max_train_steps),
                                 write=self.accelerator.is_main_process)
        if step % self.args.checkpointing_steps == 0 or preempted:
            self.checkpointer.save(step, self._checkpoint_state(skipped_images))
        if self.validator is not None and validation_due(step, self.max_train_steps, self.args.validation_steps,
                                                         self.args.validation_epochs, self.steps_per_epoch):
            with stopping_on_write_errors(Path(self.args.output_dir) / VALIDATION_DIR):
                self.records = self.validator.card_records(self.validator(step, final=step == self.max_train_steps))
            if getattr(self.args, "torch_compile", None):
                # Validation compiles graphs of its own the first time; a count that grows after that is recompiling.
                logger.info(f"--torch_compile: {compilation_count()} graphs compiled by step {step}")
        if preempted:
            end_training(self.accelerator)
            raise RunStopped(f"stopped by {SIGNALS.received or 'a signal'} after step {step}; checkpoint saved, "
                             f"resume with --resume_from_checkpoint latest", PREEMPTED_EXIT_CODE, "preempted")
        return True

    def _shared_status(self):
        """(the step's loss averaged over processes, whether any process got a preemption signal, images
        skipped on all processes so far). Every process must stop at the same step, whichever of them
        got the signal or the non-finite loss."""
        preempted, skipped_images = SIGNALS.received is not None, self._skipped_images
        if self.accelerator.num_processes == 1:
            return self._loss.item(), preempted, skipped_images
        flags = torch.tensor([float(preempted), float(skipped_images)], device=self._loss.device)
        status = self.accelerator.reduce(torch.cat([self._loss.reshape(1), flags]), reduction="sum").tolist()
        return status[0] / self.accelerator.num_processes, status[1] > 0, int(status[2])

    def _readable(self, batch):
        """The batch to train on; stops the run on an unreadable image unless skipping, and counts skips."""
        unreadable = batch.unreadable if isinstance(batch, BatchWithUnreadable) else []
        stop = bool(unreadable) and (batch.batch is None or not self.args.skip_corrupt_images)
        if self.accelerator.num_processes > 1:
            # One process meeting a bad file must not leave the others waiting in the next collective.
            flag = torch.tensor(float(stop), device=self.accelerator.device)
            stop = bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)
        if stop:
            self._stop_on_unreadable(unreadable)
        if not unreadable:
            return batch
        for source, reason in unreadable:
            self._skipped_images += 1
            tqdm.write(f"skipped unreadable image {source} ({reason}); {self._skipped_images} skipped so far",
                       file=sys.stderr)
        return batch.batch

    def _stop_on_unreadable(self, unreadable):
        if self.accelerator.num_processes > 1:
            unreadable = gather_object(list(unreadable))
        files = "; ".join(f"{source} ({reason})" for source, reason in unreadable)
        step = self.global_step
        if step > 0:
            if not self._at_step_start:
                accumulation_step, rng_states = self._step_start
                self.accelerator.step = accumulation_step
                random_state.restore(rng_states)
            self.checkpointer.save(step, self._checkpoint_state(self._skipped_total))
            saved = f"checkpoint-{step} saved"
        else:
            saved = "nothing trained yet"
        end_training(self.accelerator)
        remedy = ("no readable sample was found to take its place" if self.args.skip_corrupt_images
                  else "replace it and resume with --resume_from_checkpoint latest, or pass --skip_corrupt_images")
        raise RunStopped(f"unreadable image {files} in the data for step {step + 1}; {saved}; {remedy}",
                         UNREADABLE_EXIT_CODE, "unreadable image")
