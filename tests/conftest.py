"""Shared fixtures: the tiny offline models and datasets, built once per test session."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"

# Quiet, deterministic, offline subprocesses.
SUBPROCESS_ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
    "OMP_NUM_THREADS": "1",
    "PYTHONFAULTHANDLER": "1",  # SIGABRT then prints every thread's stack: see `run_bounded`
    # The scripts import this checkout's training_utils, whatever else is installed.
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
}
# Several processes (gloo) talk over loopback, whatever this machine's hostname resolves to.
LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"} if "lo" in dict(socket.if_nameindex()).values() else {}
RUN_TIMEOUT_S = 300  # a whole tiny run takes seconds; this long means it hangs


# Files whose tests launch whole training runs: `pytest -m "not slow"` is the quick subset (CI runs all).
SLOW_FILES = ("test_train_", "test_resilience", "test_multiprocess", "test_parallel_validation")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name.startswith(SLOW_FILES):
            item.add_marker(pytest.mark.slow)


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


def run_bounded(command, env=SUBPROCESS_ENV, timeout=RUN_TIMEOUT_S):
    """``subprocess.run(command)`` from the repository root, output captured, that cannot hang the suite.

    Output goes to files rather than pipes: a worker that outlives its launcher cannot block the
    read. On timeout, every process of the tree gets SIGABRT (faulthandler prints its stacks) and
    then SIGKILL; torchrun starts its workers in sessions of their own, so a process-group kill
    would miss them. The stacks end the AssertionError.
    """
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=env, cwd=REPO)
        try:
            process.wait(timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_tree(process.pid)
            process.wait()
            timed_out = True
        stdout.seek(0)
        stderr.seek(0)
        result = subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read())
    if timed_out:
        raise AssertionError(f"no result within {timeout} s (a hang?); the stacks of its processes:\n"
                             f"{result.stderr[-12000:]}")
    return result


def _kill_tree(pid):
    root = psutil.Process(pid)
    tree = [*root.children(recursive=True), root]
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGABRT)
    _, alive = psutil.wait_procs(tree, timeout=10)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=10)


def free_port():
    """A TCP port nothing listens on now, for one multi-process run's rendezvous: sharing the default
    port with another run (a leftover, or another job on this machine) could join the wrong one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(script, *args, processes=1, check=True, quiet=False):
    """Run ``examples/<script>`` with ``accelerate launch`` on the CPU (``processes`` > 1: gloo);
    returns the CompletedProcess. A hang fails the test within `RUN_TIMEOUT_S`."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--num_processes", str(processes)]
    if processes > 1:
        command += ["--multi_gpu", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    if quiet:
        command += ["--quiet"]
    command += [str(EXAMPLES / script), *map(str, args)]
    env = {**SUBPROCESS_ENV, "ACCELERATE_USE_CPU": "1", **LOOPBACK} if processes > 1 else SUBPROCESS_ENV
    result = run_bounded(command, env)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


def read_log(output_dir):
    """The records of ``output_dir/validation/log.jsonl``, in order."""
    return [json.loads(line) for line in (Path(output_dir) / "validation" / "log.jsonl").read_text().splitlines()]


def assert_close_validations(a, b, expected, max_difference=2):
    """Runs in ``a`` and ``b`` both logged the validations ``expected`` (``[(step, variant)]``), with images at
    most ``max_difference`` levels apart: e.g. cached against uncached encoders, equal up to float noise."""
    logs = read_log(a), read_log(b)
    for log in logs:
        assert [(record["step"], record["variant"]) for record in log] == expected
    for record_a, record_b in zip(*logs):
        for path_a, path_b in zip(record_a["images"], record_b["images"], strict=True):
            image_a, image_b = (np.asarray(Image.open(path), dtype=np.int16) for path in (a / path_a, b / path_b))
            assert np.abs(image_a - image_b).max() <= max_difference, path_b


def differing(a, b):
    """Keys whose tensors are not bitwise equal in two state dicts with the same keys."""
    return [key for key in a if not torch.equal(a[key], b[key])]


def assert_same_files(a, b):
    """Two safetensors files hold the same keys and bitwise-equal tensors."""
    a, b = load_file(a), load_file(b)
    assert a.keys() == b.keys() and len(a) > 0
    different = differing(a, b)
    assert not different, f"{len(different)} of {len(a)} tensors differ, e.g. {different[0]}"


def checkpoint_names(output_dir):
    return sorted(path.name for path in Path(output_dir).glob("checkpoint-*"))


def runs_with_and_without_cached_latents(script, run_args, root):
    """``{False: uncached run folder, True: cached}``: ``script`` on ``run_args(output_dir, *extra)`` without and
    with ``--cache_latents``, each in a folder under ``root``."""
    outputs = {}
    for cache_latents in (False, True):
        outputs[cache_latents] = Path(root) / f"cache_latents{int(cache_latents)}"
        launch(script, *run_args(outputs[cache_latents], *(["--cache_latents"] if cache_latents else [])))
    return outputs


def assert_resume_is_exact(script, run_args, output_dir, reference_dir, weight_files, *extra):
    """Train to step 6 with a checkpoint every 2 steps (keeping 2), then resume ``latest`` to step 8:
    the checkpoints kept are 4 and 6, then 6 and 8, and ``weight_files`` equal, bit for bit, those of
    the uninterrupted 8-step run in ``reference_dir``. ``run_args(output_dir, *flags)`` builds the
    script's arguments."""
    flags = [*extra, "--checkpointing_steps", 2, "--checkpoints_total_limit", 2]
    launch(script, *run_args(output_dir, "--max_train_steps", 6, *flags))
    assert checkpoint_names(output_dir) == ["checkpoint-4", "checkpoint-6"]
    result = launch(script, *run_args(output_dir, "--max_train_steps", 8, "--resume_from_checkpoint", "latest", *flags))
    assert f"resumed from {Path(output_dir) / 'checkpoint-6'} at step 6" in result.stdout
    assert checkpoint_names(output_dir) == ["checkpoint-6", "checkpoint-8"]
    for name in weight_files:
        assert_same_files(Path(output_dir) / name, Path(reference_dir) / name)
