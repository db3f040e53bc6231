"""What every Control script shares, whatever the family (FLUX.1 Control, CogView4 Control).

A Control model reads its conditioning image as more input channels: the image goes through the VAE as a target
image does (`controlnet.conditioning_latents`), and its latents are concatenated with the noisy latents along the channels
(`with_conditioning`), as ``FluxControlPipeline`` and ``CogView4ControlPipeline`` concatenate them. The transformer's
input layer (FLUX.1's ``x_embedder``, CogView4's ``patch_embed.proj``) takes twice the features: `widen_input_layer`
adds the new columns as zeros, so the widened model starts as the base model, whatever the conditioning.

Here too: the flags (the conditioning column and validation images are the ControlNet scripts',
`controlnet.add_conditioning_image_args`; `controlnet.dataset_columns` and `controlnet.load_validation_pairs` read
them), the validation that renders each prompt with its conditioning image and shows it beside the raw and EMA
samples (`make_control_validator`), the export of a Control LoRA with the norm layers that train whole beside it
(`ControlLoraExport`), and the model card's loading code (`control_how_to_load`).

The family's own conditioning (its latent layout, its text inputs) stays in the family modules and the scripts.
"""

import dataclasses

import torch

from .adapters.config import adapter_config
from .adapters.export import LoraExport, peft_saved_keys
from .adapters.injection import linear_layers_named
from .args import comma_separated
from .controlnet import add_conditioning_image_args, make_controlnet_validator
from .errors import require
from .outputs.hub import fine_tuned_how_to_load, how_to_load

# The norm layers that FluxControlPipeline.load_lora_weights reads whole beside a LoRA (its loader's
# ``_control_lora_supported_norm_keys``), which upstream's --train_norm_layers trains.
NORM_LAYERS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")

# The flags of upstream's Control scripts that these do not carry, and why.
REFUSED = {
    "--log_dataset_samples": "the validation grids show each conditioning image beside its samples; training samples "
                             "are not logged",
}

# The model card's loading code: the pipeline folder of a full fine-tune (`outputs.hub.fine_tuned_how_to_load` fills in
# the EMA transformer's swap), or the Control LoRA, which widens the base transformer's input layer as it loads.
FINE_TUNE_HOW_TO_LOAD = """
from diffusers import {pipeline_class}, {model_class}
from diffusers.utils import load_image

pipe = {pipeline_class}.from_pretrained("{output_dir}")
{swap_in_ema}image = pipe("{prompt}", control_image=load_image("{conditioning_image}")).images[0]
"""
LORA_HOW_TO_LOAD = """
from diffusers import {imports}
from diffusers.utils import load_image

pipe = {pipeline_class}.from_pretrained("{base_model}"{load_options})
pipe.load_lora_weights("{output_dir}")  # or "{output_dir}/ema"; widens the transformer's input layer as it loads
image = pipe("{prompt}", control_image=load_image("{conditioning_image}")).images[0]
"""


def add_control_args(parser):
    """The conditioning images' flags: the dataset's column and the validation images (the ControlNet scripts'); and
    upstream's ``--jsonl_for_train``, a dataset of one JSON Lines file (`data.datasets.load_train_dataset` reads it)."""
    group = parser.add_argument_group("control")
    add_conditioning_image_args(group)
    group.add_argument("--jsonl_for_train", default=None,
                       help="the training rows as a JSON Lines file (instead of --dataset_name or --train_data_dir), "
                            "its image paths absolute or relative to the working directory")


def add_control_lora_args(parser):
    """Upstream's Control LoRA flags: the LoRA's bias and initialisation, and the norm layers trained whole."""
    group = parser.add_argument_group("Control LoRA")
    group.add_argument("--use_lora_bias", action="store_true",
                       help="give each LoRA's second matrix (lora_B) a bias that trains (its first matrix then "
                            "starts as peft's default, Kaiming-uniform)")
    group.add_argument("--gaussian_init_lora", action="store_true",
                       help="start the LoRA's first matrix Gaussian: always, here, unless --use_lora_bias")
    group.add_argument("--train_norm_layers", action="store_true",
                       help="also train the attention's norm layers' scales whole (saved in the LoRA's file, which "
                            "load_lora_weights reads)")


def check_control_lora_args(args):
    """Stop in one line on what a Control LoRA cannot be, before anything loads."""
    require(args.adapter in (None, "lora") and not args.use_dora, "--adapter", args.adapter or "dora",
            "lora: load_lora_weights widens the input layer to a LoRA's shapes, and reads no other adapter")
    require(args.quantize_base is None and args.bnb_quantization_config_path is None, "--quantize_base",
            args.quantize_base or args.bnb_quantization_config_path,
            "none: the transformer's input layer is widened, which a quantised layer cannot be")
    require(not (args.use_lora_bias and args.gaussian_init_lora), "--gaussian_init_lora", True,
            "not with --use_lora_bias (peft starts a LoRA with a bias as Kaiming-uniform)")


