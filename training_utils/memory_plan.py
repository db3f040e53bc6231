"""A memory plan before any weights load: what a run would hold on the accelerator, from its configs alone.

With ``--print_memory_plan`` (the LoRA scripts' flag: `args.add_lora_args`) a script runs its own first steps on the
meta device: `pipeline.load_pipeline` builds every model of the pipeline from its config (`meta_modules`: accelerate's
``init_empty_weights``; no weights file is read, not even a header), the script adds its adapters as it always does,
and `pipeline.prepare_components` gives each tensor the dtype the run would give it, then stops the script with the
plan (`PlanReady`), which `outputs.run_status.run_script` prints as JSON on stdout, exiting 0; nothing is written.

Counted, not modelled: each component's parameters and their bytes (an int8 base as torchao stores it), what trains,
AdamW's state and the EMAs' shadows are what the run allocates (`tests/test_memory_plan.py` checks them against real
runs of the tiny fixtures). Estimated: NF4 and float8 weights and 8-bit AdamW's state (`weight_bytes`,
`optimizer_state_bytes`); activations (`activation_units`: 34 bytes per token and channel of each repeated block in
bf16, with flash attention, as Korthikanti et al. 2022 count a transformer layer; with gradient checkpointing, each
block's input plus one block recomputed); gradients (the trained fp32 tensors' size); and the peak, the larger of two
phases. Training: the frozen weights on the accelerator, less the swapped blocks (``--blocks_to_swap``) but for their
window (the two consecutive ones that hold most), what trains, its gradients, AdamW's state and the EMA where they live
on the accelerator, and the activations. Encoding: the same frozen weights and what trains, plus the frozen encoders,
which `data.frozen_encoders.FrozenEncoders` brings to the accelerator together while they run, once, before training.

With ``--gpu_memory_gb G`` the plan also names the fewest blocks to swap (then an int8 base) whose peak fits in G
(`smallest_fit`); a real run with G makes the plan first (`make_plan`: the same steps on the meta device) and stops
in one line, before any weights load, when it does not fit, unless ``--ignore_memory_plan``. GB is 10^9 bytes.
"""

import argparse
import importlib
import json
import math

import torch
from accelerate import init_empty_weights

from .block_swap import SWAPPED_COMPONENTS, WINDOW, repeated_blocks
from .errors import UsageError, is_first_process, require
from .quantization import scheme_of

# Bytes of saved activations per token and channel of a transformer block in bf16 (Korthikanti et al. 2022, with
# flash attention: 34 s b h for attention and a 4x MLP); twice that in fp32.
ACTIVATION_BYTES_PER_TOKEN_CHANNEL = 34
# The prompt tokens a transformer family attends to beside the image's, where the script sets no length.
TEXT_TOKENS = 512
# Per int8 weight row (output channel): torchao's Int8Tensor keeps an fp32 scale and an int8 zero point.
INT8_ROW_BYTES = 4 + 1
GB = 1e9


class PlanReady(Exception):
    """Raised by `prepare_components` on a planning run: the script stops there, with its plan."""

    def __init__(self, plan):
        super().__init__("memory plan ready")
        self.plan = plan


def add_memory_plan_args(parser):
    group = parser.add_argument_group("memory plan")
    group.add_argument("--print_memory_plan", action="store_true",
                       help="print what the run would hold in memory, as JSON, from the configs alone (no weights "
                            "are read), and exit")
    group.add_argument("--gpu_memory_gb", type=float, default=None,
                       help="the accelerator's memory (10^9 bytes): the plan names the smallest --blocks_to_swap "
                            "(and quantisation) that fits, and a run that would not fit stops before loading")
    group.add_argument("--ignore_memory_plan", action="store_true",
                       help="run although the memory plan says that the run does not fit in --gpu_memory_gb")


def check_memory_plan_args(args):
    value = getattr(args, "gpu_memory_gb", None)
    require(value is None or (value > 0 and math.isfinite(value)), "--gpu_memory_gb", value, "a positive number")


def planning(args):
    """Whether this run of the script only makes its memory plan (its models on the meta device)."""
    return getattr(args, "planning", False)


