"""Smoke tests of what users' files and machines do to a run, end to end on the tiny fixtures: photos stored
rotated and 16-bit images train as the pictures they show; a damaged disk cache is encoded again, never trained
on; a stop during the final writes leaves whole outputs and a rerun completes them; a status survives the launcher;
--overwrite_output_dir clears only what runs write. Every bad file and fault is made here."""

import json
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import EXAMPLES, launch, launch_together, launching
from training_utils.data.images import ORIENTATION
from training_utils.names import STATUS_FILE
from training_utils.outputs.writing import process_umask
from training_utils.testing import assert_same_files

LORA_SCRIPT = "text_to_image/train_text_to_image_lora.py"
DREAMBOOTH_SCRIPT = "dreambooth/train_dreambooth_lora.py"
LORA = "pytorch_lora_weights.safetensors"
OUTPUTS = [LORA, f"ema/{LORA}", "pytorch_lora_weights_kohya.safetensors", "ema/pytorch_lora_weights_kohya.safetensors"]


def lora_flags(tiny, output_dir, data, *extra):
    return ["--pretrained_model_name_or_path", tiny["sd"], "--train_data_dir", data, "--output_dir", output_dir,
            "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3, "--random_flip", "--rank", 4,
            "--seed", 3, "--max_train_steps", 4, "--checkpointing_steps", 1000, "--report_to", "none", *extra]


def stored_rotated(source, target):
    """A copy of the imagefolder ``source`` whose pictures are stored as a camera stores a shot taken turned a
    quarter (each one way or the other), with the EXIF orientation that turns it upright."""
    shutil.copytree(source, target)
    for number, path in enumerate(sorted(target.glob("*.png"))):
        orientation = (6, 8)[number % 2]
        exif = Image.Exif()
        exif[ORIENTATION] = orientation
        turn = Image.Transpose.ROTATE_90 if orientation == 6 else Image.Transpose.ROTATE_270
        Image.open(path).transpose(turn).save(path, exif=exif)
    return target


def in_16_bits(source, target):
    """Copies of the imagefolder ``source`` as 8-bit grayscale (``target/8``) and as 16-bit grayscale PNGs of the
    same pictures (``target/16``: each level times 257, so that scaling back gives the 8-bit levels exactly)."""
    for bits in ("8", "16"):
        shutil.copytree(source, target / bits)
        for path in sorted((target / bits).glob("*.png")):
            levels = np.asarray(Image.open(path).convert("L"))
            Image.fromarray(levels if bits == "8" else levels.astype(np.uint16) * 257).save(path)
    return target / "8", target / "16"


@pytest.fixture(scope="module")
@launching
def picture_runs(tiny, tmp_path_factory):
    """``{name: output_dir}`` of runs on the same pictures stored upright and rotated (aspect-ratio buckets, with and
    without cached latents; the LoRA and the DreamBooth script), and in 8 and 16 bits."""
    root = tmp_path_factory.mktemp("pictures")
    rotated = stored_rotated(tiny["shapes_mixed"], root / "rotated")
    rotated_instance = stored_rotated(tiny["instance_mixed"], root / "rotated_instance")
    eight, sixteen = in_16_bits(tiny["shapes"], root / "gray")
    buckets = ["--use_aspect_ratio_buckets", "--center_crop"]
    cached = [*buckets, "--cache_latents", "--feature_cache_dir", root / "features"]
    dreambooth = ["--pretrained_model_name_or_path", tiny["sd"], "--instance_prompt", "a photo of sks triangle",
                  "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3, "--rank", 4, "--seed", 3,
                  "--max_train_steps", 3, "--report_to", "none", *buckets]
    launches = {
        "upright": (LORA_SCRIPT, *lora_flags(tiny, root / "upright", tiny["shapes_mixed"], *buckets)),
        "rotated": (LORA_SCRIPT, *lora_flags(tiny, root / "rotated_out", rotated, *buckets)),
        "upright_cached": (LORA_SCRIPT, *lora_flags(tiny, root / "upright_cached", tiny["shapes_mixed"], *cached)),
        "rotated_cached": (LORA_SCRIPT, *lora_flags(tiny, root / "rotated_cached", rotated, *cached)),
        "dreambooth_upright": (DREAMBOOTH_SCRIPT, *dreambooth, "--instance_data_dir", tiny["instance_mixed"],
                               "--output_dir", root / "dreambooth_upright"),
        "dreambooth_rotated": (DREAMBOOTH_SCRIPT, *dreambooth, "--instance_data_dir", rotated_instance,
                               "--output_dir", root / "dreambooth_rotated"),
        "8_bits": (LORA_SCRIPT, *lora_flags(tiny, root / "8_bits", eight)),
        "16_bits": (LORA_SCRIPT, *lora_flags(tiny, root / "16_bits", sixteen)),
    }
    launch_together(launches)
    return {name: Path(arguments[arguments.index("--output_dir") + 1]) for name, arguments in launches.items()}


