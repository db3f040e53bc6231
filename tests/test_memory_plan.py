"""`training_utils.memory_plan`: ``--print_memory_plan`` reads no weights file, and its parameter, optimizer and EMA
bytes are what a real run on the tiny fixtures allocates, exactly; ``--gpu_memory_gb`` names the smallest block swap
that fits, and stops a run that would not fit before anything loads.

Each row runs its script in this process twice: the plan (`memory_plan.make_plan`, the script's own steps on the
meta device), then one real training step with the same flags, whose pipeline, optimizer and EMAs are kept (the
script's own `prepare_components`, `make_optimizer`, `make_ema` and `make_posthoc_ema`, wrapped) and counted.
"""

import contextlib
import io
import json
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from accelerate import init_empty_weights
from diffusers import Flux2Transformer2DModel
from safetensors.torch import load_file

from helpers import EXAMPLES, SUBPROCESS_ENV, import_script
from training_utils.block_swap import repeated_blocks
from training_utils.memory_plan import GB, make_plan, smallest_fit, tensor_bytes
from training_utils.outputs.run_status import RunRecord

from tests.benchmarks.memory_plan_table import fresh_accelerate_state

LORA = "pytorch_lora_weights.safetensors"
KLEIN = "dreambooth/train_dreambooth_lora_flux2_klein.py"
SD = "dreambooth/train_dreambooth_lora.py"
WAN = "video/train_text_to_video_lora_wan.py"
COMMON = ("--max_train_steps", 1, "--report_to", "none", "--checkpointing_steps", 100, "--resolution", 32)
DREAMBOOTH = ("--instance_prompt", "a photo of sks triangle")
ROWS = {
    # an int8 base in bf16, an EMA and two post-hoc profiles
    "klein_int8": (KLEIN, "flux2_klein", "instance", (*DREAMBOOTH, "--quantize_base", "int8", "--mixed_precision",
                                                      "bf16", "--use_ema", "--ema_posthoc_sigma_rels", 0.05, 0.1)),
    # a UNet and its text encoder trained (two optimizer groups), the EMA on the CPU
    "sd_text_encoder": (SD, "sd", "instance", (*DREAMBOOTH, "--train_text_encoder", "--use_ema", "--ema_device", "cpu",
                                               "--rank", 8)),
    # video, its transformer's fp32 modules kept so under an int8 base
    "wan_int8": (WAN, "wan21", "moving_shapes", ("--num_frames", 5, "--quantize_base", "int8", "--mixed_precision",
                                                 "bf16", "--use_ema")),
}


def script_argv(tiny, tmp_path, row, *extra):
    script, model, data, flags = ROWS[row]
    data_flag = "--train_data_dir" if script == WAN else "--instance_data_dir"
    return [str(value) for value in ("--pretrained_model_name_or_path", tiny[model], data_flag, tiny[data],
                                     "--output_dir", tmp_path / row, *COMMON, *flags, *extra)]


def plan_and_run(script, argv):
    """The plan of ``argv``, and what one real step with the same flags allocated."""
    module = import_script(script)
    fresh_accelerate_state()
    plan = make_plan(module.main, module.parse_args(argv), RunRecord())
    kept = {}

    def keeping(name, function):
        def wrapper(*args, **kwargs):
            result = function(*args, **kwargs)
            kept[name] = (args, result)
            return result
        return mock.patch.object(module, name, wrapper)

    with contextlib.ExitStack() as stack:
        for name in ("prepare_components", "make_optimizer", "make_ema", "make_posthoc_ema"):
            stack.enter_context(keeping(name, getattr(module, name)))
        fresh_accelerate_state()
        module.main(module.parse_args(argv), RunRecord())
    kept["output_dir"] = Path(argv[argv.index("--output_dir") + 1])
    return plan, kept


