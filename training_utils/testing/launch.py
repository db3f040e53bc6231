"""Running a training script as a user does, with ``accelerate launch`` on the CPU, offline, bounded in time.

A run that hangs is stopped (`run_with_timeout`) with each of its processes' Python stacks in its output,
and leaves nothing running: a smoke test fails instead of stalling its suite.
"""

import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# A tiny run takes seconds; one that has not finished after this long hangs.
RUN_TIMEOUT_S = 300
# What every launched run gets on top of the caller's environment: offline, quiet and single-threaded (the tiny
# models gain nothing from more threads), and Python's stacks on SIGABRT, which `run_with_timeout` sends to a hung run.
SMOKE_TEST_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
    "OMP_NUM_THREADS": "1",
    "PYTHONFAULTHANDLER": "1",
}


def free_port():
    """A TCP port nothing listens on now, for one multi-process run's rendezvous: sharing the default port
    with another run (a leftover, or another job on this machine) could join the wrong one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_command(script, *args, processes=1, quiet=False):
    """The ``accelerate launch`` command that runs ``script`` with ``args`` on ``processes`` CPU processes (gloo,
    on a free port of the loopback interface, when more than one). ``quiet`` drops accelerate's own traceback
    after a failing script, leaving the script's output alone."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--num_processes", str(processes)]
    if processes > 1:
        command += ["--multi_gpu", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    if quiet:
        command += ["--quiet"]
    return [*command, str(script), *map(str, args)]


def launch_environment(processes=1, env=None):
    """The environment of a launched run: this process's, `SMOKE_TEST_ENV`, then ``env``. Several processes
    are kept on the CPU and talk over loopback, whatever this machine's hostname resolves to."""
    environment = {**os.environ, **SMOKE_TEST_ENV}
    if processes > 1:
        environment["ACCELERATE_USE_CPU"] = "1"
        if "lo" in dict(socket.if_nameindex()).values():
            environment["GLOO_SOCKET_IFNAME"] = "lo"
    return {**environment, **(env or {})}


def run_captured(command, env=None, timeout=RUN_TIMEOUT_S, cwd=None, stop=None):
    """``(result, stopped)``: ``command``'s `subprocess.CompletedProcess`, its output captured, and None; or, if it
    was still running after ``timeout`` seconds, what ``stop(process, stderr_file)`` returned when it ended it (by
    default SIGABRT, then SIGKILL, to every process of the run, returning True).

    Output goes to files rather than pipes, so that a worker outliving its launcher cannot block the read.
    """
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True,
                                   env=env, cwd=cwd)
        try:
            process.wait(timeout)
            stopped = None
        except subprocess.TimeoutExpired:
            stopped = (stop or _stop)(process, stderr)
            process.wait()
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read()), stopped


def run_with_timeout(command, env=None, timeout=RUN_TIMEOUT_S, cwd=None):
    """``subprocess.run(command)`` with its output captured, given up after ``timeout`` seconds (`run_captured`):
    with ``PYTHONFAULTHANDLER`` set, as `SMOKE_TEST_ENV` sets it, each process of a hung run prints its Python
    stacks, and an `AssertionError` gives the end of the output."""
    result, stopped = run_captured(command, env, timeout, cwd)
    if stopped is not None:
        raise AssertionError(f"no result within {timeout} s (a hang?); the end of its output:\n"
                             f"{result.stdout[-2000:]}\n{result.stderr[-8000:]}")
    return result


def _stop(process, log):
    """`run_captured`'s default stop: SIGABRT to ``process`` and its descendants (torchrun starts its workers in
    sessions of their own, out of reach of a process-group kill), up to 5 s for them to print their stacks and
    end, then SIGKILL to what is left."""
    tree = [process.pid, *_descendants(process.pid)]
    _send(tree, signal.SIGABRT)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (process.poll() is None or any(map(_running, tree[1:]))):
        time.sleep(0.05)
    if process.poll() is None:
        process.kill()
    _send(filter(_running, tree[1:]), signal.SIGKILL)  # an ended process's pid may be another's by now
    return True


def _send(pids, signal_number):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal_number)


def _running(pid):
    """Whether ``pid`` exists and is no zombie, as ``/proc`` says."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid):
    """The pids of ``pid``'s descendants, as ``/proc`` lists them (Linux; elsewhere none are found)."""
    children = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
            children[parent].append(int(stat.parent.name))
    found, pending = [], [pid]
    while pending:
        descendants = children[pending.pop()]
        found += descendants
        pending += descendants
    return found


def launch_script(script, *args, processes=1, timeout=RUN_TIMEOUT_S, check=True, quiet=False, env=None,
                  run=run_with_timeout):
    """Run ``script`` (a path) with ``args`` through ``accelerate launch`` on ``processes`` CPU processes, offline,
    within ``timeout`` seconds; returns the `subprocess.CompletedProcess`. With ``check``, a failed run raises
    `AssertionError` with the end of its output. ``env`` adds variables (see `launch_environment`); ``run``, called
    as ``run(command, env, timeout)``, replaces `run_with_timeout`, e.g. by one that reports more of a hang."""
    result = run(launch_command(script, *args, processes=processes, quiet=quiet), launch_environment(processes, env),
                 timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result
