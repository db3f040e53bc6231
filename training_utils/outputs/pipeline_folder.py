"""A full fine-tune's pipeline folder: only the models that trained are written anew (docs/outputs.md).

Every other model (the VAE, the frozen text encoders) keeps the files it was loaded from: they are hard-linked into
the folder (`link_or_copy`), from the base model's folder or the hub cache's blobs, where they hold exactly the model
in memory (`loaded_files`); the folder then takes only the room of what trained, and still loads if the base model
is deleted. A model whose files differ from it is written anew, as ``save_pretrained`` writes it.
"""

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from ..pipeline import modules_of
from .writing import saved_tensors, tied_to_one_of, verify_saved_tensors, write_atomically

# A weights file as diffusers and transformers name them: its base name, the variant (``.fp16``) and the shard
# (``-00001-of-00002``), each where it has one.
WEIGHTS_FILE = re.compile(r"(?P<base>[^.]+?)(?:\.(?P<variant>[^.-]+))?(?P<shard>-\d+-of-\d+)?\.safetensors")
# What a failed hard link means the file cannot be linked there (another device, a file system without links, a file
# with too many), so it is copied instead.
CANNOT_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP}


def save_pipeline(pipe, directory, trained=()):
    """``pipe.save_pretrained(directory)`` atomically, the models named in ``trained`` (and any other whose files
    were not found, or differ from it) written anew and checked against the model in memory; every other model's
    files linked (`loaded_files`, `link_or_copy`). Returns ``{component: "linked" or "written"}`` of its models."""
    links = {name: loaded_files(module) for name, module in modules_of(pipe).items() if name not in trained}
    links = {name: files for name, files in links.items() if files is not None}
    write_atomically(directory, lambda staging: save_with_links(pipe, staging, links))
    for name, module in modules_of(pipe).items():
        if name not in links:
            verify_saved_tensors(saved_tensors(Path(directory) / name), module.state_dict(), Path(directory) / name)
    return {name: "linked" if name in links else "written" for name in modules_of(pipe)}


def save_with_links(pipe, directory, links):
    """``pipe.save_pretrained(directory)``, where each component of ``links`` (``{component: {file name: source}}``)
    is saved by linking its files instead: diffusers writes the model index and every other component."""
    modules = modules_of(pipe)
    try:
        for name, files in links.items():
            # An instance attribute: what the pipeline's save_pretrained calls for this component.
            modules[name].save_pretrained = lambda folder, files=files, **options: link_files(files, folder)
        pipe.save_pretrained(directory)
    finally:
        for name in links:
            with contextlib.suppress(AttributeError):
                del modules[name].save_pretrained


def link_files(files, folder):
    """`link_or_copy` each source of ``files`` (``{file name: source path}``) into ``folder`` under its name."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        link_or_copy(source, Path(folder) / name)


def link_or_copy(source, target):
    """A hard link ``target`` to the file ``source`` (to what it points to, where it is a symbolic link, as the hub
    cache's files are); a copy where a link cannot be made (`CANNOT_LINK`: another device, ...). Returns "linked"
    or "copied"."""
    try:
        os.link(os.path.realpath(source), target)  # the file itself: a link to a symbolic link would be one
        return "linked"
    except OSError as error:
        if error.errno not in CANNOT_LINK:
            raise
    shutil.copyfile(source, target)
    return "copied"


def loaded_files(module):
    """The files that ``module`` was loaded from, ``{file name in its saved folder: source path}``, where they hold
    exactly the model in memory (`holds_exactly`): its weights (one file, named without its variant, or a
    variant-less set of shards with their index) and its JSON files (config). None where there are no such files (a
    model not loaded from a folder, or changed since)."""
    config = getattr(module, "config", None)
    name_or_path = config.get("_name_or_path") if isinstance(config, dict) else getattr(config, "_name_or_path", None)
    if not name_or_path or not Path(name_or_path).is_dir():
        return None
    folder = Path(name_or_path)
    groups = {}
    for path in sorted(folder.glob("*.safetensors")):
        match = WEIGHTS_FILE.fullmatch(path.name)
        if match:
            groups.setdefault((match["base"], match["variant"]), []).append((path, match["shard"]))
    state = module.state_dict()
    for (base, variant), files in sorted(groups.items(), key=lambda item: item[0][1] is not None):
        sharded = any(shard for _, shard in files)
        index = folder / f"{base}.safetensors.index.json"
        if sharded and (variant is not None or not index.is_file()):
            continue  # a variant's shards: its index names them by their variant
        if holds_exactly([path for path, _ in files], state):
            weights = ({path.name: path for path, _ in files} if sharded else {f"{base}.safetensors": files[0][0]})
            configs = {path.name: path for path in sorted(folder.glob("*.json")) if ".index" not in path.name}
            return {**configs, **weights, **({index.name: index} if sharded else {})}
    return None


def holds_exactly(paths, state):
    """Whether the safetensors files ``paths`` hold exactly the tensors of ``state`` (a state dict), each as loading
    it into the tensor's dtype gives it (an fp32 file behind a bf16 model; tied weights once). Never where a tensor
    is not a plain one (a shard of a sharded model, a quantised weight): such a model is written anew."""
    seen = set()
    for path in paths:
        with safe_open(path, framework="pt") as tensors:
            for key in tensors.keys():
                if key not in state or type(state[key]) is not torch.Tensor:
                    return False
                expected = state[key].detach()
                saved = tensors.get_tensor(key)
                if saved.shape != expected.shape or not torch.equal(saved.to(expected.dtype), expected.cpu()):
                    return False
                seen.add(key)
    return all(key in seen or tied_to_one_of(state, key, seen) for key in state)
