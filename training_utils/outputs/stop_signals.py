"""SIGTERM and SIGINT (what cluster schedulers send before preempting, and Ctrl-C), from a run's start to its end.

`SIGNALS` is the process's one handler of both. A run handles them from start to end (`run_status.run_script`).
Where it may stop at once (loading, caching, writing files into a staging folder), a signal raises
`errors.Interrupted` where the process is: every file is written under a temporary name first, so what is in
place stays whole. Where it may not, the block runs `deferred`, and the signal is only recorded: the training
loop stops after the step that is running, with a checkpoint; a group of files being moved into place is moved
whole before the run stops.
"""

import contextlib
import signal
import threading

from ..errors import Interrupted


class StopSignals:
    """The handler of SIGTERM and SIGINT; ``received`` names the first one received (None before)."""

    NUMBERS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received = None
        self._handling = 0
        self._deferring = 0
        self._previous = {}

    @contextlib.contextmanager
    def handled(self):
        """Handle the signals while the block runs; the handlers before it are back after it. Only the main thread
        receives signals: in another, the block just runs."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        if self._handling == 0:
            self.received = None
            self._previous = {number: signal.signal(number, self._handle) for number in self.NUMBERS}
        self._handling += 1
        try:
            yield self
        finally:
            self._handling -= 1
            if self._handling == 0:
                for number, handler in self._previous.items():
                    signal.signal(number, handler)

    @contextlib.contextmanager
    def deferred(self):
        """Inside the block a signal is only recorded in `received`, for its owner to act on where the run can stop.
        Leaving the outermost deferred block after a signal, without an error, raises `errors.Interrupted`."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        with self.handled():
            self._deferring += 1
            try:
                yield self
            finally:
                self._deferring -= 1
            if self._deferring == 0 and self.received is not None:
                raise Interrupted(self.received)

    def _handle(self, number, frame):
        self.received = self.received or signal.Signals(number).name
        if self._deferring == 0:
            raise Interrupted(self.received)


SIGNALS = StopSignals()
