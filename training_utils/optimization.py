"""The optimizer, the learning-rate schedule, and the run's length in optimizer steps."""

import math

import torch
from diffusers.optimization import get_scheduler



def make_optimizer(args, parameters, num_processes, no_decay=(), learning_rate=None):
    """AdamW (or bitsandbytes' 8-bit AdamW) over ``parameters`` (``{"<component>.<name>": parameter}``), at
    ``learning_rate`` (default ``--learning_rate``) with ``--scale_lr`` applied. The text encoders' parameters take ``--text_encoder_lr`` and
    ``--adam_weight_decay_text_encoder`` where the script has them set (upstream's flags); else the others' own.
    Parameters whose names contain one of ``no_decay`` (e.g. ``"bias"``) train without weight decay."""
    learning_rate = learning_rate or args.learning_rate
    if args.scale_lr:
        learning_rate *= args.gradient_accumulation_steps * args.train_batch_size * num_processes
    text_encoder = {name: parameter for name, parameter in parameters.items() if name.startswith("text_encoder")}
    undecayed = {name for name in parameters if name not in text_encoder and any(part in name for part in no_decay)}
    groups = [{"params": [parameter for name, parameter in parameters.items()
                          if name not in text_encoder and name not in undecayed]}]
    if undecayed:
        groups.append({"params": [parameters[name] for name in parameters if name in undecayed], "weight_decay": 0.0})
    if text_encoder:
        groups.append({"params": list(text_encoder.values()),
                       "lr": getattr(args, "text_encoder_lr", None) or learning_rate,
                       "weight_decay": getattr(args, "adam_weight_decay_text_encoder", None) or args.adam_weight_decay})
    hyperparameters = dict(lr=learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                           weight_decay=args.adam_weight_decay, eps=args.adam_epsilon)
    if args.use_8bit_adam:
        import bitsandbytes  # optional: `args.check_args` refuses --use_8bit_adam, before loading, where it is absent

        return bitsandbytes.optim.AdamW8bit(groups, **hyperparameters)
    return torch.optim.AdamW(groups, **hyperparameters, **adamw_implementation(list(parameters.values())))


# The dtypes of torch's fused Adam(W) kernels on CUDA.
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def adamw_implementation(parameters):
    """``{"fused": True}`` when every parameter is a CUDA tensor of a dtype the fused kernel takes: a few kernel
    launches update them all, every operation of the update fused (a LoRA trains hundreds of small tensors, so the
    launches are what a step of the optimizer costs); else ``{"foreach": True}``, torch's multi-tensor path.

    Either way the optimizer state holds the same tensors (``exp_avg``, ``exp_avg_sq``, ``step``), and the choice
    is saved in the state dict's parameter group: ``load_state_dict`` restores it, so a resumed run steps with the
    kernel that the run it resumes used, and continues bitwise identically.
    """
    if parameters and all(parameter.device.type == "cuda" and parameter.dtype in FUSED_DTYPES
                          for parameter in parameters):
        return {"fused": True}
    return {"foreach": True}


def training_length(args, num_batches):
    """``(max_train_steps, steps_per_epoch)`` from the flags and the loader's length per process.

    ``--max_train_steps`` wins over ``--num_train_epochs``; an epoch's last, partial accumulation
    still makes an optimizer step.
    """
    steps_per_epoch = math.ceil(num_batches / args.gradient_accumulation_steps)
    return args.max_train_steps or args.num_train_epochs * steps_per_epoch, steps_per_epoch


def make_lr_scheduler(args, optimizer, max_train_steps, num_processes, schedule=None):
    # accelerate steps a prepared scheduler once per process per optimizer step. ``schedule``: default --lr_scheduler.
    return get_scheduler(
        schedule or args.lr_scheduler, optimizer=optimizer,
        num_warmup_steps=args.lr_warmup_steps * num_processes,
        num_training_steps=max_train_steps * num_processes,
    )
