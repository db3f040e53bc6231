"""Stable Diffusion 3: its conditioning and latent layout for training, as ``StableDiffusion3Pipeline`` computes them,
and its LoRA layout in ComfyUI.

The MMDiT transformer reads two text inputs, computed as the pipeline's ``encode_prompt`` computes them at inference
(without classifier-free guidance; `encode_prompts`):

- ``encoder_hidden_states``: both CLIP encoders' penultimate hidden states, concatenated on the feature
  axis and zero-padded to T5's width, followed on the sequence axis by T5's last hidden states;
- ``pooled_projections``: both CLIP encoders' projected (pooled) outputs, concatenated.

The encoders can be given (``text_encoders``), so that a script passes the modules that ``accelerator.prepare``
wrapped and gradients reach trained encoders (the pipeline's method would call the unwrapped ones). The latents are
the VAE's, shifted and scaled by its ``shift_factor`` and ``scaling_factor`` (`normalized_latents`), in the
transformer's own layout: it predicts the velocity as it is (`prediction`). Also the SD3 scripts' own flag, the T5
sequence length (the flow-matching flags and timesteps are `flow_matching`'s), and a ControlNet's inputs as
``StableDiffusion3ControlNetPipeline`` gives them (`controlnet_inputs`).
"""

import torch
import torch.nn.functional as F

from . import base
from .base import stacked, tokenize
from .layout import BLOCK, CLIP_PAIR, Family, Rename, always, fused, two_chunk_modulation

# The original release's module tree (ComfyUI's MMDiT): comfy/utils.py mmdit_to_diffusers, read backwards.
COMFYUI_LAYOUT = (
    *fused(BLOCK + r"attn\.{}", r"joint_blocks.\1.x_block.attn.qkv", ("to_q", "to_k", "to_v")),
    *fused(BLOCK + r"attn\.{}", r"joint_blocks.\1.context_block.attn.qkv", ("add_q_proj", "add_k_proj", "add_v_proj")),
    *fused(BLOCK + r"attn2\.{}", r"joint_blocks.\1.x_block.attn2.qkv", ("to_q", "to_k", "to_v")),
    Rename(BLOCK + r"attn\.to_out\.0", r"joint_blocks.\1.x_block.attn.proj"),
    Rename(BLOCK + r"attn\.to_add_out", r"joint_blocks.\1.context_block.attn.proj"),
    Rename(BLOCK + r"attn2\.to_out\.0", r"joint_blocks.\1.x_block.attn2.proj"),
    Rename(BLOCK + r"norm1\.linear", r"joint_blocks.\1.x_block.adaLN_modulation.1"),
    Rename(BLOCK + r"norm1_context\.linear", r"joint_blocks.\1.context_block.adaLN_modulation.1",
           swap_halves=two_chunk_modulation),
    Rename(BLOCK + r"ff\.net\.0\.proj", r"joint_blocks.\1.x_block.mlp.fc1"),
    Rename(BLOCK + r"ff\.net\.2", r"joint_blocks.\1.x_block.mlp.fc2"),
    Rename(BLOCK + r"ff_context\.net\.0\.proj", r"joint_blocks.\1.context_block.mlp.fc1"),
    Rename(BLOCK + r"ff_context\.net\.2", r"joint_blocks.\1.context_block.mlp.fc2"),
    Rename(r"pos_embed\.proj", "x_embedder.proj"),
    Rename(r"context_embedder", "context_embedder"),
    Rename(r"time_text_embed\.timestep_embedder\.linear_1", "t_embedder.mlp.0"),
    Rename(r"time_text_embed\.timestep_embedder\.linear_2", "t_embedder.mlp.2"),
    Rename(r"time_text_embed\.text_embedder\.linear_1", "y_embedder.mlp.0"),
    Rename(r"time_text_embed\.text_embedder\.linear_2", "y_embedder.mlp.2"),
    Rename(r"norm_out\.linear", "final_layer.adaLN_modulation.1", swap_halves=always),
    Rename(r"proj_out", "final_layer.linear"),
)
FAMILY = Family("sd3", "SD3", ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline"), "transformer",
                CLIP_PAIR, COMFYUI_LAYOUT)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
