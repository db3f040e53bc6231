"""Smoke tests of the Cosmos Predict 2.5 LoRA script on the tiny Cosmos pipeline (the Wan 2.1 VAE, 8× in space and 4×
in time, as the released model's) and clips in upstream's layout (``videos/`` beside ``metas/``: 9, 13 and 10
frames, all in the 9-frame bucket), the runs launched together:

- full: 4 steps with EMA at 32×48 (``--height``/``--width``), validating videos started from the first clip's first
  frame every 2 steps and at the end, checkpointing at step 2;
- resumed: the full run resumed from its checkpoint-2;
- upstream: upstream's flags as its README gives them (checkpoints by epoch, its learning-rate schedule, its LoRA
  and weight-decay names, ``--do_final_eval``), Image2World only, with gradient checkpointing and cached latents.
"""

import functools
import shutil

import numpy as np
import pytest
import torch
from diffusers import Cosmos2_5_PredictBasePipeline
from PIL import Image
from safetensors.torch import load_file

from helpers import launch, launch_together, launching, together, usage_error
from training_utils.data.video import probe
from training_utils.families import cosmos
from training_utils.testing import (assert_lora_changes_pipeline_output, assert_same_files, assert_validated_at,
                                    checkpoint_names)

SCRIPT = "cosmos/train_cosmos_predict25_lora.py"
LORA = "pytorch_lora_weights.safetensors"
PROMPT = "a red circle on a white background"


def common(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["cosmos_predict25"], "--train_data_dir", tiny["cosmos_clips"],
            "--output_dir", output_dir, "--num_frames", 9, "--max_sequence_length", 48, "--seed", 3, *extra]


