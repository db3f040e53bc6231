"""``--fsdp_text_encoder``: the frozen text encoders sharded with FSDP2 while they encode, as upstream's FLUX.2 and
Z-Image scripts shard theirs, so that each of N processes holds about 1/N of each encoder's weights.

`shard_text_encoders` applies torch's ``fully_shard`` to each repeated block of an encoder (the classes its
``_no_split_modules`` names, picked by accelerate's own transformer-based wrap policy) and then to the encoder itself,
with the launch's FSDP2 settings (mesh, CPU offload of parameters). The weights keep the run's weight dtype, so a
sharded encoder computes exactly what the whole one does: a forward gathers each block's parts into the same whole
tensors, runs the block, and frees them.

A sharded forward is collective: every process must make the same forwards, in the same order. The prompts are
embedded once (`frozen_encoders.FrozenEncoders.text_embeddings`) in chunks shared out among the processes, and a process may
have fewer chunks to encode than another (fewer rows, or more of them found on disk): `in_lockstep` has all
processes agree first on the most calls any makes, and a process with fewer repeats a real call and drops its output.
Class images and validation images are rendered by every process, each making every pipeline call
(`dreambooth.generate_class_images`, `validation.Validator`). A sharded encoder stays where FSDP2 put it (its parts
on the accelerator, or on the CPU with ``fsdp_offload_params``): `feature_store.encoders_on` does not move it.
"""

import argparse
import copy
import logging

from accelerate.utils import gather_object

from ..errors import UsageError
from .fsdp2 import FSDP2_LAUNCH, fsdp_requested, held_bytes, keep_recorded_outputs, sharded_units, whole_bytes

logger = logging.getLogger(__name__)


class FsdpTextEncoderFlag(argparse.Action):
    """``--fsdp_text_encoder``, refused in one line as soon as it is parsed unless the launch asked for FSDP."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if not fsdp_requested():
            raise UsageError(None, None, f"{option_string} shards the text encoder with FSDP2: launch with "
                                         f"{FSDP2_LAUNCH}")
        setattr(namespace, self.dest, True)


def add_fsdp_text_encoder_arg(parser):
    parser.add_argument("--fsdp_text_encoder", action=FsdpTextEncoderFlag,
                        help=f"shard the frozen text encoder(s) with FSDP2 ({FSDP2_LAUNCH}), per repeated block, "
                             "while they embed the prompts and render validation and class images: each process "
                             "holds about 1/N of their weights")


def is_sharded(module):
    """Whether ``fully_shard`` was applied to ``module``."""
    from torch.distributed.fsdp import FSDPModule
    return isinstance(module, FSDPModule)


def repeated_blocks(encoder):
    """The names of the block classes of ``encoder``'s ``_no_split_modules`` that it holds (CLIP's text model lists
    its vision embeddings too, which it lacks)."""
    held = {type(module).__name__ for module in encoder.modules()}
    return [name for name in getattr(encoder, "_no_split_modules", None) or [] if name in held]


def shard_text_encoders(accelerator, encoders, enabled):
    """With ``enabled`` (``--fsdp_text_encoder``), shard each of the frozen text ``encoders`` in place with FSDP2,
    per repeated block, with the launch's FSDP2 settings; every process must call it. Logs each encoder's units and
    the bytes each process holds of it beside the whole."""
    if not enabled:
        return
    if not accelerator.is_fsdp2:  # one process: accelerate shards nothing, and neither does this
        logger.warning("--fsdp_text_encoder: this run is not sharded (one process), so neither is its text encoder")
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from accelerate.utils import get_module_children_bottom_up
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    from ..data.cache_keys import describe_before_sharding

    launch = accelerator.state.fsdp_plugin
    mesh = getattr(accelerator, "torch_device_mesh", None)
    options = {"reshard_after_forward": True,  # the encoder only runs forward: nothing is worth keeping gathered
               "offload_policy": launch.cpu_offload,
               "mp_policy": MixedPrecisionPolicy(),  # the weights are in the run's weight dtype already
               "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None}
    for encoder in encoders:
        name = type(encoder).__name__
        whole = whole_bytes({name: encoder})
        describe_before_sharding(encoder)
        plugin = copy.copy(launch)
        plugin.auto_wrap_policy = transformer_auto_wrap_policy
        plugin.transformer_cls_names_to_wrap = repeated_blocks(encoder)
        is_block = fsdp2_prepare_auto_wrap_policy(plugin, encoder)
        for module in get_module_children_bottom_up(encoder)[:-1]:  # as accelerate applies it: inner blocks first
            if is_block(module) and not is_sharded(module):
                fully_shard(module, **options)
        # The token embeddings are a unit of their own too (with the output layer where it shares their weight):
        # gathered only while they embed, and called directly by pipelines that run the encoder's layers one by one
        # (Ideogram 4's), outside the whole encoder's forward.
        embeddings, output_layer = encoder.get_input_embeddings(), encoder.get_output_embeddings()
        tied = [output_layer] if output_layer is not None and output_layer.weight is embeddings.weight else []
        if not is_sharded(embeddings):
            fully_shard([embeddings, *tied], **options)
        fully_shard(encoder, **options)
        keep_recorded_outputs({name: encoder})
        held = gather_object([held_bytes({name: encoder})])
        units = ", ".join(f"{count} {unit}" for unit, count in sharded_units({name: encoder}).items())
        logger.info(f"{name} sharded while it encodes (--fsdp_text_encoder), units: {units}; held per process: "
                    + "; ".join(f"process {index}: {part['frozen']} B" for index, part in enumerate(held))
                    + f" (whole: {whole['frozen']} B)")


def most_calls(calls):
    """The most ``calls`` any process makes; every process must call it."""
    return max(gather_object([calls]))


def in_lockstep(items, call, filler):
    """``call(item)`` for each of ``items``, yielded in turn, then ``filler()`` (a call like the others, its output
    dropped) until this process has made as many calls as the process with the most items. Every process must
    iterate it to the end: the processes agree on the most calls before the first."""
    rounds = most_calls(len(items))
    for item in items:
        yield call(item)
    for _ in range(rounds - len(items)):
        filler()
