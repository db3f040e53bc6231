"""Stable Diffusion 3's conditioning, for the SD3 training scripts.

The MMDiT transformer reads two text inputs, computed here as ``StableDiffusion3Pipeline.encode_prompt``
computes them at inference (without classifier-free guidance):

- ``encoder_hidden_states``: both CLIP encoders' penultimate hidden states, concatenated on the feature
  axis and zero-padded to T5's width, followed on the sequence axis by T5's last hidden states;
- ``pooled_projections``: both CLIP encoders' projected (pooled) outputs, concatenated.

The encoders are arguments, not the pipeline's attributes, so a script passes the modules that
``accelerator.prepare`` wrapped and gradients reach trained encoders (the pipeline's method would
call the unwrapped ones). Also the SD3 scripts' own flags: the T5 sequence length and the loss's
preconditioning (the flow-matching flags and timesteps are `flow_matching`'s).
"""

import torch
import torch.nn.functional as F

from .data import tokenize
from .errors import require


def add_sd3_args(parser):
    """The prompt-length and loss flags of the diffusers SD3 scripts, with their names and meanings."""
    group = parser.add_argument_group("SD3")
    group.add_argument("--max_sequence_length", type=int, default=77, help="T5 tokens per prompt")
    group.add_argument("--precondition_outputs", type=int, default=1, choices=[0, 1],
                       help="1: turn the predicted velocity into a clean-latent estimate and regress that (EDM-style); "
                            "0: regress the velocity noise - latents")


def check_sd3_args(args):
    require(args.max_sequence_length > 0, "--max_sequence_length", args.max_sequence_length, "a positive integer")


def tokenize_prompt(tokenizers, texts, max_sequence_length):
    """Token ids of ``texts`` for the two CLIP tokenizers and T5's, padded as ``encode_prompt`` pads them."""
    clip_tokenizer, clip_tokenizer_2, t5_tokenizer = tokenizers
    t5_ids = t5_tokenizer(texts, padding="max_length", max_length=max_sequence_length, truncation=True,
                          add_special_tokens=True, return_tensors="pt").input_ids
    return [tokenize(clip_tokenizer, texts), tokenize(clip_tokenizer_2, texts), t5_ids]


def encode_prompt(text_encoders, input_ids):
    """``(prompt_embeds, pooled_prompt_embeds)`` from the three encoders' ids (see the module's docstring)."""
    *clip_encoders, t5_encoder = text_encoders
    *clip_ids, t5_ids = input_ids
    hidden_states, pooled = [], []
    for text_encoder, ids in zip(clip_encoders, clip_ids):
        output = text_encoder(ids, output_hidden_states=True)
        hidden_states.append(output.hidden_states[-2])
        pooled.append(output.text_embeds)
    t5_states = t5_encoder(t5_ids)[0]
    clip_states = torch.cat(hidden_states, dim=-1)
    clip_states = F.pad(clip_states, (0, t5_states.shape[-1] - clip_states.shape[-1]))
    return torch.cat([clip_states, t5_states], dim=-2), torch.cat(pooled, dim=-1)

