"""The run's exceptions, and how they reach the user: one line on stderr, never a traceback.

Every module may import this one; it imports nothing of the package.
"""

import os
import sys
from contextlib import contextmanager

from safetensors import SafetensorError

# What a run exits with, by how it ended (the table in docs/reliability.md; `run_status.json` records it too).
USAGE_EXIT_CODE = 2
NON_FINITE_EXIT_CODE = 3
UNREADABLE_EXIT_CODE = 65  # EX_DATAERR: the input data was incorrect
WRITE_FAILED_EXIT_CODE = 74  # EX_IOERR
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", which is what a scheduler should do
# What writing a file raises when the disk is full, a permission is missing or a path is not a folder.
WRITE_ERRORS = (OSError, SafetensorError)


class UsageError(Exception):
    """A bad flag value or input, reported to the user as one line without a traceback."""

    def __init__(self, flag, value, expected):
        super().__init__(f"{flag}={value!r}: expected {expected}" if flag else expected)


class RunStopped(Exception):
    """The run stopped on purpose (preemption, a non-finite loss); ``exit_code`` tells the scheduler why, and
    ``reason`` (a few words: "preempted", "non-finite loss") is what ``run_status.json`` records."""

    def __init__(self, message, exit_code, reason):
        super().__init__(message)
        self.exit_code = exit_code
        self.reason = reason


class WriteFailed(RunStopped):
    """A file of the run's outputs could not be written; ``failure`` says which and why (`write_failure`)."""

    def __init__(self, directory, failure):
        super().__init__(f"could not write to {directory}: {failure}", WRITE_FAILED_EXIT_CODE, "write failed")
        self.failure = failure


class Interrupted(BaseException):
    """SIGTERM or SIGINT, received where the run may stop at once (`stop_signals`). Raised where the process is, as
    Python raises KeyboardInterrupt, and like it not an `Exception`, so that no library's ``except Exception``
    swallows it."""

    def __init__(self, signal_name):
        super().__init__(signal_name)
        self.signal_name = signal_name


def write_failure(error):
    """Why a write failed, in a few words naming the file where the error does."""
    where = getattr(error, "filename", None)
    return f"{where}: {getattr(error, 'strerror', None) or error}" if where else str(error)


def require(condition, flag, value, expected):
    """Raise `UsageError` for ``flag=value`` unless ``condition`` holds."""
    if not condition:
        raise UsageError(flag, value, expected)


def is_first_process():
    """Whether this is the first process of the run (``RANK`` 0, or the only one)."""
    return int(os.environ.get("RANK", "0")) == 0


def say_why_and_exit(error):
    """One line on stderr for a `UsageError` (``error: ...``, exit status 2) or a `RunStopped` (``stopped: ...``, its
    own exit code), then exit. Every process of a run stops together for the same reason, so only the first says
    why it stopped."""
    if isinstance(error, UsageError):
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(USAGE_EXIT_CODE)
    if is_first_process():
        print(f"stopped: {error}", file=sys.stderr, flush=True)
    sys.exit(error.exit_code)


@contextmanager
def exit_on_usage_error():
    """Turn a `UsageError` or a `RunStopped` raised inside the block into one line and its exit status
    (`say_why_and_exit`)."""
    try:
        yield
    except (UsageError, RunStopped) as error:
        say_why_and_exit(error)


def few(names, limit=5):
    """At most ``limit`` of ``names``, comma-separated, so that messages stay readable for large models."""
    listed = ", ".join(names[:limit])
    if len(names) > limit:
        listed += f", ... ({len(names) - limit} more)"
    return listed
