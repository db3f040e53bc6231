"""A tiny causal LM for the LLaDA2 script (`examples/discrete_diffusion/train_llada2.py`), in the folder layout
``AutoModelForCausalLM`` and ``AutoTokenizer`` load (config.json, model.safetensors and the tokenizer's files): a
2-layer ``Qwen2ForCausalLM``, the class of upstream's default model (Qwen2.5), its embeddings tied as Qwen2.5-0.5B's
are, and an offline byte-level BPE Qwen tokenizer holding LLaDA2's mask token ``<|mask|>``. LLaDA2's own checkpoints
(``LLaDA2MoeModelLM``) are code from the hub (trust_remote_code), which the script refuses; and a short text corpus.
"""

import json
from pathlib import Path

from .data import SEED
from .parts import tiny_qwen_tokenizer, vocabulary

MASK_TOKEN = "<|mask|>"
STORY_WORDS = ("once", "upon", "time", "there", "was", "and", "it", "is", "with", "next", "to")
# The corpus: one sentence a row of the words the tokenizer holds whole; the empty rows are those that wikitext has
# and upstream drops.
SENTENCES = ("once upon a time there was a red circle", "a blue square is next to a green triangle",
             "the small dog was on a red background", "a big yellow star and a small white circle",
             "there was a photo of a dog in the background", "once upon a time a green square was small")


def tokenizer_with_mask():
    """A real Qwen2 tokenizer (`parts.tiny_qwen_tokenizer`) of the shapes' words and the corpus's, with
    `MASK_TOKEN` as its mask token."""
    tokenizer = tiny_qwen_tokenizer(vocabulary() + list(STORY_WORDS))
    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    return tokenizer


def build_llada2(path):
    """The tiny ``Qwen2ForCausalLM`` (random weights, seed `SEED`) and its tokenizer, saved in one folder."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = tokenizer_with_mask()
    torch.manual_seed(SEED)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def build_llada2_text(path):
    """A dataset folder of one ``train.jsonl``: the `SENTENCES` in a ``text`` column, with empty rows between."""
    Path(path).mkdir(parents=True, exist_ok=True)
    rows = [text for sentence in SENTENCES for text in (sentence, " ")]
    Path(path, "train.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in rows))


FIXTURES = {"llada2": build_llada2, "llada2_text": build_llada2_text}
