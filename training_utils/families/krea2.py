"""Krea 2: its conditioning and latent layout for training, taken from the pipeline itself (`Krea2Pipeline`), and
its LoRA layout in ComfyUI.

The Krea 2 transformer reads:

- ``encoder_hidden_states`` and ``encoder_attention_mask``: what ``pipe.encode_prompt`` returns, the Qwen3-VL text
  encoder's hidden states at the pipeline's taps (its ``text_encoder_select_layers``) stacked on their own axis,
  for the prompt wrapped in the pipeline's template (a system prefix, the prompt padded to a fixed length, then the
  assistant suffix), the prefix's 34 tokens dropped, ``--max_sequence_length`` tokens in all (the pipeline's default
  unless set, `prompt_settings`), and the mask of the real ones;
- ``hidden_states``: the VAE's latents, a one-frame video ``(B, C, 1, h, w)``, standardised per channel with the
  VAE configuration's ``latents_mean`` and ``latents_std`` (Qwen-Image's VAE and convention:
  `qwen_image.image_vae`, `qwen_image.normalized_latents`), packed into tokens of the pipeline's ``patch_size``
  square patches (`model_inputs`);
- ``position_ids``: the rotary coordinates of the text and image tokens together, the text's at the origin and each
  image token at (0, row, column), as ``pipe.prepare_position_ids`` makes them (`model_inputs`, from the text's
  length and the latents' grid);
- ``timestep``: the scheduler's timestep over its ``num_train_timesteps``, then in the latents' dtype. No guidance
  embedding: Krea 2 guides by classifier-free guidance at sampling only.

Its output tokens are unpacked into the latents' layout (`prediction`), where the loss compares them with the
velocity. Training draws its noise levels from the training scheduler's own schedule, which Krea 2's configuration
(``use_dynamic_shifting``) leaves unshifted; the pipeline's sampling loop shifts its levels for the image size
(``calculate_shift``; a fixed ``mu`` for the distilled Turbo): the levels it visits are points of the same path.
Every piece is the pipeline's own, so training feeds the transformer what the pipeline's sampling loop feeds it at
the same noise level.
"""

import torch

from . import base, qwen_image
from .layout import Family, Rename

# The blocks of the image stage and of the text-fusion stages, and each block's linear layers.
STAGES = {"transformer_blocks": "blocks", r"text_fusion\.layerwise_blocks": "txtfusion.layerwise_blocks",
          r"text_fusion\.refiner_blocks": "txtfusion.refiner_blocks"}
BLOCK_LAYERS = {r"attn\.to_q": "attn.wq", r"attn\.to_k": "attn.wk", r"attn\.to_v": "attn.wv",
                r"attn\.to_out\.0": "attn.wo", r"attn\.to_gate": "attn.gate", r"ff\.(gate|up|down)": r"mlp.\2"}
# The original release's module tree (ComfyUI's Krea 2 model, comfy/ldm/krea2/model.py): diffusers'
# convert_krea2_transformer_checkpoint_to_diffusers, read backwards.
COMFYUI_LAYOUT = (
    *(Rename(rf"{stage}\.(\d+)\.{layer}", rf"{original}.\1.{name}")
      for stage, original in STAGES.items() for layer, name in BLOCK_LAYERS.items()),
    Rename(r"text_fusion\.projector", "txtfusion.projector"),
    Rename(r"img_in", "first"),
    Rename(r"time_embed\.linear_1", "tmlp.0"),
    Rename(r"time_embed\.linear_2", "tmlp.2"),
    Rename(r"time_mod_proj", "tproj.1"),
    Rename(r"txt_in\.linear_1", "txtmlp.1"),
    Rename(r"txt_in\.linear_2", "txtmlp.3"),
    Rename(r"final_layer\.linear", "last.linear"),
)
FAMILY = Family("krea2", "Krea 2", ("Krea2Pipeline",), "transformer", {}, COMFYUI_LAYOUT)
prompt_settings = base.prompt_length_settings
# The renders guide by classifier-free guidance on the empty prompt, as the pipeline does by default.
call_kwargs = base.call_kwargs
text_inputs = base.masked_text_inputs
# Qwen-Image's VAE and latents' standardisation.
image_vae = qwen_image.image_vae
normalized_latents = qwen_image.normalized_latents


def add_args(parser):
    """The prompt-encoding flag of the diffusers Krea 2 script; unset, the pipeline's own default applies."""
    base.add_max_sequence_length(parser.add_argument_group("Krea 2"), "text tokens per prompt, padding and the "
                                 "template's suffix included (default: the pipeline's, 512)")


def check_args(args):
    """Fail in one line on a bad prompt length or image size, before any weights load: the size is checked against
    the VAE's configuration, which loads without weights."""
    base.check_max_sequence_length(args)
    qwen_image.check_resolution(args, "a Krea 2 pipeline")


def prompt_dependencies(pipe, settings):
    """What the prompts' embeddings depend on besides the text encoder's weights, for the disk cache's key: the
    encoding code, the tokenizer, the pipeline's template (not the tokenizer's) and how much of it is dropped, the
    hidden states it taps, and the settings."""
    return [encode_prompts, pipe.tokenizer, pipe.prompt_template_encode_prefix, pipe.prompt_template_encode_suffix,
            pipe.prompt_template_encode_start_idx, pipe.text_encoder_select_layers, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(prompt_embeds, prompt_embeds_mask)`` of ``pipe.encode_prompt``, one row per prompt."""
    return pipe.encode_prompt(prompts, device=device, **settings)


def model_inputs(pipe, noisy_latents, timesteps, text):
    """All the transformer's inputs for `normalized_latents` ``(B, C, 1, h, w)`` at ``timesteps``, as the
    pipeline's denoising loop passes them: the latents packed into tokens of ``patch_size`` square patches, the
    rotary coordinates of the `text_inputs` ``text`` (at the origin) and then of the image's tokens, and the timesteps
    over the scheduler's ``num_train_timesteps``, then in the latents' dtype (the pipeline's order of the two)."""
    batch_size, channels, _, height, width = noisy_latents.shape
    patch, device = pipe.patch_size, noisy_latents.device
    position_ids = torch.cat([pipe.prepare_position_ids(text["encoder_hidden_states"].shape[1], 0, 0, device),
                              pipe.prepare_position_ids(0, height // patch, width // patch, device)])
    return {"hidden_states": pipe._pack_latents(noisy_latents, batch_size, channels, height, width),
            "position_ids": position_ids,
            "timestep": (timesteps / pipe.scheduler.config.num_train_timesteps).to(noisy_latents.dtype), **text}


def prediction(pipe, output, latents):
    """The transformer's output tokens in the layout of the `normalized_latents` ``latents``, ``(B, C, 1, h, w)``:
    the velocity it predicts."""
    height, width = latents.shape[-2:]
    scale = pipe.vae_scale_factor  # the unpacking takes the image's size in pixels
    return pipe._unpack_latents(output, height * scale, width * scale)
