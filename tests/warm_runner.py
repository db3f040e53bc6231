"""Single-process smoke runs without a fresh interpreter each: a warm server that has imported torch, diffusers,
transformers, accelerate and every script's modules once, and forks a child per run.

A run's child executes the script as ``__main__`` with the argv and environment that ``accelerate launch`` would
give it (`script_and_environment`: accelerate's own simple launcher computes them), its output in files, in the
folder asked; its exit status comes back as a launched run's would. A hung run is stopped as any other (the caller
holds the child's pid; `helpers.run_warm` prints its stacks). A launch costs the fork and what the script itself
does, not the ~10 s of imports and the launcher.

    server = WarmServer.start(environment)   # once per test session
    result, stopped = server.run(command, env, timeout, cwd, stop)   # like training_utils.testing.run_captured
    process = server.spawn(command, env, cwd, stdout, stderr)        # like subprocess.Popen

A multi-process launch forks one child per process, each with the environment that accelerate's multi-process
launcher and torchrun give that rank (`worker_environment`): the children rendezvous over gloo as launched workers
do. The server is single-threaded and never runs a tensor operation before forking, so that no thread (nor
OpenMP's pool) is lost in the children. Usage errors through the launcher and the copied-script test still go
through the real ``accelerate launch``.
"""

import atexit
import contextlib
import faulthandler
import importlib
import importlib.util
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
# What the scripts import only once they run: the trackers' writer, torchao for an int8 base, PyAV for videos. (Each
# pipeline class the scripts import brings its components' classes with it.)
LAZY_IMPORTS = [("torch.utils.tensorboard", ["SummaryWriter"]), ("torchao", []), ("av", [])]


def preload():
    """Import what the example scripts import, and what they import once they run, without running any."""
    for script in sorted(EXAMPLES.rglob("*.py")):
        spec = importlib.util.spec_from_file_location(f"preloaded_{script.stem}", script)
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    for module, names in LAZY_IMPORTS:
        imported = importlib.import_module(module)
        for name in names:
            getattr(imported, name)
    # transformers builds its table of checkpoint key renamings (over a thousand regular expressions, about 1 s) at
    # a process's first model load, and keeps it: built here, every child inherits it.
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("clip_text_model")


def serve(path):
    """Listen on the Unix socket ``path``: each connection sends one request (a JSON line: argv, env, cwd and the
    files for stdout and stderr); the server forks a child that runs it and answers ``{"pid"}``, then
    ``{"returncode"}`` when the child ends. Ends with its parent (the test session)."""
    preload()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    running = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            connection, _ = listener.accept()
            with connection.makefile("r") as lines:
                request = json.loads(lines.readline())
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                run_child(request)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            running[pid] = connection
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            with contextlib.suppress(OSError):
                running[pid].sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            running.pop(pid).close()


