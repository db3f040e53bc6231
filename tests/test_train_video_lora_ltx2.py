"""Smoke tests of the LTX-2 text-to-video LoRA script on the tiny LTX-2 pipeline (its real 32× and 8× video VAE) and
the ``ltx2_clips`` (17, 12 and 9 frames and a still image at 64×64: frame buckets of 17, 9 and 1 frames at
``--num_frames 17``), the runs launched together:

- full: 4 steps with EMA, validating 9-frame videos every 2 steps and at the end, checkpointing at step 2;
- resumed: the full run resumed from its checkpoint-2.

The bad inputs (a clip too short to be a video, a size off the VAE's multiple, a prompt length the text connectors
refuse) stop in one line before any weights load.
"""

import argparse
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from helpers import launch_together, launching, usage_error
from training_utils.data.rendered_video import write_mp4
from training_utils.data.video import find_clips, probe
from training_utils.families import ltx2
from training_utils.grids import read_log
from training_utils.testing import assert_lora_changes_pipeline_output, assert_same_files, checkpoint_names
from training_utils.testing.tiny.video import moving_shape

SCRIPT = "video/train_text_to_video_lora_ltx2.py"
LORA = "pytorch_lora_weights.safetensors"
PROMPT = "a red circle on a white background"


def common(tiny, output_dir, *extra, data=None):
    return ["--pretrained_model_name_or_path", tiny["ltx2"], "--train_data_dir", data or tiny["ltx2_clips"],
            "--output_dir", output_dir, "--resolution", 64, "--num_frames", 17, "--learning_rate", 1e-3,
            "--use_ema", "--ema_decay", 0.9, "--seed", 3, "--max_sequence_length", 16, "--max_train_steps", 4, *extra]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("ltx2")
    results = launch_together({"full": (SCRIPT, *common(
        tiny, root / "full", "--validation_prompt", PROMPT, "--num_validation_images", 1,
        "--validation_inference_steps", 2, "--validation_steps", 2, "--validation_num_frames", 9,
        "--checkpointing_steps", 2))})
    shutil.copytree(root / "full" / "checkpoint-2", root / "resumed" / "checkpoint-2")
    results.update(launch_together({"resumed": (SCRIPT, *common(tiny, root / "resumed", "--checkpointing_steps",
                                                                1000, "--resume_from_checkpoint", "latest"))}))
    return {name: (root / name, result) for name, result in results.items()}


def test_the_video_streams_lora_loads_into_ltx2_pipeline_and_changes_its_videos(tiny, runs):
    output_dir, result = runs["full"]
    assert ltx2.AUDIO_NOT_TRAINED in result.stderr
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and all(key.startswith("transformer.transformer_blocks.") for key in raw)
    assert {key.split(".")[3] for key in raw} == {"attn1", "attn2"}  # the video stream's; no audio layer
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    card = (output_dir / "README.md").read_text()
    assert "LTX2Pipeline" in card and "load_lora_weights" in card
    # Four steps change the tiny model's videos little, but exactly: any difference is the LoRA's.
    assert_lora_changes_pipeline_output(tiny["ltx2"], output_dir, output_dir / "ema", prompt=PROMPT, atol=1e-7,
                                        resolution=64, num_frames=9, max_sequence_length=16)


def test_validation_videos_decode_with_their_frames_and_are_not_blank(runs):
    output_dir, _ = runs["full"]
    log = read_log(output_dir)
    assert [(record["step"], record["variant"]) for record in log] == [
        (0, "base"), (2, "raw"), (2, "ema"), (4, "raw"), (4, "ema")]
    for record in log:  # a decodable mp4 of --validation_num_frames frames at the native rate, and its frame strip
        video = output_dir / record["videos"][0]
        assert probe(video) == (9, 24.0, (64, 64))
        frames = np.asarray(Image.open(output_dir / record["images"][0]))
        assert frames.shape == (64, 9 * 64, 3) and frames.min() < frames.max()


def test_clips_train_in_frame_buckets_of_8k_plus_1_frames(runs):
    _, result = runs["full"]
    for line in ("bucket 1x64x64 (frames x height x width): 1 image", "bucket 9x64x64 (frames x height x width): 2",
                 "bucket 17x64x64 (frames x height x width): 1 image"):
        assert line in result.stderr, result.stderr[-3000:]


def test_a_run_resumed_mid_epoch_ends_with_the_weights_of_the_uninterrupted_one(runs):
    (output_dir, result), (straight_dir, _) = runs["resumed"], runs["full"]
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in result.stdout
    for name in (LORA, f"ema/{LORA}"):
        assert_same_files(output_dir / name, straight_dir / name)


@pytest.fixture
def short_clip_data(tiny, tmp_path):
    """The tiny clips and a 5-frame clip: fewer than the 9 frames (two latent frames) of LTX-2's shortest video."""
    data = tmp_path / "clips"
    shutil.copytree(tiny["ltx2_clips"], data)
    write_mp4(data / "short.mp4", moving_shape("circle", "red", "white", 5, size=64), fps=24)
    (data / "short.txt").write_text("a red circle on a white background\n")
    return data


def test_a_too_short_clip_stops_the_run_or_is_left_out_never_trained_as_a_still(tiny, tmp_path, short_clip_data):
    message = usage_error(SCRIPT, *common(tiny, tmp_path / "out", data=short_clip_data))
    assert message.startswith("error: --train_data_dir=") and "short.mp4 (too short: 5 frames sampled, 9 needed)" \
        in message
    args = argparse.Namespace(train_data_dir=str(short_clip_data), dataset_name=None, max_train_samples=None,
                              frame_rate=None, frame_stride=None, num_frames=17, skip_corrupt_images=True,
                              frame_buckets=None, frame_extraction="head", frame_extraction_stride=None)
    clips = find_clips(args, ltx2.VIDEO)
    assert sorted((clip.name.rsplit("/", 1)[1], len(clip.indices)) for clip in clips) == [
        ("00.mp4", 17), ("01.mp4", 9), ("02.mp4", 9), ("still.png", 1)]


@pytest.mark.parametrize("flags, message", [
    (["--resolution", 48], "--resolution=48: expected a multiple of 32 (the VAE divides sides by 32, and the "
                           "pipeline takes whole patches)"),
    (["--num_frames", 13], "--num_frames=13: expected a frame count the VAE takes: 8k+1 (1, 9, 17, ...)"),
    (["--max_sequence_length", 12], "--max_sequence_length=12: expected a multiple of 8 (the text connectors' "
                                    "learnable registers)"),
])
def test_bad_flags_fail_in_one_line_before_anything_loads(tiny, tmp_path, flags, message):
    assert usage_error(SCRIPT, *common(tiny, tmp_path / "out", *flags)) == f"error: {message}"
    assert not (tmp_path / "out").exists()