def plan_first(args):
    """Whether a run must make its plan before it loads: ``--print_memory_plan``, or ``--gpu_memory_gb`` to check."""
    return getattr(args, "print_memory_plan", False) or (
        getattr(args, "gpu_memory_gb", None) is not None and not args.ignore_memory_plan)


def make_plan(main, args, run):
    """Run ``main(args, run)`` as a planning run, up to `prepare_components`; its plan."""
    planning_args = argparse.Namespace(**vars(args), planning=True)
    try:
        main(planning_args, run)
    except PlanReady as ready:
        return ready.plan
    raise RuntimeError("the script reached no prepare_components: it makes no memory plan")


def check_fits(plan):
    """Stop in one line when ``plan`` (made with ``--gpu_memory_gb``) does not fit."""
    if plan["fits"]:
        return
    fit = plan["smallest_fit"]
    advice = ("no --blocks_to_swap fits it, with or without an int8 base" if fit is None else
              f"--blocks_to_swap {fit['blocks_to_swap']}"
              + (f" --quantize_base {fit['quantize_base']}" if fit["quantize_base"] else "")
              + f" would ({fit['accelerator_peak_bytes_estimate'] / GB:.1f} GB)")
    raise UsageError("--gpu_memory_gb", plan["gpu_memory_gb"],
                     f"a run that fits: its memory plan estimates a peak of "
                     f"{plan['accelerator_peak_bytes_estimate'] / GB:.1f} GB on the accelerator; {advice} "
                     f"(--print_memory_plan shows the plan; --ignore_memory_plan runs anyway)")


# --- the meta pipeline ---------------------------------------------------------------------------------------------

def model_class(library, class_name):
    """The class that ``model_index.json`` names, if it is a ``torch.nn.Module``; else None."""
    try:
        cls = getattr(importlib.import_module(library), class_name)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, torch.nn.Module) else None


def meta_model(cls, path, subfolder, revision=None):
    """``cls`` built from its config in ``path/subfolder`` on the meta device (diffusers or transformers)."""
    with init_empty_weights():
        if hasattr(cls, "load_config"):  # diffusers' ModelMixin
            return cls.from_config(cls.load_config(path, subfolder=subfolder, revision=revision))
        config = cls.config_class.from_pretrained(path, subfolder=subfolder, revision=revision)
        model = cls._from_config(config)
    model.tie_weights()  # as from_pretrained ties them once loaded: one tensor, counted once
    return model


def meta_modules(pipeline_class, path, revision=None, given=()):
    """``{component: model on the meta device}`` for each model that the pipeline folder's ``model_index.json``
    names (but those ``given``)."""
    index = pipeline_class.load_config(path, revision=revision)
    modules = {}
    for name, value in index.items():
        is_component = isinstance(value, list) and len(value) == 2 and all(isinstance(part, str) for part in value)
        if name.startswith("_") or name in given or not is_component:  # a setting, or a component left out
            continue
        cls = model_class(*value)
        if cls is not None:
            modules[name] = meta_model(cls, path, name, revision)
    return modules


def mark_planned(pipe, args, weight_dtype, quantization):
    """Keep what the plan needs beside the meta pipeline: the flags, the frozen dtype, and which components load
    quantised (as `quantization.quantization_config` named them)."""
    quantized = set(quantization.quant_mapping) if quantization is not None else set()
    pipe._memory_plan = {"args": args, "weight_dtype": weight_dtype, "quantized": quantized}


def planned(pipe):
    """What `mark_planned` kept beside ``pipe``, or None for a pipeline that loaded its weights."""
    return getattr(pipe, "_memory_plan", None)


# --- counting -----------------------------------------------------------------------------------------------------

def tensor_bytes(tensor):
    """The bytes a tensor holds: a quantised weight (a tensor subclass) counts its inner tensors."""
    if hasattr(tensor, "__tensor_flatten__") and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def weight_bytes(scheme, rows, columns):
    """The bytes of a ``rows`` x ``columns`` linear weight quantised by ``scheme``: torchao's int8 (an int8 per
    weight, an fp32 scale and an int8 zero point per row: exact), its float8 (a byte per weight, an fp32 scale per
    row) or bitsandbytes' NF4 (half a byte per weight, a byte per 64-weight block's double-quantised scale); the
    last two estimated."""
    if scheme == "int8":
        return rows * (columns + INT8_ROW_BYTES)
    if scheme == "fp8":
        return rows * (columns + 4)
    return math.ceil(rows * columns / 2) + math.ceil(rows * columns / 64)


