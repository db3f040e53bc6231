"""The optimizer, the learning-rate schedule, and the run's length in optimizer steps."""

import math

import torch
from diffusers.optimization import get_scheduler

from .errors import UsageError


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
