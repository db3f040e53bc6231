"""Lumina 2 (Lumina-Image 2.0): its conditioning and latent layout for training, taken from the pipeline itself
(`Lumina2Pipeline`), and its LoRA layout in ComfyUI.

The Lumina 2 transformer reads:

- ``encoder_hidden_states`` and ``encoder_attention_mask``: what ``pipe.encode_prompt`` returns, the Gemma 2 text
  encoder's second-to-last hidden states for the prompt behind the system prompt (``"<system prompt> <Prompt Start>
  <prompt>"``), padded to ``--max_sequence_length``, with the attention mask of its tokens. The system prompt is
  the pipeline's own (``pipe.system_prompt``) unless ``--system_prompt`` says otherwise, and the length the
  pipeline's call's default unless ``--max_sequence_length`` does (`prompt_settings`); the same go to every render;
- ``hidden_states``: the VAE latents shifted and scaled by the VAE's ``shift_factor`` and ``scaling_factor``, as
  the pipeline undoes it before decoding (`normalized_latents`);
- ``timestep``: ``1 - timestep / 1000``, i.e. ``1 - sigma``: Lumina 2 counts time from the noise (0) to the image
  (1).

It predicts the opposite of flow matching's velocity ``noise - x_0``: the pipeline negates its output before the
scheduler steps, and `prediction` does the same, so the loss compares like with like (upstream's script trains the
same: its target is ``x_0 - noise``). The training noise levels come from the training scheduler made from the
pipeline's scheduler configuration (its static ``shift``; the pipeline's ``mu`` only applies with
``use_dynamic_shifting``).
"""

from . import base
from .layout import Family, Rename, fused

# Lumina2Pipeline refuses longer prompts (its check_inputs), so a longer setting would fail at the first validation.
MAX_SEQUENCE_LENGTH_LIMIT = 512
# The original release's module tree (Alpha-VLLM's NextDiT, ComfyUI's Lumina 2 model): diffusers'
# convert_lumina2_to_diffusers (loaders/single_file_utils.py), read backwards. Its fused qkv projection holds the
# queries of all heads, then the keys and values of the key-value heads: 24 and 8 heads in Lumina-Image 2.0.
BLOCK = r"((?:layers|noise_refiner|context_refiner)\.\d+)\."
COMFYUI_LAYOUT = (
    *fused(BLOCK + r"attn\.{}", r"\1.attention.qkv", ("to_q", "to_k", "to_v"), sizes=(3, 1, 1)),
    Rename(BLOCK + r"attn\.to_out\.0", r"\1.attention.out"),
    Rename(BLOCK + r"feed_forward\.linear_([123])", r"\1.feed_forward.w\2"),
    Rename(BLOCK + r"norm1\.linear", r"\1.adaLN_modulation.1"),
    Rename(r"time_caption_embed\.timestep_embedder\.linear_1", "t_embedder.mlp.0"),
    Rename(r"time_caption_embed\.timestep_embedder\.linear_2", "t_embedder.mlp.2"),
    Rename(r"time_caption_embed\.caption_embedder\.1", "cap_embedder.1"),
    Rename(r"x_embedder", "x_embedder"),
    Rename(r"norm_out\.linear_1", "final_layer.adaLN_modulation.1"),
    Rename(r"norm_out\.linear_2", "final_layer.linear"),
)
FAMILY = Family("lumina2", "Lumina 2", ("Lumina2Pipeline",), "transformer", {}, COMFYUI_LAYOUT)
call_kwargs = base.call_kwargs
text_inputs = base.masked_text_inputs  # every prompt is padded to the same length: rows batch as they are
image_vae = base.image_vae
normalized_latents = base.shifted_and_scaled_latents


def add_args(parser):
    """The prompt-encoding flags of the diffusers Lumina 2 script; unset, the pipeline's own apply."""
    group = parser.add_argument_group("Lumina 2")
    base.add_max_sequence_length(group, "tokens per prompt, its system prompt included (default: the pipeline's, 256)")
    group.add_argument("--system_prompt", default=None,
                       help="the system prompt written before every prompt (default: Lumina2Pipeline's own)")


def check_args(args):
    base.check_max_sequence_length(args, MAX_SEQUENCE_LENGTH_LIMIT, "Lumina2Pipeline")


def prompt_settings(pipe, args):
    """What the pipeline encodes prompts with, in training, validation and class images alike:
    ``--system_prompt`` (else the pipeline's ``system_prompt``) and ``--max_sequence_length`` (else the default of
    the pipeline's call, which it passes to encode_prompt)."""
    return {"max_sequence_length": base.max_sequence_length(pipe, args, "__call__"),
            "system_prompt": pipe.system_prompt if args.system_prompt is None else args.system_prompt}


def prompt_dependencies(pipe, settings):
    """What the prompts' embeddings depend on besides the text encoder's weights, for the disk cache's key: the
    encoding code, the tokenizer and the settings (the system prompt among them)."""
    return [encode_prompts, pipe.tokenizer, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(prompt_embeds, prompt_attention_mask)`` of ``pipe.encode_prompt``, one row per prompt (every prompt is
    padded to the same length, so rows batch as they are)."""
    prompt_embeds, mask, _, _ = pipe.encode_prompt(list(prompts), do_classifier_free_guidance=False, device=device,
                                                   **settings)
    return prompt_embeds, mask


def model_inputs(pipe, noisy_latents, timesteps, text):
    """All the transformer's inputs at the scheduler's ``timesteps``, as the sampling loop passes them: the
    latents, and ``1 - timesteps / 1000`` (Lumina 2's time runs from the noise to the image)."""
    return {"hidden_states": noisy_latents,
            "timestep": 1 - timesteps.to(noisy_latents.dtype) / pipe.scheduler.config.num_train_timesteps, **text}


def prediction(pipe, output, latents):
    """The velocity the pipeline steps the scheduler with: the transformer's output, negated as the pipeline
    negates it."""
    return -output
