"""How a run ends, whatever ends it: one line saying why, its exit status, and ``run_status.json``.

Every script's ``__main__`` block is ``run_script(main, parse_args)``, which makes the run's `RunRecord` and hands
it to ``main(args, run)``. The run then ends in one of these ways, each with its exit status, and the first process
writes ``run_status.json`` into the output folder last, atomically, once the folder is the run's
(`RunRecord.take_folder`: when the folder is made ready, or for a run that resumes, once its checkpoint is
accepted): a run stopped before leaves the folder's status as it was::

    {"reason": "preempted", "exit_status": 75, "last_step": 40, "resume_from": "checkpoint-40",
     "message": "stopped by SIGTERM after step 40; checkpoint saved, resume with --resume_from_checkpoint latest"}

=================  ===========  ====================================================================================
reason             exit status  what ended the run
=================  ===========  ====================================================================================
completed          0            the last step, its outputs written
usage error        2            a bad flag or input (``error: ...``)
non-finite loss    3            a NaN or infinite loss, stopped before anything was written from those weights
unreadable image   65           an image that cannot be read, with a checkpoint of the last whole step
write failed       74           a file that could not be written, named with the cause
preempted          75           SIGTERM or SIGINT: after the running step, with a checkpoint, or at once before
failed             1            anything else (a bug: its traceback follows)
running            (none)       written when the run starts: a run killed outright (SIGKILL) leaves it
=================  ===========  ====================================================================================

``accelerate launch`` exits with status 1 whenever its script fails, whatever the script's own status was: a
scheduler that requeues preempted jobs reads the reason here (the script run on one process with ``python`` exits
with its own status too). ``python -m training_utils.outputs.run_status OUTPUT_DIR`` says the status in one line
and exits with the run's exit status: 1 for a run still "running" (or killed outright), `NO_STATUS_EXIT_CODE` where
there is no readable ``run_status.json``.
"""

import argparse
import json
import logging
import sys
import traceback
from pathlib import Path

from ..errors import (PREEMPTED_EXIT_CODE, USAGE_EXIT_CODE, Interrupted, RunStopped, UsageError, WriteFailed,
                      is_first_process, say_why_and_exit)
from ..names import STATUS_FILE
from .checkpoint_folders import complete_checkpoints
from .stop_signals import SIGNALS

logger = logging.getLogger(__name__)

COMPLETED, RUNNING, FAILED = "completed", "running", "failed"
NO_STATUS_EXIT_CODE = 66  # EX_NOINPUT: the folder holds no status to read


class RunRecord:
    """What ``run_status.json`` says of the run in this process: where it goes (``output_dir``, once the folder is
    the run's) and the last completed optimizer step (``last_step``, from the training loop; None before training)."""

    def __init__(self):
        self.output_dir = None
        self.last_step = None

    def take_folder(self, output_dir):
        """Make ``output_dir`` the run's: its status says "running" now, and goes there however the run ends. Until
        then the folder's status is another run's, which nothing of this run replaces."""
        if self.output_dir is None:
            self.output_dir = output_dir
            self.write(RUNNING, None)

    def status(self, reason, exit_status, message=""):
        """The status of the run ended by ``reason``: the newest whole checkpoint in its folder is where to resume."""
        checkpoints = complete_checkpoints(self.output_dir)
        return {"reason": reason, "exit_status": exit_status, "last_step": self.last_step,
                "resume_from": checkpoints[-1][1].name if checkpoints else None, "message": message}

    def write(self, reason, exit_status, message=""):
        """Write ``run_status.json`` atomically into the run's folder (nothing before the folder is the run's, and
        only on the first process). A status that cannot be written is said on stderr: the run's own line says why
        it ended."""
        if self.output_dir is None or not is_first_process() or not Path(self.output_dir).is_dir():
            return
        from .writing import write_atomically  # imported here: the status command reads without loading torch

        text = json.dumps(self.status(reason, exit_status, message), indent=1) + "\n"
        try:
            write_atomically(self.output_dir, lambda staging: Path(staging, STATUS_FILE).write_text(text))
        except WriteFailed as failed:
            logger.error(f"{STATUS_FILE} was not written: {failed}")


def read_status(output_dir):
    """The ``run_status.json`` of the run last in ``output_dir``, or None (none there, or unreadable)."""
    try:
        return json.loads((Path(output_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return None


def interrupted_stop(interrupted, run):
    """The `RunStopped` that a signal received outside the training loop (`errors.Interrupted`) amounts to."""
    after = "before training began" if run.last_step is None else f"after step {run.last_step}"
    return RunStopped(f"stopped by {interrupted.signal_name} {after}; every file written is whole: rerun with "
                      f"--resume_from_checkpoint latest", PREEMPTED_EXIT_CODE, "preempted")


def run_script(main, parse_args):
    """Run ``main(parse_args(), run)`` as a training script, ``run`` being a new `RunRecord`, with SIGTERM and SIGINT
    handled from start to end (`stop_signals`), and end it as the table above says: one line saying why,
    ``run_status.json``, the exit status. An unexpected error also writes the status ("failed"), then its traceback
    ends the process. With ``--print_memory_plan`` the run only prints its memory plan; with ``--gpu_memory_gb``
    it makes the plan first, and stops in one line if the plan does not fit (`memory_plan`)."""
    from ..memory_plan import check_fits, make_plan, plan_first, print_plan  # here: the status command needs no torch

    run = RunRecord()
    try:
        with SIGNALS.handled():
            args = parse_args()
            if plan_first(args):
                plan = make_plan(main, args, run)
                if args.print_memory_plan:
                    print_plan(plan)
                    return
                check_fits(plan)
            main(args, run)
    except (UsageError, RunStopped, Interrupted) as error:
        stop = interrupted_stop(error, run) if isinstance(error, Interrupted) else error
        if isinstance(stop, UsageError):
            run.write("usage error", USAGE_EXIT_CODE, str(stop))
        else:
            run.write(stop.reason, stop.exit_code, str(stop))
        say_why_and_exit(stop)
    except Exception as error:
        run.write(FAILED, 1, "".join(traceback.format_exception_only(error)).strip())
        raise
    run.write(COMPLETED, 0)


def status_line(status):
    """``run_status.json`` in one line: why the run ended, its exit status, its last step, where to resume."""
    exit_status = "none yet" if status["exit_status"] is None else status["exit_status"]
    return (f"{status['reason']}: exit status {exit_status}, last step {status['last_step']}, "
            f"resume from {status['resume_from']}")


def main(argv=None):
    """Say the status of the run last in an output folder, and exit with its exit status: what a job script reads
    after ``accelerate launch``, which turns every failing status into 1."""
    parser = argparse.ArgumentParser(prog="python -m training_utils.outputs.run_status", description=main.__doc__)
    parser.add_argument("output_dir", help="the run's --output_dir")
    output_dir = parser.parse_args(argv).output_dir
    status = read_status(output_dir)
    if (not isinstance(status, dict) or not {"reason", "exit_status", "last_step", "resume_from"} <= status.keys()
            or not isinstance(status["exit_status"], (int, type(None)))):
        print(f"error: {Path(output_dir) / STATUS_FILE}: no readable run status there", file=sys.stderr)
        return NO_STATUS_EXIT_CODE
    print(status_line(status))
    return 1 if status["exit_status"] is None else status["exit_status"]


if __name__ == "__main__":
    sys.exit(main())
