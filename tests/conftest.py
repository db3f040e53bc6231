"""Shared fixtures: the tiny offline models and datasets, built once per test session."""

import collections
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
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
STACKS_MARKER = "--- stacks of pid"  # heads each hung worker's stacks in its run's stderr


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


class RunHung(AssertionError):
    """A run that gave no result in time; the message holds its processes' states and stacks."""


def run_bounded(command, env=SUBPROCESS_ENV, timeout=RUN_TIMEOUT_S):
    """``subprocess.run(command)`` from the repository root, output captured, that cannot hang the suite.

    Output goes to files rather than pipes: a worker that outlives its launcher cannot block the
    read. On timeout it raises `RunHung` with what `_stop_tree` saw of the processes and the stacks
    they printed.
    """
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True,
                                   env=env, cwd=REPO)
        try:
            process.wait(timeout)
            states = None
        except subprocess.TimeoutExpired:
            states = _stop_tree(process.pid, stderr)
            process.wait()
        stdout.seek(0)
        stderr.seek(0)
        result = subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read())
    if states is not None:
        log, marker, stacks = result.stderr.partition(STACKS_MARKER)
        raise RunHung(f"no result within {timeout} s (a hang?). The end of its log:\n"
                      f"{_readable_stderr(log)[-3000:]}\n"
                      f"The stacks of its workers:\n{_readable_stderr(marker + stacks)[-8000:]}\n"
                      f"Its processes when it was stopped:\n{states}")
    return result


def _readable_stderr(text):
    """``text`` without blank lines and faulthandler's lists of extension modules, with library paths
    cut to the package ("torch/distributed/...") and this checkout's to the repository."""
    return "\n".join(re.sub(r'File "[^"]*(site-packages|python3\.\d+)/', 'File "', line).replace(f"{REPO}/", "")
                     for line in text.splitlines() if line.strip() and not line.startswith("Extension modules:"))


def _stop_tree(pid, log):
    """Describe every process of a hung tree, then stop it. The launchers (processes with children) are
    frozen first, so that they cannot react; each worker then gets SIGABRT (faulthandler prints its
    stacks to ``log``, under a line naming it) and is waited for, one at a time, so that their stacks
    do not interleave; then everything left gets SIGKILL. torchrun starts its workers in sessions of
    their own: a process-group kill would miss them."""
    root = psutil.Process(pid)
    tree = [*root.children(recursive=True), root]
    cpu_before = {process.pid: _cpu_seconds(process) for process in tree}
    time.sleep(1)
    states = "\n".join(_describe(process, cpu_before[process.pid]) for process in tree)
    launchers, workers = [], []
    for process in tree:
        with contextlib.suppress(psutil.Error):
            (launchers if process.children() else workers).append(process)
    for process in launchers:
        with contextlib.suppress(psutil.Error):
            process.suspend()
    for process in reversed(workers):
        log.write(f"{STACKS_MARKER} {process.pid} ---\n")
        log.flush()
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGABRT)
        psutil.wait_procs([process], timeout=5)
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(tree, timeout=10)
    return states


def _cpu_seconds(process):
    with contextlib.suppress(psutil.Error):
        times = process.cpu_times()
        return times.user + times.system
    return float("nan")


def _describe(process, cpu_before):
    """One line: pid, parent, state, CPU used in the last second (spinning or blocked), where each of
    its threads waits in the kernel (/proc/<pid>/task/*/wchan), and its command."""
    try:
        waits = collections.Counter()
        for task in Path(f"/proc/{process.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                wait = (task / "wchan").read_text().strip()
                waits[wait if wait not in ("", "0") else "running"] += 1
        command = " ".join(Path(part).name if part.startswith("/") else part for part in process.cmdline()[:6])
        rank = process.environ().get("RANK", "-")
        return (f"pid {process.pid} (parent {process.ppid()}, rank {rank}) {process.status()}, "
                f"{_cpu_seconds(process) - cpu_before:.2f} s CPU in 1 s; threads waiting in "
                f"{dict(waits.most_common())}: {command}")
    except (psutil.Error, OSError) as error:
        return f"pid {process.pid}: {error!r}"


def free_port():
    """A TCP port nothing listens on now, for one multi-process run's rendezvous: sharing the default
    port with another run (a leftover, or another job on this machine) could join the wrong one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(script, *args, processes=1, check=True, quiet=False, timeout=RUN_TIMEOUT_S):
    """Run ``examples/<script>`` with ``accelerate launch`` on the CPU (``processes`` > 1: gloo);
    returns the CompletedProcess. A hang raises `RunHung` within ``timeout`` seconds."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--num_processes", str(processes)]
    if processes > 1:
        command += ["--multi_gpu", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    if quiet:
        command += ["--quiet"]
    command += [str(EXAMPLES / script), *map(str, args)]
    env = {**SUBPROCESS_ENV, "ACCELERATE_USE_CPU": "1", **LOOPBACK} if processes > 1 else SUBPROCESS_ENV
    result = run_bounded(command, env, timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")
    return result


# A two-process tiny run takes about 10 s.
MULTIPROCESS_TIMEOUT_S = 120
# Every hang `launch_processes` met, for the end of pytest's report.
HANG_REPORTS = []


def launch_processes(script, prepare, args_for, processes=2):
    """``(output_dir, CompletedProcess)`` of ``script`` on several CPU processes (gloo), in the folder that
    ``prepare()`` returns and on the arguments ``args_for(output_dir)``.

    A two-process CPU run could hang at exit: gloo's teardown deadlocked with one of gloo's threads
    over the GIL (see `training_utils.training.end_training`, which now avoids it). That race is
    torch's, so should a run still hang, the hang is reported in full (the processes' states and
    stacks) at the end of pytest's report and the run is made once more in a fresh folder; a second
    hang fails the test.
    """
    for attempt in (1, 2):
        output_dir = prepare()
        try:
            return output_dir, launch(script, *args_for(output_dir), processes=processes,
                                      timeout=MULTIPROCESS_TIMEOUT_S)
        except RunHung as hang:
            HANG_REPORTS.append(f"{os.environ.get('PYTEST_CURRENT_TEST')}, attempt {attempt}: {hang}")
            if attempt == 2:
                raise


@pytest.hookimpl(trylast=True)  # last before the final counts: what a log's tail shows
def pytest_terminal_summary(terminalreporter):
    if HANG_REPORTS:
        terminalreporter.section("runs that hung")
        for report in HANG_REPORTS:
            terminalreporter.write_line(report)


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


def assert_close_files(a, b, atol=1e-5):
    """Two safetensors files hold the same keys and tensors within ``atol`` (e.g. the weights of an uncached
    and a cached run, equal up to float noise); returns ``b``'s tensors for further checks."""
    a_tensors, b_tensors = load_file(a), load_file(b)
    assert a_tensors.keys() == b_tensors.keys() and len(b_tensors) > 0
    for key in b_tensors:
        assert torch.allclose(b_tensors[key], a_tensors[key], atol=atol), (str(b), key)
    return b_tensors


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
