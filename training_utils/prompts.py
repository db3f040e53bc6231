"""A step's text conditioning, from each sample's prompt: the rows its text encoders made for that prompt.

A family's ``encode_prompts`` turns prompts into a tuple of batch-first tensors, its parts (e.g. the hidden states
and a pooled embedding); a prompt's row is its slice of each part. Frozen text encoders embed every prompt once,
before training (`cache.FrozenEncoders.text_embeddings`); text encoders that train encode a step's prompts in the
step. Either way the step gets each sample's row (`cached_rows`, `encoded_rows`), and the family's ``text_inputs``
batches the rows into the model's text inputs.
"""

import torch


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


def stacked(rows, part):
    """Part ``part`` of every row, stacked into a batch."""
    return torch.stack([row[part] for row in rows])
