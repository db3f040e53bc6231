"""Outputs written atomically and checked once written (training_utils.outputs.writing)."""

import os
import signal
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from training_utils.errors import WRITE_FAILED_EXIT_CODE, Interrupted, RunStopped
from training_utils.outputs import writing
from training_utils.outputs.stop_signals import SIGNALS
from training_utils.outputs.writing import (PROBE_BYTES, failure_cause, save_model, saved_tensors, verify_saved_tensors,
                                            write_atomically, write_problem)


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


def test_verify_saved_tensors_takes_a_tied_weight_saved_once_under_another_of_its_names():
    # T5's encoder.embed_tokens.weight is its shared.weight: save_pretrained writes it once.
    shared = torch.arange(6.0).reshape(3, 2)
    verify_saved_tensors({"shared": shared.clone()}, {"shared": shared, "embed": shared}, "x")
    with pytest.raises(RuntimeError, match="missing \\['embed'\\]"):  # equal, but another tensor: not tied
        verify_saved_tensors({"shared": shared.clone()}, {"shared": shared, "embed": shared.clone()}, "x")
    with pytest.raises(RuntimeError, match="missing \\['embed'\\]"):  # a view of part of it: not the same tensor
        verify_saved_tensors({"shared": shared.clone()}, {"shared": shared, "embed": shared[1:]}, "x")


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


def full_disk_probe(monkeypatch):
    """Make the write probes of `writing` land on /dev/full, whose every write fails as a full disk's does."""
    monkeypatch.setattr(writing.tempfile, "TemporaryFile", lambda dir: open("/dev/full", "wb"))


def test_written_files_get_the_umasks_permissions_not_safetensors_0600(tmp_path, group_umask):
    def write(staging):
        Path(staging, "sub").mkdir()
        save_file({"a": torch.ones(1)}, f"{staging}/sub/a.safetensors")

    write_atomically(tmp_path / "out", write)
    assert stat.S_IMODE((tmp_path / "out" / "sub" / "a.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "out" / "sub").stat().st_mode) == 0o750


def test_write_problem_names_the_folder_and_the_cause(tmp_path, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert write_problem(tmp_path / "new" / "folder") is None
    assert write_problem(a_file / "out") == f"{a_file} is a file, not a folder"
    full_disk_probe(monkeypatch)
    assert write_problem(tmp_path, PROBE_BYTES) == f"{tmp_path}: No space left on device"


def test_a_failure_without_a_cause_in_its_message_gets_the_disks(tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match="unexpected pos") as unexpected:
        torch.save({"weights": torch.zeros(2**16)}, "/dev/full")  # what torch says when the disk fills up
    assert failure_cause(unexpected.value, tmp_path) == str(unexpected.value)  # this disk has room
    full_disk_probe(monkeypatch)
    assert failure_cause(unexpected.value, tmp_path) == f"{tmp_path}: No space left on device"
    assert failure_cause(OSError(13, "Permission denied", "/x/y"), tmp_path) == "/x/y: Permission denied"


def test_a_stop_signal_while_files_move_into_place_waits_for_the_last_one(tmp_path, monkeypatch):
    for name in ("raw", "ema"):
        (tmp_path / name).write_text("step 4")
    replace = os.replace

    def signalled_first(source, target):
        if {(tmp_path / name).read_text() for name in ("raw", "ema")} == {"step 4"}:
            os.kill(os.getpid(), signal.SIGTERM)
        replace(source, target)

    monkeypatch.setattr(writing.os, "replace", signalled_first)

    def write(staging):
        for name in ("raw", "ema"):
            Path(staging, name).write_text("step 8")

    with pytest.raises(Interrupted):
        with SIGNALS.handled():
            write_atomically(tmp_path, write)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ema", "raw"]
    assert {(tmp_path / name).read_text() for name in ("raw", "ema")} == {"step 8"}


def test_a_stop_signal_while_files_are_written_leaves_the_files_before(tmp_path):
    (tmp_path / "raw").write_text("step 4")

    def write(staging):
        Path(staging, "raw").write_text("step 8")
        os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Interrupted):
        with SIGNALS.handled():
            write_atomically(tmp_path, write)
    assert [path.name for path in tmp_path.iterdir()] == ["raw"] and (tmp_path / "raw").read_text() == "step 4"
