"""The global random state saved with checkpoints (training_utils.random_state)."""

import random

import numpy as np
import torch

from training_utils import random_state


def draws():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3)


def test_a_saved_state_restored_gives_the_same_draws_from_every_generator(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # NumPy caches the second normal of a pair: part of its state
    random_state.save(random_state.capture(), tmp_path / "state.safetensors")
    expected = draws()
    draws()
    random_state.restore(random_state.load(tmp_path / "state.safetensors"))
    again = draws()
    assert again[:2] == expected[:2] and torch.equal(again[2], expected[2])


def test_same_tells_states_apart():
    before = random_state.capture()
    assert random_state.same(before, random_state.capture())
    for generator, draw in (("python", random.random), ("numpy", np.random.rand), ("torch", lambda: torch.rand(1))):
        draw()
        assert not random_state.same(before, random_state.capture()), generator
        random_state.restore(before)
