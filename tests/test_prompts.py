"""training_utils.data.prompts: the prompt-length flag most transformer families share."""

import types

import pytest

from training_utils.data.prompts import check_max_sequence_length, max_sequence_length
from training_utils.errors import UsageError


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
