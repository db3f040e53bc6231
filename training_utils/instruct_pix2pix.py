"""What the InstructPix2Pix scripts share (SD 1.x and SDXL): an image edited as an instruction says.

The UNet reads the original image's latents as more input channels, after the noisy latents (`control.
with_conditioning`), as ``StableDiffusionInstructPix2PixPipeline`` concatenates them: its ``conv_in`` is widened
from 4 to 8 input channels, the new ones zero (`control.widen_input_layer`, `widen_conv_in`), so the widened UNet
starts as the text-to-image one. The original image's latents are what the pipeline's ``prepare_image_latents``
makes: the VAE's mode, unscaled (`original_image_latents`). For classifier-free guidance on both the instruction and
the image, a sample drops its instruction, its image or both (``--conditioning_dropout_prob``, upstream's
arithmetic: `conditioning_dropped`), drawn from the sample's own generator so that a resumed run draws the same.

Here too: the flags (upstream's columns, ``--val_image_url`` as a local file), the validation pairs of prompts and
original images, and the model card's loading code.
"""

import re

import torch

from .control import widen_input_layer
from .errors import UsageError, require
from .outputs.hub import EMA_SWAP, how_to_load

HOW_TO_LOAD = """
from diffusers import {pipeline_class}, {model_class}
from diffusers.utils import load_image

pipe = {pipeline_class}.from_pretrained("{output_dir}")
{swap_in_ema}image = pipe("{prompt}", image=load_image("{original_image}")).images[0]
"""


def add_instruct_pix2pix_args(parser, url_flag="--val_image_url"):
    """Upstream's flags: the dataset's columns (``--edited_image_column`` and ``--edit_prompt_column`` are the
    shared ``--image_column`` and ``--caption_column`` under upstream's names), the conditioning dropout, and the
    validation's original images (``--validation_image``, or upstream's ``url_flag``, ``--val_image_url`` or SDXL's
    ``--val_image_url_or_path``, as a local file)."""
    group = parser.add_argument_group("InstructPix2Pix")
    group.add_argument("--original_image_column", default="input_image",
                       help="the column of the images before the edit")
    group.add_argument("--edited_image_column", dest="image_column",
                       help="the column of the edited images (the same as --image_column)")
    group.add_argument("--edit_prompt_column", dest="caption_column",
                       help="the column of the edit instructions (the same as --caption_column)")
    parser.set_defaults(image_column="edited_image", caption_column="edit_prompt")
    group.add_argument("--conditioning_dropout_prob", type=float, default=None,
                       help="drop a sample's instruction with this probability, its original image with it, and "
                            "both with it (for classifier-free guidance on each)")
    group.add_argument("--validation_image", nargs="+", default=None,
                       help="original images to edit: one per --validation_prompt, or one for all prompts")
    group.add_argument(url_flag, dest="val_image_url", default=None,
                       help="upstream's validation image: a local file here (added to --validation_image)")
    parser.set_defaults(val_image_url_flag=url_flag)


def check_instruct_pix2pix_args(args):
    """Stop in one line on a bad probability or a URL (nothing is downloaded), before anything loads;
    ``--val_image_url`` joins ``--validation_image``."""
    probability = args.conditioning_dropout_prob
    require(probability is None or 0 <= probability <= 1, "--conditioning_dropout_prob", probability,
            "a probability in [0, 1]")
    if args.val_image_url is not None:
        if re.match(r"^[a-z][a-z0-9+.-]*://", args.val_image_url):
            raise UsageError(args.val_image_url_flag, args.val_image_url,
                             "a local image file: nothing is downloaded here (save the image and pass its path)")
        args.validation_image = [*(args.validation_image or []), args.val_image_url]


def dataset_columns(args):
    """The flags naming the columns an InstructPix2Pix dataset must have, for ``load_train_dataset``."""
    return {"--edited_image_column": args.image_column, "--original_image_column": args.original_image_column,
            "--caption_column": args.caption_column}


def at_size(pairs, size):
    """``pairs`` (`controlnet.load_validation_pairs`' prompts and original images) with each image resized to
    ``size`` (``{"height", "width"}``): the SD 1.x pipeline renders at its image's size."""
    return [(prompt, image.resize((size["width"], size["height"]))) for prompt, image in pairs]


def widen_conv_in(unet):
    """Widen a text-to-image UNet's ``conv_in`` (as many input channels as output ones) for the original image's
    latents; an InstructPix2Pix UNet (twice as many) is left as it is. Returns whether it was widened."""
    if unet.config.in_channels != unet.config.out_channels:
        return False
    widen_input_layer(unet, "conv_in")
    return True


def conditioning_dropped(probability, generator):
    """``(instruction dropped, image dropped)`` for one sample, as upstream draws them from one uniform ``u``: the
    instruction when ``u < 2p``, the image when ``p <= u < 3p`` (so each alone with ``p``, both with ``p``); nothing
    drawn without a probability."""
    if not probability:
        return False, False
    draw = torch.rand((), generator=generator).item()
    return draw < 2 * probability, probability <= draw < 3 * probability


def original_image_latents(vae, pixels, dtype):
    """The VAE's latents of a batch of original images (``pixels`` in [0, 1]) as the pipeline's
    ``prepare_image_latents`` makes them: encoded from [-1, 1], the distribution's mode, unscaled."""
    return vae.encode((pixels * 2 - 1).to(dtype)).latent_dist.mode()


def instruct_pix2pix_how_to_load(args, pipe, ema):
    """The model card's loading code: the pipeline folder (the EMA UNet swapped in where the run kept one),
    editing the first ``--validation_image`` with the first prompt."""
    model_class = type(pipe.unet).__name__
    swap_in_ema = EMA_SWAP.format(output_dir=args.output_dir, model="unet", model_class=model_class) if ema else ""
    original_image = args.validation_image[0] if args.validation_image else "original.png"
    return how_to_load(HOW_TO_LOAD, args, pipe, swap_in_ema=swap_in_ema, model_class=model_class,
                       original_image=original_image)
