"""Outputs written atomically and checked once written: a crash never leaves a truncated file under a final name,
and every file is read back and compared with the tensors in memory that it was written from.

Files get the permissions that the process's umask gives (safetensors writes 0600 of its own accord), and a write
that fails says why in words, also where the library that wrote gave none (torch's "unexpected pos" on a full disk).
"""

import contextlib
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import WRITE_ERRORS, WriteFailed, write_failure
from ..names import STAGING_PREFIX
from .stop_signals import SIGNALS

# How much a write probe writes: a disk with less room than this is full for our files.
PROBE_BYTES = 2**20


def write_atomically(directory, write):
    """Call ``write(staging_folder)``, then move every file it wrote into ``directory`` by rename, all of them before
    a stop signal is acted on (`stop_signals`): files written together are in place together.

    A crash mid-write leaves a ``.incomplete-*`` folder, never a truncated file under a final name; a write that
    fails (a full disk, a permission) stops the run in one line naming the file and the cause.
    """
    directory = Path(directory)
    with stopping_on_write_errors(directory):
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory, prefix=STAGING_PREFIX) as staging:
            write(staging)
            give_normal_permissions(staging)
            with SIGNALS.deferred():
                for path in sorted(Path(staging).rglob("*")):
                    if path.is_file():
                        target = directory / path.relative_to(staging)
                        target.parent.mkdir(parents=True, exist_ok=True)
                        os.replace(path, target)


@contextlib.contextmanager
def stopping_on_write_errors(directory):
    """A write into ``directory`` that fails inside the block (a full disk, a permission) stops the run in one line
    saying why (`failure_cause`)."""
    try:
        yield
    except WRITE_ERRORS as error:
        raise WriteFailed(directory, failure_cause(error, directory)) from None


def process_umask():
    """The process's umask, read without changing it where Linux shows it (setting it, even back, would race with
    the threads that write validation images)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def give_normal_permissions(root):
    """Give ``root`` and everything under it the permissions a new file or folder gets from the umask (0644 and
    0755 under the usual 022), as a group-shared folder expects; but for hard links to files outside it (a pipeline
    folder's untrained models, `pipeline_folder`), which keep the permissions of the files they are."""
    umask = process_umask()
    for path in [Path(root), *Path(root).rglob("*")]:
        if path.is_dir() or path.stat().st_nlink == 1:
            path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def write_problem(directory, size=0):
    """Why ``size`` bytes cannot be written into the folder ``directory`` (or, where it does not exist yet, the
    nearest folder above it, where it would be made) now, in words naming the folder; None if they can."""
    folder = Path(directory).absolute()
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder) as probe:
            probe.write(bytes(size))
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as error:
        return f"{folder}: {error.strerror or error}"
    return None


def failure_cause(error, directory):
    """Why writing into ``directory`` failed, in words. An `OSError` says it, naming its file (`write_failure`);
    for an error that does not (torch's "unexpected pos", safetensors' wrapped I/O error), the reason a small write
    into ``directory`` fails with now, else the error's own message."""
    if isinstance(error, OSError):
        return write_failure(error)
    return write_problem(directory, PROBE_BYTES) or write_failure(error)


def saved_tensors(directory):
    """Every tensor of every ``*.safetensors`` file directly in ``directory`` (shards merged)."""
    tensors = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def verify_saved_tensors(saved, expected, where):
    """Fail loudly unless ``saved`` holds exactly ``expected``: the same keys and bitwise-equal values. A tied
    weight (T5's ``encoder.embed_tokens.weight``, the same tensor as its ``shared.weight``) may be saved once, under
    one of its names: ``from_pretrained`` ties it again."""
    missing = {key for key in expected.keys() - saved.keys() if not tied_to_one_of(expected, key, saved.keys())}
    unexpected = saved.keys() - expected.keys()
    different = [
        key for key in expected.keys() & saved.keys()
        if not torch.equal(saved[key], expected[key].detach().to("cpu", saved[key].dtype))
    ]
    if missing or unexpected or different:
        raise RuntimeError(
            f"{where} does not match the weights in memory: missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}, different {sorted(different)[:3]}"
        )


def tied_to_one_of(tensors, key, keys):
    """Whether ``tensors[key]`` is the same tensor (the same memory, shape and strides) as ``tensors[k]`` for a ``k``
    of ``keys``."""
    def place(tensor):
        return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride()

    return any(place(tensors[key]) == place(tensors[other]) for other in keys if other != key and other in tensors)


def save_model(module, directory):
    """``module.save_pretrained(directory)`` atomically, checked against ``module``'s state dict."""
    write_atomically(directory, module.save_pretrained)
    verify_saved_tensors(saved_tensors(directory), module.state_dict(), directory)
    return Path(directory)
