"""Load the pipeline once, then hand out its components ready for training.

The scripts never load a component on its own: the pipeline built here is the one that trains
(its modules are the live ones) and the one that renders validation images; `preserved_state` restores its
schedulers and its modules' train/eval modes after such a render.
"""

import contextlib
import copy
import re

import torch
from diffusers import DDPMScheduler
from transformers import AutoTokenizer

from .block_swap import swap_blocks
from .memory_plan import PlanReady, mark_planned, memory_plan, meta_modules, planned, planning
from .quantization import follow_autocast, is_quantized

# A hub id is "name" or "owner/name"; anything else that does not exist locally is a typo'd path.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# Processors that released pipelines name as a component whose text alone the pipeline tokenizes (FLUX.2 [dev]'s
# ``tokenizer`` is Mistral's PixtralProcessor; its encode_prompt calls apply_chat_template). Transformers 5 imports
# them only beside torchvision, which training does not need: their tokenizer loads alone, from the same folder.
TEXT_ONLY_PROCESSORS = {"PixtralProcessor"}


def is_hub_id(value):
    """Whether ``value`` reads as a hub id ("name" or "owner/name"), not as a local path."""
    return HUB_ID.match(value) is not None and not value.startswith(".")


def weight_dtype_for(mixed_precision):
    """The dtype of the frozen weights: half precision under mixed precision, else fp32."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed_precision, torch.float32)


def load_pipeline(pipeline_class, args, weight_dtype=torch.float32, trained_in_fp32=(), quantization=None,
                  **components):
    """``pipeline_class.from_pretrained`` with the shared flags; ``components`` replace loaded ones.

    Every component loads in ``weight_dtype``, the frozen weights' dtype (a LoRA's base included), except those
    named in ``trained_in_fp32`` (a fully trained UNet), which load in fp32: nothing frozen is ever held in fp32
    to be cast down later. `prepare_components` makes the trained tensors fp32 before anything moves.
    ``quantization`` (`quantization.quantization_config`) quantises frozen components as they load.

    A run that only plans its memory (`memory_plan`) gets the pipeline with its models on the meta device, built
    from their configs: no weights file is read.
    """
    if planning(args):
        modules = meta_modules(pipeline_class, args.pretrained_model_name_or_path, args.revision, given=components)
        pipe = from_pretrained(pipeline_class, args.pretrained_model_name_or_path, revision=args.revision,
                               **modules, **components)
        mark_planned(pipe, args, weight_dtype, quantization)
        return pipe
    dtype = {"default": weight_dtype, **dict.fromkeys(trained_in_fp32, torch.float32)}
    if quantization is not None:
        components["quantization_config"] = quantization
    pipe = from_pretrained(pipeline_class, args.pretrained_model_name_or_path, revision=args.revision,
                           variant=args.variant, dtype=dtype, **components)
    pipe.set_progress_bar_config(disable=True)
    pipe.blocks_to_swap = getattr(args, "blocks_to_swap", 0)  # for prepare_components (block_swap.swap_blocks)
    return pipe


def from_pretrained(pipeline_class, path, revision=None, **components):
    """``pipeline_class.from_pretrained(path, revision=revision, **components)``, where each component that the
    folder's ``model_index.json`` names by one of `TEXT_ONLY_PROCESSORS` (and ``components`` does not give) loads as
    its tokenizer: the pipeline then loads, and tokenizes prompts the same, with or without torchvision."""
    index = pipeline_class.load_config(path, revision=revision)
    tokenizers = {name: AutoTokenizer.from_pretrained(path, subfolder=name, revision=revision)
                  for name, value in index.items()
                  if name not in components and isinstance(value, list) and value[-1] in TEXT_ONLY_PROCESSORS}
    # Passed as None, a component is not loaded (diffusers cannot type-check a tokenizer against a class it
    # cannot import); the tokenizer takes its place once the pipeline is built.
    pipe = pipeline_class.from_pretrained(path, revision=revision, **dict.fromkeys(tokenizers), **components)
    pipe.register_modules(**tokenizers)
    return pipe


def modules_of(pipe):
    """The pipeline's ``torch.nn.Module`` components, by component name."""
    return {name: module for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}


