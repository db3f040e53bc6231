"""Chroma: its conditioning and latent layout for training, taken from the pipeline itself (`ChromaPipeline`), and
its LoRA layout in ComfyUI.

Chroma is FLUX.1 [schnell]'s transformer with its modulation made by a small network from the timestep alone: T5
is its only text encoder (no CLIP, no pooled embedding) and it takes no guidance embedding. Its transformer reads:

- ``encoder_hidden_states``, ``txt_ids`` and ``attention_mask``: what ``pipe.encode_prompt`` returns, T5's
  hidden states for the prompt padded to ``--max_sequence_length`` (the pipeline's default unless set,
  `prompt_settings`), T5 run with the padding masked, and the mask of the prompt's tokens and its first padding
  token (Chroma's own convention), which the transformer's attention applies. ``txt_ids`` are zeros, one row for
  all prompts (`text_inputs`). The transformer takes the mask over the text and image tokens together, as the
  pipeline extends it (``_prepare_attention_mask``); `model_inputs`, which sees the text and the latents, extends
  it so;
- ``hidden_states`` and ``img_ids``: the VAE latents shifted and scaled by the VAE's ``shift_factor`` and
  ``scaling_factor`` (`normalized_latents`, as the pipeline undoes it before decoding), packed into tokens of 2×2
  patches, and their (0, row, column) ids (`model_inputs`);
- ``timestep``: the scheduler's timestep over 1000, in the latents' dtype.

Its output tokens are unpacked into the latents' layout (`prediction`), where the loss compares them with the
velocity. Training draws its noise levels from the training scheduler's own schedule, which Chroma's configuration
(``use_dynamic_shifting``) leaves unshifted; the pipeline's sampling loop shifts its levels for the image size
(``calculate_shift``): the levels it visits are points of the same path. Every piece is the pipeline's own (its
static helpers, its ``encode_prompt`` and that method's defaults), so training feeds the transformer what the
pipeline's sampling loop feeds it at the same noise level.
"""

from . import base, flux
from .base import stacked
from .layout import Family, Rename

# The original release's module tree (ComfyUI's Chroma model, comfy/ldm/chroma/model.py): diffusers'
# convert_chroma_transformer_checkpoint_to_diffusers, read backwards (FLUX.1's blocks, Chroma's modulation network).
COMFYUI_LAYOUT = (
    *flux.BLOCKS_LAYOUT,
    Rename(r"distilled_guidance_layer\.(in_proj|out_proj)", r"distilled_guidance_layer.\1"),
    Rename(r"distilled_guidance_layer\.layers\.(\d+)\.linear_1", r"distilled_guidance_layer.layers.\1.in_layer"),
    Rename(r"distilled_guidance_layer\.layers\.(\d+)\.linear_2", r"distilled_guidance_layer.layers.\1.out_layer"),
    Rename(r"x_embedder", "img_in"),
    Rename(r"context_embedder", "txt_in"),
    Rename(r"proj_out", "final_layer.linear"),
)
FAMILY = Family("chroma", "Chroma", ("ChromaPipeline",), "transformer", {}, COMFYUI_LAYOUT)
check_args = base.check_max_sequence_length
prompt_settings = base.prompt_length_settings
# The renders guide by classifier-free guidance on the empty prompt, as the pipeline does by default.
call_kwargs = base.call_kwargs
image_vae = base.image_vae
normalized_latents = base.shifted_and_scaled_latents
prediction = base.unpacked_prediction


def add_args(parser):
    """The prompt-encoding flag of the diffusers FLUX.1 script; unset, the pipeline's own default applies."""
    base.add_max_sequence_length(parser.add_argument_group("Chroma"),
                                 "T5 tokens per prompt (default: the pipeline's, 512)")


def prompt_dependencies(pipe, settings):
    """What the prompts' embeddings depend on besides the text encoder's weights, for the disk cache's key: the
    encoding code, the tokenizer and the settings."""
    return [encode_prompts, pipe.tokenizer, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(prompt_embeds, attention_mask)`` of ``pipe.encode_prompt`` (no negative prompt: training has no
    classifier-free guidance), one row per prompt; its ``text_ids`` are zeros, the same for every prompt."""
    prompt_embeds, _, attention_mask, *_ = pipe.encode_prompt(prompts, device=device,
                                                              do_classifier_free_guidance=False, **settings)
    return prompt_embeds, attention_mask


def text_inputs(rows):
    """The transformer's text inputs for a batch whose samples have the `encode_prompts` rows ``rows``: the
    attention mask of the text's tokens, which `model_inputs` extends over the image's."""
    prompt_embeds = stacked(rows, 0)
    return {"encoder_hidden_states": prompt_embeds, "attention_mask": stacked(rows, 1),
            "txt_ids": prompt_embeds.new_zeros(prompt_embeds.shape[1], 3)}


def model_inputs(pipe, noisy_latents, timesteps, text):
    """All the transformer's inputs for `normalized_latents` at ``timesteps``, as the pipeline's denoising loop
    passes them: the latents packed into tokens of 2×2 patches, their (0, row, column) ids, the timesteps in the
    latents' dtype over 1000 (the pipeline's scale; the transformer multiplies it back), and `text_inputs`' attention
    mask extended over the image's tokens as the pipeline extends it (``_prepare_attention_mask``)."""
    batch_size, channels, height, width = noisy_latents.shape
    hidden_states = pipe._pack_latents(noisy_latents, batch_size, channels, height, width)
    attention_mask = pipe._prepare_attention_mask(batch_size, hidden_states.shape[1], hidden_states.dtype,
                                                  text["attention_mask"])
    return {"hidden_states": hidden_states,
            "img_ids": pipe._prepare_latent_image_ids(batch_size, height // 2, width // 2, noisy_latents.device,
                                                      noisy_latents.dtype),
            "timestep": timesteps.to(noisy_latents.dtype) / 1000, **text, "attention_mask": attention_mask}
