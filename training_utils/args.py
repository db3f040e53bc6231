"""Command-line flags shared by every script, and the checks that run before any weights load.

A script's ``parse_args`` parses, checks (`check_args`, then the checks of its own groups), and last fills in the
defaults that depend on other flags (`fill_dependent_defaults`): the checks change nothing.

Flag names follow the diffusers example scripts so that their commands work here. A bad value stops the run with one
line on stderr naming the flag, the value and what was expected::

    error: --resolution=500: expected a positive multiple of 8
"""

import importlib.util
import inspect
import json
import math
import os
import sys
from pathlib import Path

import torch
from accelerate.utils import parse_flag_from_env

from .adapters.config import add_adapter_args, check_adapter_args, fill_adapter_settings
from .adapters.convert import DIFFUSERS, FORMAT_USERS
from .block_swap import add_block_swap_args, check_block_swap_args
from .compile import add_compile_args
from .data.flags import add_data_args
from .errors import require
from .families.registry import formats_for
from .outputs.checkpoint_folders import check_resume_from_checkpoint
from .outputs.folder import check_output_dir
from .outputs.writing import write_problem
from .parser import NOT_CARRIED, TrainingArgumentParser, flag_name
from .pipeline import is_hub_id
from .memory_plan import add_memory_plan_args, check_memory_plan_args
from .quantization import add_quantization_args, check_quantization_args


