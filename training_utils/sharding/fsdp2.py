"""FSDP2 sharding through accelerate: turning it on where accelerate would not (several CPU processes), and the
tensors of a sharded run: each process's own part of a parameter (a DTensor's local tensor), that part of a whole
tensor, and whole tensors gathered from the parts.

``accelerate launch --use_fsdp --fsdp_version 2`` (or a config file with ``fsdp_version: 2``) shards what trains:
accelerate's ``prepare`` applies ``fully_shard`` per repeated block of the model (the blocks its
``_no_split_modules`` name, or where it declares none the blocks it repeats, `unit_blocks`; unless the launch names
others) and to the model itself, the frozen base included.
accelerate's state treats several CPU processes as DDP whatever the launch asked; `enable_fsdp2_on_cpu` makes
such a run take accelerate's FSDP2 path instead (the one a GPU run takes), so that tests and CI can run it.
"""

import contextlib
import os

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.tensor import DTensor

from ..compile import declared_repeated_blocks
from ..errors import UsageError

FSDP2_LAUNCH = "accelerate launch --use_fsdp --fsdp_version 2"


def fsdp_requested():
    """Whether the launch asked for FSDP (``--use_fsdp`` or a config file's ``distributed_type: FSDP``)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def check_launch(args=None):
    """Refuse, in one line before anything loads, what this code does not shard with: DeepSpeed, FSDP1, and under
    FSDP2 a quantised base (``args``' --quantize_base or --bnb_quantization_config_path; torchao's int8 tensors do
    not shard)."""
    quantized = getattr(args, "quantize_base", None) or getattr(args, "bnb_quantization_config_path", None)
    if fsdp_requested() and quantized:
        flag = "--quantize_base" if getattr(args, "quantize_base", None) else "--bnb_quantization_config_path"
        raise UsageError(flag, quantized, f"no quantised base under FSDP2 ({FSDP2_LAUNCH}): a quantised base is not "
                                          f"sharded here yet; shard it in bf16, or train it quantised unsharded")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise UsageError(None, None, f"DeepSpeed is not supported here: shard with FSDP2 ({FSDP2_LAUNCH})")
    if fsdp_requested() and os.environ.get("FSDP_VERSION", "1") != "2":
        raise UsageError(None, None, f"FSDP version {os.environ.get('FSDP_VERSION', '1')} is not supported here: "
                                     f"shard with FSDP2 ({FSDP2_LAUNCH})")


def fsdp2_plugin():
    """accelerate's FSDP plugin as the launch set it, wrapping per repeated block by default: with no wrap policy
    given, each of the blocks the model's ``_no_split_modules`` names is a unit of its own (accelerate's own default,
    NO_WRAP, would gather the whole model at once). None unless FSDP was asked for."""
    if not fsdp_requested():
        return None
    policy = None if os.environ.get("FSDP_AUTO_WRAP_POLICY") else "transformer_based_wrap"
    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy=policy)


def unit_blocks(module):
    """The classes of ``module``'s blocks that FSDP2 shards as units of their own: its ``_no_split_modules``, or
    where it declares none (LTX-Video's transformer declares only ``_repeated_blocks``) the blocks it declares
    repeated (`compile.declared_repeated_blocks`; a model declaring neither, as ControlNet, stays one unit)."""
    return tuple(getattr(module, "_no_split_modules", None) or declared_repeated_blocks(module))


def declare_unit_blocks(module):
    """Give ``module`` (on the instance) the `unit_blocks` as ``_no_split_modules`` where it declares none, so that
    accelerate's wrap policy, which reads only that list, shards it per block and not as one unit."""
    if not getattr(module, "_no_split_modules", None) and unit_blocks(module):
        module._no_split_modules = list(unit_blocks(module))


class TrainedModules(torch.nn.ModuleDict):
    """Several trained modules as one model (`one_model_of`); never called itself (``fully_shard`` takes no container
    without a forward)."""

    def forward(self, *args, **kwargs):
        raise TypeError("the trained modules are called one by one (each gathers its own parameters), not together")


def one_model_of(trained):
    """One module holding the several modules of ``trained`` (``{component: module}``), for accelerate's FSDP2
    ``prepare``, which shards one model per call. Each trained module is a unit of its own, and so is each of its
    repeated blocks (the container's ``_no_split_modules`` name their classes): FSDP2's hooks are on the trained
    modules themselves, so the step calls them directly, each gathering its own parameters, as it calls them
    unsharded; the container holds no parameter of its own."""
    container = TrainedModules(trained)
    present = {type(submodule).__name__ for submodule in container.modules()}
    # A model's list may name classes of its relatives (transformers' CLIP text model names the vision embeddings).
    blocks = {block for module in trained.values() for block in unit_blocks(module)}
    container._no_split_modules = sorted({type(module).__name__ for module in trained.values()} | blocks & present)
    return container


def unsharded_class(module):
    """The class a module that ``fully_shard`` wrapped had before: it gave it a class of its own, FSDP<class>, made
    from FSDPModule and that class."""
    from torch.distributed.fsdp import FSDPModule
    return next(base for base in type(module).__mro__[1:] if base is not FSDPModule)


def keep_recorded_outputs(trained):
    """transformers' models record their hidden states (``output_hidden_states``) through a registry keyed on the
    model's class, which ``fully_shard`` replaces: register what each sharded module of ``trained`` records under
    its new class too, or a sharded text encoder returns no hidden states (SDXL's prompts read the penultimate)."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return
    from torch.distributed.fsdp import FSDPModule
    for module in trained.values():
        for submodule in module.modules():
            recorded = dict.get(_CAN_RECORD_REGISTRY, str(unsharded_class(submodule))) \
                if isinstance(submodule, FSDPModule) else None
            if recorded is not None:
                _CAN_RECORD_REGISTRY[submodule] = recorded


def enable_fsdp2_on_cpu(accelerator, plugin):
    """Put an accelerator that accelerate left on DDP because its processes are CPU processes (gloo) on FSDP2 with
    ``plugin``, as accelerate's state does for GPU processes: the same ``prepare``, the same ``fully_shard``."""
    state = accelerator.state
    if plugin is None or state.distributed_type != DistributedType.MULTI_CPU:
        return
    state.distributed_type = DistributedType.FSDP
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    # Every later AcceleratorState() starts from the process state's type: accelerate records it there too.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


@contextlib.contextmanager
def without_model_state(accelerator):
    """accelerate's ``save_state`` and ``load_state``, sharded, write and read each prepared model's whole state (the
    frozen base's shards too: GBs beside a LoRA of MBs) as well as the optimizer's. A checkpoint here holds what
    trains only: the trained parameters are written by its own hook (gathered, in the output's layout) and read back
    by it, and the frozen base is the pretrained one. So inside this block, accelerate's FSDP model writer and reader
    do nothing under FSDP; the optimizer's (each process its shard, ``torch.distributed.checkpoint``) run as before."""
    import accelerate.accelerator
    if not accelerator.is_fsdp2:
        yield
        return
    writer, reader = accelerate.accelerator.save_fsdp_model, accelerate.accelerator.load_fsdp_model
    accelerate.accelerator.save_fsdp_model = accelerate.accelerator.load_fsdp_model = lambda *args, **kwargs: None
    try:
        yield
    finally:
        accelerate.accelerator.save_fsdp_model, accelerate.accelerator.load_fsdp_model = writer, reader


def local_tensor(tensor):
    """This process's part of ``tensor``: a DTensor's local tensor (a view, so writes reach the parameter), or the
    tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_part(whole, like):
    """This process's part of the whole tensor ``whole``, laid out as the (possibly sharded) ``like`` is; cut
    locally, without communication."""
    if not isinstance(like, DTensor):
        return whole
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return whole[tuple(slice(start, start + size) for start, size in zip(offset, shape))]


def whole_tensors(tensors, like):
    """``{name: whole tensor on the CPU}`` from ``tensors`` (``{name: local part}``) laid out as the parameters
    ``like`` (``{name: parameter}``). Every process must call it: a sharded tensor is gathered from all of them."""
    wholes = {}
    for name, tensor in tensors.items():
        parameter = like[name]
        if isinstance(parameter, DTensor):
            tensor = DTensor.from_local(tensor, parameter.device_mesh, parameter.placements, run_check=False,
                                        shape=parameter.shape, stride=parameter.stride()).full_tensor()
        wholes[name] = tensor.detach().cpu()
    return wholes


def any_sharded(parameters):
    """Whether any of ``parameters`` (``{name: parameter}``) is sharded (a DTensor)."""
    return any(isinstance(parameter, DTensor) for parameter in parameters.values())


def unshard_trained(trained):
    """Replace every sharded trained parameter of the modules of ``trained`` (``{component: module}``) by a plain
    parameter holding its whole tensor, on every process (they all take part in gathering), so that the main process
    writes whole outputs from the live modules as an unsharded run does. The modules no longer run sharded after."""
    from torch.distributed.fsdp import FSDPModule
    for module in trained.values():
        for submodule in module.modules():
            if isinstance(submodule, FSDPModule):
                submodule.reshard()  # the root stays gathered after a forward (validation's): back to its shards
        for name, parameter in list(module.named_parameters()):
            if parameter.requires_grad and isinstance(parameter, DTensor):
                owner_name, _, attribute = name.rpartition(".")
                owner = module.get_submodule(owner_name)
                whole = parameter.detach().full_tensor()
                owner.register_parameter(attribute, torch.nn.Parameter(whole, requires_grad=True))


def plain_modules(trained):
    """Make the modules of ``trained`` (``{component: module}``), whose parameters `unshard_trained` made whole, plain
    modules again: each unit ``fully_shard`` made gets its own class back (a saved config names the stock class,
    not ``FSDP<class>``) and loses FSDP's forward hooks (which would put the stale shards back). For a full
    fine-tune's outputs, written by ``save_pretrained`` from the live modules."""
    from torch.distributed.fsdp import FSDPModule
    for module in trained.values():
        for submodule in module.modules():
            if not isinstance(submodule, FSDPModule):
                continue
            sharded = [name for name, parameter in submodule.named_parameters() if isinstance(parameter, DTensor)]
            if sharded:
                raise ValueError(f"{type(submodule).__name__} still holds sharded parameters ({sharded[0]}, ...)")
            state = submodule._get_fsdp_state()
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            submodule.__class__ = unsharded_class(submodule)


def held_bytes(trained, averages=()):
    """``{"frozen": bytes, "trained": bytes, "ema": bytes}`` that this process holds of the modules of ``trained``
    (``{component: module}``; a sharded parameter counts its local part) and of the ``averages`` (`ema.EMA` and
    `posthoc_ema.PostHocEMA`, None skipped)."""
    held = {"frozen": 0, "trained": 0, "ema": 0}
    for module in trained.values():
        for parameter in module.parameters():
            part = local_tensor(parameter)
            held["trained" if parameter.requires_grad else "frozen"] += part.numel() * part.element_size()
    held["ema"] = sum(average.num_bytes for average in averages if average is not None)
    return held


def whole_bytes(trained, averages=()):
    """`held_bytes` as one unsharded process would hold them: whole parameters, and fp32 averages of them."""
    held = {"frozen": 0, "trained": 0, "ema": 0}
    for module in trained.values():
        for parameter in module.parameters():
            held["trained" if parameter.requires_grad else "frozen"] += parameter.numel() * parameter.element_size()
            if parameter.requires_grad:
                held["ema"] += sum(4 * parameter.numel() * len(getattr(average, "profiles", [average]))
                                   for average in averages if average is not None)
    return held


def sharded_units(trained):
    """``{class name: count}`` of the modules of ``trained`` that FSDP2 gathers as one unit (those ``fully_shard``
    was applied to: the repeated blocks, and each trained module itself)."""
    from torch.distributed.fsdp import FSDPModule
    units = {}
    for module in trained.values():
        for submodule in module.modules():
            if isinstance(submodule, FSDPModule):
                name = unsharded_class(submodule).__name__
                units[name] = units.get(name, 0) + 1
    return units


def describe_held_bytes(per_process, whole):
    """One line: what each process holds (`held_bytes`, in process order) beside the whole (`whole_bytes`)."""
    processes = "; ".join(f"process {index}: " + ", ".join(f"{kind} {count} B" for kind, count in held.items())
                          for index, held in enumerate(per_process))
    return (f"sharded over {len(per_process)} processes with FSDP2: {processes} (whole: "
            + ", ".join(f"{kind} {count} B" for kind, count in whole.items()) + ")")
