"""The run's exceptions and the one-line error machinery (training_utils.errors)."""

import pytest

from training_utils.errors import RunStopped, UsageError, exit_on_usage_error, few, require


def test_exit_on_usage_error_passes_other_exceptions_through(capsys):
    with pytest.raises(ValueError, match="not mine"):
        with exit_on_usage_error():
            raise ValueError("not mine")
    assert capsys.readouterr().err == ""


def test_exit_on_usage_error_formats_flag_value_expected(capsys):
    with pytest.raises(SystemExit) as exited:
        with exit_on_usage_error():
            raise UsageError("--thing", 3, "an even number")
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: --thing=3: expected an even number\n"


@pytest.mark.parametrize("rank, printed", [(None, True), ("0", True), ("1", False)])
def test_a_stopped_run_exits_with_its_code_and_only_the_first_process_says_why(rank, printed, capsys, monkeypatch):
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)
    else:
        monkeypatch.setenv("RANK", rank)
    with pytest.raises(SystemExit) as exited:
        with exit_on_usage_error():
            raise RunStopped("stopped by SIGTERM after step 3", 75, "preempted")
    assert exited.value.code == 75
    assert capsys.readouterr().err == ("stopped: stopped by SIGTERM after step 3\n" if printed else "")


def test_usage_error_without_flag_is_just_the_expectation():
    assert str(UsageError(None, None, "something else")) == "something else"


def test_exit_on_usage_error_no_error_no_exit(capsys):
    with exit_on_usage_error():
        value = 41 + 1
    assert value == 42
    assert capsys.readouterr().err == ""


def test_require_raises_a_usage_error_naming_the_flag_only_when_the_condition_fails():
    require(True, "--rank", 4, "a positive integer")
    with pytest.raises(UsageError, match=r"^--rank=0: expected a positive integer$"):
        require(False, "--rank", 0, "a positive integer")


def test_few_lists_at_most_the_limit_and_counts_the_rest():
    assert few(["a", "b"]) == "a, b"
    assert few([f"n{i}" for i in range(8)], limit=3) == "n0, n1, n2, ... (5 more)"
    assert few([]) == ""
