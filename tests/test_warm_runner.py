"""The warm runner (tests/warm_runner.py) runs a script as ``accelerate launch`` runs it: the same argv, environment
and folder, the script's own exit status, its output; and a hung run fails with its stacks, leaving nothing
running."""

import json
import signal
import sys
import time

import pytest

from helpers import SUBPROCESS_ENV, RunHung, run_bounded, run_warm, warm_server
from training_utils.testing import launch_command

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
