"""What our own tests add to `training_utils.testing`: this checkout's scripts launched with a hang reported in
full (`run_bounded`), runs launched together, the one retry of a two-process run that hung (`launch_processes`),
and a script's input errors checked in this process (`usage_error`)."""

import atexit
import collections
import contextlib
import functools
import importlib.util
import io
import os
import re
import runpy
import signal
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from unittest import mock

import psutil
import pytest

from training_utils.testing import RUN_TIMEOUT_S, launch_environment, launch_script, run_captured
from warm_runner import WarmServer

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
# Every training script, at any depth, by its path under examples/ (upstream's names: train_*.py, and the textual inversion ones).
SCRIPTS = sorted(path.relative_to(EXAMPLES).as_posix() for path in EXAMPLES.rglob("*.py"))
# The scripts import this checkout's training_utils, whatever else is installed.
REPO_ON_PATH = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
# Quiet, deterministic, offline subprocesses, as `training_utils.testing` launches them.
SUBPROCESS_ENV = launch_environment(env=REPO_ON_PATH)
STACKS_MARKER = "--- stacks of pid"  # heads each hung worker's stacks in its run's stderr


class RunHung(AssertionError):
    """A run that gave no result in time; the message holds its processes' states and stacks."""


def run_bounded(command, env=SUBPROCESS_ENV, timeout=RUN_TIMEOUT_S, cwd=REPO):
    """``subprocess.run(command)`` in ``cwd``, output captured, that cannot hang the suite (`run_captured`): on
    timeout it raises `RunHung` with what `_stop_tree` saw of the processes and the stacks they printed."""
    return _unless_hung(*run_captured(command, env, timeout, cwd, stop=_stop_tree), timeout)


def run_warm(command, env=SUBPROCESS_ENV, timeout=RUN_TIMEOUT_S, cwd=REPO):
    """`run_bounded` for an ``accelerate launch``, whose script children of the session's warm server run, one per
    process (`warm_runner`): the same argv and environments, no interpreter to start, nothing to import."""
    only_in_slow_tests()
    return _unless_hung(*warm_server().run(command, env, timeout, cwd, stop=_stop_tree), timeout)


def _unless_hung(result, states, timeout):
    """``result``, or `RunHung` with what `_stop_tree` saw of a run stopped after ``timeout`` seconds (``states``)
    and the stacks its processes printed."""
    if states is not None:
        log, marker, stacks = result.stderr.partition(STACKS_MARKER)
        raise RunHung(f"no result within {timeout} s (a hang?). The end of its log:\n"
                      f"{_readable_stderr(log)[-3000:]}\n"
                      f"The stacks of its workers:\n{_readable_stderr(marker + stacks)[-8000:]}\n"
                      f"Its processes when it was stopped:\n{states}")
    return result


_warm = {}
_warm_lock = threading.Lock()


def warm_server():
    """The session's `warm_runner.WarmServer`, started at the first warm launch (it imports for about 10 s) and
    stopped when the session ends."""
    with _warm_lock:
        if "server" not in _warm:
            _warm["server"] = WarmServer.start(SUBPROCESS_ENV)
            atexit.register(_warm["server"].stop)
    return _warm["server"]


def _readable_stderr(text):
    """``text`` without blank lines and faulthandler's lists of extension modules, with library paths
    cut to the package ("torch/distributed/...") and this checkout's to the repository."""
    return "\n".join(re.sub(r'File "[^"]*(site-packages|python3\.\d+)/', 'File "', line).replace(f"{REPO}/", "")
                     for line in text.splitlines() if line.strip() and not line.startswith("Extension modules:"))


def _stop_tree(process, log):
    """Describe every process of a hung tree, then stop it. The launchers (processes with children) are
    frozen first, so that they cannot react; each worker then gets SIGABRT (faulthandler prints its
    stacks to ``log``, under a line naming it) and is waited for, one at a time, so that their stacks
    do not interleave; then everything left gets SIGKILL. torchrun starts its workers in sessions of
    their own: a process-group kill would miss them."""
    root = psutil.Process(process.pid)
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


