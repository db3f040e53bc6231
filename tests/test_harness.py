"""The test harness itself: a hung run must fail its test, not stall the suite; and the checks of
`training_utils.testing` must fail where they should."""

import json
import subprocess
import sys

import psutil
import pytest
import torch
from diffusers import ControlNetModel, StableDiffusionPipeline
from PIL import Image
from safetensors.torch import save_file

import helpers
from helpers import RunHung, launch_processes, run_bounded, together
from training_utils.adapters.export import LoraExport
from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_lora
from training_utils.testing import (assert_close_files, assert_close_validations, assert_lora_changes_pipeline_output,
                                    assert_model_folder_loads, assert_resumes_exactly, assert_validated_at,
                                    checkpoint_names, launch_environment, launch_script, run_with_timeout, tiny_fixture)

# A launcher whose worker, like torchrun's, runs in a session of its own and never finishes.
HUNG_LAUNCHER = """
import subprocess, sys, time
worker = '''
import os, sys, time
def waiting_at_a_barrier():
    open(sys.argv[1], "w").write(str(os.getpid()))
    time.sleep(600)
waiting_at_a_barrier()
'''
subprocess.Popen([sys.executable, "-c", worker, sys.argv[1]], start_new_session=True)
time.sleep(600)
"""


def assert_stopped(pid):
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow  # seconds before the hang is called one
def test_a_hung_run_fails_with_the_states_and_stacks_of_its_workers_and_leaves_none_running(tmp_path):
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(RunHung, match="no result within 3 s") as failure:
        run_bounded([sys.executable, "-c", HUNG_LAUNCHER, str(pid_file)], timeout=3)
    worker = int(pid_file.read_text())
    stacks, states = str(failure.value).split("Its processes when it was stopped:")
    assert "waiting_at_a_barrier" in stacks and "Extension modules" not in stacks
    assert f"pid {worker} " in states and "s CPU in 1 s; threads waiting in" in states
    assert_stopped(worker)


@pytest.mark.slow  # seconds before the hang is called one
def test_a_hung_run_without_psutil_fails_with_its_stacks_and_leaves_none_running(tmp_path):
    # training_utils.testing's own runner, for a user's CI: no psutil, the process tree read from /proc.
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(AssertionError, match="no result within 3 s") as failure:
        run_with_timeout([sys.executable, "-c", HUNG_LAUNCHER, str(pid_file)], env=launch_environment(), timeout=3)
    assert "waiting_at_a_barrier" in str(failure.value)
    assert_stopped(int(pid_file.read_text()))


def test_a_hung_multiprocess_run_is_reported_and_made_again_in_a_fresh_folder(tmp_path, monkeypatch):
    attempts = []

    def hanging_once(script, *args, processes, timeout, env=None):
        attempts.append(args)
        if len(attempts) == 1:
            raise RunHung("no result within 120 s")
        return "second result"

    monkeypatch.setattr(helpers, "launch", hanging_once)
    folders = iter([tmp_path / "a", tmp_path / "b"])
    with pytest.warns(helpers.RunHungWarning, match="attempt 1: no result within 120 s") as reports:
        output_dir, result = launch_processes("job.py", lambda: next(folders), lambda folder: [folder])
    assert (output_dir, result) == (tmp_path / "b", "second result")
    assert attempts == [(tmp_path / "a",), (tmp_path / "b",)]
    assert len(reports) == 1


def test_a_multiprocess_run_that_hangs_twice_fails(monkeypatch):
    def hanging(script, *args, processes, timeout, env=None):
        raise RunHung("no result within 120 s")

    monkeypatch.setattr(helpers, "launch", hanging)
    with pytest.warns(helpers.RunHungWarning) as reports, pytest.raises(RunHung):
        launch_processes("job.py", lambda: "folder", lambda folder: [])
    assert len(reports) == 1  # the first hang; the second fails the test


@pytest.mark.parametrize("run", [run_bounded, run_with_timeout])
def test_a_finished_run_returns_its_exit_code_and_output(run):
    result = run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")


def test_calls_made_together_give_each_its_own_result():
    assert together({"a": lambda: 1, "b": lambda: 2}) == {"a": 1, "b": 2}


