"""What every ControlNet script shares, whatever the base model and its denoiser (a UNet: SD 1.x, SDXL; a
transformer: SD3, FLUX.1, ...).

Its flags, the validation (prompt, conditioning image) pairs, the ControlNet pipeline built once (with a ControlNet
made from the loaded denoiser by the family's ``from_denoiser``), the residual cast, the validator showing each
conditioning image beside the samples, and how to load what it trained.

The base model's own conditioning (text encoders, time ids, the conditioning image's latents, ...) stays in each
script.
"""

import inspect
import json
import math
from pathlib import Path

import torch
from diffusers import ControlNetModel

from .data.images import UNREADABLE_IMAGE_ERRORS, read_image
from .errors import UsageError, require
from .outputs.hub import how_to_load
from .pipeline import load_pipeline
from .quantization import add_quantization_args
from .validation import make_validator

HOW_TO_LOAD = """
from diffusers import {controlnet_class}, {imports}
from diffusers.utils import load_image

controlnet = {controlnet_class}.from_pretrained("{output_dir}")  # or "{output_dir}/ema" for the EMA weights
pipe = {pipeline_class}.from_pretrained("{base_model}", controlnet=controlnet{load_options})
image = pipe("{prompt}", {conditioning_argument}=load_image("{conditioning_image}")).images[0]
"""

# What a ControlNet returns and its denoiser reads, by the denoiser's argument names: the UNet's residuals, SD3's,
# FLUX.1's and Qwen-Image's block samples (a list), Z-Image's (a dict by block index).
RESIDUAL_ARGUMENTS = ("down_block_additional_residuals", "mid_block_additional_residual",
                      "block_controlnet_hidden_states", "controlnet_block_samples", "controlnet_single_block_samples")

# Channels of the conditioning embedding's blocks; each block after the first halves the resolution.
CONDITIONING_EMBEDDING_CHANNELS = (16, 32, 96, 256)


def add_controlnet_args(parser, denoiser="UNet"):
    controlnet = parser.add_argument_group("ControlNet")
    controlnet.add_argument("--controlnet_model_name_or_path", default=None,
                            help=f"ControlNet to start from (default: one made from the {denoiser}'s first layers)")
    add_conditioning_args(controlnet)
    add_quantization_args(parser, base=f"the frozen {denoiser}")


def add_conditioning_image_args(group):
    """The conditioning images' flags, shared by every script that trains on (image, conditioning image, caption)
    triples (the ControlNet, T2I-Adapter and Control scripts): the dataset's column and the validation images."""
    group.add_argument("--conditioning_image_column", default="conditioning_image")
    group.add_argument("--validation_image", nargs="+", default=None,
                       help="conditioning images: one per --validation_prompt, one for all prompts, "
                            "or several for one prompt")


def add_conditioning_args(group):
    """`add_conditioning_image_args`, and upstream's --set_grads_to_none of the ControlNet and T2I-Adapter scripts."""
    add_conditioning_image_args(group)
    group.add_argument("--set_grads_to_none", action="store_true",
                       help="accepted for upstream's commands: the gradients are always freed (set to None) "
                            "between steps")


def check_controlnet_args(args, controlnet_class=ControlNetModel):
    """A local ``--controlnet_model_name_or_path`` is a folder of the script's ``controlnet_class`` (its config.json
    names it), before anything loads. Returns that folder's configuration (None for a hub id or none), for a script's
    own checks."""
    path = args.controlnet_model_name_or_path
    if not path or not Path(path).exists():
        return None
    expected = f"a {controlnet_class.__name__} folder (with config.json) or a hub id"
    config_file = Path(path) / "config.json"
    require(config_file.is_file(), "--controlnet_model_name_or_path", path, expected)
    try:
        config = json.loads(config_file.read_text())
    except ValueError:
        config = None
    class_name = config.get("_class_name") if isinstance(config, dict) else None
    require(class_name == controlnet_class.__name__, "--controlnet_model_name_or_path", path,
            f"{expected}; its config.json names {class_name!r}")
    return config


def dataset_columns(args):
    """The flags naming the columns a ControlNet dataset must have, for ``load_train_dataset``."""
    return {"--image_column": args.image_column, "--caption_column": args.caption_column,
            "--conditioning_image_column": args.conditioning_image_column}


def load_validation_pairs(args):
    """``[(prompt, conditioning image)]``: prompts and images paired one to one, or one of them shared by all."""
    prompts, paths = args.validation_prompt or [], args.validation_image or []
    paired = len(prompts) == len(paths) or 1 in (len(prompts), len(paths))
    if not paired or bool(prompts) != bool(paths):
        raise UsageError("--validation_image", paths, f"one conditioning image per --validation_prompt "
                         f"({len(prompts)}), or one image for all prompts")
    images = {}
    for path in paths:
        try:
            images[path] = read_image(path)
        except UNREADABLE_IMAGE_ERRORS:
            raise UsageError("--validation_image", path, "an existing image file") from None
    count = max(len(prompts), len(paths))
    return [(prompts[i % len(prompts)], images[paths[i % len(paths)]]) for i in range(count)]