def control_lora_config(args, target_modules):
    """peft's LoRA config the flags describe (`adapters.config.adapter_config`), with upstream's ``--use_lora_bias``."""
    config = adapter_config(args, target_modules)
    if args.use_lora_bias:
        config = dataclasses.replace(config, lora_bias=True, init_lora_weights=True)
    return config


def control_lora_layers(model, lora_layers, input_layer):
    """The full names of ``model``'s linear layers that ``--lora_layers`` names (upstream's "all-linear": every one),
    the widened ``input_layer`` always among them: its LoRA is what makes load_lora_weights widen the base's."""
    if lora_layers == "all-linear":
        return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    return linear_layers_named(model, list(dict.fromkeys([input_layer, *comma_separated(lora_layers)])))


def widen_input_layer(model, layer_name):
    """Give ``model``'s input layer ``layer_name`` (a ``Linear``, as FLUX.1's ``x_embedder``, or a ``Conv2d``, as a
    UNet's ``conv_in`` for InstructPix2Pix) twice its input features or channels, for the conditioning latents
    concatenated after the latents: the old weight's input columns first, zeros after them, the bias as it was, in
    the layer's dtype and on its device. The model's config says so (``in_channels`` doubled, ``out_channels`` kept),
    so that ``from_pretrained`` rebuilds the widened model from a saved one. Returns the new layer."""
    old = model.get_submodule(layer_name)
    factory = dict(bias=old.bias is not None, dtype=old.weight.dtype, device=old.weight.device)
    if isinstance(old, torch.nn.Conv2d):
        new = torch.nn.Conv2d(old.in_channels * 2, old.out_channels, old.kernel_size, old.stride, old.padding,
                              old.dilation, old.groups, padding_mode=old.padding_mode, **factory)
    else:
        new = torch.nn.Linear(old.in_features * 2, old.out_features, **factory)
    with torch.no_grad():
        new.weight.zero_()
        new.weight[:, :old.weight.shape[1]].copy_(old.weight)
        if old.bias is not None:
            new.bias.copy_(old.bias)
    new.requires_grad_(old.weight.requires_grad)
    model.set_submodule(layer_name, new)
    in_channels = model.config.in_channels
    model.register_to_config(in_channels=in_channels * 2, out_channels=model.config.out_channels or in_channels)
    # The config remembers which values were defaults, and ``from_config`` would put their defaults back.
    defaults = model.config.get("_use_default_values")
    if defaults is not None:
        model.register_to_config(_use_default_values=[key for key in defaults
                                                      if key not in ("in_channels", "out_channels")])
    return new


def with_conditioning(noisy_latents, conditioning_latents):
    """The Control model's input: the noisy latents, then the conditioning image's latents (in the noisy latents'
    dtype), along the channels (dimension 1), as the Control pipelines concatenate them."""
    return torch.cat([noisy_latents, conditioning_latents.to(noisy_latents.dtype)], dim=1)


def make_control_validator(args, pipe, accelerator, validation_pairs, **kwargs):
    """`validation.make_validator` rendering each prompt with its conditioning image (the pipeline's
    ``control_image``), shown in each step's grid beside the raw and EMA samples."""
    return make_controlnet_validator(args, pipe, accelerator, validation_pairs, **kwargs)


def norm_layer_names(model):
    """The names of ``model``'s parameters in the norm layers that a Control LoRA may train whole (`NORM_LAYERS`)."""
    return [name for name, _ in model.named_parameters()
            if any(f".{layer}." in f".{name}" for layer in NORM_LAYERS)]


def train_norm_layers(model):
    """Make the norm layers' scales of `norm_layer_names` train (upstream's ``--train_norm_layers``)."""
    for name in norm_layer_names(model):
        model.get_parameter(name).requires_grad_(True)


class ControlLoraExport(LoraExport):
    """A Control LoRA: the LoRA (the widened input layer's among its layers) and, trained whole beside it
    (``--train_norm_layers``), the norm layers' scales, in one ``pytorch_lora_weights.safetensors`` that
    ``pipe.load_lora_weights`` loads: it widens the base model's input layer to the LoRA's and sets the norm layers.
    Written as any LoRA; only the check that the trained parameters are what is saved knows the norm layers."""

    @classmethod
    def saved_keys(cls, module, adapter_name="default"):
        return peft_saved_keys(module, adapter_name) | {
            name for name in norm_layer_names(module) if module.get_parameter(name).requires_grad}


def control_how_to_load(args, pipe, ema=None, lora=False):
    """The model card's loading code: the Control LoRA (``lora``) into the base model's Control pipeline, or the full
    fine-tune's pipeline folder (the EMA transformer swapped in where the run kept an EMA, ``ema``), rendering the
    first validation prompt with the first ``--validation_image``."""
    conditioning_image = args.validation_image[0] if args.validation_image else "conditioning.png"
    if lora:
        return how_to_load(LORA_HOW_TO_LOAD, args, pipe, conditioning_image=conditioning_image)
    return fine_tuned_how_to_load(args, pipe, ema, "transformer", template=FINE_TUNE_HOW_TO_LOAD,
                                  conditioning_image=conditioning_image)
