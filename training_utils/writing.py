"""Outputs written atomically and checked once written: a crash never leaves a truncated file under a final name,
and every file is read back and compared with the tensors in memory that it was written from.
"""

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from .errors import WRITE_ERRORS, WriteFailed, write_failure
from .pipeline import modules_of


def write_atomically(directory, write):
    """Call ``write(staging_folder)``, then move every file it wrote into ``directory`` by rename.

    A crash mid-write leaves a ``.incomplete-*`` folder, never a truncated file under a final name; a write that
    fails (a full disk, a permission) stops the run in one line naming the file and the cause.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory, prefix=".incomplete-") as staging:
            write(staging)
            for path in sorted(Path(staging).rglob("*")):
                if path.is_file():
                    target = directory / path.relative_to(staging)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(path, target)
    except WRITE_ERRORS as error:
        raise WriteFailed(directory, write_failure(error)) from None


def saved_tensors(directory):
    """Every tensor of every ``*.safetensors`` file directly in ``directory`` (shards merged)."""
    tensors = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def verify_saved_tensors(saved, expected, where):
    """Fail loudly unless ``saved`` holds exactly ``expected``: the same keys and bitwise-equal values."""
    missing, unexpected = expected.keys() - saved.keys(), saved.keys() - expected.keys()
    different = [
        key for key in expected.keys() & saved.keys()
        if not torch.equal(saved[key], expected[key].detach().to("cpu", saved[key].dtype))
    ]
    if missing or unexpected or different:
        raise RuntimeError(
            f"{where} does not match the weights in memory: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}, different {sorted(different)[:3]}"
        )


def save_model(module, directory):
    """``module.save_pretrained(directory)`` atomically, checked against ``module``'s state dict."""
    write_atomically(directory, module.save_pretrained)
    verify_saved_tensors(saved_tensors(directory), module.state_dict(), directory)
    return Path(directory)


def save_pipeline(pipe, directory):
    """``pipe.save_pretrained(directory)`` atomically, each module's files checked against the module in memory."""
    write_atomically(directory, pipe.save_pretrained)
    for name, module in modules_of(pipe).items():
        verify_saved_tensors(saved_tensors(Path(directory) / name), module.state_dict(), Path(directory) / name)
    return Path(directory)
