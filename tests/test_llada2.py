"""training_utils.llada2: the causal LM checked before it loads, the text batches, and the masked-diffusion objective
(two complementary masked views, never predicting the mask token)."""

import argparse
import json
import math
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from diffusers import BlockRefinementScheduler

from training_utils.errors import UsageError
from training_utils.llada2 import check_causal_lm, masked_diffusion_loss, non_empty_texts, pad_collate

VOCAB, MASK = 11, 10


def test_samples_of_any_length_are_padded_on_the_right_with_a_mask_of_their_tokens():
    batch = pad_collate(pad_token_id=0)([{"input_ids": torch.tensor([5, 6, 7])}, {"input_ids": torch.tensor([8])}])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]


def test_rows_without_text_are_dropped_and_a_column_of_none_is_refused():
    dataset = Dataset.from_dict({"text": ["a text", "  ", "", "another"]})
    assert non_empty_texts(dataset, "text", "--text_column")["text"] == ["a text", "another"]
    with pytest.raises(UsageError, match="--text_column='text': expected a column holding some non-empty text"):
        non_empty_texts(Dataset.from_dict({"text": [" ", ""]}), "text", "--text_column")


class Model(torch.nn.Module):
    """Logits of a fixed table per token id: each position predicts ``table[its true token]``, read from the ids it
    was given where not masked; records the views it saw."""

    def __init__(self, truth, confident):
        super().__init__()
        self.truth, self.confident, self.views = truth, confident, []

    def forward(self, input_ids, attention_mask, position_ids):
        self.views.append(input_ids.clone())
        logits = torch.zeros(*input_ids.shape, VOCAB)
        if self.confident:  # the true token, and the mask token more still: suppressed, it must not count
            logits.scatter_(-1, self.truth[..., None], 50.0)
            logits[..., MASK] = 100.0
        return SimpleNamespace(logits=logits)


def test_the_two_views_mask_complementary_tokens_after_the_prompt_and_the_mask_token_is_never_predicted():
    torch.manual_seed(0)
    input_ids = torch.randint(0, MASK, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 10:] = 0
    scheduler = BlockRefinementScheduler(block_length=4)
    confident = Model(input_ids, confident=True)
    loss, cross_entropy, confidence = masked_diffusion_loss(confident, input_ids, attention_mask, scheduler, MASK,
                                                            prompt_length=4, block_length=4, lambda_conf=0.0,
                                                            temperature=1.0)
    first, second = (view == MASK for view in confident.views)
    assert not first[:, :4].any() and not second[:, :4].any()  # the prompt is never masked
    # Every token after the prompt is masked in exactly one view (the padding in none).
    assert not (first & second).any() and ((first | second) == ((torch.arange(12) >= 4) & attention_mask.bool())).all()
    assert cross_entropy < 1e-6 and loss == cross_entropy  # right everywhere, the mask token's lure suppressed
    uniform = Model(input_ids, confident=False)
    _, cross_entropy, _ = masked_diffusion_loss(uniform, input_ids, attention_mask, scheduler, MASK, prompt_length=4,
                                                block_length=4, lambda_conf=0.0, temperature=1.0)
    # Every masked token at chance among the VOCAB - 1 tokens it may be, in each of the two views.
    assert cross_entropy.item() == pytest.approx(2 * math.log(VOCAB - 1), rel=1e-5)


def test_a_model_that_needs_code_from_the_hub_is_refused_before_it_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llada2_moe", "architectures": ["LLaDA2MoeModelLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"}}))
    args = argparse.Namespace(pretrained_model_name_or_path=str(tmp_path), revision=None, cache_dir=None)
    with pytest.raises(UsageError, match="code from the hub \\(trust_remote_code"):
        check_causal_lm(args)