def run_child(request):
    """In the forked child: become the script's process as the launcher would start it, run it, exit with its
    status. Never returns."""
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        written = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], written),
                               (2, request["stderr"], written)):
            opened = os.open(path, mode, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        if os.environ.get("PYTHONFAULTHANDLER"):
            faulthandler.enable(all_threads=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        extra_paths = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
        sys.path[:] = [str(Path(script).resolve().parent), *extra_paths,
                       *[entry for entry in sys.path[1:] if entry not in extra_paths]]
        code = 0
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_code(exit_.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def exit_code(value):
    """The status a Python process exits with for ``sys.exit(value)``."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


class WarmServer:
    """The test session's handle on a `serve` process."""

    def __init__(self, process, path):
        self.process = process
        self.path = path

    @classmethod
    def start(cls, environment):
        """Start a server in ``environment`` (the variables every run shares, read by libraries at import) and wait
        until it has imported everything."""
        path = Path(tempfile.mkdtemp(prefix="warm_runner_")) / "socket"
        process = subprocess.Popen([sys.executable, __file__, str(path)], env=environment, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the warm runner did not start (exit status {process.wait()})")
        return cls(process, path)

    def stop(self):
        self.process.terminate()
        self.process.wait()

    def spawn(self, command, env, cwd, stdout, stderr):
        """A `WarmProcess` running ``command`` (a script under ``python``, or a single-process ``accelerate launch``
        of one) in ``env`` and ``cwd``, its output in the files named ``stdout`` and ``stderr``."""
        (argv, env), = scripts_and_environments(command, env)
        return self._fork(argv, env, cwd, stdout, stderr)

    def _fork(self, argv, env, cwd, stdout, stderr):
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(str(self.path))
        request = {"argv": argv, "env": dict(env), "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        connection.sendall(json.dumps(request).encode() + b"\n")
        return WarmProcess(connection)

    def run(self, command, env, timeout, cwd, stop):
        """``(result, stopped)`` as `training_utils.testing.run_captured` gives them, for ``command`` run by children
        of the server, one per process (`scripts_and_environments`); the output is each process's in turn. As
        torchrun does, a process that fails has the others stopped (SIGTERM); the status is the first failing
        script's own (the real launcher says only 1). ``stop(process, stderr_file)`` ends each child still running
        after ``timeout`` seconds, and what it returns (joined by lines, with several) is ``stopped``."""
        workers = scripts_and_environments(command, env)
        with contextlib.ExitStack() as files:
            outputs = [[files.enter_context(tempfile.NamedTemporaryFile("w+")) for _ in ("out", "err")]
                       for _ in workers]
            processes = [self._fork(argv, worker_env, cwd, stdout.name, stderr.name)
                         for (argv, worker_env), (stdout, stderr) in zip(workers, outputs)]
            stopped = None
            try:
                returncode = wait_like_torchrun(processes, time.monotonic() + timeout)
            except subprocess.TimeoutExpired:
                stopped = "\n".join(str(stop(process, stderr)) for process, (_, stderr) in zip(processes, outputs)
                                    if process.poll() is None)
                returncode = next((code for code in [process.wait() for process in processes] if code), 0)
            text = []
            for stream in zip(*outputs):
                for file in stream:
                    file.seek(0)
                text.append("".join(file.read() for file in stream))
            return subprocess.CompletedProcess(command, returncode, *text), stopped


def wait_like_torchrun(processes, deadline):
    """The status of ``processes`` run together: 0 when all succeed; else the first failure's, once the others have
    ended, sent SIGTERM (and SIGKILL 30 s later) as torchrun sends them. Raises `subprocess.TimeoutExpired` at
    ``deadline``."""
    running = list(processes)
    while running:
        for process in list(running):
            if process.poll() is not None:
                running.remove(process)
                if process.returncode:
                    for other in running:
                        other.send_signal(signal.SIGTERM)
                    for other in running:  # torchrun's grace period, then SIGKILL
                        try:
                            other.wait(30)
                        except subprocess.TimeoutExpired:
                            other.kill()
                            other.wait()
                    return process.returncode
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("warm run", deadline)
        time.sleep(0.01)
    return 0


def scripts_and_environments(command, env):
    """``[(argv, environment)]`` of the processes that ``command`` starts: ``[python, script, *args]`` as it is; an
    ``accelerate launch`` of a script as accelerate runs it: on one process, as its simple launcher does (the
    variables it sets, mixed precision, the CPU..., over ``env``); on several, as its multi-process launcher has
    torchrun start each worker (`worker_environment`)."""
    command = [str(part) for part in command]
    if command[1:3] != ["-m", "accelerate.commands.launch"]:
        return [(command[1:], env)]
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(command[3:]))
    multi_process = (args.use_fsdp or args.multi_gpu) and not args.cpu  # what accelerate's launch_command tests
    if args.quiet or args.use_deepspeed or args.num_machines != 1 or multi_process != (args.num_processes > 1):
        raise ValueError(f"not a launch the warm runner makes: {command}")
    if not multi_process:
        script_command, launcher_env = prepare_simple_launcher_cmd_env(args)
        return [(script_command[1:], {**env, **set_by_launcher(launcher_env)})]
    launcher_env = set_by_launcher(prepare_multi_gpu_env(args))
    argv = [args.training_script, *args.training_script_args]
    return [(argv, {**env, **launcher_env, **worker_environment(rank, args)}) for rank in range(args.num_processes)]


def set_by_launcher(launcher_env):
    """The variables of ``launcher_env`` (the launcher's environment, made from this process's) that it set."""
    return {name: value for name, value in launcher_env.items() if os.environ.get(name) != value}


def worker_environment(rank, args):
    """What torchrun's local agent adds to the environment of the worker of rank ``rank`` on one machine (the
    variables of ``torch.distributed.elastic``'s ``LocalElasticAgent._start_workers``). Each worker makes the
    rendezvous store itself (rank 0 serves it) where torchrun's agent would serve it."""
    size = str(args.num_processes)
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": size, "WORLD_SIZE": size, "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": size, "MASTER_ADDR": args.main_process_ip or "127.0.0.1",
            "MASTER_PORT": str(args.main_process_port), "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}


class WarmProcess:
    """A child of the server, as `subprocess.Popen` offers a process: ``pid``, ``returncode``, `poll`, `wait`,
    `send_signal` and `kill` (what the tests' stop functions and signals use)."""

    def __init__(self, connection):
        self.connection = connection
        self.received = b""
        self.pid = self._reply(None)["pid"]
        self.returncode = None

    def _reply(self, timeout):
        """The server's next answer (a JSON line), waiting at most ``timeout`` seconds for it."""
        while b"\n" not in self.received:
            if not select.select([self.connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            chunk = self.connection.recv(4096)
            if not chunk:
                raise RuntimeError("the warm runner closed the connection")
            self.received += chunk
        line, self.received = self.received.split(b"\n", 1)
        return json.loads(line)

    def wait(self, timeout=None):
        if self.returncode is None:
            self.returncode = self._reply(timeout)["returncode"]
            self.connection.close()
        return self.returncode

    def poll(self):
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0)
        return None

    def send_signal(self, number):
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, number)

    def kill(self):
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1])
