"""The adapter that trains beside the frozen base: its kind (``--adapter``), its settings' flags, and peft's config.

Every kind is peft's own implementation:

- ``lora``: `LoraConfig`, upstream's adapter;
- ``dora``: `LoraConfig` with ``use_dora`` (a magnitude vector per output row beside the low-rank update; upstream's
  ``--use_dora``);
- ``lokr``: `LoKrConfig`, the Kronecker product of two factors, the second (and with ``--lokr_decompose_both`` the
  first) low-rank;
- ``loha``: `LoHaConfig`, the Hadamard (element-wise) product of two low-rank products;
- ``oft``: `OFTConfig`, a block-diagonal rotation of each layer's input, which keeps the base's hyperspherical energy.

Each kind has the settings of `SETTINGS` that name it; one that it lacks, given with it, stops the run in one line
(`check_adapter_args`); those not given get their kind's default (`fill_adapter_settings`). Defaults are peft's and
the LyCORIS guidelines': LoRA and DoRA rank 4 and alpha = rank, as upstream's scripts; LoKr rank 8, alpha = rank,
factor -1 (peft's defaults, LyCORIS's "small LoKr"); LoHa rank 8 (peft's; LyCORIS: 32 at most) and alpha half the
rank (LyCORIS: from 1 to half the rank); OFT blocks of 32 (peft's).
"""

import math

import torch
from peft import LoHaConfig, LoKrConfig, LoraConfig, OFTConfig
from peft.tuners.tuners_utils import check_target_module_exists

from ..errors import require

ADAPTERS = {"lora": "LoRA", "dora": "DoRA", "lokr": "LoKr", "loha": "LoHa", "oft": "OFT"}
# Each setting's flag (its dest), the adapters that have it, and its default for each: a setting given with an
# adapter that lacks it is refused.
SETTINGS = {
    "rank": {"lora": 4, "dora": 4, "lokr": 8, "loha": 8},
    "lora_alpha": {"lora": None, "dora": None, "lokr": None, "loha": None},
    "lora_dropout": {"lora": 0.0, "dora": 0.0},
    "lokr_factor": {"lokr": -1},
    "lokr_decompose_both": {"lokr": False},
    "oft_block_size": {"oft": 32},
}


def add_adapter_args(group):
    """The flags of the adapter kind and of each kind's settings (default None: a value given is known as given)."""
    group.add_argument("--adapter", choices=list(ADAPTERS), default=None,
                       help="the adapter that trains, peft's: lora (default), dora, lokr, loha or oft")
    group.add_argument("--use_dora", action="store_true", help="upstream's name for --adapter dora")
    group.add_argument("--rank", type=int, default=None,
                       help="the adapter's rank (lora, dora, lokr, loha): default 4 for lora and dora, 8 for lokr and "
                            "loha; a LoKr rank of at least half a factor's larger side keeps that factor whole")
    group.add_argument("--lora_alpha", type=float, default=None,
                       help="the adapter's alpha, its strength alpha / rank (lora, dora, lokr, loha): default the rank "
                            "(half the rank for loha)")
    group.add_argument("--lora_dropout", type=float, default=None, help="dropout on the adapter's input (lora, dora)")
    group.add_argument("--lokr_factor", type=int, default=None,
                       help="LoKr: split each layer's sides into factors near this one (default -1: near the square "
                            "root; 4 to 8 learns more, LyCORIS's 'large LoKr')")
    group.add_argument("--lokr_decompose_both", action="store_const", const=True, default=None,
                       help="LoKr: make the first Kronecker factor low-rank too, not only the second")
    group.add_argument("--oft_block_size", type=int, default=None,
                       help="OFT: the size of the rotated blocks, a divisor of each adapted layer's input width "
                            "(default 32)")


