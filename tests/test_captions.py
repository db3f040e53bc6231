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
from training_utils.data.captions import (check_captions, check_metadata, cut_captions_warning, read_caption_file,
                                         without_bom)
from training_utils.data.datasets import load_train_dataset
from training_utils.data.dreambooth import sidecar_captioned_images
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


def test_a_leading_byte_order_mark_is_no_part_of_a_caption_file_or_a_metadata_file(tmp_path):
    sidecar = tmp_path / "a.txt"
    sidecar.write_text("sks triangle\n", encoding="utf-8-sig")  # Windows Notepad's "UTF-8 with BOM"
    assert read_caption_file(sidecar, "--caption_extension", ".txt") == "sks triangle"
    sidecar.write_bytes(b"")
    assert read_caption_file(sidecar, "--caption_extension", ".txt") == ""
    path = metadata(tmp_path / "data", {"file_name": "0.png", "text": "sks 0"}, {"file_name": "1.png", "text": "a"})
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    check_metadata(path, "--train_data_dir", str(tmp_path / "data"), "text")


def test_captions_of_a_dataset_column_lose_a_leading_byte_order_mark(tmp_path):
    metadata(tmp_path / "data", {"file_name": "0.png", "text": "\ufeffsks triangle"},
             {"file_name": "1.png", "text": "\ufeffsks circle"}, {"file_name": "2.png", "text": "a"})
    args = training_parser("test").parse_args(["--pretrained_model_name_or_path", "x/y", "--train_data_dir",
                                               str(tmp_path / "data"), "--cache_dir", str(tmp_path / "cache")])
    dataset = load_train_dataset(args, {"--image_column": "image", "--caption_column": "text"})
    assert list(dataset["text"]) == ["sks triangle", "sks circle", "a"]
    assert without_bom(["\ufeffa", "b"]) == ["a", "b"] and without_bom(7) == 7


def test_sidecar_caption_files_that_are_empty_are_counted_in_one_warning(tmp_path, caplog):
    images = []
    for name, text in (("0", "sks triangle"), ("1", ""), ("2", None)):
        images.append(tmp_path / f"{name}.png")
        Image.new("RGB", (8, 8)).save(images[-1])
        if text is not None:
            (tmp_path / f"{name}.txt").write_text(text)
    with caplog.at_level(logging.WARNING):
        instance = sidecar_captioned_images(images, ".txt", "a photo of sks")
    assert instance.captions == ["sks triangle", "", "a photo of sks"]
    assert "1 of 3 .txt caption files are empty: those images train on the empty caption, without the trigger " \
           "word" in caplog.text


def test_a_metadata_line_naming_a_file_that_is_not_there_is_named_before_anything_loads(tmp_path):
    path = metadata(tmp_path / "data", {"file_name": "0.png", "text": "a"}, {"file_name": "1.png", "text": "b"},
                    {"file_name": "gone.png", "text": "c"})
    (tmp_path / "data" / "2.png").unlink()
    with pytest.raises(UsageError) as error:
        check_metadata(path, "--train_data_dir", str(tmp_path / "data"), "text")
    assert str(error.value).endswith(f'line 3 has "file_name": "gone.png", and {tmp_path / "data" / "gone.png"} '
                                     "is not there")
    path.write_text(json.dumps({"file_name": "0.png", "text": "a", "reference_file_names": ["1.png", "r.png"]}))
    with pytest.raises(UsageError, match='line 1 has "reference_file_names": "r.png"'):
        check_metadata(path, "--train_data_dir", str(tmp_path / "data"))


def image_column_args(tmp_path, data):
    return training_parser("test").parse_args(["--pretrained_model_name_or_path", "x/y", "--dataset_name", str(data),
                                               "--cache_dir", str(tmp_path / "cache")])


def test_an_image_column_of_captions_stops_and_one_of_image_paths_holds_their_images(tmp_path):
    data = tmp_path / "data"
    metadata(data, {"file_name": "0.png", "text": "a"}, {"file_name": "1.png", "text": "b"})
    with pytest.raises(UsageError, match="^--image_column='text': expected a column of images \\(or of image files' "
                                         "paths\\): row 0 has 'a'$"):
        load_train_dataset(image_column_args(tmp_path, data), {"--image_column": "text", "--caption_column": "text"})
    table = tmp_path / "table"
    table.mkdir()
    Image.new("RGB", (8, 6)).save(table / "0.png")
    (table / "train.jsonl").write_text(json.dumps({"path": "0.png", "text": "a", "size": 3}) + "\n")
    dataset = load_train_dataset(image_column_args(tmp_path, table), {"--image_column": "path",
                                                                      "--caption_column": "text"})
    assert isinstance(dataset.features["path"], datasets.Image) and dataset[0]["path"].size == (8, 6)
    with pytest.raises(UsageError, match="^--image_column='size': expected a column of images \\(or of image files' "
                                         "paths\\): it holds Value\\('int64'\\)$"):
        load_train_dataset(image_column_args(tmp_path, table), {"--image_column": "size"})


@pytest.mark.parametrize("change, expected", [
    ("missing", 'line 2 has "file_name": "1.png", and {data}/1.png is not there'),
    ("text column", "--image_column='text': expected a column of images (or of image files' paths): row 0 has 'a'"),
])
def test_a_script_stops_on_a_missing_image_or_a_column_of_text_given_as_images_before_anything_loads(
        tmp_path, change, expected):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    metadata(tmp_path / "data", {"file_name": "0.png", "text": "a"}, {"file_name": "1.png", "text": "b"})
    if change == "missing":
        (tmp_path / "data" / "1.png").unlink()
    line = usage_error("text_to_image/train_text_to_image_lora.py", "--pretrained_model_name_or_path", model,
                       "--train_data_dir", tmp_path / "data", "--output_dir", tmp_path / "out",
                       *(["--image_column", "text"] if change == "text column" else []))
    assert line.endswith(expected.format(data=tmp_path / "data"))
