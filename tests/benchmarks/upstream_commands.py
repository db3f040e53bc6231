"""Every upstream example test's commands (`tests/test_upstream_commands.py`'s `UPSTREAM`), launched on our scripts
and the tiny fixtures, with a pass/fail table at the end:

    python -m tests.benchmarks.upstream_commands                      # all of them, about 10 minutes on 2 cores
    python -m tests.benchmarks.upstream_commands --only sd3 --keep out  # the tests whose name holds "sd3"

Each test's runs go in turn in a folder of their own (as upstream's test does them); the tests run side by side,
as many at once as `helpers.RUNS_AT_ONCE`. A test passes when each run succeeds and leaves the checkpoints and files
its `Run` names, or, for a flag we refuse on purpose, stops with its one line. Not part of the test suite: it takes
minutes (`test_upstream_commands.py` parses every command and runs the few that once failed).
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # the test helpers import each other by bare name, as pytest puts them on the path

import helpers  # noqa: E402
from test_upstream_commands import UPSTREAM, run_upstream_test, upstream_fixtures  # noqa: E402


def outcome(upstream, fixtures, output_dir):
    """``(result, seconds, detail)`` of running ``upstream``'s commands: "pass", "refused" (with its line) or
    "FAIL" (with the line that says why)."""
    start = time.monotonic()
    try:
        run_upstream_test(upstream, fixtures, output_dir)
    except AssertionError as failure:
        return "FAIL", time.monotonic() - start, reason(str(failure))
    refused = [upstream.refused] if upstream.refused is not None else [run.refused for run in upstream.runs
                                                                          if run.refused is not None]
    if refused:
        return "refused", time.monotonic() - start, refused[0]
    return "pass", time.monotonic() - start, ""


def reason(message):
    """The line of a failure's message that says why: the script's ``error:``/``stopped:`` line, the exception a
    traceback ends with, or the message's first line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if line.startswith(("error:", "stopped:")):
            return line
    exceptions = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception"))]
    return (exceptions or lines or ["?"])[-1 if exceptions else 0][:300]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the tests whose name holds this")
    parser.add_argument("--keep", type=Path, default=None, help="a folder for the fixtures and runs (kept)")
    args = parser.parse_args(argv)
    from training_utils.testing.tiny import build

    root = args.keep or Path(tempfile.mkdtemp(prefix="upstream_commands_"))
    chosen = [upstream for upstream in UPSTREAM if args.only in upstream.test]
    fixtures = upstream_fixtures(build(root / "tiny"), root)
    start = time.monotonic()
    results = helpers.together({upstream.test: (lambda upstream=upstream, index=index: outcome(
        upstream, fixtures, root / f"run{index:02d}")) for index, upstream in enumerate(chosen)})
    print("\n| upstream test | our script | result | s | detail |\n|---|---|---|---|---|")
    for upstream in chosen:
        result, seconds, detail = results[upstream.test]
        print(f"| {upstream.test} | {upstream.script} | {result} | {seconds:.0f} | {detail} |")
    counts = {result: sum(outcome[0] == result for outcome in results.values())
              for result in ("pass", "refused", "FAIL")}
    print(f"\n{counts['pass']} pass, {counts['refused']} refused, {counts['FAIL']} fail, of {len(chosen)} "
          f"upstream tests, in {time.monotonic() - start:.0f} s; runs in {root}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
