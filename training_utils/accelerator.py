"""The run's `Accelerator`, made from the flags; what trains, prepared by it; and the run's end on every process
together.

The accelerator writes trackers under the output folder (made ready first, for the script's run record:
`outputs.folder.prepare_output_dir`), draws each epoch's data order from (seed, epoch) alone, and seeds every RNG.
"""

import logging
import os
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

from .errors import UsageError
from .memory_plan import planning
from .outputs.folder import prepare_output_dir
from .sharding.fsdp2 import (check_launch, declare_unit_blocks, enable_fsdp2_on_cpu, fsdp2_plugin, keep_recorded_outputs,
                             one_model_of)


def make_accelerator(args, run):
    """An `Accelerator` writing trackers under ``output_dir/logging_dir``, with a seedable sampler
    so that each epoch's data order depends on (seed, epoch) alone; also seeds every RNG, and makes the output
    folder ready and ``run``'s (`outputs.folder.prepare_output_dir`) before any process goes on. A launch asking
    for FSDP2 shards (`sharding`), on CPU processes too; DeepSpeed, FSDP1 and a quantised base under FSDP2 are
    refused in one line."""
    check_launch(args)
    output_dir = Path(args.output_dir)
    plugin = fsdp2_plugin()
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(project_dir=str(output_dir),
                                            logging_dir=str(output_dir / args.logging_dir)),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        fsdp_plugin=plugin,
    )
    enable_fsdp2_on_cpu(accelerator, plugin)
    check_connected(accelerator)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        level=logging.INFO if accelerator.is_local_main_process else logging.ERROR)
    set_seed(args.seed)
    if args.allow_tf32 and torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
    if accelerator.is_main_process and not planning(args):  # a memory plan writes nothing
        prepare_output_dir(args, run)
    accelerator.wait_for_everyone()
    return accelerator


def check_connected(accelerator):
    """Refuse processes that the launcher started together but accelerate left apart: without a GPU, accelerate
    connects several processes only when told they are CPU processes, and otherwise each would train alone, over
    the others' files."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != launched:
        raise UsageError(None, None, f"accelerate launch started {launched} processes, but accelerate left them "
                                     f"unconnected (each would train alone): on CPU processes, launch with --cpu, or "
                                     f"with ACCELERATE_USE_CPU=1 set beside --use_fsdp (which refuses --cpu)")


def prepare_trained(accelerator, trained, optimizer, lr_scheduler):
    """accelerate's ``prepare`` of what trains: the modules of ``trained`` (``{component: module}``, wrapped where
    several processes train), the optimizer and its schedule. Returns the prepared modules by component name, which
    the step calls (so that gradients sync) and ``accelerator.accumulate`` takes, the optimizer and the schedule.
    ``trained`` keeps the unwrapped modules, whose parameter names key the EMA, checkpoints and exports. Sharded
    (FSDP2), accelerate prepares one model per call: several trained modules are prepared as one
    (`sharding.fsdp2.one_model_of`), each sharded as a unit of its own, and called directly by the step.

    DDP leaves the frozen weights alone: every process loaded the same ones, and broadcasting them when it wraps a
    module would fail on a quantised base (torchao's int8 tensors cannot be viewed as a flat buffer)."""
    if accelerator.is_fsdp2:
        if len(trained) == 1:
            declare_unit_blocks(next(iter(trained.values())))
        model = one_model_of(trained) if len(trained) > 1 else next(iter(trained.values()))
        _, optimizer, lr_scheduler = accelerator.prepare(model, optimizer, lr_scheduler)
        keep_recorded_outputs(trained)
        return dict(trained), optimizer, lr_scheduler  # fully_shard works in place: the step calls these
    for module in trained.values():
        module._ddp_params_and_buffers_to_ignore = [name for name, parameter in module.named_parameters()
                                                    if not parameter.requires_grad]
    prepared = accelerator.prepare(*trained.values(), optimizer, lr_scheduler)
    return dict(zip(trained, prepared)), *prepared[len(trained):]


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


def tracker_config(args):
    """The run's flags as trackers accept them (scalars only; lists become strings)."""
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value)
            for key, value in vars(args).items()}
