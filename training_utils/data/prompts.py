"""A step's text conditioning, from each sample's prompt: the rows its text encoders made for that prompt.

A family's ``encode_prompts`` turns prompts into a tuple of batch-first tensors, its parts (e.g. the hidden states
and a pooled embedding); a prompt's row is its slice of each part. Frozen text encoders embed every prompt once,
before training (`frozen_encoders.FrozenEncoders.text_embeddings`, in the chunks of `text_chunk_encoder`); text encoders that
train encode a step's prompts in the step. Either way the step gets each sample's row (`cached_rows`,
`encoded_rows`), and the family's ``text_inputs`` batches the rows into the model's text inputs.
"""

import torch

from .feature_store import Block


def cached_rows(embeddings, device):
    """``rows(prompts)``: each prompt's row as the frozen text encoders embedded it before training (``embeddings``,
    ``{prompt: row}``), on ``device``."""
    def rows(prompts):
        return [tuple(part.to(device, non_blocking=True) for part in embeddings[prompt]) for prompt in prompts]

    return rows


def encoded_rows(encode):
    """``rows(prompts)``: the prompts encoded in the step by ``encode(prompts)`` (text encoders that train, so that
    gradients reach them), split into rows."""
    def rows(prompts):
        return list(zip(*encode(list(prompts))))

    return rows


def text_chunk_encoder(captions, encode):
    """``encode_chunk(indices)`` for `feature_store.encode_once`: ``encode(list of captions)`` as a `Block` on the
    CPU, a row per caption.

    ``encode`` returns a tensor or a tuple of them, its parts (e.g. SDXL's hidden states and pooled embeddings):
    what a family's ``encode_prompts`` or a pipeline's ``encode_prompt`` returns. A part is batch-first (a row per
    caption), or one for all the captions, as FLUX.1's ``text_ids`` are: such a part does not start with one row
    when one caption is encoded, and each caption's row is the whole of it."""
    shared = []  # whether each part is one for all the captions, found by encoding one caption

    def parts_of(texts):
        encoded = encode(texts)
        return (encoded,) if isinstance(encoded, torch.Tensor) else tuple(encoded)

    def encode_chunk(indices):
        parts = parts_of([captions[index] for index in indices])
        if not shared:
            one = parts if len(indices) == 1 else parts_of([captions[indices[0]]])
            shared.extend(part.dim() == 0 or part.shape[0] != 1 for part in one)
        rows = {}
        for number, (part, whole) in enumerate(zip(parts, shared, strict=True)):
            if whole or part.shape[0] != len(indices):
                part = part.expand(len(indices), *part.shape)
            rows[str(number)] = part.cpu()
        return Block(torch.tensor(indices, dtype=torch.int64), rows, {})

    return encode_chunk


def embeddings_by_caption(captions, blocks):
    """``{caption: row}`` from the blocks of `text_chunk_encoder`, in ``captions``' order; a row is a tuple of
    tensors, one per part of what ``encode`` returned."""
    found = {}
    for block in blocks:
        parts = [block.tensors[str(number)] for number in range(len(block.tensors))]
        found.update(zip(block.indices.tolist(), zip(*parts)))
    return {caption: found[index] for index, caption in enumerate(captions)}

