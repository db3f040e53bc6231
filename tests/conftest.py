"""Fixtures (the tiny offline models and datasets, built once per test session) and pytest hooks. What tests
share besides fixtures is in `training_utils.testing` (what any script's smoke test needs) and `helpers`."""

import pytest

import helpers

# Files whose tests launch whole training runs: `pytest -m "not slow"` is the quick subset (CI runs all).
SLOW_FILES = ("test_train_", "test_resilience", "test_multiprocess", "test_parallel_validation", "test_copied_script")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name.startswith(SLOW_FILES):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)  # last before the final counts: what a log's tail shows
def pytest_terminal_summary(terminalreporter):
    if helpers.HANG_REPORTS:
        terminalreporter.section("runs that hung")
        for report in helpers.HANG_REPORTS:
            terminalreporter.write_line(report)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``{fixture name: path}`` of every tiny fixture of ``training_utils.tiny``."""
    from training_utils.tiny import build

    return build(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_sd_pipe(tiny):
    """The tiny SD pipeline, loaded once. Tests must not change it (load their own to mutate)."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)
    return pipe