def training_parser(description, validation_inference_steps=30, resolution=512, interpolation="bilinear",
                    tracker_project_name=None, optional_pretrained_model=None, pretrained_model_aliases=()):
    """A parser with the flags every script shares; scripts add their own on top, and give the defaults that their
    upstream counterparts give (``tracker_project_name``: by default the script's file name). The upstream flags
    that no script here carries (`NOT_CARRIED`) are refused with their reason. A script that can start without a
    pretrained pipeline (a model trained from scratch) says what ``--pretrained_model_name_or_path`` then is in
    ``optional_pretrained_model`` (its help): the flag is optional there. ``pretrained_model_aliases`` are upstream's
    other names for ``--pretrained_model_name_or_path`` (Kandinsky's ``--pretrained_decoder_model_name_or_path``)."""
    parser = TrainingArgumentParser(description=description, refused=NOT_CARRIED)

    model = parser.add_argument_group("model")
    model.add_argument("--pretrained_model_name_or_path", *pretrained_model_aliases, required=optional_pretrained_model is None,
                       help=optional_pretrained_model or "diffusers pipeline folder or hub id")
    model.add_argument("--revision", default=None, help="hub revision of the pretrained pipeline")
    model.add_argument("--variant", default=None, help="weights variant to load, e.g. fp16")

    add_data_args(parser, resolution, interpolation)

    train = parser.add_argument_group("training")
    train.add_argument("--output_dir", default="output")
    train.add_argument("--overwrite_output_dir", action="store_true",
                       help="clear what another run wrote into --output_dir first (otherwise such a folder is refused)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--train_batch_size", type=int, default=1)
    train.add_argument("--num_train_epochs", type=int, default=1)
    train.add_argument("--max_train_steps", type=int, default=None, help="overrides --num_train_epochs")
    train.add_argument("--gradient_accumulation_steps", type=int, default=1)
    train.add_argument("--gradient_checkpointing", action="store_true")
    train.add_argument("--learning_rate", type=float, default=1e-4)
    train.add_argument("--scale_lr", action="store_true",
                       help="multiply the lr by batch size, accumulation and processes")
    train.add_argument("--lr_scheduler", default="constant",
                       choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                                "constant_with_warmup"])
    train.add_argument("--lr_warmup_steps", type=int, default=0)
    train.add_argument("--use_8bit_adam", action="store_true")
    train.add_argument("--adam_beta1", type=float, default=0.9)
    train.add_argument("--adam_beta2", type=float, default=0.999)
    train.add_argument("--adam_weight_decay", type=float, default=1e-2)
    train.add_argument("--adam_epsilon", type=float, default=1e-8)
    train.add_argument("--max_grad_norm", type=float, default=1.0)
    train.add_argument("--allow_tf32", action="store_true")
    train.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    add_compile_args(train)

    checkpoints = parser.add_argument_group("checkpoints")
    checkpoints.add_argument("--checkpointing_steps", type=int, default=500)
    checkpoints.add_argument("--checkpoints_total_limit", type=int, default=None)
    checkpoints.add_argument("--resume_from_checkpoint", default=None,
                             help='"latest", a checkpoint name under --output_dir, or a path')
    checkpoints.add_argument("--resume_with_changed_args", action="store_true",
                             help="resume although a flag that decides the training trajectory changed (the run is "
                                  "then no longer the one the checkpoint came from)")

    logging = parser.add_argument_group("logging and hub")
    logging.add_argument("--logging_dir", default="logs", help="tracker folder, relative to --output_dir")
    logging.add_argument("--report_to", default="tensorboard", help='"tensorboard", "wandb", "all" or "none"')
    logging.add_argument("--tracker_project_name", default=tracker_project_name or Path(sys.argv[0]).stem,
                         help="the trackers' project name (default: the script's name)")
    logging.add_argument("--push_to_hub", action="store_true")
    logging.add_argument("--hub_token", default=None)
    logging.add_argument("--hub_model_id", default=None)

    validation = parser.add_argument_group("validation")
    validation.add_argument("--validation_prompt", "--validation_prompts", dest="validation_prompt", nargs="+",
                            default=None, help="one or more prompts")
    validation.add_argument("--num_validation_images", type=int, default=4, help="images per prompt and variant")
    validation.add_argument("--validation_steps", type=int, default=None,
                            help="validate every N steps and at the final step "
                                 "(default: 100 unless --validation_epochs)")
    validation.add_argument("--validation_epochs", type=int, default=None)
    validation.add_argument("--validation_inference_steps", type=int, default=validation_inference_steps)
    validation.add_argument("--validation_height", type=int, default=None,
                            help="default: --resolution, or with buckets the most common bucket's")
    validation.add_argument("--validation_width", type=int, default=None,
                            help="default: --resolution, or with buckets the most common bucket's")
    validation.add_argument("--validation_guidance_scale", type=float, default=None,
                            help="the guidance scale validation renders with (default: the pipeline's, or the one "
                                 "the script renders with)")
    validation.add_argument("--validation_true_cfg_scale", type=float, default=None,
                            help="the true classifier-free guidance scale validation renders with, against the empty "
                                 "prompt, for pipelines that take one (Qwen-Image, FLUX.1; default: the script's)")

    ema = parser.add_argument_group("EMA")
    ema.add_argument("--use_ema", action="store_true", help="keep an EMA of the trained parameters")
    ema.add_argument("--ema_decay", type=float, default=0.9999, help="maximum decay, in [0, 1)")
    ema.add_argument("--ema_update_every", type=int, default=1, help="update every K optimizer steps")
    ema.add_argument("--ema_device", default="accelerator", choices=["accelerator", "cpu"])
    ema.add_argument("--offload_ema", dest="ema_device", action="store_const", const="cpu",
                     help="upstream's name for --ema_device cpu")
    ema.add_argument("--foreach_ema", action="store_true",
                     help="accepted for upstream's commands: the EMA always updates with torch's multi-tensor "
                          "(foreach) operations")
    ema.add_argument("--ema_warmup", action="store_true", help="ramp the decay up as 1 - (1 + step/inv_gamma)^-power")
    ema.add_argument("--ema_inv_gamma", type=float, default=1.0)
    ema.add_argument("--ema_power", type=float, default=2 / 3)
    ema.add_argument("--ema_posthoc_sigma_rels", type=float, nargs="+", default=None,
                     help="track power-function EMAs of these relative lengths (two or more, e.g. 0.05 0.10) "
                          "and snapshot them, to choose the EMA length after training (EDM2 post-hoc EMA)")
    ema.add_argument("--ema_posthoc_snapshot_steps", type=int, default=None,
                     help="snapshot the post-hoc EMA profiles every N steps and at the end (default: 20 per run)")
    validation.add_argument("--validation_sigma_rels", type=float, nargs="+", default=None,
                            help="post-hoc EMA lengths to render at the final validation (default: the tracked ones)")
    return parser


