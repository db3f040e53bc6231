"""FLUX.2's conditioning and latent layout for training, taken from the pipeline itself (`Flux2KleinPipeline`).

The FLUX.2 transformer reads:

- ``encoder_hidden_states`` and ``txt_ids``: what ``pipe.encode_prompt`` returns, the text encoder's hidden
  states at a few layers stacked on the feature axis, and their position ids. The layers and the prompt length
  are the pipeline's defaults unless ``--text_encoder_out_layers`` and ``--max_sequence_length`` say otherwise
  (`prompt_settings`), and the same settings go to every call of the pipeline (validation, class images);
- ``hidden_states`` and ``img_ids``: the VAE latents folded into 2×2 patches, standardised with the VAE's
  batch-norm statistics (`normalized_latents`), packed into a sequence of tokens, and their position ids
  (`image_inputs`);
- ``timestep``: the scheduler's timestep over 1000, and no guidance embedding (the pipeline passes none).

Every piece is the pipeline's own (its static helpers, its ``encode_prompt`` and that method's defaults), so
training feeds the transformer what the pipeline's sampling loop feeds it at the same noise level.
"""

import inspect

import torch
from diffusers import Flux2Transformer2DModel
from transformers import AutoConfig

from .errors import UsageError, require


def add_flux2_args(parser):
    """The prompt-encoding flags of the diffusers FLUX.2 scripts; unset, the pipeline's own defaults apply."""
    group = parser.add_argument_group("FLUX.2")
    group.add_argument("--max_sequence_length", type=int, default=None,
                       help="tokens per prompt (default: the pipeline's, 512)")
    group.add_argument("--text_encoder_out_layers", type=int, nargs="+", default=None,
                       help="indices of the text encoder's hidden states that the prompt embedding stacks "
                            "(default: the pipeline's, 9 18 27 for FLUX.2 [klein])")


def check_flux2_args(args):
    """Fail in one line on a bad prompt setting, before any weights load: ``--text_encoder_out_layers`` is
    checked against the text encoder's and the transformer's configurations, which load without weights."""
    require(args.max_sequence_length is None or args.max_sequence_length > 0, "--max_sequence_length",
            args.max_sequence_length, "a positive integer")
    if args.text_encoder_out_layers is not None:
        check_text_encoder_out_layers(args.text_encoder_out_layers, *model_configs(args))


def model_configs(args):
    """The text encoder's configuration and the transformer's (a dict) of ``--pretrained_model_name_or_path``."""
    path, options = args.pretrained_model_name_or_path, {"revision": args.revision, "cache_dir": args.cache_dir}
    try:
        return (AutoConfig.from_pretrained(path, subfolder="text_encoder", **options),
                Flux2Transformer2DModel.load_config(path, subfolder="transformer", **options))
    except (OSError, ValueError):
        raise UsageError("--pretrained_model_name_or_path", path,
                         "a FLUX.2 pipeline whose text_encoder and transformer configurations load") from None


def check_text_encoder_out_layers(layers, text_encoder_config, transformer_config):
    depth, width = text_encoder_config.num_hidden_layers, text_encoder_config.hidden_size
    # The hidden states are the embeddings' and each layer's output: depth + 1 of them, indexed from either end.
    require(all(-depth - 1 <= layer <= depth for layer in layers), "--text_encoder_out_layers", layers,
            f"indices of the text encoder's hidden states, from {-depth - 1} to {depth} (it has {depth} layers)")
    features = transformer_config["joint_attention_dim"]
    require(len(layers) * width == features, "--text_encoder_out_layers", layers,
            f"{features // width} indices: the transformer reads {features} text features, {width} from each layer")


def prompt_settings(pipe, args):
    """What ``pipe.encode_prompt`` runs with, in training, validation and class images alike:
    ``--max_sequence_length`` and ``--text_encoder_out_layers``, or where unset the method's own defaults."""
    defaults = inspect.signature(pipe.encode_prompt).parameters
    return {"max_sequence_length": args.max_sequence_length or defaults["max_sequence_length"].default,
            "text_encoder_out_layers": tuple(args.text_encoder_out_layers
                                             or defaults["text_encoder_out_layers"].default)}


def normalized_latents(pipe, latents):
    """VAE latents ``(B, C, H, W)`` as the transformer reads them: 2×2 patches folded into the channels, then
    standardised with the VAE's batch-norm running statistics, as the pipeline encodes images (sampling undoes
    both before decoding)."""
    patches = pipe._patchify_latents(latents)
    bn, eps = pipe.vae.bn, pipe.vae.config.batch_norm_eps
    mean = bn.running_mean.view(1, -1, 1, 1).to(patches.device, patches.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(patches.device, patches.dtype)
    return (patches - mean) / std


def image_inputs(pipe, noisy_latents, timesteps):
    """The transformer's image inputs for `normalized_latents` at ``timesteps``, as the pipeline's denoising loop
    passes them: the latents packed into tokens, their position ids, and the timesteps in the latents' dtype over
    1000 (the pipeline's scale; the transformer multiplies it back)."""
    return {"hidden_states": pipe._pack_latents(noisy_latents),
            "img_ids": pipe._prepare_latent_ids(noisy_latents).to(noisy_latents.device),
            "timestep": timesteps.to(noisy_latents.dtype) / 1000}


def unpack(pipe, tokens, like):
    """The transformer's output tokens back in the layout of the latents ``like``, placed by their position ids."""
    height, width = like.shape[-2:]
    return pipe._unpack_latents_with_ids(tokens, pipe._prepare_latent_ids(like).to(tokens.device), height, width)
