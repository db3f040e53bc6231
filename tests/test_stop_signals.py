"""SIGTERM and SIGINT from a run's start to its end (training_utils.outputs.stop_signals)."""

import os
import signal
import threading

import pytest

from training_utils.errors import Interrupted
from training_utils.outputs.stop_signals import StopSignals


def send(number=signal.SIGTERM):
    os.kill(os.getpid(), number)


def test_a_signal_outside_a_deferred_block_stops_where_the_process_is():
    signals = StopSignals()
    reached = []
    with pytest.raises(Interrupted) as interrupted:
        with signals.handled():
            send(signal.SIGINT)
            reached.append("after the signal")
    assert interrupted.value.signal_name == "SIGINT" and reached == []


def test_inside_a_deferred_block_a_signal_is_recorded_and_acted_on_when_the_block_ends():
    signals = StopSignals()
    steps = []
    with pytest.raises(Interrupted, match="SIGTERM"):
        with signals.handled():
            with signals.deferred():
                send()
                steps.append("the rest of the block runs")
                assert signals.received == "SIGTERM"
            steps.append("never: the block's end stops the run")
    assert steps == ["the rest of the block runs"]


def test_a_nested_deferral_leaves_the_signal_to_the_outer_one_and_an_error_goes_first():
    signals = StopSignals()
    with signals.handled():
        with pytest.raises(ValueError):
            with signals.deferred():
                with signals.deferred():
                    send()
                assert signals.received == "SIGTERM"  # the inner block ended without stopping
                raise ValueError("the block's own error propagates, not the signal")


def test_the_handlers_before_are_back_after_the_run_and_the_next_run_starts_without_a_signal():
    signals = StopSignals()
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted):
        with signals.deferred():
            send()
    assert signal.getsignal(signal.SIGTERM) is before
    with signals.handled():
        assert signals.received is None


def test_another_thread_cannot_handle_signals_and_its_blocks_just_run():
    signals = StopSignals()
    ran = []

    def work():
        with signals.deferred():
            ran.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert ran == [signal.getsignal(signal.SIGTERM)]
