"""The test harness itself: a hung run must fail its test, not stall the suite."""

import json
import sys

import psutil
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import conftest
from conftest import RunHung, assert_close_files, assert_close_validations, launch_processes, run_bounded

# A launcher whose worker, like torchrun's, runs in a session of its own and never finishes.
HUNG_LAUNCHER = """
import subprocess, sys, time
worker = '''
import os, sys, time
def waiting_at_a_barrier():
    open(sys.argv[1], "w").write(str(os.getpid()))
    time.sleep(600)
waiting_at_a_barrier()
'''
subprocess.Popen([sys.executable, "-c", worker, sys.argv[1]], start_new_session=True)
time.sleep(600)
"""


def test_a_hung_run_fails_with_the_states_and_stacks_of_its_workers_and_leaves_none_running(tmp_path):
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(RunHung, match="no result within 3 s") as failure:
        run_bounded([sys.executable, "-c", HUNG_LAUNCHER, str(pid_file)], timeout=3)
    worker = int(pid_file.read_text())
    stacks, states = str(failure.value).split("Its processes when it was stopped:")
    assert "waiting_at_a_barrier" in stacks and "Extension modules" not in stacks
    assert f"pid {worker} " in states and "s CPU in 1 s; threads waiting in" in states
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


def test_a_hung_multiprocess_run_is_reported_and_made_again_in_a_fresh_folder(tmp_path, monkeypatch):
    attempts = []

    def hanging_once(script, *args, processes, timeout):
        attempts.append(args)
        if len(attempts) == 1:
            raise RunHung("no result within 120 s")
        return "second result"

    monkeypatch.setattr(conftest, "launch", hanging_once)
    monkeypatch.setattr(conftest, "HANG_REPORTS", [])
    folders = iter([tmp_path / "a", tmp_path / "b"])
    output_dir, result = launch_processes("job.py", lambda: next(folders), lambda folder: [folder])
    assert (output_dir, result) == (tmp_path / "b", "second result")
    assert attempts == [(tmp_path / "a",), (tmp_path / "b",)]
    assert len(conftest.HANG_REPORTS) == 1 and "attempt 1: no result within 120 s" in conftest.HANG_REPORTS[0]


def test_a_multiprocess_run_that_hangs_twice_fails(monkeypatch):
    def hanging(script, *args, processes, timeout):
        raise RunHung("no result within 120 s")

    monkeypatch.setattr(conftest, "launch", hanging)
    monkeypatch.setattr(conftest, "HANG_REPORTS", [])
    with pytest.raises(RunHung):
        launch_processes("job.py", lambda: "folder", lambda folder: [])
    assert len(conftest.HANG_REPORTS) == 2


def test_a_finished_run_returns_its_exit_code_and_output():
    result = run_bounded([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")


def fake_run(output_dir, grey):
    """A run folder whose validation log holds one record of one image, a solid ``grey``."""
    (output_dir / "validation").mkdir(parents=True)
    Image.new("RGB", (4, 4), (grey,) * 3).save(output_dir / "validation" / "raw.png")
    record = {"step": 2, "variant": "raw", "prompt": "p", "images": ["validation/raw.png"]}
    (output_dir / "validation" / "log.jsonl").write_text(json.dumps(record) + "\n")
    return output_dir


def test_close_validations_allow_float_noise_but_not_more_nor_other_records(tmp_path):
    reference, close, far = (fake_run(tmp_path / name, grey) for name, grey in (("a", 100), ("b", 102), ("c", 103)))
    assert_close_validations(reference, close, [(2, "raw")])
    with pytest.raises(AssertionError):
        assert_close_validations(reference, far, [(2, "raw")])
    with pytest.raises(AssertionError):
        assert_close_validations(reference, close, [(2, "raw"), (2, "ema")])


def test_close_files_allow_float_noise_but_not_more_nor_other_keys(tmp_path):
    weights = {"a": torch.zeros(3), "b": torch.ones(2)}
    paths = {}
    for name, tensors in (("reference", weights), ("close", {**weights, "a": torch.full((3,), 5e-6)}),
                          ("far", {**weights, "a": torch.full((3,), 2e-5)}), ("other", {"a": weights["a"]})):
        paths[name] = tmp_path / f"{name}.safetensors"
        save_file(tensors, paths[name])
    assert assert_close_files(paths["reference"], paths["close"]).keys() == weights.keys()
    for name in ("far", "other"):
        with pytest.raises(AssertionError):
            assert_close_files(paths["reference"], paths[name])