call_kwargs = base.call_kwargs
image_vae = base.image_vae
normalized_latents = base.shifted_and_scaled_latents
prediction = base.output_as_is  # the velocity, in the latents' own layout


def add_args(parser):
    """The prompt-length flag of the diffusers SD3 scripts, with its name, meaning and default."""
    base.add_max_sequence_length(parser.add_argument_group("SD3"), "T5 tokens per prompt (default: 77)")
    parser.set_defaults(max_sequence_length=77)


def check_args(args):
    base.check_max_sequence_length(args)


def prompt_settings(pipe, args):
    """How prompts are encoded, in training, validation and class images alike: ``--max_sequence_length`` T5
    tokens."""
    return {"max_sequence_length": args.max_sequence_length}


def prompt_dependencies(pipe, settings):
    """What the prompts' embeddings depend on besides the text encoders' weights, for the disk cache's key: the
    encoding code, the three tokenizers and the settings."""
    return [encode_prompts, pipe.tokenizer, pipe.tokenizer_2, pipe.tokenizer_3, settings]


def encode_prompts(pipe, prompts, device, settings, text_encoders=None):
    """``(prompt_embeds, pooled_prompt_embeds)``, one row per prompt (see the module's docstring). ``text_encoders``
    (by component name) replace the pipeline's: the wrapped modules of those that train."""
    clip_encoder, clip_encoder_2, t5_encoder = (
        (text_encoders or {}).get(name, getattr(pipe, name)) for name in TEXT_ENCODERS)
    hidden_states, pooled = [], []
    for text_encoder, tokenizer in ((clip_encoder, pipe.tokenizer), (clip_encoder_2, pipe.tokenizer_2)):
        output = text_encoder(tokenize(tokenizer, prompts).to(device), output_hidden_states=True)
        hidden_states.append(output.hidden_states[-2])
        pooled.append(output.text_embeds)
    t5_ids = pipe.tokenizer_3(prompts, padding="max_length", max_length=settings["max_sequence_length"],
                              truncation=True, add_special_tokens=True, return_tensors="pt").input_ids
    t5_states = t5_encoder(t5_ids.to(device))[0]
    clip_states = torch.cat(hidden_states, dim=-1)
    clip_states = F.pad(clip_states, (0, t5_states.shape[-1] - clip_states.shape[-1]))
    return torch.cat([clip_states, t5_states], dim=-2), torch.cat(pooled, dim=-1)


def text_inputs(rows):
    """The transformer's text inputs for a batch whose samples have the `encode_prompts` rows ``rows``."""
    return {"encoder_hidden_states": stacked(rows, 0), "pooled_projections": stacked(rows, 1)}


def model_inputs(pipe, noisy_latents, timesteps, text):
    """All the transformer's inputs: the noisy latents as they are, the scheduler's timesteps and ``text``."""
    return {"hidden_states": noisy_latents, "timestep": timesteps, **text}


def controlnet_inputs(pipe, inputs, conditioning_latents):
    """The inputs of ``pipe.controlnet`` (an SD3ControlNetModel) beside the transformer's ``inputs`` (`model_inputs`),
    as ``StableDiffusion3ControlNetPipeline`` gives them: the conditioning image's VAE latents
    (``conditioning_latents``, as the VAE samples them) scaled, and shifted too unless the ControlNet takes zero
    pooled projections (InstantX's, and those ``from_transformer`` makes), which it then gets; the prompt's hidden
    states unless it has no context embedder (SD3.5's official ControlNets)."""
    config, vae_config = pipe.controlnet.config, pipe.vae.config
    zero_pooled = config.force_zeros_for_pooled_projection
    shift = 0 if zero_pooled else vae_config.shift_factor
    pooled = inputs["pooled_projections"]
    return {"hidden_states": inputs["hidden_states"], "timestep": inputs["timestep"],
            "encoder_hidden_states": None if config.joint_attention_dim is None else inputs["encoder_hidden_states"],
            "pooled_projections": torch.zeros_like(pooled) if zero_pooled else pooled,
            "controlnet_cond": (conditioning_latents - shift) * vae_config.scaling_factor}
