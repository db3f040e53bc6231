"""training_utils.families.base: what several families share, the prompt-length flag and the text helpers among it."""

import types

import pytest
import torch

from training_utils.errors import UsageError
from training_utils.families.base import check_max_sequence_length, max_sequence_length, tokenize


class Pipeline:
    def encode_prompt(self, prompt, max_sequence_length=512):
        pass

    def __call__(self, prompt, max_sequence_length=226):
        pass


@pytest.mark.parametrize("value, expected", [(None, 512), (77, 77)])
def test_an_unset_length_is_the_pipelines_encode_prompt_default(value, expected):
    assert max_sequence_length(Pipeline(), types.SimpleNamespace(max_sequence_length=value)) == expected


def test_a_pipeline_that_passes_its_own_length_gives_its_calls_default():
    assert max_sequence_length(Pipeline(), types.SimpleNamespace(max_sequence_length=None), "__call__") == 226


@pytest.mark.parametrize("value", [0, -3])
def test_a_length_that_is_not_positive_fails_in_one_line(value):
    with pytest.raises(UsageError, match=f"--max_sequence_length={value}: expected a positive integer"):
        check_max_sequence_length(types.SimpleNamespace(max_sequence_length=value))
    check_max_sequence_length(types.SimpleNamespace(max_sequence_length=None))


def test_a_length_over_the_pipelines_limit_fails_in_one_line_naming_it():
    with pytest.raises(UsageError, match="--max_sequence_length=513: expected a positive integer of at most 512 "
                                         r"\(FluxPipeline's limit\)"):
        check_max_sequence_length(types.SimpleNamespace(max_sequence_length=513), 512, "FluxPipeline")
    check_max_sequence_length(types.SimpleNamespace(max_sequence_length=512), 512, "FluxPipeline")


def test_tokenize_pads_to_max_length(tiny_sd_pipe):
    tokenizer = tiny_sd_pipe.tokenizer
    ids = tokenize(tokenizer, ["a red circle", "a blue square on a white background"])
    assert ids.shape == (2, tokenizer.model_max_length) == (2, 77)
    assert ids.dtype == torch.long
    assert not torch.equal(ids[0], ids[1])
    expected = tokenizer("a red circle").input_ids
    assert ids[0, : len(expected)].tolist() == expected
    assert torch.all(ids[0, len(expected):] == tokenizer.pad_token_id)


def test_tokenize_truncates(tiny_sd_pipe):
    tokenizer = tiny_sd_pipe.tokenizer
    ids = tokenize(tokenizer, ["red " * 200])
    assert ids.shape == (1, 77)
    assert ids[0, -1].item() == tokenizer.eos_token_id