@pytest.mark.parametrize("upright, other", [("upright", "rotated"), ("upright_cached", "rotated_cached"),
                                            ("dreambooth_upright", "dreambooth_rotated"), ("8_bits", "16_bits")])
def test_pictures_train_as_they_show_whatever_their_orientation_tag_or_bit_depth(picture_runs, upright, other):
    assert_same_files(picture_runs[upright] / LORA, picture_runs[other] / LORA)


def damage(shard, how):
    """Damage a disk-cache shard as a failing disk or an interrupted copy does: 64 KiB zeroed in its middle (its
    size unchanged), or its last bytes cut off."""
    data = shard.read_bytes()
    if how == "zeroed":
        middle = len(data) // 2
        shard.write_bytes(data[:middle] + bytes(min(2**16, len(data) - middle)) + data[middle + 2**16:])
    else:
        shard.write_bytes(data[:-100])


@pytest.mark.slow
def test_a_damaged_disk_cache_is_named_and_encoded_again_and_the_run_trains_as_before(tiny, tmp_path):
    flags = ["--cache_latents", "--feature_cache_dir", tmp_path / "features"]
    launch(LORA_SCRIPT, *lora_flags(tiny, tmp_path / "first", tiny["shapes"], *flags))
    (latents,) = (tmp_path / "features").glob("latents-*/shard-*")
    (text_embeddings,) = (tmp_path / "features").glob("text_embeddings-*/shard-*")
    assert latents.stat().st_size > 2**17
    damage(latents, "zeroed")
    damage(text_embeddings, "truncated")
    again = launch(LORA_SCRIPT, *lora_flags(tiny, tmp_path / "again", tiny["shapes"], *flags))
    for shard in (latents, text_embeddings):
        assert f"feature cache: {shard} " in again.stderr and "; removed, its items are encoded again" in again.stderr
    assert_same_files(tmp_path / "first" / LORA, tmp_path / "again" / LORA)


SIGNALLED_BETWEEN_RAW_AND_EMA = '''
import os, runpy, signal, sys
from training_utils.outputs.export import Export
save_ema = Export.save_ema
def signalled_first(self, directory):
    os.kill(os.getpid(), signal.SIGTERM)  # the raw weights are written; the EMA's are next
    return save_ema(self, directory)
Export.save_ema = signalled_first
sys.argv[0] = {script!r}
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def end_flags(tiny, output_dir, steps, *extra):
    return lora_flags(tiny, output_dir, tiny["shapes"], "--max_train_steps", steps, "--checkpointing_steps", 4,
                      "--use_ema", "--ema_decay", 0.9, "--export_formats", "kohya", *extra)


@pytest.fixture(scope="module")
@launching
def end_of_run(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}``: "earlier" ran 4 steps; "stopped" resumed it to 10 steps in a copy of its
    folder and was sent SIGTERM between the final raw and EMA writes; "rerun" reran that, after what a killed
    final write leaves was planted; "straight" ran the 10 steps uninterrupted."""
    root = tmp_path_factory.mktemp("end_of_run")
    first = launch_together({"earlier": (LORA_SCRIPT, *end_flags(tiny, root / "earlier", 4)),
                              "straight": (LORA_SCRIPT, *end_flags(tiny, root / "straight", 10))})
    shutil.copytree(root / "earlier", root / "stopped")
    wrapper = root / "signalled_between_raw_and_ema.py"
    wrapper.write_text(SIGNALLED_BETWEEN_RAW_AND_EMA.format(script=str(EXAMPLES / LORA_SCRIPT)))
    resume = ["--resume_from_checkpoint", "latest"]
    stopped = launch(wrapper, *end_flags(tiny, root / "stopped", 10, *resume), check=False)
    shutil.copytree(root / "stopped", root / "rerun")
    half_written = root / "rerun" / ".incomplete-a1b2c3" / "vae" / "diffusion_pytorch_model.safetensors"
    half_written.parent.mkdir(parents=True)
    half_written.write_bytes(b"a copy of the VAE, half written")
    rerun = launch(LORA_SCRIPT, *end_flags(tiny, root / "rerun", 10, *resume))
    return {"earlier": (root / "earlier", first["earlier"]), "straight": (root / "straight", first["straight"]),
            "stopped": (root / "stopped", stopped), "rerun": (root / "rerun", rerun)}


def test_a_stop_during_the_final_writes_says_why_and_leaves_the_outputs_before_whole(end_of_run):
    output_dir, result = end_of_run["stopped"]
    assert result.returncode == 75, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1] == ("stopped: stopped by SIGTERM after step 10; every file written is "
                                              "whole: rerun with --resume_from_checkpoint latest")
    for name in OUTPUTS:
        assert_same_files(end_of_run["earlier"][0] / name, output_dir / name)
    assert not [path for path in output_dir.rglob("*") if path.name.startswith(".incomplete-")]
    status = json.loads((output_dir / STATUS_FILE).read_text())
    assert {key: status[key] for key in ("reason", "exit_status", "last_step", "resume_from")} == {
        "reason": "preempted", "exit_status": 75, "last_step": 10, "resume_from": "checkpoint-8"}


def test_a_rerun_completes_it_as_the_uninterrupted_run_and_removes_what_killed_writes_left(end_of_run):
    output_dir, result = end_of_run["rerun"]
    assert "resumed from" in result.stdout and "checkpoint-8 at step 8" in result.stdout
    for name in OUTPUTS:
        assert_same_files(end_of_run["straight"][0] / name, output_dir / name)
    assert not (output_dir / ".incomplete-a1b2c3").exists()
    assert json.loads((output_dir / STATUS_FILE).read_text())["reason"] == "completed"


def test_every_file_a_run_writes_has_the_permissions_of_the_umask(end_of_run):
    output_dir, _ = end_of_run["rerun"]
    expected = 0o666 & ~process_umask()
    modes = {path.relative_to(output_dir).as_posix(): stat.S_IMODE(path.stat().st_mode)
             for path in output_dir.rglob("*") if path.is_file()}
    assert modes and {name: mode for name, mode in modes.items() if mode != expected} == {}


NAN_FROM_STEP_2 = '''
import runpy, sys
import training_utils.diffusion as diffusion
loss = diffusion.diffusion_loss
calls = []
def nan_from_step_2(*args, **kwargs):
    calls.append(1)
    return loss(*args, **kwargs) * (float("nan") if len(calls) >= 2 else 1.0)