def controlnet_from_unet(unet, base):
    """A ControlNet copying ``unet``'s encoder, whose conditioning embedding shrinks the conditioning image
    as much as the ``base`` pipeline's VAE shrinks the image (8x for SD and SDXL: four blocks; 2x for the tiny test
    VAE: two). `load_controlnet_pipeline`'s ``from_denoiser`` for the UNet families."""
    blocks = int(math.log2(base.vae_scale_factor)) + 1
    return ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=CONDITIONING_EMBEDDING_CHANNELS[:blocks])


def denoiser_name(pipeline_class):
    """The component of ``pipeline_class``'s pipelines that a ControlNet copies and steers: ``unet`` or
    ``transformer``."""
    return "unet" if "unet" in inspect.signature(pipeline_class.__init__).parameters else "transformer"


def conditioning_argument(pipe):
    """The name under which ``pipe`` takes the conditioning image: ``control_image`` (SD3, FLUX.1, ...) or
    ``image`` (SD 1.x, SDXL)."""
    return "control_image" if "control_image" in inspect.signature(pipe.__call__).parameters else "image"


def load_controlnet_pipeline(pipeline_class, base_pipeline_class, args, weight_dtype, quantization=None,
                             controlnet_class=ControlNetModel, from_denoiser=controlnet_from_unet, **components):
    """The ControlNet pipeline, loaded once, its frozen components in ``weight_dtype`` (``quantization``, if any,
    quantises them as they load) and the ControlNet in fp32: with ``--controlnet_model_name_or_path`` that
    ``controlnet_class`` is a component of the one load; without it, the base pipeline loads and the ControlNet that
    ``from_denoiser(denoiser, base pipeline)`` makes from its denoiser (UNet or transformer) joins its components.
    ``components`` replace loaded ones (e.g. a VAE)."""
    if args.controlnet_model_name_or_path:
        controlnet = controlnet_class.from_pretrained(args.controlnet_model_name_or_path)
        return load_pipeline(pipeline_class, args, weight_dtype, quantization=quantization, controlnet=controlnet,
                             **components)
    # The ControlNet copies the denoiser's weights exactly, so from an fp32 denoiser: the pipeline's own, which
    # `prepare_components` casts to the weight dtype before it moves; or, when the pipeline's is quantised,
    # one read from the same folder for the copy alone.
    name = denoiser_name(base_pipeline_class)
    trained_in_fp32 = [] if quantization else [name]
    base = load_pipeline(base_pipeline_class, args, weight_dtype, trained_in_fp32, quantization, **components)
    denoiser = getattr(base, name)
    if quantization:
        denoiser = type(denoiser).from_pretrained(args.pretrained_model_name_or_path, subfolder=name,
                                                  revision=args.revision, variant=args.variant)
    controlnet = from_denoiser(denoiser, base)
    # The base pipeline's options that the ControlNet pipeline shares (requires_safety_checker,
    # force_zeros_for_empty_prompt, ...) carry over with its components.
    accepted = inspect.signature(pipeline_class.__init__).parameters
    options = {name: value for name, value in base.config.items() if name in accepted and name not in base.components}
    pipe = pipeline_class(**base.components, controlnet=controlnet, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype)
    if isinstance(value, dict):
        return {key: _cast(item, dtype) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cast(item, dtype) for item in value]
    return value


def cast_residuals_to_denoiser_dtype(denoiser, args, kwargs):
    """A denoiser forward pre-hook: the ControlNet's residuals (`RESIDUAL_ARGUMENTS`) in the frozen denoiser's dtype,
    in training and validation alike.

    Under mixed precision the prepared ControlNet returns fp32 (accelerate's output wrapper); CUDA's
    autocast copes with fp32 residuals in a half-precision denoiser, the CPU's does not.
    """
    for name in RESIDUAL_ARGUMENTS:
        if kwargs.get(name) is not None:
            kwargs[name] = _cast(kwargs[name], denoiser.dtype)
    return args, kwargs


def conditioning_latents(frozen, conditioning_pixels):
    """The VAE's latents of a batch of conditioning images (``conditioning_pixels`` in [0, 1], the ControlNet
    convention of `data.images.ImageWithConditioningTransform`), before the VAE's scaling: encoded now by
    ``frozen`` (a `data.frozen_encoders.FrozenEncoders`) from [-1, 1], as the transformer ControlNet and Control
    pipelines' image processors hand them to the VAE, and sampled as those pipelines sample them."""
    return frozen.encode(conditioning_pixels * 2 - 1)


def make_controlnet_validator(args, pipe, accelerator, validation_pairs, **kwargs):
    """`make_validator` rendering each prompt with its conditioning image, which is shown beside the samples."""
    prompts, conditioning_images = zip(*validation_pairs) if validation_pairs else ([], [])
    prompt_kwargs = [{conditioning_argument(pipe): image} for image in conditioning_images]
    return make_validator(args, pipe, accelerator, prompts, prompt_kwargs=prompt_kwargs,
                          conditioning_images=conditioning_images, **kwargs)


def controlnet_how_to_load(args, pipe, **fields):
    """The model card's loading code for the trained ControlNet (``pipe.controlnet``'s class) in ``pipe``'s class,
    with the first ``--validation_image``."""
    conditioning_image = args.validation_image[0] if args.validation_image else "conditioning.png"
    return how_to_load(HOW_TO_LOAD, args, pipe, conditioning_image=conditioning_image,
                       controlnet_class=type(pipe.controlnet).__name__,
                       conditioning_argument=conditioning_argument(pipe), **fields)
