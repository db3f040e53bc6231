"""Smoke tests of the CogVideoX LoRA scripts (upstream's ``examples/cogvideo``) on the tiny CogVideoX pipelines (a VAE
of the released 8× and 4× ratios) and the moving-shapes clips (9, 7, 12 and 6 frames and a still image: frame
buckets of 9, 5 and 1 frames at ``--num_frames 9``), the runs launched together:

- full: text-to-video (CogVideoX 1.0's layout), 3 steps with EMA, random flips, validating videos at step 2 and at
  the end, checkpointing at step 2 (mid-epoch), the VAE off the accelerator between steps;
- resumed: the full run resumed from its checkpoint-2;
- i2v: the image-to-video script (CogVideoX 1.5's layout: pairs of latent frames) on upstream's data layout and
  flags (``--instance_data_root`` lists, ``--id_token``, ``--height``/``--width``, ``--max_num_frames``, prompts
  joined by ``:::``), with cached latents, validating from an image at its last step; on two processes (laying out
  the lists at once), sharded (FSDP2).
"""

import argparse
import functools
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from helpers import FSDP2, import_script, launch, launch_together, launching, together, usage_error
from training_utils.data.video import Clip, probe, read_frames
from training_utils.data.video_lists import fill_video_list_args, find_listed_clips, video_list_folder, with_id_token
from training_utils.errors import UsageError
from training_utils.families import cogvideox
from training_utils.testing import assert_lora_changes_pipeline_output, assert_same_files, assert_validated_at

SCRIPT = "cogvideo/train_cogvideox_lora.py"
I2V_SCRIPT = "cogvideo/train_cogvideox_image_to_video_lora.py"
LORA = "pytorch_lora_weights.safetensors"
PROMPT = "a red circle on a white background"
I2V_PROMPTS = ["sks a red circle", "sks a blue square"]


def common(tiny, output_dir, *extra, model="cogvideox"):
    return ["--pretrained_model_name_or_path", tiny[model], "--output_dir", output_dir, "--learning_rate", 1e-3,
            "--rank", 4, "--lora_alpha", 4, "--train_batch_size", 1, "--use_ema", "--ema_decay", 0.9, "--seed", 3,
            "--max_train_steps", 3, "--report_to", "none", *extra]


def t2v(tiny, output_dir, *extra):
    return common(tiny, output_dir, "--train_data_dir", tiny["moving_shapes"], "--resolution", 32, "--num_frames", 9,
                  "--random_flip", "--guidance_scale", 1, *extra)


def upstream_data(tiny):
    lists = tiny["moving_shapes_lists"]
    return ["--instance_data_root", lists, "--caption_column", "prompts.txt", "--video_column", "videos.txt",
            "--id_token", "sks", "--height", 32, "--width", 32, "--max_num_frames", 9]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("cogvideox")
    results = together({
        "full": functools.partial(launch, SCRIPT, *t2v(
            tiny, root / "full", "--validation_prompt", PROMPT, "--validation_inference_steps", 2,
            "--validation_steps", 2, "--validation_num_frames", 9, "--checkpointing_steps", 2,
            "--offload")),
        "i2v": functools.partial(launch, I2V_SCRIPT, *common(
            tiny, root / "i2v", *upstream_data(tiny), "--checkpointing_steps", 1000, "--cache_latents",
            "--validation_prompt", ":::".join(I2V_PROMPTS), "--validation_prompt_separator", ":::",
            "--validation_images", tiny["moving_shapes"] / "still.png", "--num_validation_videos", 1,
            "--validation_inference_steps", 2, "--validation_steps", 1000, "--fps", 16, "--guidance_scale", 1,
            "--use_dynamic_cfg", "--enable_slicing", "--enable_tiling", "--skip_frames_start", 0, "--skip_frames_end",
            0, model="cogvideox_i2v"), processes=2, env=FSDP2),
    })
    shutil.copytree(root / "full" / "checkpoint-2", root / "resumed" / "checkpoint-2")
    results.update(launch_together({"resumed": (SCRIPT, *t2v(tiny, root / "resumed", "--checkpointing_steps", 1000,
                                                             "--resume_from_checkpoint", "latest"))}))
    return {name: (root / name, result) for name, result in results.items()}


def assert_decodes_moving_frames(path, frames, fps):
    """The mp4 at ``path`` decodes to ``frames`` frames of 32×32 at ``fps``, and is not blank: its pixels vary."""
    assert probe(path) == (frames, fps, (32, 32))
    pixels = np.stack([np.asarray(frame, dtype=np.float32) for frame in read_frames(path, list(range(frames)))])
    assert pixels.std() > 1.0


