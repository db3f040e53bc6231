"""Smoke tests of the LTX-Video text-to-video LoRA script on the tiny LTX-Video pipeline (its real 32x spatial and
8x temporal VAE) and the moving-shapes clips (9, 7, 12 and 6 frames and a still image: at 8x in time the 7- and
6-frame clips are too short to be videos, left out with --skip_corrupt_images), the runs launched together:

- full: 4 steps with EMA, validating 9-frame videos every 2 steps and at the end, checkpointing at step 2;
- resumed: the full run resumed from its checkpoint-2;
- i2v: the image-to-video script, the stills left out too, validating from the first clip's first frame at its last
  step.
"""

import shutil

import numpy as np
import pytest
import torch
from diffusers import LTXImageToVideoPipeline
from PIL import Image
from safetensors.torch import load_file

from helpers import launch_together, launching, usage_error
from training_utils.data.video import probe
from training_utils.testing import assert_lora_changes_pipeline_output, assert_same_files, assert_validated_at

SCRIPT = "video/train_text_to_video_lora_ltx.py"
I2V_SCRIPT = "video/train_image_to_video_lora_ltx.py"
LORA = "pytorch_lora_weights.safetensors"
PROMPT = "a red circle on a white background"


def common(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["ltx"], "--train_data_dir", tiny["moving_shapes"],
            "--output_dir", output_dir, "--resolution", 32, "--num_frames", 9, "--learning_rate", 1e-3,
            "--use_ema", "--ema_decay", 0.9, "--seed", 3, "--max_sequence_length", 16, "--max_train_steps", 4,
            *extra]


def full_run(tiny, output_dir, *extra):
    return common(tiny, output_dir, "--skip_corrupt_images", "--validation_prompt", PROMPT,
                  "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", 2,
                  "--validation_num_frames", 9, *extra)


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("ltx")
    results = launch_together({
        "full": (SCRIPT, *full_run(tiny, root / "full", "--checkpointing_steps", 2)),
        "i2v": (I2V_SCRIPT, *full_run(tiny, root / "i2v", "--checkpointing_steps", 1000, "--validation_steps", 1000)),
    })
    shutil.copytree(root / "full" / "checkpoint-2", root / "resumed" / "checkpoint-2")
    results.update(launch_together({"resumed": (SCRIPT, *common(
        tiny, root / "resumed", "--skip_corrupt_images", "--checkpointing_steps", 1000, "--resume_from_checkpoint",
        "latest"))}))
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_raw_and_ema_loras_of_the_transformer(runs):
    output_dir, _ = runs["full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw and raw.keys() == ema.keys() and all(key.startswith("transformer.transformer_blocks.") for key in raw)
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)


def test_too_short_clips_are_left_out_named(runs):
    _, result = runs["full"]
    for name in ("7 frames sampled", "6 frames sampled", "2 of 5 files left out (--skip_corrupt_images)"):
        assert name in result.stderr, result.stderr[-3000:]


def test_validates_decodable_nine_frame_videos_at_the_due_steps(runs):
    output_dir, _ = runs["full"]
    log = assert_validated_at(output_dir, [2, 4], ("raw", "ema"), [PROMPT], num_images=1)
    for record in log:
        assert probe(output_dir / record["videos"][0])[0] == 9
        strip = np.asarray(Image.open(output_dir / record["images"][0]))
        assert strip.shape[:2] == (32, 9 * 32) and len(np.unique(strip)) > 1
    assert "LTXPipeline" in (output_dir / "README.md").read_text()


def test_the_lora_loads_into_the_pipeline_and_changes_its_videos(tiny, runs):
    output_dir, _ = runs["full"]
    assert_lora_changes_pipeline_output(tiny["ltx"], output_dir, output_dir / "ema", prompt=PROMPT, atol=1e-7,
                                        num_frames=9, max_sequence_length=16, guidance_scale=1.0)


def test_a_run_resumed_mid_training_ends_with_the_weights_of_the_uninterrupted_one(runs):
    (output_dir, result), (straight_dir, _) = runs["resumed"], runs["full"]
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in result.stdout
    for name in (LORA, f"ema/{LORA}"):
        assert_same_files(output_dir / name, straight_dir / name)


def test_a_resolution_the_vae_does_not_take_fails_in_one_line(tiny, tmp_path):
    message = usage_error(SCRIPT, *full_run(tiny, tmp_path / "out", "--resolution", 48))
    assert message.startswith("error: --resolution=48: expected a multiple of 32 (the VAE divides sides by 32")
    assert not (tmp_path / "out").exists()


def test_clips_too_short_for_the_vae_stop_the_run_naming_them(tiny, tmp_path):
    message = usage_error(SCRIPT, *common(tiny, tmp_path / "out"))
    assert message.startswith("error: --train_data_dir=") and "7 frames sampled, 9 needed" in message
    assert "6 frames sampled, 9 needed" in message and "(--skip_corrupt_images leaves them out)" in message


def test_image_to_video_learns_the_frames_after_the_first_and_validates_from_an_image(tiny, runs, tmp_path):
    output_dir, result = runs["i2v"]
    assert "left out 1 one-frame clips (still images)" in result.stderr, result.stderr[-3000:]
    log = assert_validated_at(output_dir, [4], ("raw", "ema"), [PROMPT], num_images=1)
    assert probe(output_dir / log[0]["videos"][0])[0] == 9
    first_frame = Image.open(output_dir / "validation" / "conditioning-p00.png")
    assert first_frame.size == (32, 32)
    assert "LTXImageToVideoPipeline" in (output_dir / "README.md").read_text()
    # The released folder loads as either pipeline: the tiny one's copy, saved as the image-to-video one.
    base = tmp_path / "ltx_i2v"
    LTXImageToVideoPipeline.from_pretrained(tiny["ltx"]).save_pretrained(base)
    assert_lora_changes_pipeline_output(base, output_dir, output_dir / "ema", prompt=PROMPT, atol=1e-7, num_frames=9,
                                        max_sequence_length=16, guidance_scale=1.0, image=first_frame)


def test_a_validation_image_per_prompt_or_one_for_all_is_checked_before_anything_loads(tiny, tmp_path):
    still = tiny["moving_shapes"] / "still.png"  # two images for three prompts
    flags = ["--validation_prompt", "a", "b", "c", "--validation_image", still, still]
    message = usage_error(I2V_SCRIPT, *common(tiny, tmp_path / "out", "--skip_corrupt_images", *flags))
    assert message.startswith("error: --validation_image=[") and message.endswith(
        "expected image files, one for every --validation_prompt or one for all")
