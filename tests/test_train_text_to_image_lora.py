"""Smoke tests: the text-to-image LoRA script end to end on the tiny fixtures, through ``accelerate launch``."""

import sys
from functools import partial

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from safetensors.torch import load_file

from conftest import EXAMPLES, assert_resume_is_exact, assert_same_files, launch, read_log, run_bounded

SCRIPT = "text_to_image/train_text_to_image_lora.py"
LORA = "pytorch_lora_weights.safetensors"
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


def common(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["sd"], "--train_data_dir", tiny["shapes"],
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3,
            "--random_flip", "--use_ema", "--ema_decay", 0.9, "--rank", 4, "--seed", 3, *extra]


def validation_flags(steps):
    return ["--validation_prompt", *PROMPTS, "--num_validation_images", 2, "--validation_inference_steps", 2,
            "--validation_steps", steps]


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory):
    """8 steps with validation every 3 steps (and at the final step) and a checkpoint every 3."""
    output_dir = tmp_path_factory.mktemp("full")
    result = launch(SCRIPT, *common(tiny, output_dir, "--max_train_steps", 8, *validation_flags(3),
                                    "--checkpointing_steps", 3, "--checkpoints_total_limit", 1))
    return output_dir, result


@pytest.fixture(scope="module")
def plain_run(tiny, tmp_path_factory):
    """The same 8 steps without validation and without checkpoints."""
    output_dir = tmp_path_factory.mktemp("plain")
    launch(SCRIPT, *common(tiny, output_dir, "--max_train_steps", 8, "--checkpointing_steps", 1000))
    return output_dir


def test_writes_raw_and_ema_lora_with_equal_keys_and_different_values(full_run):
    output_dir, result = full_run
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and len(raw) > 0
    assert all(key.startswith("unet.") and "lora" in key for key in raw)
    assert all(raw[key].shape == ema[key].shape and raw[key].dtype == torch.float32 for key in raw)
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert f"raw LoRA: {output_dir / LORA}" in result.stdout
    assert f"ema LoRA: {output_dir / 'ema' / LORA}" in result.stdout


def test_validates_at_the_due_steps_and_the_final_step_once(full_run):
    output_dir, _ = full_run
    log = read_log(output_dir)
    assert [(r["step"], r["variant"]) for r in log[::2]] == [(3, "raw"), (3, "ema"), (6, "raw"), (6, "ema"),
                                                              (8, "raw"), (8, "ema")]
    assert [r["prompt"] for r in log[:2]] == PROMPTS
    for record in log:
        assert len(record["images"]) == 2 and all((output_dir / path).is_file() for path in record["images"])
    pngs = sorted((output_dir / "validation").rglob("*.png"))
    assert len(pngs) == 3 * 2 * 2 * 2  # steps x variants x prompts x images
    card = (output_dir / "README.md").read_text()
    assert "load_lora_weights" in card and log[-1]["images"][0] in card
    assert list((output_dir / "logs").rglob("events.out.tfevents.*")), "no tensorboard events written"


