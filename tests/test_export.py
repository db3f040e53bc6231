import pytest
import torch
from safetensors.torch import save_file

from training_utils.ema import EMA
from training_utils.export import (save_model, save_model_with_ema, saved_tensors, verify_saved_tensors,
                                   write_atomically)


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


def test_write_atomically_keeps_the_old_file_when_writing_fails(tmp_path):
    (tmp_path / "model.bin").write_text("old")

    def write(staging):
        (tmp_path.joinpath(staging, "model.bin")).write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(tmp_path, write)
    assert (tmp_path / "model.bin").read_text() == "old"


def test_saved_tensors_merges_shards(tmp_path):
    save_file({"a": torch.ones(1)}, tmp_path / "m-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(1)}, tmp_path / "m-00002-of-00002.safetensors")
    assert set(saved_tensors(tmp_path)) == {"a", "b"}


def test_save_model_with_ema_writes_both_and_restores_the_live_weights(tiny, tmp_path):
    from diffusers import ControlNetModel

    model = ControlNetModel.from_pretrained(tiny["controlnet"])
    parameters = dict(model.named_parameters())
    ema = EMA(parameters, decay=0.5)
    ema.update(1)
    with torch.no_grad():
        for parameter in parameters.values():
            parameter.add_(1)
    live = {name: parameter.detach().clone() for name, parameter in parameters.items()}

    paths = save_model_with_ema(model, tmp_path, ema, tmp_path / "ema")

    assert (tmp_path / "config.json").is_file() and (tmp_path / "ema" / "config.json").is_file()
    raw, averaged = saved_tensors(paths["raw"]), saved_tensors(paths["ema"])
    assert all(torch.equal(raw[name], live[name]) for name in live)
    assert all(torch.equal(averaged[name], ema.shadows[name]) for name in live)
    assert all(torch.equal(parameters[name], live[name]) for name in live)
    reloaded = ControlNetModel.from_pretrained(tmp_path / "ema")
    assert torch.equal(reloaded.conv_in.weight, ema.shadows["conv_in.weight"])


def test_save_model_refuses_a_file_that_does_not_match(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)

    def save_pretrained(directory):
        save_file({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}, f"{directory}/model.safetensors")

    model.save_pretrained = save_pretrained
    with pytest.raises(RuntimeError, match="does not match"):
        save_model(model, tmp_path)