def parameter_bytes(module, scheme=None):
    """The bytes of ``module``'s parameters as they are (dtype given), or, quantised by ``scheme`` as diffusers
    loads a quantised model: each frozen linear weight quantised (`weight_bytes`), but in the modules that the model
    keeps in fp32 (its ``_keep_in_fp32_modules``: fp32, not quantised); the rest as it is."""
    keep_in_fp32 = set(getattr(module, "_keep_in_fp32_modules", None) or ()) if scheme else set()
    total, seen = 0, set()
    for layer_name, layer in module.named_modules():
        for name, parameter in layer.named_parameters(recurse=False):
            if id(parameter) in seen:  # tied: one tensor
                continue
            seen.add(id(parameter))
            if parameter.requires_grad or not scheme:
                total += tensor_bytes(parameter)
            elif keep_in_fp32 & set(f"{layer_name}.{name}".split(".")):
                total += 4 * parameter.numel()
            elif isinstance(layer, torch.nn.Linear) and name == "weight":
                total += weight_bytes(scheme, *parameter.shape)
            else:
                total += tensor_bytes(parameter)
    return total


def trained_parameters(trained):
    return [parameter for module in trained.values() for parameter in module.parameters() if parameter.requires_grad]


def optimizer_state_bytes(parameters, eight_bit=False):
    """AdamW's state for ``parameters``: ``exp_avg`` and ``exp_avg_sq`` of each tensor's dtype and shape, and its
    ``step`` (an fp32 scalar). bitsandbytes' 8-bit AdamW keeps uint8 states (its 256-element blocks' scales
    uncounted) for tensors of 4096 elements or more, and fp32 states for smaller ones (an estimate)."""
    total = 0
    for parameter in parameters:
        states = 2 * parameter.numel() * (1 if eight_bit and parameter.numel() >= 4096 else parameter.element_size())
        total += states + 4
    return total


def ema_state_bytes(args, parameters):
    """The fp32 shadows of the EMA (``--use_ema``) and of each post-hoc EMA profile (``--ema_posthoc_sigma_rels``)."""
    copies = int(args.use_ema) + len(args.ema_posthoc_sigma_rels or ())
    return copies * sum(4 * parameter.numel() for parameter in parameters)


# --- activations --------------------------------------------------------------------------------------------------

def config_value(config, *names, default=None):
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    return default


def vae_compression(vae):
    """``(spatial, temporal, latent channels)`` of a VAE, from its config."""
    config = vae.config
    spatial = (getattr(vae, "spatial_compression_ratio", None) or config_value(config, "scale_factor_spatial")
               or 2 ** (len(config_value(config, "block_out_channels", default=[0] * 4)) - 1))
    temporal = getattr(vae, "temporal_compression_ratio", None) or config_value(config, "scale_factor_temporal",
                                                                                 default=1)
    channels = config_value(config, "latent_channels", "z_dim", "in_channels_latent", default=4)
    return int(spatial), int(temporal), int(channels)


def latent_tokens(pipe, denoiser, height, width, frames):
    """The image (video) tokens a transformer sees for one sample: the latent grid, packed 2x2 where the pipeline
    packs it (the transformer takes four latent channels per token), else cut in the transformer's patches."""
    spatial, temporal, channels = vae_compression(pipe.vae)
    config = denoiser.config
    latent_frames = (frames - 1) // temporal + 1 if frames > 1 else 1
    patch = config_value(config, "patch_size", "all_patch_size", default=1)
    patch = patch[-1] if isinstance(patch, (list, tuple)) else patch
    patch_t = config_value(config, "patch_size_t", default=1)
    if config_value(config, "in_channels", default=channels) == 4 * channels:
        patch, patch_t = 2, 1
    return (math.ceil(height / spatial / patch) * math.ceil(width / spatial / patch)
            * math.ceil(latent_frames / patch_t))