def add_lora_args(parser, pipeline_class, train_text_encoder=False):
    """The adapter's flags (`adapters.config.add_adapter_args`: LoRA by default), and those of a quantised base
    (`quantization.add_quantization_args`): an adapter trains beside a frozen base, which may be quantised; and the
    memory plan's (`memory_plan.add_memory_plan_args`). The file
    layouts offered are those that apply to ``pipeline_class``'s family (`families.registry.formats_for`). With
    ``train_text_encoder``, the text encoders may train too, with an optimizer setting of their own (upstream's flags;
    SD3's script gives them upstream's defaults)."""
    adapter = parser.add_argument_group("adapter")
    add_adapter_args(adapter)
    if train_text_encoder:
        add_text_encoder_training_args(adapter, "also train the adapter on the text encoder(s)")
    formats = formats_for(pipeline_class.__name__)
    adapter.add_argument("--export_formats", nargs="+", choices=[DIFFUSERS, *formats], default=[DIFFUSERS],
                         help=f"the file layouts written beside each other, for every adapter written (raw, EMA, "
                              f"post-hoc, checkpoints): {DIFFUSERS} (always: the adapter's own, which "
                              f"load_lora_weights or peft reads)"
                              + "".join(f", {name} ({FORMAT_USERS[name]})" for name in formats))
    if "kohya" in formats:
        adapter.add_argument("--output_kohya_format", action="store_true",
                             help="upstream's name for adding kohya to --export_formats")
    add_quantization_args(parser)
    if "transformer" in inspect.signature(pipeline_class.__init__).parameters:  # the transformer families
        add_block_swap_args(parser.add_argument_group("memory"))
    add_memory_plan_args(parser)


def add_text_encoder_training_args(group, train_help):
    """``--train_text_encoder`` (``train_help`` says what trains), and the text encoders' optimizer settings of their
    own, as upstream's transformer DreamBooth scripts have them (LoRA and full fine-tune alike)."""
    group.add_argument("--train_text_encoder", action="store_true", help=train_help)
    group.add_argument("--text_encoder_lr", type=float, default=None,
                       help="the text encoders' learning rate (default: --learning_rate)")
    group.add_argument("--adam_weight_decay_text_encoder", type=float, default=None,
                       help="the text encoders' weight decay (default: --adam_weight_decay)")


def add_lora_layers_arg(parser, default, example):
    """``--lora_layers``: the linear layers of the transformer that get an adapter, by name (upstream's flag)."""
    parser.add_argument("--lora_layers", default=default,
                        help=f"comma-separated names of the transformer's linear layers to adapt (or the ends of "
                             f"their names, e.g. {example})")


def add_aliases(parser, aliases):
    """Each ``{flag: alias}`` of ``aliases``: ``alias`` another spelling of ``parser``'s ``flag`` (upstream's name for
    the same argument)."""
    for flag, alias in aliases.items():
        action = parser._option_string_actions[flag]
        action.option_strings.append(alias)
        parser._option_string_actions[alias] = action


def comma_separated(value):
    """The names in a comma-separated flag value, stripped."""
    return [name.strip() for name in value.split(",")]


def export_formats(args):
    """The LoRA file layouts ``--export_formats`` and ``--output_kohya_format`` ask for, diffusers' first."""
    asked = [*args.export_formats, *(["kohya"] if getattr(args, "output_kohya_format", False) else [])]
    return list(dict.fromkeys([DIFFUSERS, *asked]))


def add_diffusion_loss_args(parser):
    """The epsilon/v-prediction loss options of the UNet scripts."""
    loss = parser.add_argument_group("loss")
    loss.add_argument("--prediction_type", default=None, choices=["epsilon", "v_prediction"],
                      help="default: what the pipeline's scheduler was trained with")
    loss.add_argument("--snr_gamma", type=float, default=None, help="min-SNR loss weighting gamma (5.0 is usual)")
    loss.add_argument("--noise_offset", type=float, default=0.0)


def add_cache_args(parser):
    """How the frozen encoders' outputs are cached (text embeddings always are) and where the encoders live."""
    cache = parser.add_argument_group("caching")
    cache.add_argument("--cache_latents", action="store_true",
                       help="encode the images with the VAE once before training (without --center_crop, each "
                            "image's random crop is drawn once, then)")
    cache.add_argument("--feature_cache_dir", default=None,
                       help="keep the cached text embeddings (and latents) on disk here, read memory-mapped; a later "
                            "run with the same model, data and settings reuses them without running the encoders")
    cache.add_argument("--offload", action="store_true",
                       help="keep the VAE off the accelerator between steps too when it encodes in every step "
                            "(the text encoders, and a VAE whose latents are cached, always are)")


