"""The warm runner (tests/warm_runner.py) runs a script as ``accelerate launch`` runs it: the same argv, environment
and folder, the script's own exit status, its output; and a hung run fails with its stacks, leaving nothing
running."""

import json
import signal
import sys
import time

import pytest

from helpers import SUBPROCESS_ENV, RunHung, run_bounded, run_warm, warm_server
from training_utils.testing import launch_command, launch_environment

# Writes what it was given to the file named by its first argument, then exits as its second says.
REPORTING_SCRIPT = """
import json, os, sys
from pathlib import Path

Path(sys.argv[1]).write_text(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "main": __name__,
                                         "env": {name: value for name, value in os.environ.items()
                                                 if name.startswith(("ACCELERATE_", "OMP_", "HF_"))}}))
print("to stdout")
print("to stderr", file=sys.stderr)
if sys.argv[2] == "raise":
    raise ValueError("raised by the script")
sys.exit(int(sys.argv[2]))
"""


# Each process writes its argv, environment and an all-gathered rank to <argv[1]>-<rank>.json; the rank that
# FAIL_RANK names exits 3 before the collective.
TWO_PROCESS_JOB = """
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
if os.environ.get("FAIL_RANK") == str(rank):
    print(f"rank {rank} fails", file=sys.stderr)
    sys.exit(3)
gathered = [torch.zeros(1) for _ in range(2)]
dist.all_gather(gathered, torch.tensor([float(rank)]))
names = ("ACCELERATE_", "OMP_", "HF_", "RANK", "LOCAL_", "WORLD_", "GROUP_", "ROLE_", "MASTER_", "TORCH")
Path(f"{sys.argv[1]}-{rank}.json").write_text(json.dumps({
    "argv": sys.argv[1:], "gathered": [int(tensor.item()) for tensor in gathered],
    "env": {name: value for name, value in os.environ.items() if name.startswith(names)}}))
dist.destroy_process_group()
"""


# What differs between a warm worker's environment and a launched one's: the port (each launch takes a free one),
# who serves the rendezvous store (torchrun's agent; warm, rank 0), and the files and signals of torchrun's agent.
TORCHRUN_AGENT_ONLY = ("MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE",
                       "TORCHELASTIC_SIGNALS_TO_HANDLE")


def without(env, names):
    return {name: value for name, value in env.items() if name not in names}


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "report.py"
    path.write_text(REPORTING_SCRIPT)
    return path


@pytest.mark.slow
def test_a_warm_run_gets_what_accelerate_launch_gives_the_script(script, tmp_path):
    launched, warm = tmp_path / "launched.json", tmp_path / "warm.json"
    real = run_bounded(launch_command(script, launched, 3), cwd=tmp_path)
    result = run_warm(launch_command(script, warm, 3), cwd=tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (3, "to stdout\n", "to stderr\n")
    assert real.returncode != 0  # accelerate's launcher says only that the script failed
    seen, expected = json.loads(warm.read_text()), json.loads(launched.read_text())
    assert seen["argv"] == [str(warm), "3"] and expected["argv"] == [str(launched), "3"]
    assert seen["cwd"] == expected["cwd"] == str(tmp_path) and seen["main"] == "__main__"
    assert seen["env"] == expected["env"] and seen["env"]["ACCELERATE_MIXED_PRECISION"] == "no"


@pytest.mark.slow
def test_a_warm_two_process_run_gets_what_accelerate_launch_and_torchrun_give_each_worker(tmp_path):
    job = tmp_path / "job.py"
    job.write_text(TWO_PROCESS_JOB)
    expected = run_bounded(launch_command(job, tmp_path / "launched", processes=2), cwd=tmp_path,
                           env=launch_environment(2, SUBPROCESS_ENV))
    result = run_warm(launch_command(job, tmp_path / "warm", processes=2), cwd=tmp_path,
                      env=launch_environment(2, SUBPROCESS_ENV))
    assert expected.returncode == result.returncode == 0, result.stderr
    for rank in (0, 1):
        seen, launched = (json.loads((tmp_path / f"{run}-{rank}.json").read_text()) for run in ("warm", "launched"))
        assert seen["argv"] == [str(tmp_path / "warm")] and launched["argv"] == [str(tmp_path / "launched")]
        assert without(seen["env"], TORCHRUN_AGENT_ONLY) == without(launched["env"], TORCHRUN_AGENT_ONLY)
        assert seen["env"]["RANK"] == str(rank) and seen["gathered"] == launched["gathered"] == [0, 1]
    failing = run_warm(launch_command(job, tmp_path / "fail", processes=2), cwd=tmp_path,
                       env=launch_environment(2, {**SUBPROCESS_ENV, "FAIL_RANK": "1"}))
    # Rank 1 exits 3; rank 0, waiting for it in a collective, is stopped as torchrun stops it.
    assert failing.returncode == 3 and "rank 1 fails" in failing.stderr


@pytest.mark.slow
def test_an_exception_exits_1_with_its_traceback_and_a_signal_is_the_status(script, tmp_path):
    result = run_warm([sys.executable, script, tmp_path / "out.json", "raise"])
    assert result.returncode == 1 and "ValueError: raised by the script" in result.stderr
    sleeping = tmp_path / "sleep.py"
    sleeping.write_text("import sys, time\nopen(sys.argv[1], 'w').close()\ntime.sleep(60)\n")
    process = warm_server().spawn([sys.executable, sleeping, tmp_path / "started"], SUBPROCESS_ENV, tmp_path,
                                  tmp_path / "out", tmp_path / "err")
    while not (tmp_path / "started").exists():
        assert process.poll() is None, (tmp_path / "err").read_text()
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM


@pytest.mark.slow
def test_a_hung_warm_run_fails_with_its_stacks_and_is_stopped(tmp_path):
    hanging = tmp_path / "hang.py"
    hanging.write_text("import time\ndef waiting_forever():\n    time.sleep(600)\nwaiting_forever()\n")
    with pytest.raises(RunHung, match="no result within 2 s") as failure:
        run_warm([sys.executable, hanging], timeout=2)
    assert "waiting_forever" in str(failure.value)