def launching(fixture):
    """Mark a fixture function that launches training runs: conftest marks every test that uses it slow."""
    fixture.launches = True
    return fixture


# Whether the running test is marked slow (conftest sets it before each test's fixtures run).
running_slow_test = [True]


def only_in_slow_tests():
    """Stop a test that launches a run but is not marked slow, so that ``-m "not slow"`` stays the quick subset:
    mark it ``@pytest.mark.slow``, or its fixture `launching`."""
    if not running_slow_test[0]:
        raise AssertionError(f"{os.environ.get('PYTEST_CURRENT_TEST')} launches a run but is not marked slow")


def launch(script, *args, processes=1, quiet=False, env=None, **options):
    """`training_utils.testing.launch_script` on ``examples/<script>`` (or an absolute path) with this checkout's
    training_utils, a hang reported in full; ``env`` adds variables (e.g. those ``--use_fsdp`` sets). The script runs
    in the warm server (`run_warm`) unless ``TESTS_COLD_LAUNCH=1``; a ``quiet`` run (what users see of the launcher)
    through ``accelerate launch`` itself (`run_bounded`)."""
    only_in_slow_tests()
    warm = not quiet and os.environ.get("TESTS_COLD_LAUNCH") != "1"
    return launch_script(EXAMPLES / script, *args, processes=processes, quiet=quiet,
                         env={**REPO_ON_PATH, **(env or {})}, run=run_warm if warm else run_bounded, **options)


# A run keeps one core busy (its imports, then its single-threaded steps) and holds under 1 GB: so many at once, on
# the cores this process may use (not more than 4, whatever a container reports).
RUNS_AT_ONCE = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def together(calls):
    """``{name: call()}`` for ``calls``, ``{name: a function of no arguments}``, `RUNS_AT_ONCE` running at once: on
    CI's two cores, two runs take little longer than one."""
    pool = ThreadPoolExecutor(RUNS_AT_ONCE)
    try:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}
    finally:
        pool.shutdown(cancel_futures=True)  # after a failure, the calls not started yet are not worth waiting for


def launch_together(launches, **options):
    """``{name: launch(*arguments, **options)}`` for ``launches``, ``{name: (script, *args)}``, run `together`."""
    return together({name: functools.partial(launch, *arguments, **options) for name, arguments in launches.items()})


# What ``accelerate launch --use_fsdp --fsdp_version 2`` sets: a run launched with these shards (FSDP2).
FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
# A two-process tiny run takes about 10 s.
MULTIPROCESS_TIMEOUT_S = 120


class RunHungWarning(UserWarning):
    """A run that hung and was made again: its report, in pytest's warnings summary (from every xdist worker)."""


def launch_processes(script, prepare, args_for, processes=2, env=None):
    """``(output_dir, CompletedProcess)`` of ``script`` on several CPU processes (gloo), in the folder that
    ``prepare()`` returns and on the arguments ``args_for(output_dir)``; ``env`` adds variables (`FSDP2`'s shard it).

    Should a run hang at exit (a race in torch's gloo teardown that `training_utils.accelerator.end_training`
    avoids), the hang is reported in full (the processes' states and stacks) in pytest's warnings summary
    (`RunHungWarning`) and the run is made once more in a fresh folder; a second hang fails the test.
    """
    for attempt in (1, 2):
        output_dir = prepare()
        try:
            return output_dir, launch(script, *args_for(output_dir), processes=processes, env=env,
                                      timeout=MULTIPROCESS_TIMEOUT_S)
        except RunHung as hang:
            if attempt == 2:
                raise
            warnings.warn(f"{os.environ.get('PYTEST_CURRENT_TEST')}, attempt {attempt}: {hang}", RunHungWarning)


