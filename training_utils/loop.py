"""The bookkeeping around the optimizer steps that every script shares.

What a script computes in a step (its loss, its conditioning) stays in the script; what happens
between steps is the same everywhere and lives here::

    loop = TrainingLoop(accelerator, args, dataloader, optimizer, lr_scheduler, parameters, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)   # resumes if asked
    for batch in loop:                      # epochs, resuming mid-epoch, stops at max_train_steps
        with accelerator.accumulate(model):
            loss = ...                      # the script's own step
            loop.backward_and_step(loss)    # then, when due: EMA, snapshots, checkpoint, validation

Preemption (SIGTERM, or SIGINT as from Ctrl-C) lets the current step finish, writes a checkpoint
and stops the run with `PREEMPTED_EXIT_CODE`; a non-finite loss stops it before anything is
written from the broken weights, keeping the last good checkpoint.
"""

import math
import signal

import torch
from tqdm.auto import tqdm

from .args import RunStopped
from .checkpointing import Checkpointer, resume_position
from .data import epoch_batches
from .training import posthoc_snapshot_steps
from .validation import validation_due

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", which is what a scheduler should do
NON_FINITE_EXIT_CODE = 3


class PreemptionSignals:
    """Records SIGTERM/SIGINT instead of dying mid-step; restores the previous handlers on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        for number in self.SIGNALS:
            self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(self, *exc):
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def _record(self, number, frame):
        self.received = signal.Signals(number).name


class TrainingLoop:
    """Iterates the batches of a run, steps the optimizer, and does everything due after each step.

    It owns the run's `Checkpointer` (the trained ``parameters``, ``ema`` and ``posthoc`` EMA are
    what checkpoints hold besides accelerate's state) and resumes from ``--resume_from_checkpoint``
    when made, so build it after ``accelerator.prepare``. ``global_step`` is the number of completed
    optimizer steps; ``records`` holds the last validation's log records (for the model card).
    """

    def __init__(self, accelerator, args, dataloader, optimizer, lr_scheduler, parameters, max_train_steps,
                 steps_per_epoch, ema=None, posthoc=None, validator=None):
        self.accelerator = accelerator
        self.args = args
        self.dataloader = dataloader
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.parameters = list(parameters.values())
        self.max_train_steps = max_train_steps
        self.steps_per_epoch = steps_per_epoch
        self.ema = ema
        self.posthoc = posthoc
        self.validator = validator
        self.records = []
        self._loss = 0.0
        self._signals = PreemptionSignals()
        self._progress = None
        self.checkpointer = Checkpointer(accelerator, args.output_dir, parameters, ema, args.checkpoints_total_limit,
                                         posthoc)
        self.global_step = self.checkpointer.resume(args.resume_from_checkpoint)

    def __iter__(self):
        first_epoch, batches_to_skip = resume_position(self.global_step, self.steps_per_epoch,
                                                       self.args.gradient_accumulation_steps)
        num_epochs = math.ceil(self.max_train_steps / self.steps_per_epoch)
        self._progress = tqdm(total=self.max_train_steps, initial=self.global_step,
                              disable=not self.accelerator.is_local_main_process)
        if self.posthoc is not None:
            self.posthoc.start(self.args.output_dir, self.global_step, write=self.accelerator.is_main_process)
        with self._signals:
            for epoch in range(first_epoch, num_epochs):
                skip = batches_to_skip if epoch == first_epoch else 0
                for batch in epoch_batches(self.accelerator, self.dataloader, epoch, skip):
                    if self.global_step >= self.max_train_steps:
                        break
                    yield batch
        self._progress.close()

    def backward_and_step(self, loss):
        """Backpropagate ``loss``, clip, step the optimizer and the lr schedule (accelerate holds the step
        back while accumulating), and after a completed optimizer step do what is due: logging, EMA
        updates, checkpoint, validation, preemption. Call inside ``accelerator.accumulate(...)``.
        Returns True when an optimizer step completed."""
        if not torch.isfinite(loss.detach()).all():
            raise RunStopped(
                f"the loss is {loss.item()} at step {self.global_step + 1}; stopped before writing anything from "
                f"these weights (the last checkpoint in {self.args.output_dir} is intact)", NON_FINITE_EXIT_CODE)
        self.accelerator.backward(loss)
        if self.accelerator.sync_gradients:
            self.accelerator.clip_grad_norm_(self.parameters, self.args.max_grad_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad()
        self._loss += loss.detach().item() / self.args.gradient_accumulation_steps
        if not self.accelerator.sync_gradients:
            return False

        self.global_step += 1
        step = self.global_step
        self.accelerator.log({"train_loss": self._loss, "lr": self.lr_scheduler.get_last_lr()[0]}, step=step)
        self._progress.update(1)
        self._progress.set_postfix(loss=f"{self._loss:.4g}")
        self._loss = 0.0

        if self.ema is not None and self.ema.is_due(step, self.max_train_steps):
            self.ema.update(step)
        if self.posthoc is not None:
            self.posthoc.on_step(step, self.max_train_steps, self.args.output_dir,
                                 posthoc_snapshot_steps(self.args, self.max_train_steps),
                                 write=self.accelerator.is_main_process)
        preempted = self._preemption_requested()
        if step % self.args.checkpointing_steps == 0 or (preempted and step < self.max_train_steps):
            self.checkpointer.save(step)
        if self.validator is not None and validation_due(step, self.max_train_steps, self.args.validation_steps,
                                                         self.args.validation_epochs, self.steps_per_epoch):
            self.records = self.validator(step, final=step == self.max_train_steps)
        if preempted and step < self.max_train_steps:
            self.accelerator.end_training()
            raise RunStopped(f"stopped by {self._signals.received or 'a signal'} after step {step}; checkpoint saved, "
                             f"resume with --resume_from_checkpoint latest", PREEMPTED_EXIT_CODE)
        return True

    def _preemption_requested(self):
        requested = self._signals.received is not None
        if self.accelerator.num_processes > 1:
            # Every process must stop at the same step, whichever of them got the signal.
            flag = torch.tensor(float(requested), device=self.accelerator.device)
            requested = bool(self.accelerator.reduce(flag, reduction="sum").item() > 0)
        return requested