def test_writes_raw_and_ema_loras_and_validates_videos_at_the_due_steps(tiny, runs):
    output_dir, _ = runs["full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and all(key.startswith("transformer.transformer_blocks.") for key in raw)
    assert {key.split(".")[3] for key in raw} == {"attn1"}
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    log = assert_validated_at(output_dir, [2, 3], ("raw", "ema"), [PROMPT], num_images=1)
    for record in log:  # a decodable mp4 of --validation_num_frames frames at CogVideoX's 8 fps, and its frame strip
        assert_decodes_moving_frames(output_dir / record["videos"][0], 9, 8.0)
        assert Image.open(output_dir / record["images"][0]).size == (9 * 32, 32)
    card = (output_dir / "README.md").read_text()
    assert "CogVideoXPipeline" in card and "load_lora_weights" in card
    assert_lora_changes_pipeline_output(tiny["cogvideox"], output_dir, output_dir / "ema", prompt=PROMPT, atol=1e-7,
                                        num_frames=5, guidance_scale=1.0)


def test_clips_train_in_frame_buckets_never_padded(runs):
    _, result = runs["full"]
    for line in ("bucket 1x32x32 (frames x height x width): 1 image", "bucket 5x32x32 (frames x height x width): 2",
                 "bucket 9x32x32 (frames x height x width): 2"):
        assert line in result.stderr, result.stderr[-3000:]


def test_a_run_resumed_mid_epoch_ends_with_the_weights_of_the_uninterrupted_one(runs):
    (output_dir, result), (straight_dir, _) = runs["resumed"], runs["full"]
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in result.stdout
    for name in (LORA, f"ema/{LORA}"):
        assert_same_files(output_dir / name, straight_dir / name)


def test_image_to_video_trains_on_upstreams_layout_and_validates_from_an_image(tiny, runs):
    output_dir, result = runs["i2v"]
    assert "FSDP2 units: 1 CogVideoXTransformer3DModel, 1 CogVideoXPatchEmbed, 2 CogVideoXBlock" in result.stderr
    # Upstream's lists (blank lines skipped): the four videos, in the 9- and 5-frame buckets (a batch each process).
    for line in ("bucket 5x32x32 (frames x height x width): 2", "bucket 9x32x32 (frames x height x width): 2"):
        assert line in result.stderr, result.stderr[-3000:]
    log = assert_validated_at(output_dir, [3], ("raw", "ema"), I2V_PROMPTS, num_images=1)
    for record in log:  # --max_num_frames frames, written at --fps
        assert_decodes_moving_frames(output_dir / record["videos"][0], 9, 16.0)
    assert "CogVideoXImageToVideoPipeline" in (output_dir / "README.md").read_text()
    image = Image.open(tiny["moving_shapes"] / "still.png").convert("RGB")
    assert_lora_changes_pipeline_output(tiny["cogvideox_i2v"], output_dir, output_dir / "ema", prompt=I2V_PROMPTS[0],
                                        atol=1e-7, num_frames=5, guidance_scale=1.0, image=image)


def test_upstreams_lists_and_a_local_dataset_give_the_same_clips_with_the_id_token(tiny):
    lists = tiny["moving_shapes_lists"]
    parse_args = import_script(SCRIPT).parse_args
    from_lists = parse_args(["--pretrained_model_name_or_path", str(tiny["cogvideox"]), *map(str, upstream_data(tiny))])
    from_dataset = parse_args(["--pretrained_model_name_or_path", str(tiny["cogvideox"]), "--dataset_name", str(lists),
                               "--instance_data_root", str(lists), "--max_num_frames", "9", "--cache_dir",
                               str(lists.parent / "datasets_cache")])
    clips = [find_listed_clips(args, cogvideox.VIDEO) for args in (from_lists, from_dataset)]
    prompts = (lists / "prompts.txt").read_text().split("\n\n")
    assert [clip.caption for clip in clips[0]] == [f"sks {prompt.strip()}" for prompt in prompts]
    assert [clip.caption for clip in clips[1]] == [prompt.strip() for prompt in prompts]  # no --id_token given
    assert [len(clip.indices) for clip in clips[0]] == [len(clip.indices) for clip in clips[1]] == [9, 5, 9, 5]
    assert [probe(clip.source) for clip in clips[0]] == [probe(clip.source) for clip in clips[1]]
    assert from_lists.aspect_ratio_buckets == [(32, 32)] and from_lists.center_crop  # upstream's centre crop


def test_a_too_short_video_stops_the_run_instead_of_training_as_a_still(tiny, tmp_path):
    from training_utils.data.rendered_video import write_mp4
    from training_utils.testing.tiny.video import moving_shape

    (tmp_path / "videos").mkdir()
    write_mp4(tmp_path / "videos" / "short.mp4", moving_shape("circle", "red", "white", 3), fps=8)
    (tmp_path / "videos.txt").write_text("videos/short.mp4\n")
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    flags = ["--instance_data_root", tmp_path, "--caption_column", "prompts.txt", "--video_column", "videos.txt"]
    error = usage_error(SCRIPT, *common(tiny, tmp_path / "out", *flags))
    assert error == (f"error: --instance_data_root='{tmp_path}': expected readable videos of 5 frames or more: "
                     f"{tmp_path / 'videos' / 'short.mp4'} (too short: 3 frames sampled, 5 needed) "
                     "(--skip_corrupt_images leaves them out)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, message", [
    (["--max_num_frames", 8], "--num_frames=8: expected a frame count the VAE takes: 4k+1 (1, 5, 9, ...)"),
    (["--height", 40, "--width", 32], "--height/--width='40/32': expected positive multiples of 16 (the VAE divides "
                                      "sides by 8, and the transformer takes whole patches)"),
    (["--resolution", 24], "--resolution=24: expected a multiple of 16 (the VAE divides sides by 8, and the pipeline "
                           "takes whole patches)"),
    (["--validation_prompt", "a", "--validation_num_frames", 5],
     "--validation_num_frames=5: expected a length the pipeline renders, 8k+1 (1, 9, 17, ..., 49): its VAE decodes an "
     "even count of latent frames to 4 frames each (5 frames render as 8); --validation_num_frames sets it apart from "
     "training's"),
    (["--skip_frames_start", 4], "--skip_frames_start=4: expected 0: each clip trains from its first frame (the clip "
                                 "reader shared by every video script, training_utils/data/video.py, starts there): "
                                 "cut intros and outros out of the files"),
])
def test_bad_flags_fail_in_one_line_before_anything_loads(tiny, tmp_path, flags, message):
    flags = ["--train_data_dir", tiny["moving_shapes"], *flags]
    assert usage_error(SCRIPT, *common(tiny, tmp_path / "out", *flags)) == f"error: {message}"
    assert not (tmp_path / "out").exists()


def test_upstreams_lists_are_checked_before_anything_loads(tiny, tmp_path):
    lists = tiny["moving_shapes_lists"]
    (tmp_path / "prompts.txt").write_text("one prompt\n")
    (tmp_path / "videos.txt").write_text("videos/00.mp4\nvideos/01.mp4\n")
    flags = ["--instance_data_root", tmp_path, "--caption_column", "prompts.txt", "--video_column", "videos.txt"]
    assert usage_error(SCRIPT, *common(tiny, tmp_path / "out", *flags)) == (
        "error: --caption_column/--video_column='prompts.txt/videos.txt': expected as many prompts as videos "
        "(1 prompts, 2 videos)")
    flags = ["--instance_data_root", lists, "--dataset_name", tiny["moving_shapes"]]
    assert "expected the folder of --dataset_name" in usage_error(SCRIPT, *common(tiny, tmp_path / "out", *flags))


def test_the_image_to_video_script_refuses_a_text_to_video_model_and_upstreams_nccl_timeout(tiny, tmp_path):
    flags = ["--train_data_dir", tiny["moving_shapes"]]
    error = usage_error(I2V_SCRIPT, *common(tiny, tmp_path / "out", *flags))
    assert error.startswith(f"error: --pretrained_model_name_or_path='{tiny['cogvideox']}': expected an "
                            "image-to-video pipeline (CogVideoXImageToVideoPipeline)")
    error = usage_error(I2V_SCRIPT, *common(tiny, tmp_path / "out", *flags, "--nccl_timeout", 600,
                                            model="cogvideox_i2v"))
    assert "--nccl_timeout" in error and "600 seconds" in error


def test_upstreams_lists_are_laid_out_once_by_their_content_and_never_in_the_users_folder(tiny):
    lists = tiny["moving_shapes_lists"]
    before = sorted(path.name for path in lists.rglob("*"))
    args = argparse.Namespace(instance_data_root=str(lists), caption_column="prompts.txt", video_column="videos.txt")
    folder = Path(video_list_folder(args))
    assert video_list_folder(args) == str(folder)  # written again (another process), the same folder and files
    assert sorted(path.name for path in lists.rglob("*")) == before
    links = sorted(folder.glob("*.mp4"))
    assert [link.resolve() for link in links] == [(lists / f"videos/{index:02d}.mp4").resolve() for index in range(4)]
    assert links[1].with_suffix(".txt").read_text() == "a blue square on a black background\n"
    assert not list(folder.glob(".*"))  # no partial file left behind


def test_the_id_token_leads_every_caption_and_upstreams_sizes_become_the_shared_flags():
    clips = [Clip("a.mp4", "a cat", [0], (32, 32)), Clip("b.mp4", ["a dog", "a puppy"], [0], (32, 32))]
    assert [clip.caption for clip in with_id_token(clips, "sks")] == ["sks a cat", ["sks a dog", "sks a puppy"]]
    assert with_id_token(clips, None) == clips
    args = argparse.Namespace(skip_frames_start=0, skip_frames_end=0, height=32, width=64, validation_height=None,
                              validation_width=None, video_reshape_mode="random", center_crop=True)
    fill_video_list_args(args, cogvideox.VIDEO)
    assert (args.aspect_ratio_buckets, args.validation_height, args.validation_width) == ([(32, 64)], 32, 64)
    assert not args.center_crop
    with pytest.raises(UsageError, match="--height/--width='32/None': expected both or neither"):
        fill_video_list_args(argparse.Namespace(skip_frames_start=0, skip_frames_end=0, height=32, width=None),
                             cogvideox.VIDEO)