diffusion.diffusion_loss = nan_from_step_2
sys.argv[0] = {script!r}
runpy.run_path(sys.argv[0], run_name="__main__")
'''


@pytest.mark.slow
def test_the_status_survives_the_launcher_which_exits_1_whatever_the_script_did(tiny, tmp_path):
    wrapper = tmp_path / "nan_from_step_2.py"
    wrapper.write_text(NAN_FROM_STEP_2.format(script=str(EXAMPLES / LORA_SCRIPT)))
    flags = lora_flags(tiny, tmp_path / "out", tiny["shapes"], "--checkpointing_steps", 1)
    through_launcher = launch(wrapper, *flags, quiet=True, check=False)
    assert through_launcher.returncode == 1, through_launcher.stderr[-3000:]
    assert "Traceback" not in through_launcher.stderr
    assert through_launcher.stderr.splitlines()[-1] == (
        f"stopped: the loss is nan at step 2; stopped before writing anything from these weights "
        f"({tmp_path / 'out' / 'checkpoint-1'} is the last checkpoint)")
    status = json.loads((tmp_path / "out" / STATUS_FILE).read_text())
    assert {key: status[key] for key in ("reason", "exit_status", "last_step", "resume_from")} == {
        "reason": "non-finite loss", "exit_status": 3, "last_step": 1, "resume_from": "checkpoint-1"}
    direct = launch(wrapper, *lora_flags(tiny, tmp_path / "direct", tiny["shapes"]), check=False)
    assert direct.returncode == 3, direct.stderr[-3000:]


@pytest.mark.slow
def test_overwrite_output_dir_clears_another_runs_outputs_and_keeps_the_users_files(tiny, tmp_path):
    output_dir = tmp_path / "out"
    launch(LORA_SCRIPT, *lora_flags(tiny, output_dir, tiny["shapes"], "--checkpointing_steps", 2, "--seed", 5))
    (output_dir / "notes.txt").write_text("the user's")
    launch(LORA_SCRIPT, *lora_flags(tiny, output_dir, tiny["shapes"], "--max_train_steps", 3, "--checkpointing_steps",
                                    3, "--overwrite_output_dir"))
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-3"]
    assert (output_dir / "notes.txt").read_text() == "the user's"
    launch(LORA_SCRIPT, *lora_flags(tiny, tmp_path / "alone", tiny["shapes"], "--max_train_steps", 3))
    assert_same_files(tmp_path / "alone" / LORA, output_dir / LORA)
