"""The accelerator, optimizer, learning-rate schedule and step arithmetic every script sets up the same way."""

import logging
import math
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed
from diffusers.optimization import get_scheduler

from .args import UsageError


def make_accelerator(args):
    """An `Accelerator` writing trackers under ``output_dir/logging_dir``, with a seedable sampler
    so that each epoch's data order depends on (seed, epoch) alone; also seeds every RNG."""
    output_dir = Path(args.output_dir)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / args.logging_dir)),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        level=logging.INFO if accelerator.is_local_main_process else logging.ERROR)
    set_seed(args.seed)
    if args.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
    return accelerator


def end_training(accelerator):
    """End the run on every process together, once the main process has written what it writes.

    The other processes wait for it in a barrier rather than tearing down the process group at
    once. gloo's teardown holds the GIL and waits for gloo's threads; one of those may still be
    freeing the tensors of the last collective, which needs the GIL: a deadlock (the class of
    pytorch/pytorch#56297) that hung two-process CPU runs at exit. After the barrier, the last
    work of those threads is the barrier itself, which holds no tensor.
    """
    accelerator.wait_for_everyone()
    accelerator.end_training()


def make_optimizer(args, parameters, num_processes):
    """AdamW (or bitsandbytes' 8-bit AdamW) over ``parameters``, with ``--scale_lr`` applied."""
    learning_rate = args.learning_rate
    if args.scale_lr:
        learning_rate *= args.gradient_accumulation_steps * args.train_batch_size * num_processes
    optimizer_class = torch.optim.AdamW
    if args.use_8bit_adam:
        try:
            import bitsandbytes
        except ImportError:
            raise UsageError("--use_8bit_adam", True, "bitsandbytes installed (pip install bitsandbytes)") from None
        optimizer_class = bitsandbytes.optim.AdamW8bit
    return optimizer_class(
        list(parameters), lr=learning_rate, betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay, eps=args.adam_epsilon,
    )


def training_length(args, num_batches):
    """``(max_train_steps, steps_per_epoch)`` from the flags and the loader's length per process.

    ``--max_train_steps`` wins over ``--num_train_epochs``; an epoch's last, partial accumulation
    still makes an optimizer step.
    """
    steps_per_epoch = math.ceil(num_batches / args.gradient_accumulation_steps)
    return args.max_train_steps or args.num_train_epochs * steps_per_epoch, steps_per_epoch


def make_lr_scheduler(args, optimizer, max_train_steps, num_processes):
    # accelerate steps a prepared scheduler once per process per optimizer step.
    return get_scheduler(
        args.lr_scheduler, optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * num_processes,
        num_training_steps=max_train_steps * num_processes,
    )


def make_ema(args, parameters, accelerator):
    """The `EMA` that ``--use_ema`` and its flags ask for, or None."""
    if not args.use_ema:
        return None
    from .ema import EMA

    return EMA(parameters, decay=args.ema_decay, update_every=args.ema_update_every, warmup=args.ema_warmup,
               inv_gamma=args.ema_inv_gamma, power=args.ema_power,
               device="cpu" if args.ema_device == "cpu" else accelerator.device)


def make_posthoc_ema(args, parameters, accelerator, export_format):
    """The `PostHocEMA` that ``--ema_posthoc_sigma_rels`` asks for, or None. ``export_format`` tells the
    synthesis how to write its results (``posthoc_ema.lora_export_format`` / ``module_export_format``)."""
    if not args.ema_posthoc_sigma_rels:
        return None
    from .posthoc_ema import PostHocEMA

    return PostHocEMA(parameters, args.ema_posthoc_sigma_rels, update_every=args.ema_update_every,
                      device="cpu" if args.ema_device == "cpu" else accelerator.device, export_format=export_format)


def posthoc_snapshot_steps(args, max_train_steps):
    """``--ema_posthoc_snapshot_steps``, or about 20 snapshots over the run: EDM2's least-squares fit
    needs a couple dozen to reconstruct other lengths well."""
    return args.ema_posthoc_snapshot_steps or max(1, max_train_steps // 20)


def tracker_config(args):
    """The run's flags as trackers accept them (scalars only; lists become strings)."""
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value) for key, value in vars(args).items()}
