"""End to end on the LoRA script: preemption, exact resume with gradient accumulation, incomplete
checkpoints, resuming past the end, and unreadable images (stop with a checkpoint, or skip).

The script runs as under plain ``python`` (one process needs no ``accelerate launch``), in the warm runner, so the
test can signal it directly.
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

from helpers import EXAMPLES, REPO, SUBPROCESS_ENV, launching, run_warm, together, warm_server
from training_utils.names import STATUS_FILE
from training_utils.testing import RUN_TIMEOUT_S

SCRIPT = EXAMPLES / "text_to_image" / "train_text_to_image_lora.py"
LORA = "pytorch_lora_weights.safetensors"
# With --seed 3, --train_batch_size 2 and accumulation 2, sample 27 is in the second micro-batch of step 3.
CORRUPT_IMAGE = "0027.png"


def flags(tiny, output_dir, *extra, data_dir=None):
    """10 steps of 2 micro-batches over 36 images (9 steps per epoch), a cosine lr schedule and an EMA.
    A flag repeated in ``extra`` overrides (argparse keeps the last value)."""
    return ["--pretrained_model_name_or_path", tiny["sd"], "--train_data_dir", data_dir or tiny["shapes"],
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2,
            "--gradient_accumulation_steps", 2, "--max_train_steps", 10, "--checkpointing_steps", 2,
            "--learning_rate", 1e-3, "--lr_scheduler", "cosine", "--lr_warmup_steps", 2, "--random_flip",
            "--use_ema", "--ema_decay", 0.9, "--seed", 3, "--report_to", "none", *extra]


def run(*args, check=True):
    result = run_warm([sys.executable, SCRIPT, *args])
    if check and result.returncode != 0:
        raise AssertionError(f"failed ({result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return result


def stopped_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("stopped:")]


def assert_same_state(a, b, where):
    """Recursive equality of loaded state: tensors bitwise, everything else with ==."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{index}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_checkpoint(a, b):
    """Trained tensors, EMA, optimizer state and lr schedule (incl. the current lr) are bitwise equal."""
    for name in (LORA, f"ema/{LORA}"):
        assert_same_state(load_file(a / name), load_file(b / name), name)
    for name in ("optimizer.bin", "scheduler.bin"):
        assert_same_state(torch.load(a / name, weights_only=False), torch.load(b / name, weights_only=False), name)
    assert torch.load(a / "scheduler.bin", weights_only=False)["_last_lr"]


def assert_same_outputs(a, b):
    for path in (LORA, f"ema/{LORA}"):
        assert_same_state(load_file(a / path), load_file(b / path), path)


def preempt(tiny, output_dir):
    """(exit status, stderr) of the run of `flags`, sent SIGTERM from outside as soon as its first checkpoint
    appears."""
    stdout, stderr = output_dir.parent / "preempted.out", output_dir.parent / "preempted.err"
    process = warm_server().spawn([sys.executable, SCRIPT, *flags(tiny, output_dir)], SUBPROCESS_ENV, REPO, stdout,
                                  stderr)
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (output_dir / "checkpoint-2").is_dir() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    returncode = process.wait(timeout=RUN_TIMEOUT_S)
    return returncode, stderr.read_text()


