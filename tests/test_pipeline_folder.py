"""A full fine-tune's pipeline folder (training_utils.outputs.pipeline_folder): what trained written anew, every other
model's files hard links to the files it was loaded from where they hold exactly the model in memory, copies where
they cannot be linked, and the folder loads as the pipeline in memory."""

import errno
import os
import shutil
import stat

import pytest
import torch
from diffusers import StableDiffusionPipeline
from transformers import T5EncoderModel

from training_utils.outputs import pipeline_folder
from training_utils.outputs.pipeline_folder import loaded_files, save_pipeline
from training_utils.outputs.writing import process_umask
from training_utils.testing import assert_same_tensors

UNET, VAE, TEXT_ENCODER = ("unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                           "text_encoder/model.safetensors")


@pytest.fixture
def base(tiny, tmp_path):
    """A copy of the tiny SD pipeline's folder, its files read-only (0444), as a shared base model may be."""
    folder = shutil.copytree(tiny["sd"], tmp_path / "base")
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(0o444)
    return folder


def trained_pipe(base):
    """The pipeline of ``base`` with its UNet changed (trained) and its VAE in bf16, as a frozen model under mixed
    precision is (its files fp32)."""
    pipe = StableDiffusionPipeline.from_pretrained(base)
    with torch.no_grad():
        for parameter in pipe.unet.parameters():
            parameter.add_(0.01)
    pipe.vae.to(torch.bfloat16)
    return pipe


def assert_loads_as_in_memory(pipe, folder):
    loaded = StableDiffusionPipeline.from_pretrained(folder)
    for name in ("unet", "vae", "text_encoder"):
        expected = getattr(pipe, name).state_dict()
        assert_same_tensors({key: tensor.to(expected[key].dtype) for key, tensor in
                             getattr(loaded, name).state_dict().items()}, expected, name)


def test_untrained_models_are_links_to_the_files_they_were_loaded_from_and_keep_their_permissions(base, tmp_path):
    pipe, out = trained_pipe(base), tmp_path / "out"
    assert save_pipeline(pipe, out, trained=["unet"]) == {"unet": "written", "vae": "linked", "text_encoder": "linked"}
    for name in (VAE, TEXT_ENCODER, "vae/config.json"):
        assert os.path.samefile(out / name, base / name), name
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o444
    assert not os.path.samefile(out / UNET, base / UNET)
    assert stat.S_IMODE((out / UNET).stat().st_mode) == 0o666 & ~process_umask()
    assert_loads_as_in_memory(pipe, out)


def test_a_file_of_the_hub_cache_a_symbolic_link_to_its_blob_is_linked_to_the_blob(base, tmp_path):
    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    (base / VAE).rename(blob)
    (base / VAE).symlink_to(blob)
    out = tmp_path / "out"
    assert save_pipeline(trained_pipe(base), out, trained=["unet"])["vae"] == "linked"
    assert not (out / VAE).is_symlink() and os.path.samefile(out / VAE, blob)


def test_a_model_that_differs_from_its_files_is_written_anew(base, tmp_path):
    pipe, out = trained_pipe(base), tmp_path / "out"
    with torch.no_grad():  # untrained, yet not what its files hold
        next(pipe.text_encoder.parameters()).add_(1)
    assert save_pipeline(pipe, out, trained=["unet"])["text_encoder"] == "written"
    assert not os.path.samefile(out / TEXT_ENCODER, base / TEXT_ENCODER)
    assert os.path.samefile(out / VAE, base / VAE)
    assert_loads_as_in_memory(pipe, out)


def test_a_trained_model_is_written_anew_even_where_its_files_hold_it(base, tmp_path):
    pipe, out = StableDiffusionPipeline.from_pretrained(base), tmp_path / "out"
    assert save_pipeline(pipe, out, trained=["unet"])["unet"] == "written"
    assert (out / UNET).stat().st_nlink == 1


def test_files_that_cannot_be_linked_are_copied(base, tmp_path, monkeypatch):
    def other_device(source, target, **options):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(pipeline_folder.os, "link", other_device)
    pipe, out = trained_pipe(base), tmp_path / "out"
    save_pipeline(pipe, out, trained=["unet"])
    for name in (VAE, TEXT_ENCODER):
        assert (out / name).stat().st_nlink == 1 and (out / name).read_bytes() == (base / name).read_bytes()
    assert_loads_as_in_memory(pipe, out)


def test_a_failed_link_for_another_reason_is_an_error(base, tmp_path, monkeypatch):
    def no_room(source, target, **options):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pipeline_folder.os, "link", no_room)
    with pytest.raises(Exception, match="No space left on device"):
        save_pipeline(trained_pipe(base), tmp_path / "out", trained=["unet"])


def test_t5s_tied_embedding_saved_once_is_the_model_in_memory(tiny):
    text_encoder = T5EncoderModel.from_pretrained(tiny["sd3"] / "text_encoder_3")
    assert "encoder.embed_tokens.weight" in text_encoder.state_dict()
    assert loaded_files(text_encoder)["model.safetensors"] == tiny["sd3"] / "text_encoder_3" / "model.safetensors"
    with torch.no_grad():
        text_encoder.shared.weight[0] += 1  # both names change: no longer the file
    assert loaded_files(text_encoder) is None
