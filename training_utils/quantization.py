"""A quantised frozen base ("QLoRA"): its flags, their checks before any weights load, and diffusers' loading config.

Only frozen modules are quantised: the base model the adapter (or ControlNet) trains beside, and with
``--quantize_text_encoders`` the frozen text encoders. What trains, its EMA and its post-hoc EMA stay fp32
tensors of their own, so quantisation never touches them; they are exactly what a stock, unquantised pipeline
loads.
"""

import importlib.util
import json
from pathlib import Path

import torch
from diffusers import BitsAndBytesConfig, TorchAoConfig
from diffusers.quantizers import PipelineQuantizationConfig
from transformers import BitsAndBytesConfig as TransformersBitsAndBytesConfig
from transformers import TorchAoConfig as TransformersTorchAoConfig

from .errors import UsageError, require

SCHEMES = {
    "int8": "torchao int8 weight-only (CPU and CUDA)",
    "nf4": "bitsandbytes 4-bit NF4 with double quantisation (CUDA)",
    "fp8": "torchao float8 weight-only (CUDA, compute capability 8.9 or newer)",
}
PACKAGES = {"int8": "torchao", "fp8": "torchao", "nf4": "bitsandbytes", "bnb": "bitsandbytes"}


def add_quantization_args(parser, base="the frozen base model"):
    """The quantisation flags, for a script whose ``base`` (e.g. "the UNet") is frozen."""
    group = parser.add_argument_group("quantised base")
    group.add_argument("--quantize_base", choices=list(SCHEMES), default=None,
                       help=f"load {base} quantised: " + "; ".join(f"{name}: {what}" for name, what in SCHEMES.items()))
    group.add_argument("--bnb_quantization_config_path", default=None,
                       help=f"a JSON file of bitsandbytes options (BitsAndBytesConfig's arguments) to load {base} with")
    group.add_argument("--quantize_text_encoders", action="store_true",
                       help="quantise the frozen text encoders the same way")


def scheme_of(args):
    """The quantisation scheme the flags ask for: a `SCHEMES` name, "bnb" for a bitsandbytes JSON file, or None."""
    if args.bnb_quantization_config_path:
        return "bnb"
    return args.quantize_base


def check_quantization_args(args, cuda_capability=None):
    """Stop with one line, before any weights load, if this machine cannot run the asked scheme.

    ``cuda_capability`` is the GPU's ``(major, minor)``, by default this machine's (None without CUDA).
    """
    if args.bnb_quantization_config_path:
        require(args.quantize_base is None, "--quantize_base", args.quantize_base,
                "no --quantize_base beside --bnb_quantization_config_path")
        bnb_options(args.bnb_quantization_config_path)
    scheme = scheme_of(args)
    require(scheme is not None or not args.quantize_text_encoders, "--quantize_text_encoders", True,
            "--quantize_base or --bnb_quantization_config_path to say how")
    if scheme is None:
        return
    flag = "--bnb_quantization_config_path" if scheme == "bnb" else "--quantize_base"
    value = args.bnb_quantization_config_path if scheme == "bnb" else scheme
    package = PACKAGES[scheme]
    require(importlib.util.find_spec(package) is not None, flag, value,
            f"the {package} package (pip install {package}, or pip install -e '.[quantization]')")
    if cuda_capability is None and torch.cuda.is_available():
        cuda_capability = torch.cuda.get_device_capability()
    if scheme in ("nf4", "bnb"):
        require(cuda_capability is not None, flag, value, "a CUDA GPU (bitsandbytes quantisation runs on CUDA)")
    if scheme == "fp8":
        require(cuda_capability is not None and tuple(cuda_capability) >= (8, 9), flag, value,
                "a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper)")


def bnb_options(path):
    """The bitsandbytes options of the JSON file ``path``: a dict of BitsAndBytesConfig's arguments."""
    flag = "--bnb_quantization_config_path"
    try:
        options = json.loads(Path(path).read_text())
    except OSError:
        raise UsageError(flag, path, "an existing JSON file") from None
    except ValueError as error:
        raise UsageError(flag, path, f"a JSON file ({error})") from None
    require(isinstance(options, dict), flag, path, "a JSON object of BitsAndBytesConfig's arguments")
    return options


def quantization_config(args, weight_dtype, base, text_encoders=()):
    """diffusers' ``PipelineQuantizationConfig`` that quantises the components named ``base`` and, with
    ``--quantize_text_encoders``, those named ``text_encoders`` (transformers models) as they load; None
    without a scheme. Computation runs in ``weight_dtype``."""
    scheme = scheme_of(args)
    if scheme is None:
        return None
    if scheme in ("int8", "fp8"):
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig  # optional: only for these

        torchao_type = Int8WeightOnlyConfig if scheme == "int8" else Float8WeightOnlyConfig
    else:
        options = (bnb_options(args.bnb_quantization_config_path) if scheme == "bnb" else
                   {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                    "bnb_4bit_compute_dtype": weight_dtype})

    def config_for(is_transformers_model):
        if scheme in ("int8", "fp8"):
            return (TransformersTorchAoConfig if is_transformers_model else TorchAoConfig)(torchao_type())
        return (TransformersBitsAndBytesConfig if is_transformers_model else BitsAndBytesConfig)(**options)

    mapping = {name: config_for(False) for name in base}
    if args.quantize_text_encoders:
        mapping.update({name: config_for(True) for name in text_encoders})
    return PipelineQuantizationConfig(quant_mapping=mapping)


def is_quantized(module):
    """Whether ``module`` was loaded quantised (diffusers and transformers models say so alike)."""
    return bool(getattr(module, "is_quantized", False))


def follow_autocast(module):
    """Make the quantised linear layers of ``module`` take their input in autocast's dtype, as a plain linear
    layer does: torchao's quantised weights compute through ``__torch_function__``, before autocast would cast
    the input, so an fp32 activation (the scheduler's latents, a timestep embedding) would stay fp32 and meet
    half-precision weights downstream."""
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and type(layer.weight) is not torch.nn.Parameter:
            layer.register_forward_pre_hook(input_in_autocast_dtype)


def input_in_autocast_dtype(layer, args):
    """A forward pre-hook: the first argument, if floating point, in the autocast dtype of its device, when
    autocast is on there."""
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        device_type = args[0].device.type
        if torch.is_autocast_enabled(device_type):
            return (args[0].to(torch.get_autocast_dtype(device_type)), *args[1:])
    return None