def deleting_after_load(script, folders, directory):
    """A script in ``directory`` that runs ``script`` but deletes ``folders`` (the base model's, a VAE's) as soon
    as `training_utils.pipeline.load_pipeline` returns: a run that reads its base model again fails."""
    wrapper = Path(directory) / "train_then_delete_model.py"
    wrapper.write_text(
        "import runpy, shutil, sys\n"
        "import training_utils.pipeline as pipeline\n"
        "load = pipeline.load_pipeline\n"
        "def load_then_delete(*args, **kwargs):\n"
        "    pipe = load(*args, **kwargs)\n"
        f"    for folder in {[str(folder) for folder in folders]!r}:\n"
        "        shutil.rmtree(folder)\n"
        "    return pipe\n"
        "pipeline.load_pipeline = load_then_delete\n"
        "for module in list(sys.modules.values()):  # those that took it by name before (a warm runner's)\n"
        "    if getattr(module, 'load_pipeline', None) is load:\n"
        "        module.load_pipeline = load_then_delete\n"
        f"sys.argv[0] = {str(script)!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    return wrapper


def controlnet_flags(tiny, model, output_dir, *extra, mixed=False):
    """A ControlNet script's flags on the tiny ``model`` fixture: random crops and flips, 30% empty prompts. On 64px
    squares with upstream's --proportion_empty_prompts; or, ``mixed``, on pictures of mixed shapes in aspect-ratio
    buckets, each seen twice an epoch, with the same flag by its shared name."""
    data = (["--train_data_dir", tiny["shapes_mixed"], "--use_aspect_ratio_buckets", "--repeats", 2,
             "--caption_dropout", 0.3] if mixed else
            ["--train_data_dir", tiny["shapes_controlnet"], "--proportion_empty_prompts", 0.3])
    return ["--pretrained_model_name_or_path", tiny[model], *data, "--output_dir", output_dir, "--resolution", 32,
            "--train_batch_size", 2, "--learning_rate", 1e-3, "--random_flip", "--use_ema", "--ema_decay", 0.9,
            "--seed", 3, *extra]


def forget_prepared(accelerator):
    """Forget ``accelerator``'s checkpoint hooks and prepared objects (one Accelerator serves a test module): what
    `Accelerator.free_memory` forgets, without its garbage collection, which takes about a second in a process that
    has imported diffusers."""
    accelerator._save_model_state_pre_hook.clear()
    accelerator._load_model_state_pre_hook.clear()
    accelerator._models, accelerator._optimizers, accelerator._schedulers, accelerator._dataloaders = [], [], [], []
    accelerator.step = 0


@functools.cache
def import_script(script):
    """The module of ``examples/<script>``, imported by path (its ``main`` does not run)."""
    path = EXAMPLES / script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def usage_error(script, *args):
    """The one ``error:`` line of ``python examples/<script> args``, run in this process (a launch spends seconds
    importing), which must stop at its input checks with exit status 2 and no traceback. Every script makes its
    accelerator right after those checks and before loading any weights: a script that gets that far fails the
    test."""
    path = EXAMPLES / script

    def past_the_input_checks(args):
        raise AssertionError(f"{script} accepted {vars(args)} and went on to make its accelerator")

    stderr = io.StringIO()
    with (mock.patch("training_utils.accelerator.make_accelerator", past_the_input_checks),
          mock.patch.object(sys, "argv", [str(path), *map(str, args)]), contextlib.redirect_stderr(stderr),
          pytest.raises(SystemExit) as exited):
        runpy.run_path(str(path), run_name="__main__")
    stderr = stderr.getvalue()
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert exited.value.code == 2 and "Traceback" not in stderr and len(errors) == 1, stderr[-2000:]
    return errors[0]


def launched_usage_error(result):
    """`usage_error`'s line, from the result of a run launched with ``check=False`` that its checks stopped: one
    line, no traceback and a failed exit status (launched with ``quiet=True``: through ``accelerate launch --quiet``
    too)."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and "Traceback" not in result.stderr and len(errors) == 1, result.stderr[-2000:]
    return errors[0]


def family_args(module, model, *argv):
    """The flags of a family's module (its `add_args`) parsed from ``argv`` for the pipeline at ``model``, and checked
    (its `check_args`), as a script parses them."""
    from training_utils.args import training_parser

    parser = training_parser("test")
    module.add_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", str(model), *map(str, argv)])
    module.check_args(args)
    return args
