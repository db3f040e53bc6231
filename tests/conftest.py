"""Fixtures (the tiny offline models and datasets, built once per test session) and pytest hooks. What tests
share besides fixtures is in `training_utils.testing` (what any script's smoke test needs) and `helpers`."""

import os

import pytest
import torch

import helpers

# One thread per process, in this process as in the runs it launches (`training_utils.testing.launch`): the suite
# runs two workers and their runs on two cores, and torch's thread pool, given cores that others use, spins (a
# tiny UNet's render took 30 times the CPU with two threads on a busy machine).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

def pytest_collection_modifyitems(items):
    """Mark slow each test that launches training runs, itself (marked so) or through a fixture (`helpers.launching`):
    ``pytest -m "not slow"`` is the quick subset, which `helpers.only_in_slow_tests` keeps true."""
    for item in items:
        fixtures = [definition for definitions in item._fixtureinfo.name2fixturedefs.values()
                    for definition in definitions]
        if any(getattr(definition.func, "launches", False) for definition in fixtures):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item):
    helpers.running_slow_test[0] = item.get_closest_marker("slow") is not None


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``{fixture name: path}`` of every tiny fixture of ``training_utils.testing.tiny``."""
    from training_utils.testing.tiny import build

    return build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_sd_pipe(tiny):
    """The tiny SD pipeline, loaded once. Tests must not change it (load their own to mutate)."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def group_umask():
    """The process's umask 027 (new files 0640, folders 0750) while the test runs."""
    previous = os.umask(0o027)
    yield
    os.umask(previous)
