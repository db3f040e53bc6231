"""Z-Image: its conditioning and latent layout for training, taken from the pipeline itself (`ZImagePipeline`), and
its LoRA layout in ComfyUI.

The Z-Image transformer takes lists, one tensor per image, positionally ``(x, t, cap_feats)``:

- ``cap_feats``: the prompt embeddings ``pipe.encode_prompt`` returns, the text encoder's second-to-last hidden
  states at the prompt's own tokens (the padding dropped), so each prompt's has its own length. The prompt length
  is the pipeline's default unless ``--max_sequence_length`` says otherwise (`prompt_settings`). To be cached like
  any embedding, a batch of them is padded into one tensor beside their lengths (`encode_prompts`), and each row is
  cut back to the pipeline's own (`text_inputs`);
- ``x``: the VAE latents shifted and scaled by the VAE's ``shift_factor`` and ``scaling_factor``, as the pipeline
  undoes it before decoding (`normalized_latents`), each image as ``(C, 1, H, W)``: a frame axis, which the
  transformer patchifies with the 2×2 spatial patches (`model_inputs`);
- ``t``: ``(1000 - timestep) / 1000``, i.e. ``1 - sigma``: Z-Image counts time from the noise (0) to the image (1).

It predicts the opposite of flow matching's velocity ``noise - x_0``: the pipeline negates its output before the
scheduler steps, and `prediction` does the same, so the loss compares like with like. The training noise levels
come from the training scheduler made from the pipeline's scheduler config (its static ``shift``, which is
Z-Image's; the pipeline's resolution-dependent ``mu`` only applies with ``use_dynamic_shifting``, off for Z-Image).

Every piece is the pipeline's own (its ``encode_prompt`` and that method's defaults, its VAE's config, its sampling
loop's conventions), so training feeds the transformer what the pipeline's sampling loop feeds it at the same noise
level.

A ControlNet (``ZImageControlNetModel``, for ``ZImageControlNetPipeline``) takes the transformer's inputs and
``control_context``, the conditioning image as the pipeline prepares it (`control_context`), and returns residuals
keyed by the index of the main layer they are added to. It runs the transformer's own embedders and refiners
(``ZImageControlNetModel.from_transformer`` shares them, as the pipeline does when it is built); its own modules
are its control layers, its control noise refiner and its patch embedder, which `controlnet_from_transformer`
copies from the transformer and `unshare_transformer_modules` keeps apart from the shared ones.
"""

import torch
from diffusers import ZImageControlNetModel, ZImageTransformer2DModel

from ..errors import UsageError, require
from . import base
from .layout import Family, Rename, fused

# The original release's module tree (ComfyUI's Z-Image model): comfy/utils.py z_image_to_diffusers, read backwards.
BLOCK = r"((?:layers|noise_refiner|context_refiner)\.\d+)\."
COMFYUI_LAYOUT = (
    *fused(BLOCK + r"attention\.{}", r"\1.attention.qkv", ("to_q", "to_k", "to_v")),
    Rename(BLOCK + r"attention\.to_out\.0", r"\1.attention.out"),
    Rename(BLOCK + r"(feed_forward\.w[123]|adaLN_modulation\.0)", r"\1.\2"),
    Rename(r"all_x_embedder\.2-1", "x_embedder"),
    Rename(r"all_final_layer\.2-1\.(linear|adaLN_modulation\.1)", r"final_layer.\1"),
    Rename(r"(t_embedder\.mlp\.[02]|cap_embedder\.1)", r"\1"),
)
FAMILY = Family("z_image", "Z-Image", ("ZImagePipeline",), "transformer", {}, COMFYUI_LAYOUT)
check_args = base.check_max_sequence_length
prompt_settings = base.prompt_length_settings
call_kwargs = base.call_kwargs
image_vae = base.image_vae
normalized_latents = base.shifted_and_scaled_latents


def add_args(parser):
    """The prompt-encoding flag of the diffusers Z-Image script; unset, the pipeline's own default applies."""
    base.add_max_sequence_length(parser.add_argument_group("Z-Image"),
                                 "tokens per prompt, its chat template included (default: the pipeline's, 512)")


def prompt_dependencies(pipe, settings):
    """What the prompts' embeddings depend on besides the text encoder's weights, for the disk cache's key: the
    encoding code, the tokenizer, its chat template (not part of its vocabulary) and the settings."""
    return [encode_prompts, pipe.tokenizer, pipe.tokenizer.chat_template, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(embeddings, lengths)``: ``pipe.encode_prompt``'s embedding of each prompt (no negative prompt: training
    has no classifier-free guidance), zero-padded to the longest into one tensor ``(B, L, D)``, and each one's
    length ``(B,)``."""
    # A copy: the pipeline writes each prompt's chat-templated text into the list it is given.
    embeddings, _ = pipe.encode_prompt(list(prompts), device=device, do_classifier_free_guidance=False, **settings)
    lengths = torch.tensor([len(embedding) for embedding in embeddings], device=device)
    return torch.nn.utils.rnn.pad_sequence(embeddings, batch_first=True), lengths


def text_inputs(rows):
    """The transformer's text inputs for a batch whose samples have the `encode_prompts` rows ``rows``: each
    prompt's embedding cut back to its own length, exactly what ``pipe.encode_prompt`` returned."""
    return {"cap_feats": [embedding[: int(length)] for embedding, length in rows]}


def model_inputs(pipe, noisy_latents, timesteps, text):
    """All the transformer's inputs for `normalized_latents` at the scheduler's ``timesteps``, as the pipeline's
    denoising loop passes them: one ``(C, 1, H, W)`` tensor per image, and ``(1000 - timesteps) / 1000`` (the
    pipeline's convention; the transformer multiplies it by its ``t_scale``, 1000)."""
    return {"x": list(noisy_latents.unsqueeze(2).unbind(0)), "t": (1000 - timesteps) / 1000, **text}


