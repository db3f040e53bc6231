"""Unit tests of `training_utils.accelerator`: processes launched together that accelerate left apart stop."""

import pytest

from training_utils.accelerator import check_connected
from training_utils.errors import UsageError


def processes(count):
    return type("Accelerator", (), {"num_processes": count})()


def test_processes_launched_together_but_left_apart_stop_in_one_line(monkeypatch):
    # accelerate launch --use_fsdp --num_processes 2 on a machine without GPU: two processes, each alone.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UsageError, match=r"^accelerate launch started 2 processes, but accelerate left them "
                                         r"unconnected \(each would train alone\): on CPU processes, launch with "
                                         r"--cpu, or with ACCELERATE_USE_CPU=1 set beside --use_fsdp"):
        check_connected(processes(1))
    check_connected(processes(2))
    monkeypatch.delenv("WORLD_SIZE")
    check_connected(processes(1))
