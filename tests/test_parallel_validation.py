"""Validation shared out over two CPU processes writes exactly what one process writes."""

import json

import pytest

from helpers import REPO, launch, launch_processes, launching
from training_utils.testing import rendered_images

JOB = REPO / "tests" / "parallel_validation_job.py"
PROMPTS = ["a red circle", "a blue square", "a green triangle"]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{processes: output_dir}`` of the job on one and on two processes."""
    output_dirs = {1: tmp_path_factory.mktemp("processes1")}
    launch(JOB, tiny["sd"], output_dirs[1])
    output_dirs[2], _ = launch_processes(JOB, lambda: tmp_path_factory.mktemp("processes2"),
                                         lambda output_dir: [tiny["sd"], output_dir])
    return output_dirs


def rendered(output_dir, process):
    return json.loads((output_dir / f"rendered-{process}.json").read_text())


def validation_files(output_dir):
    return {path.relative_to(output_dir).as_posix(): path.read_bytes()
            for path in sorted((output_dir / "validation").rglob("*")) if path.is_file()}


def test_two_processes_write_the_same_files_and_log_as_one(runs):
    single, double = validation_files(runs[1]), validation_files(runs[2])
    assert sorted(single) == sorted(double)
    assert len(rendered_images(runs[1])) == 2 * 2 * 3 * 2  # steps, variants, prompts, images; the grids besides
    for name, content in single.items():
        assert content == double[name], name
    records = [json.loads(line) for line in single["validation/log.jsonl"].decode().splitlines()]
    assert [(r["step"], r["variant"], r["prompt"]) for r in records] == [
        (step, variant, prompt) for step in (1, 2) for variant in ("raw", "ema") for prompt in PROMPTS]


def test_the_pipeline_calls_are_shared_out_between_the_processes(runs):
    assert sorted(rendered(runs[1], 0)) == sorted(PROMPTS * 4)
    first, second = rendered(runs[2], 0), rendered(runs[2], 1)
    assert len(first) == len(second) == 6  # three calls per validation each, instead of six on the main process
    assert sorted(first + second) == sorted(PROMPTS * 4)


def test_raw_and_ema_images_differ(runs):
    files = validation_files(runs[2])
    assert files["validation/step-000002/raw-p00-00.png"] != files["validation/step-000002/ema-p00-00.png"]
