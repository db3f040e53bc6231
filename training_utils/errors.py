"""The run's exceptions, and how they reach the user: one line on stderr, never a traceback.

Every module may import this one; it imports nothing of the package.
"""

import os
import sys
from contextlib import contextmanager

from safetensors import SafetensorError

WRITE_FAILED_EXIT_CODE = 74  # EX_IOERR
# What writing a file raises when the disk is full, a permission is missing or a path is not a folder.
WRITE_ERRORS = (OSError, SafetensorError)


class UsageError(Exception):
    """A bad flag value or input, reported to the user as one line without a traceback."""

    def __init__(self, flag, value, expected):
        super().__init__(f"{flag}={value!r}: expected {expected}" if flag else expected)


class RunStopped(Exception):
    """The run stopped on purpose (preemption, a non-finite loss); ``exit_code`` tells the scheduler why."""

    def __init__(self, message, exit_code):
        super().__init__(message)
        self.exit_code = exit_code


class WriteFailed(RunStopped):
    """A file of the run's outputs could not be written; ``failure`` says which and why (`write_failure`)."""

    def __init__(self, directory, failure):
        super().__init__(f"could not write to {directory}: {failure}", WRITE_FAILED_EXIT_CODE)
        self.failure = failure


def write_failure(error):
    """Why a write failed, in a few words naming the file where the error does."""
    where = getattr(error, "filename", None)
    return f"{where}: {getattr(error, 'strerror', None) or error}" if where else str(error)


def require(condition, flag, value, expected):
    """Raise `UsageError` for ``flag=value`` unless ``condition`` holds."""
    if not condition:
        raise UsageError(flag, value, expected)


@contextmanager
def exit_on_usage_error():
    """Turn a `UsageError` raised inside the block into one line on stderr and exit status 2, and a
    `RunStopped` into one line and its own exit code. Every process of a run stops together for the
    same reason, so only the first (``RANK`` 0) says why."""
    try:
        yield
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except RunStopped as stop:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"stopped: {stop}", file=sys.stderr, flush=True)
        sys.exit(stop.exit_code)


def few(names, limit=5):
    """At most ``limit`` of ``names``, comma-separated, so that messages stay readable for large models."""
    listed = ", ".join(names[:limit])
    if len(names) > limit:
        listed += f", ... ({len(names) - limit} more)"
    return listed
