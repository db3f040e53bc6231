"""What every ControlNet script shares, whatever the base model (SD 1.x, SDXL).

Its flags, the validation (prompt, conditioning image) pairs, the ControlNet pipeline built once, the
residual cast, and how to load what it trained.

The base model's own conditioning (text encoders, time ids, ...) stays in each script.
"""

import inspect
import math
from pathlib import Path

from diffusers import ControlNetModel

from .data.images import UNREADABLE_IMAGE_ERRORS, read_image
from .errors import UsageError, require
from .outputs.hub import how_to_load
from .pipeline import load_pipeline
from .quantization import add_quantization_args
from .validation import make_validator

HOW_TO_LOAD = """
from diffusers import {imports}
from diffusers.utils import load_image

controlnet = ControlNetModel.from_pretrained("{output_dir}")  # or "{output_dir}/ema" for the EMA weights
pipe = {pipeline_class}.from_pretrained("{base_model}", controlnet=controlnet{load_options})
image = pipe("{prompt}", image=load_image("{conditioning_image}")).images[0]
"""

# Channels of the conditioning embedding's blocks; each block after the first halves the resolution.
CONDITIONING_EMBEDDING_CHANNELS = (16, 32, 96, 256)


def add_controlnet_args(parser):
    controlnet = parser.add_argument_group("ControlNet")
    controlnet.add_argument("--controlnet_model_name_or_path", default=None,
                            help="ControlNet to start from (default: a copy of the UNet's encoder)")
    add_conditioning_image_args(controlnet)
    controlnet.add_argument("--set_grads_to_none", action="store_true",
                            help="accepted for upstream's commands: the gradients are always freed (set to None) "
                                 "between steps")
    add_quantization_args(parser, base="the frozen UNet")


def add_conditioning_image_args(group):
    """The conditioning images' flags, shared with the Control scripts (`control`): the dataset's column and the
    validation images."""
    group.add_argument("--conditioning_image_column", default="conditioning_image")
    group.add_argument("--validation_image", nargs="+", default=None,
                       help="conditioning images: one per --validation_prompt, one for all prompts, "
                            "or several for one prompt")


def check_controlnet_args(args):
    path = args.controlnet_model_name_or_path
    if path and Path(path).exists():
        require((Path(path) / "config.json").is_file(), "--controlnet_model_name_or_path", path,
                "a ControlNetModel folder (with config.json) or a hub id")


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


def controlnet_from_unet(unet, vae_scale_factor):
    """A ControlNet copying ``unet``'s encoder, whose conditioning embedding shrinks the conditioning image
    as much as the VAE shrinks the image (8x for SD and SDXL: four blocks; 2x for the tiny test VAE: two)."""
    blocks = int(math.log2(vae_scale_factor)) + 1
    return ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=CONDITIONING_EMBEDDING_CHANNELS[:blocks])


def load_controlnet_pipeline(pipeline_class, base_pipeline_class, args, weight_dtype, quantization=None,
                             **components):
    """The ControlNet pipeline, loaded once, its frozen components in ``weight_dtype`` (``quantization``, if any,
    quantises them as they load) and the ControlNet in fp32: with ``--controlnet_model_name_or_path`` that
    ControlNet is a component of the one load; without it, the base pipeline loads and a ControlNet made from
    its UNet joins its components. ``components`` replace loaded ones (e.g. a VAE)."""
    if args.controlnet_model_name_or_path:
        controlnet = ControlNetModel.from_pretrained(args.controlnet_model_name_or_path)
        return load_pipeline(pipeline_class, args, weight_dtype, quantization=quantization, controlnet=controlnet,
                             **components)
    # The ControlNet copies the UNet's encoder exactly, so from an fp32 UNet: the pipeline's own, which
    # `prepare_components` casts to the weight dtype before it moves; or, when the pipeline's is quantised,
    # one read from the same folder for the copy alone.
    trained_in_fp32 = [] if quantization else ["unet"]
    base = load_pipeline(base_pipeline_class, args, weight_dtype, trained_in_fp32, quantization, **components)
    unet = base.unet
    if quantization:
        unet = type(base.unet).from_pretrained(args.pretrained_model_name_or_path, subfolder="unet",
                                               revision=args.revision, variant=args.variant)
    controlnet = controlnet_from_unet(unet, base.vae_scale_factor)
    # The base pipeline's options that the ControlNet pipeline shares (requires_safety_checker,
    # force_zeros_for_empty_prompt, ...) carry over with its components.
    accepted = inspect.signature(pipeline_class.__init__).parameters
    options = {name: value for name, value in base.config.items() if name in accepted and name not in base.components}
    pipe = pipeline_class(**base.components, controlnet=controlnet, **options)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def cast_residuals_to_unet_dtype(unet, args, kwargs):
    """A UNet forward pre-hook: the ControlNet's residuals in the frozen UNet's dtype, in training and validation alike.

    Under mixed precision the prepared ControlNet returns fp32 (accelerate's output wrapper); CUDA's
    autocast copes with fp32 residuals in a half-precision UNet, the CPU's does not.
    """
    if kwargs.get("mid_block_additional_residual") is not None:
        kwargs["mid_block_additional_residual"] = kwargs["mid_block_additional_residual"].to(unet.dtype)
        kwargs["down_block_additional_residuals"] = [
            residual.to(unet.dtype) for residual in kwargs["down_block_additional_residuals"]]
    return args, kwargs


def make_controlnet_validator(args, pipe, accelerator, validation_pairs, image_argument="image", **kwargs):
    """`make_validator` rendering each prompt with its conditioning image (the pipeline's ``image_argument``), which
    is shown beside the samples."""
    prompts, conditioning_images = zip(*validation_pairs) if validation_pairs else ([], [])
    prompt_kwargs = [{image_argument: image} for image in conditioning_images]
    return make_validator(args, pipe, accelerator, prompts, prompt_kwargs=prompt_kwargs,
                          conditioning_images=conditioning_images, **kwargs)


def controlnet_how_to_load(args, pipe, **fields):
    """The model card's loading code for the trained ControlNet, with the first ``--validation_image``."""
    conditioning_image = args.validation_image[0] if args.validation_image else "conditioning.png"
    return how_to_load(HOW_TO_LOAD, args, pipe, conditioning_image=conditioning_image, **fields)