def check_pretrained_path(value, flag="--pretrained_model_name_or_path", read_weights=True):
    """A pipeline folder (with ``read_weights``, its safetensors files whole) or a hub id."""
    path = Path(value).expanduser()
    if path.exists():
        require(path.is_dir() and (path / "model_index.json").is_file(), flag, value,
                "a diffusers pipeline folder (with model_index.json) or a hub id")
        for weights in sorted(path.rglob("*.safetensors")) if read_weights else ():
            problem = safetensors_problem(weights)
            require(problem is None, flag, value, f"a pipeline whose weight files are whole: {weights} {problem}")
    else:
        require(is_hub_id(value), flag, value, "an existing diffusers pipeline folder or a hub id (owner/name)")


def safetensors_problem(path):
    """What is wrong with the safetensors file ``path`` (an unreadable header, a size other than the header
    says), or None. Reads the header only."""
    with open(path, "rb") as file:
        length_bytes = file.read(8)
        length = int.from_bytes(length_bytes, "little") if len(length_bytes) == 8 else None
        size = os.fstat(file.fileno()).st_size
        if length is None or length > size - 8:
            return "has no readable header (truncated or not a safetensors file)"
        try:
            header = json.loads(file.read(length))
        except ValueError:
            return "has a corrupt header"
    expected = 8 + length + max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"),
                                default=0)
    if size != expected:
        return f"is {size} bytes, but its header describes {expected} (truncated or damaged)"
    return None


def check_posthoc_args(args):
    max_sigma_rel = 12 ** -0.5  # the longest a power-function EMA can be
    sigma_rels = args.ema_posthoc_sigma_rels
    if sigma_rels is not None:
        require(len(set(sigma_rels)) >= 2, "--ema_posthoc_sigma_rels", sigma_rels, "two or more distinct values")
    for flag in ("ema_posthoc_sigma_rels", "validation_sigma_rels"):
        for value in getattr(args, flag) or ():
            require(0 < value < max_sigma_rel, f"--{flag}", value,
                    f"relative EMA lengths in (0, {max_sigma_rel:.4f})")
    require(args.validation_sigma_rels is None or sigma_rels is not None, "--validation_sigma_rels",
            args.validation_sigma_rels,
            "--ema_posthoc_sigma_rels as well (the sweep is synthesized from its snapshots)")
    require(args.ema_posthoc_snapshot_steps is None or args.ema_posthoc_snapshot_steps > 0,
            "--ema_posthoc_snapshot_steps", args.ema_posthoc_snapshot_steps, "a positive integer")


