"""FLUX.1 ([dev], [schnell]): its conditioning and latent layout for training, taken from the pipeline itself
(`FluxPipeline`), and its LoRA layout in ComfyUI.

The FLUX.1 transformer reads:

- ``encoder_hidden_states``, ``pooled_projections`` and ``txt_ids``: what ``pipe.encode_prompt`` returns
  (`encode_prompts`): T5's hidden states, CLIP's pooled output, and the text tokens' position ids, one set for every
  prompt (unbatched); the prompt length is the pipeline's default unless ``--max_sequence_length`` says otherwise.
  The CLIP encoder may train (a LoRA, ``--train_text_encoder``; or new tokens' rows, as T5's may): its wrapped module
  is given to `encode_prompts`;
- ``hidden_states`` and ``img_ids``: the VAE latents shifted and scaled by the VAE's configuration
  (`normalized_latents`), packed into a sequence of 2×2 patches, and their position ids (`model_inputs`);
- ``timestep``: the scheduler's timestep over 1000;
- ``guidance``, where the transformer embeds it ([dev], distilled to take the guidance scale beside the prompt):
  ``--guidance_scale`` for every sample, as the pipeline passes its ``guidance_scale``. It comes with each prompt's
  row (`encode_prompts`), so the protocol's functions keep their signatures.

Its output tokens are unpacked into the latents' layout (`prediction`), where the loss compares them with the
velocity. Every piece is the pipeline's own (its static helpers, its ``encode_prompt`` and that method's defaults),
so training feeds the transformer what the pipeline's sampling loop feeds it at the same noise level; and a
ControlNet what ``FluxControlNetPipeline`` feeds it (`controlnet_inputs`).
"""

import torch

from . import base
from .base import stacked, tokenize
from .layout import BLOCK, Family, Rename, always, fused

