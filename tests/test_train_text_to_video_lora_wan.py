"""Smoke tests of the Wan text-to-video LoRA script on the tiny Wan pipelines and the moving-shapes clips (9, 7, 12
and 6 frames and a still image: frame buckets of 9, 5 and 1 frames at ``--num_frames 9``), the runs launched
together:

- full: Wan 2.1, 4 steps with EMA, random flips, validating videos every 2 steps and at the end, checkpointing at
  step 2 (mid-epoch), the VAE off the accelerator between steps;
- cached: the same 4 steps with --cache_latents on disk, neither validating nor checkpointing;
- experts: Wan 2.2's two experts on an int8 base, with gradient checkpointing, in frame buckets 5 and 9 given,
  sliding windows 3 frames apart;
- resumed: the full run resumed from its checkpoint-2;
- i2v: the image-to-video script on Wan 2.1 I2V-style (a CLIP image encoder), with cached latents, validating from
  the first clip's first frame at its last step; on two processes, sharded (FSDP2).
"""

import functools
import shutil

import pytest
import torch
from diffusers import WanPipeline
from PIL import Image
from safetensors.torch import load_file

from helpers import FSDP2, launch, launch_together, launching, together, usage_error
from training_utils.data.video import probe
from training_utils.testing import (assert_close_files, assert_lora_changes_pipeline_output, assert_same_files,
                                    assert_validated_at, checkpoint_names)

SCRIPT = "video/train_text_to_video_lora_wan.py"
I2V_SCRIPT = "video/train_image_to_video_lora_wan.py"
LORA = "pytorch_lora_weights.safetensors"
PROMPT = "a red circle on a white background"