def check_args(args, check_model=check_pretrained_path):
    """The checks every script shares. Call right after parsing, before anything loads; `fill_dependent_defaults`
    follows the checks. ``check_model`` checks ``--pretrained_model_name_or_path`` (a pipeline folder or hub id; a
    script loading another kind of folder gives its own check)."""
    check_output_dir(args)
    # A memory plan reads no weights file, not even a header.
    if args.pretrained_model_name_or_path is not None:  # None only where the flag is optional (`training_parser`)
        check_model(args.pretrained_model_name_or_path, read_weights=not getattr(args, "print_memory_plan", False))
    require(args.resolution > 0 and args.resolution % 8 == 0, "--resolution", args.resolution,
            "a positive multiple of 8")
    for flag in ("train_batch_size", "num_train_epochs", "gradient_accumulation_steps", "checkpointing_steps",
                 "validation_inference_steps", "ema_update_every"):
        require(getattr(args, flag) > 0, f"--{flag}", getattr(args, flag), "a positive integer")
    require(args.num_validation_images >= 0, "--num_validation_images", args.num_validation_images,
            "a non-negative integer (0 renders no validation images)")
    for flag in ("max_train_steps", "max_train_samples", "validation_steps", "validation_epochs",
                 "checkpoints_total_limit"):
        value = getattr(args, flag)
        require(value is None or value > 0, f"--{flag}", value, "a positive integer")
    require(args.repeats > 0, "--repeats", args.repeats, "a positive integer")
    # Every model here needs multiples of 8 at least; the model's own multiple is checked once its config is read.
    for height, width in args.aspect_ratio_buckets or ():
        require(height % 8 == 0 and width % 8 == 0, "--aspect_ratio_buckets", f"{height},{width}",
                "sides that are multiples of 8")
    require(0 <= args.caption_dropout <= 1, flag_name(args, "caption_dropout"), args.caption_dropout,
            "a number in [0, 1]")
    for flag in ("validation_height", "validation_width"):
        value = getattr(args, flag)
        require(value is None or (value > 0 and value % 8 == 0), f"--{flag}", value, "a positive multiple of 8")
    require(args.lr_warmup_steps >= 0, "--lr_warmup_steps", args.lr_warmup_steps, "a non-negative integer")
    require(args.dataloader_num_workers >= 0, "--dataloader_num_workers", args.dataloader_num_workers,
            "a non-negative integer")
    require(args.learning_rate > 0 and math.isfinite(args.learning_rate), "--learning_rate", args.learning_rate,
            "a positive number")
    text_encoder_lr = getattr(args, "text_encoder_lr", None)
    require(text_encoder_lr is None or (text_encoder_lr > 0 and math.isfinite(text_encoder_lr)), "--text_encoder_lr",
            text_encoder_lr, "a positive number")
    require(0 <= args.ema_decay < 1, "--ema_decay", args.ema_decay, "a number in [0, 1)")
    require(args.max_grad_norm > 0, "--max_grad_norm", args.max_grad_norm, "a positive number")
    require(not args.use_8bit_adam or importlib.util.find_spec("bitsandbytes") is not None, "--use_8bit_adam", True,
            "bitsandbytes installed (pip install bitsandbytes)")
    if hasattr(args, "adapter"):
        check_adapter_args(args)
    if getattr(args, "lora_layers", None) is not None:
        require(all(comma_separated(args.lora_layers)), "--lora_layers", args.lora_layers,
                "comma-separated layer names")
    if getattr(args, "snr_gamma", None) is not None:
        require(args.snr_gamma > 0, "--snr_gamma", args.snr_gamma, "a positive number")
    feature_cache_dir = getattr(args, "feature_cache_dir", None)
    if feature_cache_dir is not None:
        require(not Path(feature_cache_dir).is_file(), "--feature_cache_dir", feature_cache_dir,
                "a folder (or a path where one can be made), not a file")
        problem = write_problem(feature_cache_dir)
        require(problem is None, "--feature_cache_dir", feature_cache_dir, f"a folder this run can write ({problem})")
    # accelerate launch always sets ACCELERATE_USE_CPU, to "False" unless --cpu: parse it, don't test presence.
    on_cuda = torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU")
    require(args.mixed_precision != "fp16" or on_cuda,
            "--mixed_precision", args.mixed_precision, "a CUDA device for fp16 (use bf16 or no on the CPU)")
    require(args.mixed_precision != "bf16" or not on_cuda or torch.cuda.is_bf16_supported(),
            "--mixed_precision", args.mixed_precision, "a GPU with bf16 support (use fp16 on this one)")
    require(args.ema_inv_gamma > 0, "--ema_inv_gamma", args.ema_inv_gamma, "a positive number")
    require(args.ema_power > 0, "--ema_power", args.ema_power, "a positive number")
    check_posthoc_args(args)
    if hasattr(args, "quantize_base"):
        check_quantization_args(args)
    if hasattr(args, "blocks_to_swap"):
        check_block_swap_args(args)
    if hasattr(args, "gpu_memory_gb"):
        check_memory_plan_args(args)
    if args.validation_prompt is not None:
        require(all(prompt.strip() for prompt in args.validation_prompt), "--validation_prompt",
                args.validation_prompt, "non-empty prompts")
    check_resume_from_checkpoint(args.resume_from_checkpoint, args.output_dir)
    # A token in the tracker's logged config would leak it to whoever sees the run.
    require(args.hub_token is None or args.report_to not in ("wandb", "all"), "--hub_token", "<hidden>",
            "no --hub_token with --report_to wandb/all (log in with `hf auth login` instead)")


def fill_dependent_defaults(args):
    """Fill in the defaults that depend on other flags, once the flags are checked: ``--validation_steps`` 100
    unless ``--validation_epochs`` is given, and, in a script with adapter flags (`add_lora_args`), the adapter's kind
    and settings (`fill_adapter_settings`)."""
    if args.validation_steps is None and args.validation_epochs is None:
        args.validation_steps = 100
    if hasattr(args, "adapter"):
        fill_adapter_settings(args)
