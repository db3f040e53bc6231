"""Outputs written atomically and checked once written (training_utils.writing)."""

import pytest
import torch
from safetensors.torch import save_file

from training_utils.errors import WRITE_FAILED_EXIT_CODE, RunStopped
from training_utils.writing import save_model, saved_tensors, verify_saved_tensors, write_atomically


def test_verify_saved_tensors_catches_differences():
    tensors = {"a": torch.ones(2), "b": torch.zeros(3)}
    verify_saved_tensors(dict(tensors), tensors, "x")
    with pytest.raises(RuntimeError, match="different \\['a'\\]"):
        verify_saved_tensors(tensors, {"a": torch.ones(2) * 2, "b": torch.zeros(3)}, "x")
    with pytest.raises(RuntimeError, match="missing \\['c'\\]"):
        verify_saved_tensors(tensors, {**tensors, "c": torch.ones(1)}, "x")
    with pytest.raises(RuntimeError, match="unexpected \\['b'\\]"):
        verify_saved_tensors(tensors, {"a": torch.ones(2)}, "x")
    with pytest.raises(RuntimeError, match="different"):
        verify_saved_tensors({"a": torch.tensor([1.0, 1.0 + 1e-7])}, {"a": torch.ones(2)}, "x")


def test_write_atomically_moves_nested_files_and_leaves_no_staging(tmp_path):
    def write(staging):
        (tmp_path / "seen").write_text(staging)
        (tmp_path.joinpath(staging, "sub")).mkdir()
        (tmp_path.joinpath(staging, "sub", "a.txt")).write_text("a")

    write_atomically(tmp_path / "out", write)
    assert (tmp_path / "out" / "sub" / "a.txt").read_text() == "a"
    assert not list((tmp_path / "out").glob(".incomplete-*"))


def test_a_failed_write_stops_in_one_line_keeping_the_old_file_and_no_half_written_one(tmp_path):
    (tmp_path / "model.bin").write_text("old")

    def write(staging):
        (tmp_path.joinpath(staging, "model.bin")).write_text("half")
        raise OSError(28, "No space left on device", str(tmp_path.joinpath(staging, "model.bin")))

    with pytest.raises(RunStopped) as stopped:
        write_atomically(tmp_path, write)
    assert stopped.value.exit_code == WRITE_FAILED_EXIT_CODE
    assert str(stopped.value).startswith(f"could not write to {tmp_path}: {tmp_path}/.incomplete-")
    assert str(stopped.value).endswith("/model.bin: No space left on device")
    assert (tmp_path / "model.bin").read_text() == "old"
    assert [path.name for path in tmp_path.iterdir()] == ["model.bin"]


def test_saved_tensors_merges_shards(tmp_path):
    save_file({"a": torch.ones(1)}, tmp_path / "m-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(1)}, tmp_path / "m-00002-of-00002.safetensors")
    assert set(saved_tensors(tmp_path)) == {"a", "b"}


def test_save_model_refuses_a_file_that_does_not_match(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)

    def save_pretrained(directory):
        save_file({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, f"{directory}/model.safetensors")

    model.save_pretrained = save_pretrained
    with pytest.raises(RuntimeError, match="does not match"):
        save_model(model, tmp_path)