@pytest.fixture(scope="module")
def planned_runs(tiny, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("memory_plan")
    return {row: plan_and_run(ROWS[row][0], script_argv(tiny, tmp_path, row)) for row in ROWS}


@pytest.mark.parametrize("row", ROWS)
def test_parameter_optimizer_and_ema_bytes_are_what_the_run_allocates(planned_runs, row):
    plan, kept = planned_runs[row]
    pipe, trained = kept["prepare_components"][0][:2]
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            entry = plan["components"][name]
            assert entry["parameters"] == sum(parameter.numel() for parameter in module.parameters()), name
            assert entry["bytes"] == sum(tensor_bytes(parameter) for parameter in module.parameters()), name
    parameters = [parameter for module in trained.values() for parameter in module.parameters()
                  if parameter.requires_grad]
    assert plan["trainable_parameters"] == sum(parameter.numel() for parameter in parameters) > 0
    optimizer = kept["make_optimizer"][1]
    state = [tensor for per_parameter in optimizer.state.values() for tensor in per_parameter.values()]
    assert len(optimizer.state) == len(parameters)  # one step taken: every tensor has its state
    assert plan["optimizer_state_bytes"] == sum(tensor_bytes(tensor) for tensor in state)
    emas = [kept[name][1] for name in ("make_ema", "make_posthoc_ema") if kept[name][1] is not None]
    assert plan["ema_bytes"] == sum(ema.num_bytes for ema in emas) > 0


def test_an_int8_base_is_planned_at_its_quantised_size(planned_runs):
    plan = planned_runs["klein_int8"][0]
    transformer, text_encoder = plan["components"]["transformer"], plan["components"]["text_encoder"]
    assert (transformer["quantization"], text_encoder["quantization"]) == ("int8", None)
    assert transformer["bytes"] < transformer["parameters"] * 2 == text_encoder["bytes"] / text_encoder[
        "parameters"] * transformer["parameters"]
    assert plan["ema_device"] == "accelerator" and planned_runs["sd_text_encoder"][0]["ema_device"] == "cpu"
    sd = planned_runs["sd_text_encoder"][0]
    assert (transformer["dtype"], sd["components"]["unet"]["dtype"]) == ("bfloat16", "float32")  # no mixed precision


def test_a_run_that_fits_trains_as_it_would_without_the_plan(tiny, planned_runs, tmp_path):
    """The plan made first (``--gpu_memory_gb``), through the command line, leaves the run as it was: the same
    adapter, bitwise, as the row's run without it."""
    status, _, stderr = run_in_process(script_argv(tiny, tmp_path, "klein_int8", "--gpu_memory_gb", 1000))
    assert status == 0, stderr[-2000:]
    reference = load_file(planned_runs["klein_int8"][1]["output_dir"] / LORA)
    adapter = load_file(tmp_path / "klein_int8" / LORA)
    assert reference.keys() == adapter.keys() and reference
    assert all(torch.equal(reference[name], tensor) for name, tensor in adapter.items())


def test_checkpointing_saves_activations_and_video_counts_its_frames(planned_runs):
    for plan, _ in planned_runs.values():
        activations = plan["activations_bytes_estimate"]
        assert 0 < activations["with_gradient_checkpointing"] < activations["without_gradient_checkpointing"]
        assert plan["repeated_blocks"] > 0 and plan["blocks_to_swap"] == 0
    assert planned_runs["wan_int8"][0]["activations_bytes_estimate"]["frames"] == 5


@pytest.fixture(scope="module")
def weightless(tiny, tmp_path_factory):
    """The tiny FLUX.2 [klein] pipeline without its weights files: a plan that loaded any would fail."""
    folder = tmp_path_factory.mktemp("weightless") / "flux2_klein"
    shutil.copytree(tiny["flux2_klein"], folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return folder


def run_in_process(argv):
    """``python examples/<KLEIN> argv`` in this process: its exit status, stdout and stderr."""
    path = EXAMPLES / KLEIN
    stdout, stderr = io.StringIO(), io.StringIO()
    fresh_accelerate_state()
    with (mock.patch.object(sys, "argv", [str(path), *map(str, argv)]), contextlib.redirect_stdout(stdout),
          contextlib.redirect_stderr(stderr)):
        try:
            runpy.run_path(str(path), run_name="__main__")
            status = 0
        except SystemExit as exited:
            status = exited.code
    return status, stdout.getvalue(), stderr.getvalue()


def klein_argv(tiny, folder, output_dir, *extra):
    return ["--pretrained_model_name_or_path", folder, "--instance_data_dir", tiny["instance"], "--output_dir",
            output_dir, *COMMON, *DREAMBOOTH, "--use_ema", *extra]


def test_the_plan_reads_no_weights_and_prints_json_alone(tiny, weightless, tmp_path):
    """The command line itself, launched: the plan is all of stdout, the exit status 0, the output folder untouched."""
    result = subprocess.run([sys.executable, EXAMPLES / KLEIN,
                             *map(str, klein_argv(tiny, weightless, tmp_path / "out", "--print_memory_plan"))],
                            env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads(result.stdout)
    assert plan["components"]["transformer"]["parameters"] > 0 and "fits" not in plan
    assert not (tmp_path / "out").exists()


def test_gpu_memory_names_the_smallest_swap_that_fits_and_stops_a_run_that_does_not(tiny, weightless, tmp_path):
    status, stdout, _ = run_in_process(klein_argv(tiny, weightless, tmp_path, "--print_memory_plan"))
    peak = json.loads(stdout)["accelerator_peak_bytes_estimate"]
    # A budget just under the unswapped peak. The tiny klein has three blocks; swapping one or two keeps them all in
    # the window of two, so only swapping all three fits, before an int8 base is tried.
    status, stdout, _ = run_in_process(klein_argv(tiny, weightless, tmp_path, "--print_memory_plan",
                                                  "--gpu_memory_gb", (peak - 1) / GB))
    plan = json.loads(stdout)
    fit = plan["smallest_fit"]
    assert status == 0 and not plan["fits"] and (fit["blocks_to_swap"], fit["quantize_base"]) == (3, None)
    assert fit["accelerator_peak_bytes_estimate"] <= peak - 1
    assert run_in_process(klein_argv(tiny, weightless, tmp_path, "--print_memory_plan", "--gpu_memory_gb",
                                     peak / GB))[1].count('"fits": true') == 1
    # Swapping all three blocks keeps the two consecutive ones that hold most (the double-stream block and the first
    # single-stream one): the last single-stream block's weights leave the accelerator.
    swapping = json.loads(run_in_process(klein_argv(tiny, weightless, tmp_path, "--print_memory_plan",
                                                    "--blocks_to_swap", 3))[1])
    with init_empty_weights():
        config = Flux2Transformer2DModel.load_config(weightless / "transformer")
        transformer = Flux2Transformer2DModel.from_config(config)
    last = repeated_blocks(transformer)[-1][1]
    assert swapping["blocks_to_swap"] == 3 and swapping["repeated_blocks"] == 3
    assert peak - swapping["accelerator_peak_bytes_estimate"] == 4 * sum(p.numel() for p in last.parameters())  # fp32
    # A real run that does not fit stops in one line before loading (the weights are not there to load).
    status, stdout, stderr = run_in_process(klein_argv(tiny, weightless, tmp_path, "--gpu_memory_gb", 1e-6))
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert status == 2 and "Traceback" not in stderr and len(errors) == 1, stderr[-2000:]
    assert errors[0].startswith("error: --gpu_memory_gb=1e-06: expected a run that fits: its memory plan estimates")
    assert "no --blocks_to_swap fits it, with or without an int8 base" in errors[0]
    assert "--ignore_memory_plan" in errors[0]
    # Told to, the same run goes on (here on the fixture with its weights, so that it can train).
    status, _, stderr = run_in_process(klein_argv(tiny, tiny["flux2_klein"], tmp_path / "ignored", "--gpu_memory_gb",
                                                  1e-6, "--ignore_memory_plan"))
    assert status == 0 and (tmp_path / "ignored" / LORA).is_file(), stderr[-2000:]


def test_the_smallest_fit_is_the_fewest_swapped_blocks_then_an_int8_base():
    def estimate(scheme, blocks_to_swap):  # 10 GB, less 1 GB a swapped block; an int8 base halves it
        return (10 - blocks_to_swap) * GB / (2 if scheme == "int8" else 1)

    assert smallest_fit(estimate, None, 8, 7 * GB) == {"blocks_to_swap": 3, "quantize_base": None,
                                                       "accelerator_peak_bytes_estimate": 7 * GB}
    assert smallest_fit(estimate, None, 2, 4 * GB) == {"blocks_to_swap": 2, "quantize_base": "int8",
                                                       "accelerator_peak_bytes_estimate": 4 * GB}
    assert smallest_fit(estimate, "int8", 8, 7 * GB) == {"blocks_to_swap": 0, "quantize_base": "int8",
                                                         "accelerator_peak_bytes_estimate": 5 * GB}
    assert smallest_fit(estimate, None, 2, 3 * GB) is None


def test_the_table_goes_into_its_own_section_of_the_page(tmp_path):
    from tests.benchmarks.memory_plan_table import SECTION, write_section

    page = tmp_path / "memory.md"
    page.write_text("# Memory\n\n## Block swap\n\nswapping.\n")
    write_section(page, "| old |")
    write_section(page, "| new |")  # replaces its own section, keeps the others
    text = page.read_text()
    assert text.startswith("# Memory\n\n## Block swap\n\nswapping.\n\n" + SECTION + "\n")
    assert text.count(SECTION) == 1 and "| new |" in text and "| old |" not in text
    page.write_text(text + "\n## After\n\nkept.\n")
    write_section(page, "| newer |")
    assert page.read_text().endswith("| newer |\n\n## After\n\nkept.\n")


def test_the_readmes_copy_of_the_table_is_replaced_in_place(tmp_path):
    from tests.benchmarks.memory_plan_table import TABLE_START, replace_table

    page = tmp_path / "README.md"
    page.write_text(f"## Memory\n\nestimates:\n\n{TABLE_START} a |\n|---|\n| old |\n\n**GPU figures:** none.\n")
    replace_table(page, f"{TABLE_START} a |\n|---|\n| new |")
    assert page.read_text() == (f"## Memory\n\nestimates:\n\n{TABLE_START} a |\n|---|\n| new |\n\n"
                                "**GPU figures:** none.\n")
    page.write_text("no table")
    with pytest.raises(ValueError, match="no memory plan table"):
        replace_table(page, "| new |")