def prediction(pipe, output, latents):
    """The transformer's outputs (one ``(C, 1, H, W)`` tensor per image) as the velocity the pipeline steps the
    scheduler with, ``(B, C, H, W)``: stacked, and negated as the pipeline negates them."""
    return -torch.stack(output).squeeze(2)


# The modules of the transformer that ZImageControlNetModel.from_transformer hands to the ControlNet (and t_scale).
SHARED_WITH_THE_TRANSFORMER = ("t_embedder", "all_x_embedder", "cap_embedder", "noise_refiner", "context_refiner",
                               "x_pad_token", "cap_pad_token")


def add_controlnet_args(parser):
    """The flag that shapes a new ControlNet: which of the transformer's main layers it guides."""
    parser.add_argument("--control_layers_places", default=None,
                        help="comma-separated indices of the transformer's main layers that a new ControlNet guides, "
                             "0 among them (default: every fifth, 0,5,10,..., as the released Z-Image ControlNet); "
                             "a --controlnet_model_name_or_path has its own")


def check_controlnet_args(args):
    """Fail in one line, before any weights load, on ``--control_layers_places`` that are not distinct layers of the
    transformer (its configuration, read without weights) including the first; set them to their default."""
    if args.controlnet_model_name_or_path:
        require(args.control_layers_places is None, "--control_layers_places", args.control_layers_places,
                "unset with --controlnet_model_name_or_path, whose ControlNet has its own")
        return
    path = args.pretrained_model_name_or_path
    try:
        layers = ZImageTransformer2DModel.load_config(path, subfolder="transformer", revision=args.revision,
                                                      cache_dir=args.cache_dir)["n_layers"]
    except (OSError, ValueError, KeyError):
        raise UsageError("--pretrained_model_name_or_path", path, "a Z-Image pipeline") from None
    if args.control_layers_places is None:
        args.control_layers_places = list(range(0, layers, 5))
        return
    value = args.control_layers_places
    try:
        places = [int(place) for place in value.split(",")]
    except ValueError:
        raise UsageError("--control_layers_places", value, "comma-separated layer indices") from None
    require(0 in places and len(set(places)) == len(places) and all(0 <= place < layers for place in places),
            "--control_layers_places", value, f"distinct indices of the transformer's {layers} main layers, 0 among "
            "them")
    args.control_layers_places = places


def controlnet_from_transformer(transformer, control_layers_places):
    """A ``ZImageControlNetModel`` guiding the main layers ``control_layers_places`` of ``transformer``, its own
    modules copies of the transformer's: each control layer the layer it guides, its control noise refiner the
    noise refiner, its control patch embedder the image patch embedder (the control image's latents have the image
    latents' channels). Its output projections start at zero (the class makes them so), so it changes nothing
    until it trains."""
    config = transformer.config
    controlnet = ZImageControlNetModel(
        control_layers_places=list(control_layers_places), control_in_dim=config.in_channels,
        all_patch_size=config.all_patch_size, all_f_patch_size=config.all_f_patch_size, dim=config.dim,
        n_refiner_layers=config.n_refiner_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
        norm_eps=config.norm_eps, qk_norm=config.qk_norm)
    for layer, place in zip(controlnet.control_layers, control_layers_places, strict=True):
        layer.load_state_dict(transformer.layers[place].state_dict(), strict=False)  # all but the projections
    controlnet.control_noise_refiner.load_state_dict(transformer.noise_refiner.state_dict())
    controlnet.control_all_x_embedder.load_state_dict(transformer.all_x_embedder.state_dict())
    return controlnet


def unshare_transformer_modules(controlnet):
    """Keep the transformer's modules that ``ZImageControlNetModel.from_transformer`` (called by the pipeline) gave
    ``controlnet`` as plain attributes rather than its submodules: it still runs them, but its parameters, state dict
    and saved files are its own (what ``ZImageControlNetModel.from_pretrained`` loads), and training it leaves the
    transformer frozen. Also sets the ``gradient_checkpointing`` flag that the class leaves unset until
    ``enable_gradient_checkpointing`` (diffusers 0.42) while its forward reads it wherever gradients are enabled."""
    if not hasattr(controlnet, "gradient_checkpointing"):
        controlnet.gradient_checkpointing = False
    for name in SHARED_WITH_THE_TRANSFORMER:
        shared = getattr(controlnet, name)
        if name in controlnet._modules:
            del controlnet._modules[name]
        else:
            del controlnet._parameters[name]
        object.__setattr__(controlnet, name, shared)
    return controlnet


@torch.no_grad()
def control_context(pipe, controlnet, conditioning_pixels):
    """The ControlNet's ``control_context`` for conditioning images ``(B, 3, H, W)`` in [0, 1], as
    ``ZImageControlNetPipeline`` prepares its control image: in [-1, 1], encoded to the mode of the VAE's latent
    distribution, shifted and scaled as the image latents, a frame axis ``(B, C, 1, h, w)``, and zero channels up
    to the ControlNet's ``control_in_dim`` (a ControlNet that also reads inpainting channels)."""
    vae = pipe.vae
    latents = vae.encode((conditioning_pixels * 2 - 1).to(vae.device, vae.dtype)).latent_dist.mode()
    latents = normalized_latents(pipe, latents).unsqueeze(2)
    missing = controlnet.config.control_in_dim - latents.shape[1]
    return torch.cat([latents, latents.new_zeros(latents.shape[0], missing, *latents.shape[2:])], dim=1)
