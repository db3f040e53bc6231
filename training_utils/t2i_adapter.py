"""What the T2I-Adapter script needs beyond the conditioning images it shares with the ControlNet scripts
(`controlnet`): its flags, the adapter made for a UNet, the features as ``StableDiffusionXLAdapterPipeline`` feeds them
to the UNet, upstream's cubic timestep sampling, and how to load what it trained.

A T2I-Adapter (``T2IAdapter``, SDXL's ``full_adapter_xl``) turns the conditioning image, in [0, 1] as the pipeline
preprocesses it, into one feature per UNet down block (and one for SDXL's middle block); the pipeline multiplies them
by ``adapter_conditioning_scale`` and the UNet adds them inside its down blocks
(``down_intrablock_additional_residuals``).
"""

import json
import math
from pathlib import Path

import torch
from diffusers import AutoencoderKL, T2IAdapter, UNet2DConditionModel

from .controlnet import add_conditioning_args
from .errors import require
from .outputs.hub import how_to_load
from .pipeline import load_pipeline
from .quantization import add_quantization_args

HOW_TO_LOAD = """
from diffusers import T2IAdapter, {imports}
from diffusers.utils import load_image

adapter = T2IAdapter.from_pretrained("{output_dir}")  # or "{output_dir}/ema" for the EMA weights
pipe = {pipeline_class}.from_pretrained("{base_model}", adapter=adapter{load_options})
image = pipe("{prompt}", image=load_image("{conditioning_image}"),
             adapter_conditioning_scale={adapter_conditioning_scale}).images[0]
"""

# SDXL's adapter unshuffles the conditioning image's pixels by twice the VAE's downsampling (16 for its 8).
DOWNSCALE_PER_VAE_FACTOR = 2


def add_t2i_adapter_args(parser):
    adapter = parser.add_argument_group("T2I-Adapter")
    adapter.add_argument("--adapter_model_name_or_path", default=None,
                         help="T2IAdapter to start from (default: a new full_adapter_xl sized for the UNet, as "
                              "upstream's for SDXL: channels 320, 640, 1280, 1280, pixels unshuffled by 16)")
    adapter.add_argument("--adapter_conditioning_scale", type=float, default=1.0,
                         help="what the adapter's features are multiplied by before the UNet adds them, in training "
                              "and validation alike (the pipeline's adapter_conditioning_scale)")
    add_conditioning_args(adapter)
    add_quantization_args(parser, base="the frozen UNet")


def check_t2i_adapter_args(args):
    """The adapter's folder, its scale, and sizes its pixel unshuffle can take (from the configs, no weights)."""
    path = args.adapter_model_name_or_path
    if path and Path(path).exists():
        config = Path(path) / "config.json"
        require(config.is_file() and json.loads(config.read_text()).get("_class_name") == "T2IAdapter",
                "--adapter_model_name_or_path", path, "a T2IAdapter folder (with config.json) or a hub id")
    scale = args.adapter_conditioning_scale
    require(math.isfinite(scale) and scale > 0, "--adapter_conditioning_scale", scale, "a positive number")
    factor = adapter_downscale_factor(args)
    for flag in ("resolution", "validation_height", "validation_width"):
        value = getattr(args, flag, None)
        require(value is None or factor is None or value % factor == 0, f"--{flag}", value,
                f"a multiple of {factor}, the T2I-Adapter's downscale factor")


def adapter_downscale_factor(args):
    """What the adapter unshuffles the conditioning image's pixels by, from a local adapter's config, or for a new
    one from a local base model's VAE config; None where only the hub knows."""
    path = args.adapter_model_name_or_path
    if path:
        config = Path(path) / "config.json"
        return json.loads(config.read_text())["downscale_factor"] if config.is_file() else None
    config = Path(args.pretrained_model_name_or_path) / "vae" / "config.json"
    if not config.is_file():
        return None
    return DOWNSCALE_PER_VAE_FACTOR * 2 ** (len(json.loads(config.read_text())["block_out_channels"]) - 1)