def test_launch_script_runs_accelerate_launch_on_the_cpu_and_fails_with_the_end_of_the_output():
    launched = []

    def failing(command, env, timeout):
        launched.append((command, env, timeout))
        return subprocess.CompletedProcess(command, 1, "the output\n", "error: --resolution=30: expected\n")

    with pytest.raises(AssertionError, match="train.py failed \\(1\\):\nthe output\n\nerror: --resolution=30"):
        launch_script("train.py", "--resolution", 30, processes=2, timeout=7, env={"EXTRA": "1"}, run=failing)
    [(command, env, timeout)] = launched
    assert command[1:4] == ["-m", "accelerate.commands.launch", "--num_machines"] and timeout == 7
    assert command[command.index("--num_processes") + 1] == "2" and "--multi_gpu" in command
    assert command[command.index("--main_process_ip") + 1] == "127.0.0.1"
    assert command[-3:] == ["train.py", "--resolution", "30"]
    assert env["ACCELERATE_USE_CPU"] == "1" and env["EXTRA"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert launch_script("train.py", run=failing, check=False).returncode == 1
    assert "--multi_gpu" not in launched[-1][0] and "ACCELERATE_USE_CPU" not in launched[-1][1]


def test_tiny_fixture_builds_the_named_fixture_and_refuses_others(tmp_path):
    shapes = tiny_fixture("shapes", tmp_path)
    assert shapes == tmp_path / "shapes" and len((shapes / "metadata.jsonl").read_text().splitlines()) == 36
    with pytest.raises(ValueError, match="unknown tiny fixture 'sd4'; expected one of sd, "):
        tiny_fixture("sd4", tmp_path)


def fake_run(output_dir, grey, steps=(2,), variants=("raw",), prompts=("p",)):
    """A run folder whose validation log holds one record of one image per step, variant and prompt, a solid
    ``grey``, with the step's grid and the prompt's progress grid, after the base model's (step 0) of each prompt."""
    (output_dir / "validation").mkdir(parents=True)
    records = []
    for step, step_variants in [(0, ("base",)), *((step, variants) for step in steps)]:
        for variant in step_variants:
            for index, prompt in enumerate(prompts):
                image, grid, progress = (f"validation/{name}.png" for name in (
                    f"{variant}-{step}-{index}", f"grid-{step}-{index}", f"progress-{index}"))
                for path in (image, grid, progress):
                    Image.new("RGB", (4, 4), (grey,) * 3).save(output_dir / path)
                records.append({"step": step, "variant": variant, "prompt": prompt, "images": [image], "grid": grid,
                                "progress": progress})
    (output_dir / "validation" / "log.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return output_dir


def test_validated_at_needs_every_step_variant_and_prompt_once_in_order_and_their_images(tmp_path):
    output_dir = fake_run(tmp_path / "run", 100, steps=(3, 6, 8), variants=("raw", "ema"), prompts=("a", "b"))
    assert len(assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"), num_images=1)) == 2 + 12
    assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"), ["a", "b"])
    for steps, variants, prompts in (([3, 6], ("raw", "ema"), None), ([3, 6, 8, 8], ("raw", "ema"), None),
                                     ([3, 6, 8], ("raw",), None), ([3, 6, 8], ("raw", "ema"), ["b", "a"])):
        with pytest.raises(AssertionError, match="validated"):
            assert_validated_at(output_dir, steps, variants, prompts)
    with pytest.raises(AssertionError):
        assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"), num_images=2)
    (output_dir / "validation" / "ema-8-1.png").unlink()
    with pytest.raises(AssertionError, match="ema-8-1.png"):
        assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"))
    (output_dir / "validation" / "ema-8-1.png").touch()
    (output_dir / "validation" / "grid-8-1.png").unlink()
    with pytest.raises(AssertionError, match="grid-8-1.png"):
        assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"))


def test_close_validations_allow_float_noise_but_not_more_nor_other_records(tmp_path):
    reference, close, far = (fake_run(tmp_path / name, grey) for name, grey in (("a", 100), ("b", 102), ("c", 103)))
    assert_close_validations(reference, close, [(2, "raw")])
    with pytest.raises(AssertionError):
        assert_close_validations(reference, far, [(2, "raw")])
    with pytest.raises(AssertionError):
        assert_close_validations(reference, close, [(2, "raw"), (2, "ema")])


def test_close_files_allow_float_noise_but_not_more_nor_other_keys(tmp_path):
    weights = {"a": torch.zeros(3), "b": torch.ones(2)}
    paths = {}
    for name, tensors in (("reference", weights), ("close", {**weights, "a": torch.full((3,), 5e-6)}),
                          ("far", {**weights, "a": torch.full((3,), 2e-5)}), ("other", {"a": weights["a"]})):
        paths[name] = tmp_path / f"{name}.safetensors"
        save_file(tensors, paths[name])
    assert assert_close_files(paths["reference"], paths["close"]).keys() == weights.keys()
    for name in ("far", "other"):
        with pytest.raises(AssertionError):
            assert_close_files(paths["reference"], paths[name])


def test_lora_must_load_and_change_the_pipelines_output(tiny, tmp_path):
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    add_lora(pipe.unet, 4, ATTENTION_PROJECTIONS)
    export = LoraExport.of(StableDiffusionPipeline, {"unet": pipe.unet})
    export.save(tmp_path / "untrained")  # lora_B is zero: no change
    with torch.no_grad():
        for name, parameter in pipe.unet.named_parameters():
            if "lora_B" in name:
                parameter.normal_(generator=torch.Generator().manual_seed(0))
    export.save(tmp_path / "trained")
    base, trained = assert_lora_changes_pipeline_output(tiny["sd"], tmp_path / "trained")
    assert base.shape == trained.shape == (1, 32, 32, 3)
    with pytest.raises(AssertionError, match="untrained changes no image"):
        assert_lora_changes_pipeline_output(tiny["sd"], tmp_path / "trained", tmp_path / "untrained")


def test_model_folder_must_load_in_fp32_and_differ_from_its_initial_weights(tiny, tmp_path):
    controlnet = ControlNetModel.from_pretrained(tiny["controlnet"])
    assert_model_folder_loads(ControlNetModel, tiny["controlnet"])
    with pytest.raises(AssertionError, match="untrained"):
        assert_model_folder_loads(ControlNetModel, tiny["controlnet"], initial=tiny["controlnet"])
    with torch.no_grad():
        controlnet.controlnet_mid_block.weight.add_(1)
    controlnet.save_pretrained(tmp_path / "trained")
    assert isinstance(assert_model_folder_loads(ControlNetModel, tmp_path / "trained", initial=tiny["controlnet"]),
                      ControlNetModel)
    controlnet.half().save_pretrained(tmp_path / "half")
    with pytest.raises(AssertionError, match="expected fp32"):
        assert_model_folder_loads(ControlNetModel, tmp_path / "half")


def test_checkpoint_names_are_in_step_order(tmp_path):
    for step in (10, 9, 100):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / ".checkpoint-11.incomplete").mkdir()
    assert checkpoint_names(tmp_path) == ["checkpoint-9", "checkpoint-10", "checkpoint-100"]


def test_resume_must_start_from_the_copied_checkpoint_and_end_with_the_same_files(tmp_path):
    straight = tmp_path / "straight"
    (straight / "checkpoint-6").mkdir(parents=True)
    save_file({"a": torch.ones(2)}, straight / "weights.safetensors")
    launched = []

    def resuming(weights, message="resumed from {checkpoint} at step 6"):
        def launch(script, *args):
            launched.append((script, args))
            output_dir = args[1]
            save_file(weights, output_dir / "weights.safetensors")
            checkpoint = output_dir / "checkpoint-6"
            return subprocess.CompletedProcess(args, 0, message.format(checkpoint=checkpoint), "")

        return launch

    def args_for(output_dir):
        return ["--output_dir", output_dir]

    result = assert_resumes_exactly("train.py", args_for, straight, tmp_path / "resumed", 6, ["weights.safetensors"],
                                    launch=resuming({"a": torch.ones(2)}))
    assert result.returncode == 0 and (tmp_path / "resumed" / "checkpoint-6").is_dir()
    assert launched == [("train.py", ("--output_dir", tmp_path / "resumed", "--resume_from_checkpoint", "latest"))]
    for name, launch in (("other", resuming({"a": torch.zeros(2)})),
                         ("fresh", resuming({"a": torch.ones(2)}, "no checkpoint in {checkpoint}"))):
        with pytest.raises(AssertionError):
            assert_resumes_exactly("train.py", args_for, straight, tmp_path / name, 6, ["weights.safetensors"],
                                   launch=launch)