SINGLE = r"single_transformer_blocks\.(\d+)\."
# The original release's module tree (ComfyUI's FLUX.1 model): diffusers' convert_flux_to_diffusers, read backwards.
# The double-stream blocks' layers, and the single-stream blocks' linear layers (Chroma's are the same): a
# single-stream block's linear1 fuses q, k, v and the MLP's input projection, four times as wide as each.
BLOCKS_LAYOUT = (
    *fused(BLOCK + r"attn\.{}", r"double_blocks.\1.img_attn.qkv", ("to_q", "to_k", "to_v")),
    *fused(BLOCK + r"attn\.{}", r"double_blocks.\1.txt_attn.qkv", ("add_q_proj", "add_k_proj", "add_v_proj")),
    Rename(BLOCK + r"attn\.to_out\.0", r"double_blocks.\1.img_attn.proj"),
    Rename(BLOCK + r"attn\.to_add_out", r"double_blocks.\1.txt_attn.proj"),
    Rename(BLOCK + r"ff\.net\.0\.proj", r"double_blocks.\1.img_mlp.0"),
    Rename(BLOCK + r"ff\.net\.2", r"double_blocks.\1.img_mlp.2"),
    Rename(BLOCK + r"ff_context\.net\.0\.proj", r"double_blocks.\1.txt_mlp.0"),
    Rename(BLOCK + r"ff_context\.net\.2", r"double_blocks.\1.txt_mlp.2"),
    *fused(SINGLE + "{}", r"single_blocks.\1.linear1", (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", "proj_mlp"),
           sizes=(1, 1, 1, 4)),
    Rename(SINGLE + r"proj_out", r"single_blocks.\1.linear2"),
)
COMFYUI_LAYOUT = (
    *BLOCKS_LAYOUT,
    Rename(BLOCK + r"norm1\.linear", r"double_blocks.\1.img_mod.lin"),
    Rename(BLOCK + r"norm1_context\.linear", r"double_blocks.\1.txt_mod.lin"),
    Rename(SINGLE + r"norm\.linear", r"single_blocks.\1.modulation.lin"),
    Rename(r"x_embedder", "img_in"),
    Rename(r"context_embedder", "txt_in"),
    Rename(r"time_text_embed\.timestep_embedder\.linear_1", "time_in.in_layer"),
    Rename(r"time_text_embed\.timestep_embedder\.linear_2", "time_in.out_layer"),
    Rename(r"time_text_embed\.guidance_embedder\.linear_1", "guidance_in.in_layer"),
    Rename(r"time_text_embed\.guidance_embedder\.linear_2", "guidance_in.out_layer"),
    Rename(r"time_text_embed\.text_embedder\.linear_1", "vector_in.in_layer"),
    Rename(r"time_text_embed\.text_embedder\.linear_2", "vector_in.out_layer"),
    Rename(r"norm_out\.linear", "final_layer.adaLN_modulation.1", swap_halves=always),
    Rename(r"proj_out", "final_layer.linear"),
)
# The CLIP encoder's LoRA (--train_text_encoder) in kohya's names, which ComfyUI reads for FLUX.1's clip_l.
TEXT_ENCODER_PREFIXES = {"text_encoder": "lora_te1"}
FAMILY = Family("flux", "FLUX.1", ("FluxPipeline",), "transformer", TEXT_ENCODER_PREFIXES, COMFYUI_LAYOUT)
call_kwargs = base.call_kwargs  # the prompt settings and the guidance
image_vae = base.image_vae
normalized_latents = base.shifted_and_scaled_latents
prediction = base.unpacked_prediction


def add_args(parser):
    """The prompt and guidance flags of the diffusers FLUX.1 script; unset, the pipeline's own defaults apply."""
    group = parser.add_argument_group("FLUX.1")
    base.add_max_sequence_length(group, "T5 tokens per prompt (default: the pipeline's, 512)")
    base.add_guidance_scale(group, "the guidance that FLUX.1 [dev]'s transformer embeds in training, and "
                                   "validation's (upstream's default, 3.5; [schnell] embeds none)")


def check_args(args):
    base.check_max_sequence_length(args, 512, "FluxPipeline")


def prompt_settings(pipe, args):
    """What ``pipe.encode_prompt`` runs with, in training, validation and class images alike: ``--max_sequence_length``
    or the method's default; and the guidance."""
    return {"max_sequence_length": base.max_sequence_length(pipe, args), "guidance_scale": args.guidance_scale}


def prompt_dependencies(pipe, settings):
    """What the prompts' rows depend on besides the text encoders' weights, for the disk cache's key: the encoding
    code, both tokenizers and the settings (the guidance among them)."""
    return [encode_prompts, pipe.tokenizer, pipe.tokenizer_2, settings]


def encode_prompts(pipe, prompts, device, settings, text_encoders=None):
    """``(prompt_embeds, pooled_prompt_embeds, text_ids)`` as ``pipe.encode_prompt`` computes them, with the text
    ids (one set for all prompts there) given to each prompt, so that every part has a row per prompt; and where the
    transformer embeds the guidance, each prompt's: the guidance scale, fp32, as the pipeline passes it. A CLIP or T5
    encoder given (``text_encoders["text_encoder"]``, ``["text_encoder_2"]``: the wrapped module, when it trains)
    replaces the pipeline's, T5's tokens as ``pipe._get_t5_prompt_embeds`` makes them."""
    text_encoders = text_encoders or {}
    clip_encoder = text_encoders.get("text_encoder", pipe.text_encoder)
    clip_ids = tokenize(pipe.tokenizer, prompts).to(device)
    pooled = clip_encoder(clip_ids, output_hidden_states=False).pooler_output.to(pipe.text_encoder.dtype)
    if "text_encoder_2" in text_encoders:
        t5_ids = pipe.tokenizer_2(prompts, padding="max_length", max_length=settings["max_sequence_length"],
                                  truncation=True, return_tensors="pt").input_ids.to(device)
        embeds = text_encoders["text_encoder_2"](t5_ids, output_hidden_states=False)[0].to(pipe.text_encoder_2.dtype)
    else:
        embeds = pipe._get_t5_prompt_embeds(prompts, max_sequence_length=settings["max_sequence_length"],
                                            device=device)
    text_ids = torch.zeros(len(prompts), embeds.shape[1], 3, device=device, dtype=pipe.text_encoder.dtype)
    if not pipe.transformer.config.guidance_embeds:
        return embeds, pooled, text_ids
    return embeds, pooled, text_ids, torch.full((len(prompts),), settings["guidance_scale"], device=embeds.device)


def text_inputs(rows):
    """The transformer's text inputs for a batch whose samples have the `encode_prompts` rows ``rows``: the text
    ids are every prompt's, unbatched, as the pipeline passes them; the guidance, if the rows hold it."""
    return {"encoder_hidden_states": stacked(rows, 0), "pooled_projections": stacked(rows, 1), "txt_ids": rows[0][2],
            "guidance": stacked(rows, 3) if len(rows[0]) > 3 else None}


def model_inputs(pipe, noisy_latents, timesteps, text):
    """All the transformer's inputs for `normalized_latents` at ``timesteps``, as the pipeline's denoising loop
    passes them: the latents packed into 2×2 patches, their position ids, and the timesteps in the latents' dtype
    over 1000."""
    batch, channels, height, width = noisy_latents.shape
    return {"hidden_states": pipe._pack_latents(noisy_latents, batch, channels, height, width),
            "img_ids": pipe._prepare_latent_image_ids(batch, height // 2, width // 2, noisy_latents.device,
                                                      noisy_latents.dtype),
            "timestep": timesteps.to(noisy_latents.dtype) / 1000, **text}


def controlnet_inputs(pipe, inputs, conditioning_latents, settings):
    """The inputs of ``pipe.controlnet`` (an InstantX-style FluxControlNetModel) beside the transformer's ``inputs``
    (`model_inputs`), as ``FluxControlNetPipeline`` gives them: the conditioning image's VAE latents
    (``conditioning_latents``, as the VAE samples them) shifted, scaled and packed as the latents are, and the
    guidance scale of ``settings`` where the ControlNet embeds it (whether or not the transformer does)."""
    batch, channels, height, width = conditioning_latents.shape
    conditioning = pipe._pack_latents(normalized_latents(pipe, conditioning_latents), batch, channels, height, width)
    guidance = None
    if pipe.controlnet.config.guidance_embeds:
        guidance = torch.full((batch,), settings["guidance_scale"], device=conditioning.device)
    return {**inputs, "controlnet_cond": conditioning, "guidance": guidance}