@pytest.fixture(scope="module")
def corrupt_data(tiny, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("corrupt") / "shapes"
    shutil.copytree(tiny["shapes"], data_dir)
    image = data_dir / CORRUPT_IMAGE
    image.write_bytes(image.read_bytes()[: image.stat().st_size // 2])  # truncated, as by an interrupted copy
    return data_dir


def corrupt_flags(tiny, output_dir, data_dir, *extra):
    return flags(tiny, output_dir, "--max_train_steps", 5, "--checkpointing_steps", 1000, *extra, data_dir=data_dir)


@pytest.fixture(scope="module")
@launching
def runs(tiny, corrupt_data, tmp_path_factory):
    """``{name: (output_dir, result)}`` of the runs that start from scratch, made together: uninterrupted (`flags`);
    preempted (the same, `preempt`ed: its result is (exit status, stderr)); corrupt_stopped and corrupt_skipped
    (`corrupt_flags`, without and with --skip_corrupt_images, the latter logging to tensorboard and checkpointing
    every 4 steps)."""
    root = tmp_path_factory.mktemp("runs")
    results = together({
        "uninterrupted": partial(run, *flags(tiny, root / "uninterrupted")),
        "preempted": partial(preempt, tiny, root / "preempted"),
        "corrupt_stopped": partial(run, *corrupt_flags(tiny, root / "corrupt_stopped", corrupt_data), check=False),
        "corrupt_skipped": partial(run, *corrupt_flags(tiny, root / "corrupt_skipped", corrupt_data,
                                                       "--skip_corrupt_images", "--report_to", "tensorboard",
                                                       "--checkpointing_steps", 4)),
    })
    return {name: (root / name, result) for name, result in results.items()}


def last_checkpoint_step(output_dir):
    return max(int(path.name.split("-")[1]) for path in output_dir.glob("checkpoint-*"))


@pytest.fixture(scope="module")
@launching
def resumed_runs(tiny, corrupt_data, runs, tmp_path_factory):
    """``{name: (output_dir, result)}`` of the runs that resume one of `runs` in a copy of it, made together:

    - preempted: the preempted run, after planting what a kill during a later save would leave behind;
    - past_the_end: the uninterrupted run's checkpoint-10, with --max_train_steps 8;
    - still_skipping: the corrupt_skipped run's checkpoint-4, which counted one skipped image;
    - stopped_then_skipping: the corrupt_stopped run's checkpoint-2, with --skip_corrupt_images;
    - damaged_latest: the uninterrupted run's checkpoints 4 and 6, the latter without its accelerate random states.
    """
    root = tmp_path_factory.mktemp("resumed")
    preempted, (returncode, stderr) = runs["preempted"]
    assert returncode == 75, stderr[-3000:]
    shutil.copytree(preempted, root / "preempted")
    next_save = (last_checkpoint_step(preempted) // 2 + 1) * 2
    half_written = root / "preempted" / f".incomplete-checkpoint-{next_save}"
    half_written.mkdir()
    (half_written / LORA).write_bytes(b"\x00" * 100)
    (half_written / "left_by_a_killed_save").write_text("")
    (root / "preempted" / ".checkpoint-99.incomplete").mkdir()  # as killed saves of earlier versions left them
    (root / "preempted" / "ema" / ".incomplete-abc123").mkdir(parents=True)  # a killed final write's
    for name, source, step in (("past_the_end", "uninterrupted", 10), ("still_skipping", "corrupt_skipped", 4),
                               ("stopped_then_skipping", "corrupt_stopped", 2)):
        shutil.copytree(runs[source][0] / f"checkpoint-{step}", root / name / f"checkpoint-{step}")
    for step in (4, 6):
        shutil.copytree(runs["uninterrupted"][0] / f"checkpoint-{step}", root / "damaged_latest" / f"checkpoint-{step}")
    (root / "damaged_latest" / "checkpoint-6" / "random_states_0.pkl").unlink()
    resume = ["--resume_from_checkpoint", "latest"]
    results = together({
        "preempted": partial(run, *flags(tiny, root / "preempted", *resume)),
        "past_the_end": partial(run, *flags(tiny, root / "past_the_end", *resume, "--max_train_steps", 8)),
        "still_skipping": partial(run, *corrupt_flags(tiny, root / "still_skipping", corrupt_data,
                                                      "--skip_corrupt_images", "--report_to", "tensorboard", *resume)),
        "stopped_then_skipping": partial(run, *corrupt_flags(tiny, root / "stopped_then_skipping", corrupt_data,
                                                             *resume, "--skip_corrupt_images")),
        "damaged_latest": partial(run, *flags(tiny, root / "damaged_latest", *resume)),
    })
    return {name: (root / name, result) for name, result in results.items()}


def test_sigterm_checkpoints_the_step_it_stopped_at_and_exits_75(runs):
    output_dir, (returncode, stderr) = runs["preempted"]
    assert returncode == 75, stderr[-3000:]
    stopped = stopped_lines(stderr)
    assert len(stopped) == 1 and "SIGTERM" in stopped[0], stderr[-3000:]
    assert stderr.splitlines()[-1] == stopped[0], "the progress bar was drawn after the stop's reason"
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert 2 < step < 10, "the run should stop early: the signal came right after checkpoint-2"
    state = json.loads((output_dir / f"checkpoint-{step}" / "training_state.json").read_text())
    trajectory = state.pop("trajectory")
    assert state == {"format": 3, "global_step": step, "processes": 1, "skipped_images": 0, "steps_per_epoch": 9,
                     "ema_step": step}
    assert trajectory["seed"] == 3 and trajectory["learning_rate"] == 1e-3 and trajectory["lr_scheduler"] == "cosine"
    assert "output_dir" not in trajectory and "hub_token" not in trajectory
    assert not (output_dir / LORA).exists(), "a stopped run must not write final outputs"


def test_the_status_command_says_how_the_preempted_run_ended_and_exits_with_its_status(runs):
    output_dir, (returncode, _) = runs["preempted"]
    step = last_checkpoint_step(output_dir)
    command = subprocess.run([sys.executable, "-m", "training_utils.outputs.run_status", output_dir],
                             capture_output=True, text=True, env=SUBPROCESS_ENV, cwd=REPO)
    assert (command.returncode, command.stdout, command.stderr) == (
        75, f"preempted: exit status 75, last step {step}, resume from checkpoint-{step}\n", "")


def test_a_refused_resume_leaves_the_status_of_the_completed_run(tiny, runs, tmp_path):
    shutil.copytree(runs["uninterrupted"][0], tmp_path / "out")
    completed = (tmp_path / "out" / STATUS_FILE).read_text()
    assert json.loads(completed)["reason"] == "completed"
    refused = run(*flags(tiny, tmp_path / "out", "--adapter", "loha", "--resume_from_checkpoint", "latest"),
                  check=False)
    assert refused.returncode == 2 and "--adapter was 'lora', now 'loha'" in refused.stderr, refused.stderr[-3000:]
    assert (tmp_path / "out" / STATUS_FILE).read_text() == completed


def test_resumed_run_equals_the_uninterrupted_one_in_weights_ema_optimizer_and_lr(runs, resumed_runs):
    output_dir, result = resumed_runs["preempted"]
    stopped_at = last_checkpoint_step(runs["preempted"][0])
    assert f"resumed from {output_dir / f'checkpoint-{stopped_at}'} at step {stopped_at}" in result.stdout
    uninterrupted, _ = runs["uninterrupted"]
    assert_same_checkpoint(output_dir / "checkpoint-10", uninterrupted / "checkpoint-10")
    assert_same_outputs(output_dir, uninterrupted)


def test_latest_passes_over_a_damaged_checkpoint_and_the_run_ends_as_the_uninterrupted_one(runs, resumed_runs):
    output_dir, result = resumed_runs["damaged_latest"]
    assert f"not resuming from {output_dir / 'checkpoint-6'}: random_states_0.pkl is missing; trying the one " \
           f"before" in result.stderr
    assert f"resumed from {output_dir / 'checkpoint-4'} at step 4" in result.stdout
    uninterrupted, _ = runs["uninterrupted"]
    assert_same_checkpoint(output_dir / "checkpoint-10", uninterrupted / "checkpoint-10")
    assert_same_outputs(output_dir, uninterrupted)


def test_what_killed_writes_left_is_removed_by_the_next_run_and_never_resumed_from(runs, resumed_runs):
    output_dir, result = resumed_runs["preempted"]
    next_save = (last_checkpoint_step(runs["preempted"][0]) // 2 + 1) * 2
    saved = output_dir / f"checkpoint-{next_save}"
    assert not (saved / "left_by_a_killed_save").exists()
    assert load_file(saved / LORA)
    assert not [path for path in output_dir.rglob("*") if "incomplete" in path.name]
    assert "removed what 3 interrupted write(s) left" in result.stderr


def test_resuming_at_or_past_max_train_steps_trains_nothing_and_writes_the_outputs(runs, resumed_runs):
    output_dir, result = resumed_runs["past_the_end"]
    assert f"resumed from {output_dir / 'checkpoint-10'} at step 10" in result.stdout
    assert_same_outputs(output_dir, runs["uninterrupted"][0])
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-10"]
    assert (output_dir / "README.md").is_file()


def test_an_unreadable_image_stops_the_run_naming_it_after_a_checkpoint(runs, corrupt_data):
    output_dir, result = runs["corrupt_stopped"]
    assert result.returncode == 65, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    stopped = stopped_lines(result.stderr)
    assert len(stopped) == 1, result.stderr[-3000:]
    assert str(corrupt_data / CORRUPT_IMAGE) in stopped[0] and "step 3" in stopped[0]
    assert result.stderr.splitlines()[-1] == stopped[0], "the progress bar was drawn after the stop's reason"
    # Steps 1 and 2 were complete; step 3 was half accumulated when its second micro-batch failed.
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (output_dir / LORA).exists()


def logged_skips(output_dir):
    """The ``skipped_images`` scalars a run logged to tensorboard, as (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # The scalars' folder; accelerate writes the run's hyperparameters into a subfolder of it.
    events = min((path.parent for path in (output_dir / "logs").rglob("events.out.tfevents.*")),
                 key=lambda p: len(p.parts))
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars("skipped_images")]


def test_skip_corrupt_images_trains_on_counts_and_logs_the_skip(runs, corrupt_data):
    output_dir, result = runs["corrupt_skipped"]
    skipped = [line for line in result.stderr.splitlines() if line.startswith("skipped unreadable image")]
    assert len(skipped) == 1 and str(corrupt_data / CORRUPT_IMAGE) in skipped[0], result.stderr[-3000:]
    assert (output_dir / LORA).is_file()
    assert logged_skips(output_dir) == [(3, 1.0), (4, 1.0), (5, 1.0)]


def test_a_resumed_run_goes_on_counting_the_skipped_images(runs, resumed_runs):
    checkpoint = runs["corrupt_skipped"][0] / "checkpoint-4"
    state = json.loads((checkpoint / "training_state.json").read_text())
    assert (state["global_step"], state["skipped_images"]) == (4, 1)
    assert logged_skips(resumed_runs["still_skipping"][0]) == [(5, 1.0)]


def test_resuming_the_stopped_run_with_skipping_equals_skipping_from_the_start(runs, resumed_runs):
    """The stop's checkpoint holds step 2 as it ended (accumulation counter, RNG), though step 3 had begun."""
    output_dir, result = resumed_runs["stopped_then_skipping"]
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in result.stdout
    assert_same_outputs(output_dir, runs["corrupt_skipped"][0])


def test_dreambooth_style_paths_are_named_and_replaced_also_through_loader_workers(tiny, tmp_path):
    """The folder scripts' samples name their files directly; markers cross worker processes as batches."""
    from training_utils.data.frozen_encoders import FrozenEncoders
    from training_utils.data.datasets import BatchWithUnreadable, make_dataloader
    from training_utils.data.images import ImageTransform
    from training_utils.data.dreambooth import (InstanceImages, dreambooth_dataset, instance_then_class_collate,
                                                list_images)

    images = list_images(tiny["instance"])
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    pixels = FrozenEncoders(None, [], ImageTransform(32), "cpu", torch.float32, cache_latents=False, batch_size=1)
    dataset = dreambooth_dataset(InstanceImages.captioned_by([images[0], broken, images[1]], "sks"), None, pixels,
                                 seed=0)
    sample = dataset[1]
    assert sample.source == str(broken) and "UnidentifiedImageError" in sample.reason
    assert torch.equal(sample.substitute["instance"], dataset[2]["instance"])
    loader = make_dataloader(dataset, 3, 1, instance_then_class_collate, seed=0, shuffle=False)
    (batch,) = list(loader)
    assert isinstance(batch, BatchWithUnreadable) and batch.unreadable == [(sample.source, sample.reason)]
    assert batch.batch["images"].shape == (3, 3, 32, 32)
