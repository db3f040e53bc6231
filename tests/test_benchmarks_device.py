"""`tests/benchmarks/device_throughput.py` and `device_memory.py` on tiny configs (``--smoke``): the GPU run cannot
happen here, so their plumbing is checked here: both modes, the batch search, the NF4 skip; the memory benchmark's
planned transformer materialised, quantised and swapped; the tables and their JSON."""

import json

from tests.benchmarks import device_memory
from tests.benchmarks.device_throughput import COLUMNS, main

QUICK = ["--smoke", "--inline", "--steps", "1", "--warmup", "0", "--large_batch_steps", "1", "--max_batch", "2"]


def table_rows(markdown):
    """The cells of the first table's rows, header included."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if not line.startswith("|---")]


def test_smoke_run_writes_the_table_and_its_json(tmp_path):
    main(QUICK + ["--models", "flux2_klein", "--output_dir", str(tmp_path)])

    rows = table_rows((tmp_path / "device_cpu.md").read_text())
    assert tuple(rows[0]) == COLUMNS
    measured = [row for row in rows[1:] if len(row) == len(COLUMNS)]
    status = {(row[1], row[2], row[3]): row[-1] for row in measured}
    # batch 1, then the search: 2 fits and is the cap; compiled starts from eager's largest
    assert status == {("eager", "none", "1"): "ok", ("eager", "none", "2"): "ok", ("compiled", "none", "1"): "ok",
                      ("compiled", "none", "2"): "ok", ("eager", "nf4", "1"): "skipped: bitsandbytes' NF4 needs CUDA"}
    records = json.loads((tmp_path / "device_cpu.json").read_text())["records"]
    assert all(record["tflops"] > 0 and record["step_seconds"] > 0 for record in records if record["status"] == "ok")


def test_sdxl_smoke_step(tmp_path):
    records = main(QUICK + ["--models", "sdxl", "--modes", "eager", "--quantize_base", "none", "--max_batch", "1",
                            "--output_dir", str(tmp_path)])
    assert [(record["batch"], record["status"]) for record in records] == [(1, "ok")]



def test_memory_smoke_run_measures_each_base_and_swap_beside_the_plan(tmp_path):
    records = device_memory.main(["--smoke", "--families", "wan_14b", "--steps", "1", "--output_dir", str(tmp_path)])
    assert [(record["base"], record["blocks_to_swap"], record["status"]) for record in records] == [
        ("none", 0, "ok"), ("none", 1, "ok"), ("int8", 0, "ok"), ("int8", 1, "ok")]
    assert all(record["step_seconds"] > 0 and record["estimate_bytes"] > 0 for record in records)
    # the int8 base's plan is smaller; on the CPU there is no accelerator peak to measure
    assert records[2]["estimate_bytes"] < records[0]["estimate_bytes"] and records[0]["peak_bytes"] is None
    rows = table_rows((tmp_path / "device_memory_cpu.md").read_text())
    assert tuple(rows[0]) == device_memory.COLUMNS and len(rows) == 5
    assert json.loads((tmp_path / "device_memory_cpu.json").read_text())["records"] == records