def prepare_components(pipe, trained, device, weight_dtype, encoders=()):
    """Freeze every module of ``pipe`` and move it to ``device``: frozen tensors in ``weight_dtype``, trained
    tensors in fp32. The frozen ``encoders`` (VAE, text encoders) stay on the CPU: `frozen_encoders.FrozenEncoders` takes
    them to the device only while they run, and not at all when their outputs are on disk already.

    ``trained`` maps component names to modules whose ``requires_grad`` parameters are trained (call after
    adding adapters). Parameters that require grad are fp32 for the optimizer; everything else is frozen and in
    ``weight_dtype``, so mixed precision saves memory on the frozen parts only. Each module gets its dtypes
    before it moves, so no tensor reaches the accelerator in a dtype it will not keep. A quantised module
    keeps the dtypes it loaded with (it loaded in ``weight_dtype``); only its trained tensors become fp32. With
    ``--blocks_to_swap``, the transformer's swapped blocks keep their frozen weights on the CPU
    (`block_swap.swap_blocks`).

    On a meta pipeline (a run that only plans its memory) the dtypes are given as they would be, nothing moves, and
    the run stops with its plan (`memory_plan.PlanReady`).
    """
    if planned(pipe) is not None:
        for module in modules_of(pipe).values():
            trains = id(module) in {id(module) for module in trained.values()}
            if not trains:
                module.requires_grad_(False)
            for parameter in module.parameters():
                parameter.data = parameter.data.float() if parameter.requires_grad else parameter.data.to(weight_dtype)
        raise PlanReady(memory_plan(pipe, trained, encoders))
    trained_modules = {id(module) for module in trained.values()}
    left_on_cpu = {id(module) for module in encoders} - trained_modules
    for name, module in modules_of(pipe).items():
        if id(module) in trained_modules:
            # Tensor by tensor: trained weights never pass through half precision.
            for parameter in module.parameters():
                if parameter.requires_grad:
                    parameter.data = parameter.data.float()
                elif not is_quantized(module):
                    parameter.data = parameter.data.to(weight_dtype)
        else:
            module.requires_grad_(False)
            module.eval()
            if not is_quantized(module):
                module.to(dtype=weight_dtype)
        if is_quantized(module):
            follow_autocast(module)
        if id(module) not in left_on_cpu:
            swap_blocks(pipe, name, module, device)
            module.to(device)


def trainable_parameters(trained):
    """``{"<component>.<parameter name>": parameter}`` for every parameter that requires grad.

    These names key the EMA, the checkpoints and the export check, so they must not depend on
    wrappers such as DDP: take them from the unwrapped modules.
    """
    parameters = {
        f"{component}.{name}": parameter
        for component, module in trained.items()
        for name, parameter in module.named_parameters()
        if parameter.requires_grad
    }
    if not parameters:
        raise ValueError(f"nothing to train: no parameter of {', '.join(trained)} requires grad")
    return parameters


def training_noise_scheduler(pipe, scheduler_class=DDPMScheduler, prediction_type=None):
    """The scheduler that adds noise during training, made from the pipeline's scheduler config.

    With ``prediction_type``, the pipeline's own (inference) scheduler is switched to it too, so
    validation renders with what the model is being trained to predict.
    """
    if prediction_type is not None:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, prediction_type=prediction_type)
    return scheduler_class.from_config(pipe.scheduler.config)


@contextlib.contextmanager
def preserved_state(schedulers, modules):
    """Restore the schedulers' attributes (None where a pipeline has none) and every submodule's train/eval mode on
    exit."""
    schedulers = [scheduler for scheduler in schedulers if scheduler is not None]
    saved_schedulers = [copy.deepcopy(vars(scheduler)) for scheduler in schedulers]
    saved_modes = [(submodule, submodule.training) for module in modules for submodule in module.modules()]
    try:
        yield
    finally:
        for scheduler, saved in zip(schedulers, saved_schedulers):
            vars(scheduler).clear()
            vars(scheduler).update(saved)
        for submodule, training in saved_modes:
            submodule.training = training