def common(tiny, output_dir, *extra, model="wan21"):
    return ["--pretrained_model_name_or_path", tiny[model], "--train_data_dir", tiny["moving_shapes"],
            "--output_dir", output_dir, "--resolution", 32, "--num_frames", 9, "--learning_rate", 1e-3,
            "--center_crop", "--random_flip", "--use_ema", "--ema_decay", 0.9, "--seed", 3, "--max_sequence_length",
            16, "--max_train_steps", 4, *extra]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    results = together({
        "full": functools.partial(launch, SCRIPT, *common(
            tiny, root / "full", "--validation_prompt", PROMPT, "--num_validation_images", 1,
            "--validation_inference_steps", 2, "--validation_steps", 2, "--validation_num_frames", 5,
            "--checkpointing_steps", 2, "--offload")),
        "cached": functools.partial(launch, SCRIPT, *common(
            tiny, root / "cached", "--checkpointing_steps", 1000, "--cache_latents", "--feature_cache_dir",
            root / "features")),
        "experts": functools.partial(launch, SCRIPT, *common(
            tiny, root / "experts", "--checkpointing_steps", 1000, "--quantize_base", "int8", "--mixed_precision",
            "bf16", "--gradient_checkpointing", "--frame_buckets", "5,9", "--frame_extraction", "slide",
            "--frame_extraction_stride", 3, model="wan22")),
        # The video family's sharded launch: two processes, FSDP2.
        "i2v": functools.partial(launch, I2V_SCRIPT, *common(
            tiny, root / "i2v", "--checkpointing_steps", 1000, "--cache_latents", "--validation_prompt", PROMPT,
            "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_num_frames", 5,
            model="wan_i2v"), processes=2, env=FSDP2),
    })
    shutil.copytree(root / "full" / "checkpoint-2", root / "resumed" / "checkpoint-2")
    results.update(launch_together({"resumed": (SCRIPT, *common(tiny, root / "resumed", "--checkpointing_steps",
                                                                1000, "--resume_from_checkpoint", "latest"))}))
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_raw_and_ema_loras_and_validates_videos_at_the_due_steps(tiny, runs):
    output_dir, result = runs["full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and all(key.startswith("transformer.blocks.") for key in raw)
    assert {key.split(".")[3] for key in raw} == {"attn1", "attn2"}
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    log = assert_validated_at(output_dir, [2, 4], ("raw", "ema"), [PROMPT], num_images=1)
    for record in log:  # a decodable mp4 of --validation_num_frames frames, and its frame strip
        assert probe(output_dir / record["videos"][0]) == (5, 16.0, (32, 32))
        assert Image.open(output_dir / record["images"][0]).size == (5 * 32, 32)
    card = (output_dir / "README.md").read_text()
    assert "WanPipeline" in card and "load_lora_weights" in card and log[-1]["progress"] in card
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    # Four steps change the tiny model's videos little, but exactly: any difference is the LoRA's.
    assert_lora_changes_pipeline_output(tiny["wan21"], output_dir, output_dir / "ema", prompt=PROMPT, atol=1e-7,
                                        num_frames=5, max_sequence_length=16, guidance_scale=1.0)


def test_clips_train_in_frame_buckets_never_padded(runs):
    _, result = runs["full"]
    for line in ("bucket 1x32x32 (frames x height x width): 1 image", "bucket 5x32x32 (frames x height x width): 2",
                 "bucket 9x32x32 (frames x height x width): 2"):
        assert line in result.stderr, result.stderr[-3000:]


def test_sliding_windows_of_the_given_frame_buckets_each_train_as_a_sample(runs):
    """Buckets 5 and 9, windows 3 frames apart: the 9-frame clip gives one of 9, the 12-frame clip two (from frames
    0 and 3), the 7- and 6-frame clips one of 5 each, the still one frame."""
    _, result = runs["experts"]
    for line in ("bucket 1x32x32 (frames x height x width): 1 image", "bucket 5x32x32 (frames x height x width): 2",
                 "bucket 9x32x32 (frames x height x width): 3"):
        assert line in result.stderr, result.stderr[-3000:]


def test_a_run_resumed_mid_epoch_ends_with_the_weights_of_the_uninterrupted_one(runs):
    (output_dir, result), (straight_dir, _) = runs["resumed"], runs["full"]
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in result.stdout
    for name in (LORA, f"ema/{LORA}"):
        assert_same_files(output_dir / name, straight_dir / name)


def test_cached_latents_per_clip_train_like_encoding_every_step(runs):
    (cached_dir, _), (encoded_dir, _) = runs["cached"], runs["full"]
    for name in (LORA, f"ema/{LORA}"):
        assert_close_files(encoded_dir / name, cached_dir / name, atol=1e-5)
    stores = [load_file(shard)["0/parameters"] for shard in (cached_dir.parent / "features").glob("latents-*/shard-*")]
    # A store per frame bucket: each clip once, both flips, 1, 2 or 3 latent frames of 4x4, mean and log-variance.
    assert sorted(tuple(parameters.shape[1:]) for parameters in stores) == [(2, 32, frames, 4, 4) for frames in
                                                                            (1, 2, 3)]


def test_both_experts_of_an_int8_wan22_train_and_load_into_their_transformers(tiny, runs):
    output_dir, _ = runs["experts"]
    high, low = load_file(output_dir / LORA), load_file(output_dir / "transformer_2" / LORA)
    assert high.keys() == low.keys() and all(key.startswith("transformer.") for key in high)
    assert all(tensor.dtype == torch.float32 for tensor in high.values())
    pipe = WanPipeline.from_pretrained(tiny["wan22"])
    pipe.load_lora_weights(output_dir, adapter_name="trained")
    pipe.load_lora_weights(output_dir / "transformer_2", adapter_name="trained", load_into_transformer_2=True)
    for transformer, lora in ((pipe.transformer, high), (pipe.transformer_2, low)):
        key = next(key for key in lora if "lora_B" in key)
        loaded = transformer.get_parameter(key.removeprefix("transformer.").replace(".weight", ".trained.weight"))
        assert torch.equal(loaded, lora[key]) and loaded.abs().sum() > 0  # each expert trained some steps


@pytest.mark.parametrize("flags, message", [
    (["--num_frames", 8], "--num_frames=8: expected a frame count the VAE takes: 4k+1 (1, 5, 9, ...)"),
    (["--frame_rate", 8, "--frame_stride", 2], "--frame_rate/--frame_stride='8.0/2': expected one of the two"),
    (["--train_expert", "low"], None),
])
def test_bad_flags_fail_in_one_line_before_anything_loads(tiny, tmp_path, flags, message):
    message = message or ("--train_expert='low': expected high or nothing: the pipeline has one transformer, no "
                          "low-noise expert (transformer_2)")
    assert usage_error(SCRIPT, *common(tiny, tmp_path / "out", *flags)) == f"error: {message}"
    assert not (tmp_path / "out").exists()


def test_image_to_video_trains_sharded_on_first_frames_and_validates_from_an_image(tiny, runs):
    output_dir, result = runs["i2v"]
    assert "FSDP2 units: 1 WanTransformer3DModel" in result.stderr, result.stderr[-3000:]
    log = assert_validated_at(output_dir, [4], ("raw", "ema"), [PROMPT], num_images=1)
    assert probe(output_dir / log[0]["videos"][0]) == (5, 16.0, (32, 32))
    first_frame = Image.open(output_dir / "validation" / "conditioning-p00.png")
    assert first_frame.size == (32, 32)
    assert "WanImageToVideoPipeline" in (output_dir / "README.md").read_text()
    assert_lora_changes_pipeline_output(tiny["wan_i2v"], output_dir, prompt=PROMPT, atol=1e-7, num_frames=5,
                                        max_sequence_length=16, guidance_scale=1.0, image=first_frame)


def test_a_validation_image_per_prompt_or_one_for_all_is_checked_before_anything_loads(tiny, tmp_path):
    still = tiny["moving_shapes"] / "still.png"  # two images for three prompts
    flags = ["--validation_prompt", "a", "b", "c", "--validation_image", still, still]
    message = usage_error(I2V_SCRIPT, *common(tiny, tmp_path / "out", *flags, model="wan_i2v"))
    assert message.startswith("error: --validation_image=[") and message.endswith(
        "expected image files, one for every --validation_prompt or one for all")

