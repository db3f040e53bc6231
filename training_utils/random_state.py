"""The process's global random state: Python's, NumPy's and torch's (CPU and each accelerator's generators).

A checkpoint holds it in a safetensors file per process (torch's generator states as tensors, Python's and
NumPy's as JSON metadata), so that a resumed run draws what the uninterrupted one drew. `restore` checks that
the state it set is the state in force, and a checkpoint without it is never resumed quietly.
"""

import json
import random

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

ACCELERATORS = ("cuda", "xpu")


def capture():
    """The current global random states."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    for name in ACCELERATORS:
        module = getattr(torch, name, None)
        if module is not None and module.is_available():
            states[name] = module.get_rng_state_all()
    return states


def restore(states):
    """Set the global random states to ``states`` (from `capture` or `load`), and check that they are set."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    for name in ACCELERATORS:
        if name in states:
            getattr(torch, name).set_rng_state_all(states[name])
    if not same(capture(), states):
        raise RuntimeError("the random state did not take effect")


def same(a, b):
    """Whether two captured states are equal, generator by generator."""
    if a.keys() != b.keys() or a["python"] != b["python"]:
        return False
    numpy_a, numpy_b = a["numpy"], b["numpy"]
    if numpy_a[0] != numpy_b[0] or not np.array_equal(numpy_a[1], numpy_b[1]) or numpy_a[2:] != numpy_b[2:]:
        return False
    pairs = [(a["torch"], b["torch"])] + [pair for name in ACCELERATORS if name in a for pair in zip(a[name], b[name])]
    return all(torch.equal(x, y) for x, y in pairs)


def save(states, path):
    """Write ``states`` to the safetensors file ``path``."""
    version, internal, gauss_next = states["python"]
    kind, keys, position, has_gauss, cached_gaussian = states["numpy"]
    metadata = {"python": json.dumps([version, list(internal), gauss_next]),
                "numpy": json.dumps([kind, keys.tolist(), position, has_gauss, cached_gaussian]),
                "accelerators": json.dumps({name: len(states[name]) for name in ACCELERATORS if name in states})}
    tensors = {"torch": states["torch"]}
    for name in ACCELERATORS:
        tensors.update({f"{name}.{index}": state for index, state in enumerate(states.get(name, []))})
    save_file(tensors, path, metadata=metadata)


def load(path):
    """The states `save` wrote to ``path``."""
    with safe_open(path, framework="pt") as file:
        metadata = file.metadata()
        version, internal, gauss_next = json.loads(metadata["python"])
        kind, keys, position, has_gauss, cached_gaussian = json.loads(metadata["numpy"])
        states = {"python": (version, tuple(internal), gauss_next),
                  "numpy": (kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian),
                  "torch": file.get_tensor("torch")}
        for name, count in json.loads(metadata["accelerators"]).items():
            states[name] = [file.get_tensor(f"{name}.{index}") for index in range(count)]
    return states