def hidden_size(config):
    heads, head_dim = config_value(config, "num_attention_heads"), config_value(config, "attention_head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int):
        return heads * head_dim
    return int(config_value(config, "hidden_size", "inner_dim", "dim", default=0))


def activation_units(pipe, denoiser, blocks, height, width, frames):
    """``[(tokens, channels)]`` per checkpointed unit of one sample: each repeated block of a transformer (its image
    tokens and the prompt's), or each resnet and attention layer of a UNet at its level's resolution."""
    config = denoiser.config
    if "block_out_channels" not in config:
        tokens = latent_tokens(pipe, denoiser, height, width, frames) + TEXT_TOKENS
        return [(tokens, hidden_size(config))] * len(blocks)
    spatial, _, _ = vae_compression(pipe.vae)
    layers = config["layers_per_block"]
    attention_layers = config.get("transformer_layers_per_block", 1)
    units = []
    for level, (channels, kind) in enumerate(zip(config["block_out_channels"], config["down_block_types"])):
        tokens = (height // spatial >> level) * (width // spatial >> level)
        per_layer = 1 + ("CrossAttn" in kind) * (attention_layers[level] if isinstance(attention_layers, list)
                                                 else attention_layers)
        units += [(tokens, channels)] * (per_layer * (2 * layers + 1))  # down, then up (one layer more)
    return units


def activation_bytes(units, batch_size, weight_dtype, checkpointing):
    """Saved activations of ``units`` for a batch (see the module's docstring)."""
    scale = batch_size * (4 if weight_dtype == torch.float32 else 2) / 2
    full = [ACTIVATION_BYTES_PER_TOKEN_CHANNEL * tokens * channels * scale for tokens, channels in units]
    if not checkpointing:
        return int(sum(full))
    return int(sum(2 * tokens * channels * scale for tokens, channels in units) + max(full, default=0))


# --- the plan -----------------------------------------------------------------------------------------------------

def swapped_off(model, blocks_to_swap, frozen_bytes):
    """What swapping ``model``'s first ``blocks_to_swap`` repeated blocks takes off the accelerator: their frozen
    bytes (``frozen_bytes(block)``) but for the window's, the `block_swap.WINDOW` consecutive ones that hold most."""
    swapped = [frozen_bytes(block) for _, block in repeated_blocks(model)[:blocks_to_swap]]
    if not swapped:
        return 0
    return sum(swapped) - max(sum(swapped[index:index + WINDOW]) for index in range(len(swapped)))


def training_bytes(resident, trainable_bytes, optimizer_bytes, ema_on_accelerator, activations):
    """The training phase's peak: the ``resident`` frozen weights, what trains and its gradients (fp32, the same
    size), the optimizer's state, the EMA where it is on the accelerator, and the activations."""
    return resident + 2 * trainable_bytes + optimizer_bytes + ema_on_accelerator + activations


def denoiser_name(pipe, trained):
    """The component that denoises (the one whose blocks swap): the trained transformer or UNet."""
    for name in ("transformer", "unet"):
        if name in trained or hasattr(pipe, name):
            return name
    return next(iter(trained))


def memory_plan(pipe, trained, encoders):
    """The plan of a meta pipeline that `prepare_components` has just given the run's dtypes (see the module's
    docstring). The blocks that swap are `block_swap.repeated_blocks`' (the first N of each swapped component)."""
    kept = planned(pipe)
    args, weight_dtype, quantized = kept["args"], kept["weight_dtype"], kept["quantized"]
    modules = {name: module for name, module in pipe.components.items() if isinstance(module, torch.nn.Module)}
    trained_ids = {id(module) for module in trained.values()}
    encoder_ids = {id(module) for module in encoders} - trained_ids
    parameters = trained_parameters(trained)
    trainable_bytes = sum(tensor_bytes(parameter) for parameter in parameters)
    optimizer_bytes = optimizer_state_bytes(parameters, args.use_8bit_adam)
    ema_bytes = ema_state_bytes(args, parameters)
    name = denoiser_name(pipe, trained)
    denoiser = modules[name]
    blocks = [block for _, block in repeated_blocks(denoiser)]
    height = width = args.resolution
    frames = getattr(args, "num_frames", None) or 1
    units = activation_units(pipe, denoiser, blocks, height, width, frames)
    activations = {checkpointing: activation_bytes(units, args.train_batch_size, weight_dtype, checkpointing)
                   for checkpointing in (False, True)}

    run_scheme = scheme_of(args)

    def frozen_bytes(module, component, base_scheme):
        """What stays frozen of ``module`` (trained tensors apart), quantised as the run quantises ``component``, or
        the denoiser as ``base_scheme``."""
        scheme = run_scheme if component in quantized else base_scheme if component == name else None
        return parameter_bytes(module, scheme) - sum(
            tensor_bytes(parameter) for parameter in module.parameters() if parameter.requires_grad)

    def estimate(base_scheme, blocks_to_swap):
        """The peak of the run with its denoiser quantised as ``base_scheme`` and ``blocks_to_swap`` of the
        repeated blocks of each swapped component off the accelerator."""
        resident = encoding = 0
        for component, module in modules.items():
            held = frozen_bytes(module, component, base_scheme)
            if id(module) in encoder_ids:
                encoding += held
                continue
            if component in SWAPPED_COMPONENTS:
                held -= swapped_off(module, blocks_to_swap, lambda block: frozen_bytes(block, component, base_scheme))
            resident += held
        on_accelerator = trainable_bytes + (ema_bytes if args.ema_device != "cpu" else 0)
        training = training_bytes(resident, trainable_bytes, optimizer_bytes,
                                  ema_bytes if args.ema_device != "cpu" else 0,
                                  activations[bool(args.gradient_checkpointing)])
        return {"training": training, "encoding": resident + on_accelerator + encoding}

    def peak(base_scheme, blocks_to_swap):
        return max(estimate(base_scheme, blocks_to_swap).values())

    components = {}
    for component, module in modules.items():
        as_run = frozen_bytes(module, component, run_scheme) + sum(
            tensor_bytes(parameter) for parameter in module.parameters() if parameter.requires_grad)
        components[component] = {
            "class": type(module).__name__,
            "parameters": sum(parameter.numel() for parameter in module.parameters()),
            "bytes": as_run,
            "dtype": str(weight_dtype).removeprefix("torch."),
            "quantization": run_scheme if component in quantized else None,
            "device": "accelerator while encoding" if id(module) in encoder_ids else "accelerator",
        }
    blocks_to_swap = getattr(args, "blocks_to_swap", 0) or 0
    plan = {
        "components": components,
        "trainable_parameters": sum(parameter.numel() for parameter in parameters),
        "trainable_bytes": trainable_bytes,
        "optimizer_state_bytes": optimizer_bytes,
        "ema_bytes": ema_bytes,
        "ema_device": "cpu" if args.ema_device == "cpu" else "accelerator",
        "activations_bytes_estimate": {"without_gradient_checkpointing": activations[False],
                                       "with_gradient_checkpointing": activations[True],
                                       "resolution": args.resolution, "frames": frames,
                                       "batch_size": args.train_batch_size},
        "gradient_checkpointing": bool(args.gradient_checkpointing),
        "repeated_blocks": len(blocks),
        "blocks_to_swap": blocks_to_swap,
        "accelerator_peak_bytes_estimate": peak(run_scheme, blocks_to_swap),
        "accelerator_peak_bytes_estimate_by_phase": estimate(run_scheme, blocks_to_swap),
    }
    if args.gpu_memory_gb is not None:
        budget = args.gpu_memory_gb * GB
        plan["gpu_memory_gb"] = args.gpu_memory_gb
        plan["fits"] = plan["accelerator_peak_bytes_estimate"] <= budget
        swappable = len(blocks) if name in SWAPPED_COMPONENTS else 0
        plan["smallest_fit"] = smallest_fit(peak, run_scheme, swappable, budget)
    return plan


def smallest_fit(estimate, run_scheme, num_blocks, budget):
    """The fewest blocks to swap whose ``estimate(scheme, blocks)`` (a peak) fits ``budget``: first with the run's
    quantisation, then, for an unquantised run, with an int8 base; None where nothing fits."""
    for scheme in [run_scheme] + (["int8"] if run_scheme is None else []):
        for blocks_to_swap in range(num_blocks + 1):
            peak = estimate(scheme, blocks_to_swap)
            if peak <= budget:
                return {"blocks_to_swap": blocks_to_swap, "quantize_base": scheme,
                        "accelerator_peak_bytes_estimate": peak}
    return None


def print_plan(plan):
    """The plan as JSON on stdout, from the first process only (each process of a launch plans alike)."""
    if is_first_process():
        print(json.dumps(plan, indent=1))