def check_adapter_args(args):
    """Fail on a setting the adapter lacks or a bad value, before any load."""
    require(not args.use_dora or args.adapter in (None, "dora"), "--adapter", args.adapter,
            "dora or nothing beside --use_dora (upstream's name for --adapter dora)")
    adapter = adapter_kind(args)
    for flag, defaults in SETTINGS.items():
        if adapter not in defaults:
            owners = ", ".join(ADAPTERS[name] for name in defaults)
            require(getattr(args, flag) is None, f"--{flag}", getattr(args, flag),
                    f"no --{flag} with --adapter {adapter} (a setting of {owners})")
    if args.rank is not None:
        require(args.rank > 0, "--rank", args.rank, "a positive integer")
    if args.lora_alpha is not None:
        require(0 < args.lora_alpha < math.inf, "--lora_alpha", args.lora_alpha, "a positive number")
    if args.lora_dropout is not None:
        require(0 <= args.lora_dropout < 1, "--lora_dropout", args.lora_dropout, "a number in [0, 1)")
    if args.lokr_factor is not None:
        require(args.lokr_factor == -1 or args.lokr_factor > 0, "--lokr_factor", args.lokr_factor,
                "-1 (near the square root) or a positive integer")
    if args.oft_block_size is not None:
        require(args.oft_block_size > 1, "--oft_block_size", args.oft_block_size, "an integer above 1")


def adapter_kind(args):
    """The adapter the flags ask for: ``--adapter``, dora with ``--use_dora``, lora by default."""
    return "dora" if args.use_dora else args.adapter or "lora"


def fill_adapter_settings(args):
    """Give ``--adapter`` its kind and every setting of that kind not given its default (checked flags): the adapter
    and its settings are what the checkpoints record (`checkpoint_folders.trajectory_flags`)."""
    args.adapter = adapter_kind(args)
    for flag, defaults in SETTINGS.items():
        if args.adapter in defaults and getattr(args, flag) is None:
            setattr(args, flag, defaults[args.adapter])


def adapter_config(args, target_modules):
    """peft's config of the adapter the (checked) flags describe, on ``target_modules``."""
    if args.adapter in ("lora", "dora"):
        return LoraConfig(r=args.rank, lora_alpha=alpha(args), lora_dropout=args.lora_dropout,
                          init_lora_weights="gaussian", use_dora=args.adapter == "dora", target_modules=target_modules)
    if args.adapter == "lokr":
        return LoKrConfig(r=args.rank, alpha=alpha(args), decompose_factor=args.lokr_factor,
                          decompose_both=args.lokr_decompose_both, target_modules=target_modules)
    if args.adapter == "loha":
        return LoHaConfig(r=args.rank, alpha=alpha(args), target_modules=target_modules)
    return OFTConfig(oft_block_size=args.oft_block_size, target_modules=target_modules)


def check_oft_block_size(model, config):
    """Stop in one line, before the adapter is added, where an OFT ``config``'s block size does not divide the input
    width of a layer of ``model`` that it adapts: peft would train that layer with another block size (with a
    warning), while the adapter's files record the one asked for. Names the block sizes that fit every layer."""
    if not isinstance(config, OFTConfig):
        return
    widths = sorted({oft_input_width(module) for name, module in model.named_modules()
                     if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))
                     and check_target_module_exists(config, name)})
    block_size = config.oft_block_size
    fitting = [size for size in range(2, min(widths, default=0) + 1) if all(width % size == 0 for width in widths)]
    require(all(width % block_size == 0 for width in widths), "--oft_block_size", block_size,
            f"a divisor of every adapted layer's input width ({', '.join(map(str, widths))}): "
            f"{', '.join(map(str, fitting)) or 'none above 1; adapt other layers'}")


def oft_input_width(module):
    """The width that OFT splits into blocks: a linear layer's inputs, a convolution's inputs times its kernel."""
    if isinstance(module, torch.nn.Conv2d):
        return module.in_channels * math.prod(module.kernel_size)
    return module.in_features


def alpha(args):
    """``--lora_alpha``, or the adapter's default: the rank (half the rank for LoHa)."""
    if args.lora_alpha is not None:
        return args.lora_alpha
    return args.rank / 2 if args.adapter == "loha" else args.rank