def full(tiny, output_dir, *extra):
    return common(tiny, output_dir, "--height", 32, "--width", 48, "--learning_rate", 1e-3, "--rank", 4,
                  "--use_ema", "--ema_decay", 0.9, "--max_train_steps", 4, *extra)


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("cosmos")
    results = together({
        "full": functools.partial(launch, SCRIPT, *full(
            tiny, root / "full", "--validation_prompt", PROMPT, "--num_validation_images", 1,
            "--validation_inference_steps", 2, "--validation_steps", 2, "--validation_num_frames", 9,
            "--checkpointing_steps", 2)),
        "upstream": functools.partial(launch, SCRIPT, *common(
            tiny, root / "upstream", "--train_batch_size=1", "--num_train_epochs=2", "--checkpointing_epochs=1",
            "--seed=0", "--height", 32, "--width", 32, "--allow_tf32", "--gradient_checkpointing", "--lora_rank", 4,
            "--lora_alpha", 4, "--weight_decay", 0.01, "--learning_rate", 1e-3, "--scheduler_warm_up_steps", 2,
            "--num_training_steps", 6, "--scheduler_f_max", 1.0, "--scheduler_f_min", 0.5, "--do_final_eval",
            "--num_inference_steps", 2, "--num_validation_images", 1, "--conditional_frames_probs", '{"1": 1.0}',
            "--cfg_dropout_prob", 0.5, "--cache_latents")),
    })
    shutil.copytree(root / "full" / "checkpoint-2", root / "resumed" / "checkpoint-2")
    results.update(launch_together({"resumed": (SCRIPT, *full(tiny, root / "resumed", "--checkpointing_steps", 1000,
                                                              "--resume_from_checkpoint", "latest"))}))
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_raw_and_ema_loras_and_validates_videos_from_the_first_frame(tiny, runs):
    output_dir, result = runs["full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and all(key.startswith("transformer.transformer_blocks.") for key in raw)
    assert {key.split(".")[3] for key in raw} == {"attn1", "attn2", "ff"}  # upstream's layers: attention and MLP
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert "bucket 9x32x48 (frames x height x width): 3" in result.stderr, result.stderr[-3000:]
    log = assert_validated_at(output_dir, [2, 4], ("raw", "ema"), [PROMPT], num_images=1)
    for record in log:  # a decodable mp4 of 9 frames at 16 a second, not one value throughout, and its frame strip
        assert probe(output_dir / record["videos"][0]) == (9, 16.0, (48, 32))
        strip = np.asarray(Image.open(output_dir / record["images"][0]))
        assert strip.shape == (32, 9 * 48, 3) and len(np.unique(strip)) > 1
    assert Image.open(output_dir / "validation" / "conditioning-p00.png").size == (32, 32)  # the clip's own frame
    card = (output_dir / "README.md").read_text()
    assert "Cosmos2_5_PredictBasePipeline" in card and f'pipe.load_lora_weights("{output_dir}")' in card
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    # Four steps change the tiny model's videos little, but exactly: any difference is the LoRA's.
    assert_lora_changes_pipeline_output(tiny["cosmos_predict25"], output_dir, output_dir / "ema", prompt=PROMPT,
                                        atol=1e-7, num_frames=9, max_sequence_length=48, guidance_scale=1.0,
                                        components={"safety_checker": cosmos.PassThroughSafetyChecker()})


def test_a_run_resumed_mid_epoch_ends_with_the_weights_of_the_uninterrupted_one(runs):
    (output_dir, result), (straight_dir, _) = runs["resumed"], runs["full"]
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in result.stdout
    for name in (LORA, f"ema/{LORA}"):
        assert_same_files(output_dir / name, straight_dir / name)


def test_upstreams_flags_checkpoint_by_epoch_schedule_the_rate_as_upstream_and_render_the_first_clip(runs):
    output_dir, _ = runs["upstream"]
    assert checkpoint_names(output_dir) == ["checkpoint-3", "checkpoint-6"]  # an epoch is 3 clips
    log = assert_validated_at(output_dir, [6], ("raw",), ["a red circle on a white background"], num_images=1)
    assert probe(output_dir / log[-1]["videos"][0])[0] == 9
    scheduler = torch.load(output_dir / "checkpoint-6" / "scheduler.bin", weights_only=True)
    # Warm-up over 2 steps to f_max, then linear to f_min at step 6: 6 steps end at f_min.
    assert scheduler["last_epoch"] == 6 and scheduler["_last_lr"] == [pytest.approx(1e-3 * 0.5)]


@pytest.mark.parametrize("flags, message", [
    (["--height", 40, "--width", 32], "--height/--width='40/32': expected multiples of 16 (the VAE divides sides by 8, "
                                      "and the pipeline takes whole patches)"),
    (["--conditional_frames_probs", '{"3": 1}'], "--conditional_frames_probs='{\"3\": 1}': expected a JSON object of "
                                                 "latent frame counts 0, 1 or 2 and their probabilities, such as "
                                                 "{\"1\": 0.5, \"2\": 0.5}"),
    (["--num_frames", 8], "--num_frames=8: expected a frame count the VAE takes: 4k+1 (1, 5, 9, ...)"),
])
def test_bad_flags_fail_in_one_line_before_anything_loads(tiny, tmp_path, flags, message):
    assert usage_error(SCRIPT, *common(tiny, tmp_path / "out", *flags)) == f"error: {message}"
    assert not (tmp_path / "out").exists()


def test_clips_too_short_for_their_conditioning_frames_or_stills_are_refused_before_anything_loads(tiny, tmp_path):
    """The moving shapes: 7- and 6-frame clips give two latent frames, all of them conditioning in Video2World, and
    a still would be nothing but conditioning: the run stops before the pipeline loads."""
    shapes = tiny["moving_shapes"]
    message = usage_error(SCRIPT, *common(tiny, tmp_path / "out", "--train_data_dir", shapes))
    assert f"{shapes / 'still.png'} (a still image: this family trains on videos only)" in message
    message = usage_error(SCRIPT, *common(tiny, tmp_path / "out", "--train_data_dir", shapes, "--skip_corrupt_images",
                                          "--num_frames", 5))
    assert message.endswith("expected clips of more than 2 latent frames (9 frames or more), the most that "
                            "--conditional_frames_probs conditions on; the shortest has 5")