def test_keeps_the_newest_checkpoint_within_the_limit(full_run):
    output_dir, _ = full_run
    checkpoints = sorted(path.name for path in output_dir.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-6"]
    assert not list(output_dir.glob(".checkpoint-*")), "an incomplete checkpoint was left behind"
    files = {path.name for path in (output_dir / "checkpoint-6").iterdir()}
    assert {"trained_parameters.safetensors", "ema.safetensors", "training_state.json"} <= files


def test_validation_and_checkpointing_leave_the_weights_untouched(full_run, plain_run):
    output_dir, _ = full_run
    assert_same_files(output_dir / LORA, plain_run / LORA)
    assert_same_files(output_dir / "ema" / LORA, plain_run / "ema" / LORA)
    assert not (plain_run / "validation").exists()


def test_resumed_run_prunes_and_ends_with_the_same_weights(tiny, tmp_path, full_run):
    # Mid-epoch, with random flips: the resumed run is the uninterrupted one, bit for bit.
    assert_resume_is_exact(SCRIPT, partial(common, tiny), tmp_path, full_run[0], [LORA, f"ema/{LORA}"])


def test_ema_decay_zero_equals_the_raw_weights(tiny, tmp_path):
    launch(SCRIPT, *common(tiny, tmp_path, "--max_train_steps", 3, "--ema_decay", 0, "--checkpointing_steps", 1000))
    assert_same_files(tmp_path / LORA, tmp_path / "ema" / LORA)


def test_outputs_load_into_a_fresh_pipeline_and_change_its_output(tiny, full_run):
    output_dir, _ = full_run
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)

    def render():
        return pipe(PROMPTS[0], num_inference_steps=2, height=32, width=32, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    base = render()
    pipe.load_lora_weights(output_dir)
    with_raw = render()
    pipe.unload_lora_weights()
    pipe.load_lora_weights(output_dir / "ema")
    with_ema = render()
    assert not np.allclose(base, with_raw, atol=1e-4)
    assert not np.allclose(base, with_ema, atol=1e-4)
    assert not np.allclose(with_raw, with_ema, atol=1e-6)


def test_never_reads_the_base_model_after_start_up(tiny, tmp_path):
    """The base model folder is deleted right after the pipeline loads; validation and saving still work."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny["sd"], model)
    wrapper = (
        "import runpy, shutil, sys\n"
        "import training_utils.pipeline as pipeline\n"
        "load = pipeline.load_pipeline\n"
        "def load_then_delete(*args, **kwargs):\n"
        "    pipe = load(*args, **kwargs)\n"
        f"    shutil.rmtree({str(model)!r})\n"
        "    return pipe\n"
        "pipeline.load_pipeline = load_then_delete\n"
        f"sys.argv = [{str(EXAMPLES / SCRIPT)!r}] + sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    output_dir = tmp_path / "out"
    args = common(tiny, output_dir, "--max_train_steps", 4, *validation_flags(2), "--checkpointing_steps", 2)
    args[1] = model
    result = run_bounded([sys.executable, "-c", wrapper, *map(str, args)])
    assert result.returncode == 0, result.stderr[-4000:]
    assert not model.exists()
    # The final step (4) is also a due step (every 2): validated once, raw and EMA.
    assert [(r["step"], r["variant"]) for r in read_log(output_dir)[::2]] == [(2, "raw"), (2, "ema"), (4, "raw"),
                                                                             (4, "ema")]
    assert (output_dir / LORA).is_file() and (output_dir / "ema" / LORA).is_file()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--resolution", 30], "error: --resolution=30: expected a positive multiple of 8"),
        (["--caption_column", "caption"], "error: --caption_column='caption': expected a column of the dataset"),
        (["--ema_decay", 1.0], "error: --ema_decay=1.0: expected a number in [0, 1)"),
    ],
)
def test_bad_input_fails_with_one_line_before_anything_loads(tiny, tmp_path, flags, message):
    output_dir = tmp_path / "out"
    result = launch(SCRIPT, *common(tiny, output_dir, *flags), check=False, quiet=True)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), result.stderr[-2000:]
    assert not output_dir.exists()


def test_posthoc_ema_sweep_snapshots_and_synthesis(tiny, tmp_path):
    output_dir = tmp_path / "out"
    launch(SCRIPT, *common(tiny, output_dir, "--max_train_steps", 6, *validation_flags(3),
                           "--ema_posthoc_sigma_rels", 0.05, 0.1, "--ema_posthoc_snapshot_steps", 2,
                           "--validation_sigma_rels", 0.05, 0.08, "--checkpointing_steps", 1000))
    snapshots = sorted(path.name for path in (output_dir / "posthoc_ema").glob("snapshot-*.safetensors"))
    assert len(snapshots) == 3 * 2 and snapshots[0].startswith("snapshot-00000002-")
    log = read_log(output_dir)
    assert [(r["step"], r["variant"]) for r in log[::2]] == [
        (3, "raw"), (3, "ema"), (6, "raw"), (6, "ema"), (6, "ema_sigma_rel-0.05"), (6, "ema_sigma_rel-0.08")]
    assert (output_dir / "validation" / "step-000006" / "grid-p00.png").is_file()
    from PIL import Image

    with Image.open(output_dir / "validation" / "step-000006" / "grid-p00.png") as grid:
        assert grid.size == (32 * 2, 32 * 3)  # images per prompt x (raw + two sweep rows)

    result = run_bounded([sys.executable, "-m", "training_utils.posthoc_ema", "--output_dir", str(output_dir),
                          "--sigma_rel", "0.05", "0.08"])
    assert result.returncode == 0, result.stderr[-3000:]
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    tracked = load_file(output_dir / "posthoc_ema" / "sigma_rel-0.05" / LORA)
    pipe.load_lora_weights(output_dir / "posthoc_ema" / "sigma_rel-0.08")
    synthesized = load_file(output_dir / "posthoc_ema" / "sigma_rel-0.08" / LORA)
    assert tracked.keys() == synthesized.keys() == load_file(output_dir / LORA).keys()
    assert any(not torch.equal(tracked[key], synthesized[key]) for key in tracked)
