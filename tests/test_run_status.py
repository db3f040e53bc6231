"""How a run ends, whatever ends it (training_utils.outputs.run_status): one line, the exit status, run_status.json."""

import json
import os
import signal
import subprocess
import sys

import pytest

from training_utils.errors import RunStopped, UsageError
from training_utils.names import STATUS_FILE
from training_utils.outputs.run_status import NO_STATUS_EXIT_CODE, main, read_status, run_script


def script(output_dir, body, step=None):
    """``(main, parse_args)`` of a script whose main takes the folder ``output_dir`` (as the output folder's set-up
    does) and runs ``body()`` after completing ``step`` steps."""
    def parse_args():
        return output_dir

    def script_main(args, run):
        run.take_folder(args)
        run.last_step = step
        body()

    return script_main, parse_args


def ended(capsys, output_dir, script_main, parse_args):
    """(exit status, stderr, the status written) of ``run_script(script_main, parse_args)``."""
    with pytest.raises(SystemExit) as exited:
        run_script(script_main, parse_args)
    return exited.value.code, capsys.readouterr().err, json.loads((output_dir / STATUS_FILE).read_text())


def raising(error):
    def body():
        raise error

    return body


def test_a_completed_run_says_so_with_its_last_step_and_latest_checkpoint(tmp_path):
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-10").mkdir()
    run_script(*script(tmp_path, lambda: None, step=12))
    assert read_status(tmp_path) == {"reason": "completed", "exit_status": 0, "last_step": 12,
                                     "resume_from": "checkpoint-10", "message": ""}


@pytest.mark.parametrize("error, reason, code, line", [
    (UsageError("--rank", 0, "a positive integer"), "usage error", 2, "error: --rank=0: expected a positive integer"),
    (RunStopped("the loss is nan at step 3", 3, "non-finite loss"), "non-finite loss", 3,
     "stopped: the loss is nan at step 3"),
    (RunStopped("could not write out: No space left on device", 74, "write failed"), "write failed", 74,
     "stopped: could not write out: No space left on device"),
])
def test_a_stop_is_one_line_its_exit_status_and_the_same_in_the_status(tmp_path, capsys, error, reason, code, line):
    status, stderr, written = ended(capsys, tmp_path, *script(tmp_path, raising(error), step=2))
    assert (status, stderr) == (code, line + "\n")
    assert written == {"reason": reason, "exit_status": code, "last_step": 2, "resume_from": None,
                       "message": line.split(": ", 1)[1]}


def test_a_signal_outside_the_loop_stops_at_once_as_a_preemption(tmp_path, capsys):
    def signalled():
        os.kill(os.getpid(), signal.SIGTERM)

    status, stderr, written = ended(capsys, tmp_path, *script(tmp_path, signalled, step=5))
    message = ("stopped by SIGTERM after step 5; every file written is whole: rerun with --resume_from_checkpoint "
               "latest")
    assert (status, stderr) == (75, f"stopped: {message}\n")
    assert (written["reason"], written["exit_status"], written["message"]) == ("preempted", 75, message)


def test_an_unexpected_error_is_recorded_as_failed_and_keeps_its_traceback(tmp_path):
    with pytest.raises(KeyError):
        run_script(*script(tmp_path, raising(KeyError("vae"))))
    assert read_status(tmp_path) == {"reason": "failed", "exit_status": 1, "last_step": None, "resume_from": None,
                                     "message": "KeyError: 'vae'"}


def test_nothing_is_written_before_the_folder_is_the_runs_nor_by_the_other_processes(tmp_path, capsys, monkeypatch):
    def refused():
        raise UsageError("--output_dir", str(tmp_path), "a folder without another run's outputs")

    with pytest.raises(SystemExit):
        run_script(lambda args, run: None, refused)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        run_script(*script(tmp_path, raising(RunStopped("stopped by SIGTERM", 75, "preempted"))))
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().err == f"error: --output_dir={str(tmp_path)!r}: expected a folder without another " \
                                      f"run's outputs\n"


def test_a_run_stopped_before_it_takes_the_folder_leaves_the_status_of_the_run_before(tmp_path, capsys):
    completed = json.dumps({"reason": "completed", "exit_status": 0, "last_step": 9, "resume_from": "checkpoint-8"})
    (tmp_path / STATUS_FILE).write_text(completed)

    def refused_resume(args, run):
        raise UsageError("--resume_from_checkpoint", "latest", "a checkpoint of this adapter")

    with pytest.raises(SystemExit):
        run_script(refused_resume, lambda: tmp_path)
    assert (tmp_path / STATUS_FILE).read_text() == completed


@pytest.mark.parametrize("status, line, exit_status", [
    ({"reason": "preempted", "exit_status": 75, "last_step": 40, "resume_from": "checkpoint-40", "message": "..."},
     "preempted: exit status 75, last step 40, resume from checkpoint-40", 75),
    ({"reason": "completed", "exit_status": 0, "last_step": 12, "resume_from": None, "message": ""},
     "completed: exit status 0, last step 12, resume from None", 0),
    ({"reason": "running", "exit_status": None, "last_step": 3, "resume_from": None, "message": ""},
     "running: exit status none yet, last step 3, resume from None", 1),
])
def test_the_status_command_says_the_status_in_one_line_and_exits_with_the_runs_status(tmp_path, capsys, status,
                                                                                        line, exit_status):
    (tmp_path / STATUS_FILE).write_text(json.dumps(status))
    assert main([str(tmp_path)]) == exit_status
    assert capsys.readouterr() == (line + "\n", "")


@pytest.mark.parametrize("text", [None, "{not json", '{"reason": "completed"}', '["completed", 0]',
                                  '{"reason": "x", "exit_status": "75", "last_step": 1, "resume_from": null}'])
def test_the_status_command_without_a_readable_status_says_so_in_one_line(tmp_path, capsys, text):
    if text is not None:
        (tmp_path / STATUS_FILE).write_text(text)
    assert main([str(tmp_path)]) == NO_STATUS_EXIT_CODE
    assert capsys.readouterr() == ("", f"error: {tmp_path / STATUS_FILE}: no readable run status there\n")


def test_the_status_command_runs_as_a_module_with_the_runs_exit_status(tmp_path):
    (tmp_path / STATUS_FILE).write_text(json.dumps({"reason": "write failed", "exit_status": 74, "last_step": 2,
                                                    "resume_from": "checkpoint-2", "message": "disk full"}))
    command = subprocess.run([sys.executable, "-m", "training_utils.outputs.run_status", str(tmp_path)],
                             capture_output=True, text=True)
    assert (command.returncode, command.stdout, command.stderr) == (
        74, "write failed: exit status 74, last step 2, resume from checkpoint-2\n", "")