def new_adapter(unet_config, vae_scale_factor, seed=None):
    """A new ``full_adapter_xl`` for a UNet of ``unet_config``: a feature for each down block, in its channels, and
    for SDXL's three blocks a fourth for the middle block (the XL adapter halves its size after the second feature,
    as SDXL's third block does); pixels unshuffled by twice ``vae_scale_factor``. For SDXL that is upstream's
    adapter: channels 320, 640, 1280, 1280, unshuffled by 16. Initialised from ``seed`` without touching the global
    random state."""
    channels = list(unet_config["block_out_channels"])
    if len(channels) == 3:
        channels.append(channels[-1])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0 if seed is None else seed)
        return T2IAdapter(in_channels=3, channels=channels, num_res_blocks=2,
                          downscale_factor=DOWNSCALE_PER_VAE_FACTOR * vae_scale_factor, adapter_type="full_adapter_xl")


def load_adapter_pipeline(pipeline_class, args, weight_dtype, quantization=None, **components):
    """The adapter pipeline, loaded once, its frozen components in ``weight_dtype`` (``quantization``, if any,
    quantises them as they load) and the adapter in fp32: the one of ``--adapter_model_name_or_path``, or a
    `new_adapter` made from the UNet's and VAE's configs. ``components`` replace loaded ones (e.g. a VAE)."""
    if args.adapter_model_name_or_path:
        adapter = T2IAdapter.from_pretrained(args.adapter_model_name_or_path)
    else:
        options = {"revision": args.revision}
        unet_config = UNet2DConditionModel.load_config(args.pretrained_model_name_or_path, subfolder="unet", **options)
        vae_config = (components["vae"].config if "vae" in components else
                      AutoencoderKL.load_config(args.pretrained_model_name_or_path, subfolder="vae", **options))
        adapter = new_adapter(unet_config, 2 ** (len(vae_config["block_out_channels"]) - 1), args.seed)
    return load_pipeline(pipeline_class, args, weight_dtype, quantization=quantization, adapter=adapter.float(),
                         **components)


def adapter_features(adapter, conditioning_pixels, scale):
    """The UNet's ``down_intrablock_additional_residuals`` for ``conditioning_pixels`` (B, 3, H, W in [0, 1]): the
    adapter's features times ``scale``, as the pipeline computes them."""
    return [feature * scale for feature in adapter(conditioning_pixels)]


def cast_features_to_unet_dtype(unet, args, kwargs):
    """A UNet forward pre-hook: the adapter's features in the frozen UNet's dtype (a new list, which the UNet empties),
    in training and validation alike. The fp32 adapter's features meet a half-precision UNet under mixed precision."""
    features = kwargs.get("down_intrablock_additional_residuals")
    if features is not None:
        kwargs["down_intrablock_additional_residuals"] = [feature.to(unet.dtype) for feature in features]
    return args, kwargs


def cubic_timesteps(noise_scheduler, batch_size, device):
    """Training timesteps drawn as upstream's script draws them: ``t = (1 - u³) T`` for uniform ``u``, so that most
    fall among the noisy early steps of sampling, where the image's structure, which the adapter steers, forms
    (T2I-Adapter paper, section 3.4)."""
    count = noise_scheduler.config.num_train_timesteps
    timesteps = ((1 - torch.rand(batch_size, device=device) ** 3) * count).long()
    return timesteps.clamp(0, count - 1)


def t2i_adapter_how_to_load(args, pipe, **fields):
    """The model card's loading code for the trained adapter, with the first ``--validation_image``."""
    conditioning_image = args.validation_image[0] if args.validation_image else "conditioning.png"
    return how_to_load(HOW_TO_LOAD, args, pipe, conditioning_image=conditioning_image,
                       adapter_conditioning_scale=args.adapter_conditioning_scale, **fields)
