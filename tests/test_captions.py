"""Captions as people write them (training_utils.data.captions): a row without one is named by file and line before
anything loads, and captions the text encoder cuts are counted."""

import json
import logging

import datasets
import pytest
import torch
from PIL import Image

from helpers import usage_error
from training_utils.args import training_parser
from training_utils.data.captions import check_captions, check_metadata, cut_captions_warning
from training_utils.data.datasets import load_train_dataset
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform
from training_utils.errors import UsageError
from training_utils.testing.tiny import parts as tiny

EXPECTED = "a caption (a string, or a list of strings) in every line of"


def metadata(folder, *lines):
    """An imagefolder in ``folder``: an image per line of ``metadata.jsonl`` (raw bytes, or JSON objects)."""
    folder.mkdir(exist_ok=True)
    path = folder / "metadata.jsonl"
    rows = [line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines]
    path.write_bytes(b"\n".join(rows) + b"\n")
    for number in range(len(lines)):
        Image.new("RGB", (8, 8)).save(folder / f"{number}.png")
    return path


@pytest.mark.parametrize("row, has", [
    ({"file_name": "1.png"}, 'has no "text"'),
    ({"file_name": "1.png", "text": None}, 'has "text": null'),
    ({"file_name": "1.png", "text": 7}, 'has "text": 7'),
    ({"file_name": "1.png", "text": []}, 'has "text": []'),
    ({"file_name": "1.png", "text": ["a", None]}, 'has "text": ["a", null]'),
])
def test_a_line_without_a_caption_is_named_by_file_and_line(tmp_path, row, has):
    path = metadata(tmp_path, {"file_name": "0.png", "text": "a red circle"}, row)
    with pytest.raises(UsageError) as error:
        check_metadata(path, "--train_data_dir", str(tmp_path), "text")
    assert str(error.value) == (f"--train_data_dir={str(tmp_path)!r}: expected {EXPECTED} {path}: line 2 {has}; "
                                f'write "text": "" for an empty caption')


def test_a_line_that_is_not_utf8_is_named_by_file_line_and_byte(tmp_path):
    path = metadata(tmp_path, {"file_name": "0.png", "text": "ok"}, b'{"file_name": "1.png", "text": "caf\xe9"}')
    with pytest.raises(UsageError, match=f"expected UTF-8 text in {path}: line 2 is not \\(byte 0xe9 at position "
                                         f"36\\)$"):
        check_metadata(path, "--train_data_dir", str(tmp_path), "text")


def test_empty_and_listed_captions_are_captions_and_a_column_no_line_has_is_left_to_the_column_check(tmp_path):
    path = metadata(tmp_path, {"file_name": "0.png", "text": ""}, {"file_name": "1.png", "text": ["a", "b"]})
    check_metadata(path, "--train_data_dir", str(tmp_path), "text")
    check_metadata(path, "--train_data_dir", str(tmp_path), "caption")


def test_a_dataset_row_without_a_caption_is_named_by_its_index():
    check_captions(datasets.Dataset.from_dict({"text": ["a", ""]}), "text")
    with pytest.raises(UsageError, match="^--caption_column='text': expected a caption \\(a string, or a list of "
                                         "strings\\) in every row: row 1 has null; "):
        check_captions(datasets.Dataset.from_dict({"text": ["a", None]}), "text")


def test_a_script_stops_on_a_null_caption_before_anything_loads(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    path = metadata(tmp_path / "data", {"file_name": "0.png", "text": "a"}, {"file_name": "1.png", "text": None})
    line = usage_error("text_to_image/train_text_to_image_lora.py", "--pretrained_model_name_or_path", model,
                       "--train_data_dir", tmp_path / "data", "--output_dir", tmp_path / "out")
    assert line.endswith(f'{path}: line 2 has "text": null; write "text": "" for an empty caption')


def test_captions_longer_than_a_tokenizer_takes_are_counted_in_one_line():
    tokenizer = tiny.tiny_clip_tokenizer(model_max_length=8)
    captions = ["a red circle", "a red circle on a blue square beside a green triangle", ""]
    assert cut_captions_warning(captions, [tokenizer]) == (
        "captions cut to fit the text encoders: 1 of 3 longer than the 8 tokens CLIPTokenizer takes ('a red circle on "
        "a blue square beside a g...')")
    assert cut_captions_warning(captions[:1], [tokenizer]) is None
    assert "2 of 3 longer than the 4 tokens" in cut_captions_warning(captions, [tokenizer, {"max_sequence_length": 4}])


def test_the_text_embeddings_warn_of_cut_captions(caplog):
    tokenizer = tiny.tiny_clip_tokenizer(model_max_length=8)
    encoders = FrozenEncoders(None, [], ImageTransform(8), "cpu", torch.float32)
    encoders.text_embeddings(["short", "a caption of many more words than eight tokens"],
                             lambda texts: torch.zeros(len(texts), 2), depends_on=[tokenizer])
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings == ["captions cut to fit the text encoders: 1 of 2 longer than the 8 tokens CLIPTokenizer takes "
                        "('a caption of many more words than eight ...')"]


def test_a_dataset_folder_given_as_dataset_name_is_checked_line_by_line_too(tmp_path):
    path = metadata(tmp_path / "data", {"file_name": "0.png", "text": "a"}, b'{"file_name": "1.png", "text": "\xff"}')
    args = training_parser("test").parse_args(["--pretrained_model_name_or_path", "x/y", "--dataset_name",
                                               str(tmp_path / "data"), "--cache_dir", str(tmp_path / "cache")])
    with pytest.raises(UsageError, match=f"^--dataset_name='{tmp_path / 'data'}': expected UTF-8 text in {path}: "
                                         f"line 2 is not"):
        load_train_dataset(args, {"--image_column": "image", "--caption_column": "text"})
