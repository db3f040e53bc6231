"""training_utils.data.video: clips found, probed and named when they cannot train; frames sampled and bucketed; frames
laid out alike; validation videos written as mp4 with a frame strip."""

import argparse
import json
import logging

import numpy as np
import pytest
import torch
from diffusers import WanPipeline

from training_utils.data.images import ImageTransform
from training_utils.data.rendered_video import RenderedVideo, video_frames, write_mp4
from training_utils.data.video import (VideoTransform, add_video_args, check_image_to_video_clips, check_video_args,
                                       clip_sample, extract_windows, find_clips, frame_indices, probe, read_frames,
                                       window_rate)
from training_utils.errors import UsageError
from training_utils.families import wan
from training_utils.families.base import VideoGeometry
from training_utils.testing.tiny.video import build_moving_shapes, moving_shape

WAN = wan.VIDEO
# A family of another geometry, as LTX-Video's: 8× in time, 32× in space, 25 frames a second, PIL frames.
EIGHT_IN_TIME = VideoGeometry(spatial=32, temporal=8, size_multiple=32, fps=25, output_type="pil")


@pytest.fixture(scope="module")
def clips_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    build_moving_shapes(folder)
    return folder


def video_args(*argv, geometry=WAN):
    parser = argparse.ArgumentParser()
    parser.add_argument("--resolution", type=int, default=32)
    for flag in ("--train_data_dir", "--dataset_name", "--dataset_config_name", "--cache_dir"):
        parser.add_argument(flag)
    parser.add_argument("--caption_column", default="text")
    parser.add_argument("--max_train_samples", type=int)
    parser.add_argument("--skip_corrupt_images", action="store_true")
    add_video_args(parser, WanPipeline)
    args = parser.parse_args(list(map(str, argv)))
    check_video_args(args, geometry)
    return args


def test_frames_are_sampled_by_stride_or_rate_and_bucketed_at_the_longest_count_the_vae_takes():
    assert frame_indices(12, 8.0) == list(range(12))
    assert frame_indices(12, 8.0, frame_stride=3) == [0, 3, 6, 9]
    assert frame_indices(12, 8.0, frame_rate=4) == [0, 2, 4, 6, 8, 10]
    assert frame_indices(9, 24.0, frame_rate=16) == [0, 1, 3, 4, 6, 7]  # the frame shown at each 1/16 s
    assert (WAN.counts_up_to(17), WAN.counts_up_to(1)) == ([5, 9, 13, 17], [1])
    assert EIGHT_IN_TIME.counts_up_to(33) == [9, 17, 25, 33]
    assert (WAN.min_frames, EIGHT_IN_TIME.min_frames) == (5, 9)


def test_a_clip_gives_its_first_frames_frames_spread_over_it_or_every_window():
    indices = list(range(0, 24, 2))  # every other frame of 24: 12 sampled frames
    assert extract_windows(indices, 5) == [[0, 2, 4, 6, 8]]
    assert extract_windows(indices, 5, "uniform") == [[0, 6, 12, 16, 22]]  # 11 / 4 steps of 2.75, rounded
    assert extract_windows(indices, 12, "uniform") == [indices]
    assert extract_windows(indices, 5, "slide") == [[0, 2, 4, 6, 8], [10, 12, 14, 16, 18]]  # the last 2 fill none
    assert extract_windows(indices, 5, "slide", stride=3) == [indices[k:k + 5] for k in (0, 3, 6)]
    assert extract_windows([0], 1, "slide") == [[0]]
    assert window_rate(8.0, indices, [0, 2, 4, 6, 8]) == 8.0
    assert window_rate(8.0, indices, [0, 6, 12, 16, 22]) == 8.0 * 4 / 11  # 5 frames over 11 sampled intervals
    assert window_rate(None, indices, [0, 6]) is None


@pytest.mark.parametrize("flags, message", [
    (["--num_frames", 10], "--num_frames=10: expected a frame count the VAE takes: 4k+1 (1, 5, 9, ...)"),
    (["--validation_num_frames", 0], "--validation_num_frames=0: expected a frame count the VAE takes: 4k+1 "
                                     "(1, 5, 9, ...)"),
    (["--frame_stride", 0], "--frame_stride=0: expected a positive integer"),
    (["--frame_rate", -1], "--frame_rate=-1.0: expected a positive number"),
    (["--frame_buckets", "9,10"], "--frame_buckets='9,10': expected a frame count the VAE takes: 4k+1 (1, 5, 9, ...); "
                                  "10 is not"),
    (["--frame_buckets", "9;17"], "--frame_buckets='9;17': expected frame counts separated by commas, such as 9,17,33"),
    (["--frame_extraction_stride", 2], "--frame_extraction_stride=2: expected nothing unless --frame_extraction is "
                                       "slide (windows a stride apart)"),
    (["--frame_extraction", "slide", "--frame_extraction_stride", 0], "--frame_extraction_stride=0: expected a "
                                                                      "positive integer"),
])
def test_bad_video_flags_fail_in_one_line(flags, message):
    with pytest.raises(UsageError) as error:
        video_args(*flags)
    assert str(error.value) == message


@pytest.mark.parametrize("geometry, flags, message", [
    (EIGHT_IN_TIME, ["--num_frames", 5], "--num_frames=5: expected a frame count the VAE takes: 8k+1 (1, 9, 17, ...)"),
    (EIGHT_IN_TIME, ["--resolution", 48], "--resolution=48: expected a multiple of 32 (the VAE divides sides by 32, "
                                          "and the pipeline takes whole patches)"),
    (WAN, ["--resolution", 24], "--resolution=24: expected a multiple of 16 (the VAE divides sides by 8, and the "
                                "pipeline takes whole patches)"),
])
def test_frame_counts_and_sizes_are_checked_against_the_familys_geometry(geometry, flags, message):
    with pytest.raises(UsageError) as error:
        video_args(*flags, geometry=geometry)
    assert str(error.value) == message
    assert video_args("--num_frames", 17, "--resolution", 64, geometry=EIGHT_IN_TIME).validation_fps == 25
    assert video_args("--num_frames", 9).validation_fps == 16
    assert video_args("--validation_fps", 30, geometry=EIGHT_IN_TIME).validation_fps == 30


def test_clips_too_short_for_an_eight_frame_vae_are_refused_or_left_out_never_trained_as_stills(clips_dir, caplog):
    """The 6- and 7-frame clips are videos for Wan (5-frame buckets) but not for a VAE 8× in time: they stop the run
    in one line, or with --skip_corrupt_images are left out and counted; none trains at one frame."""
    with pytest.raises(UsageError) as error:
        find_clips(video_args("--train_data_dir", clips_dir, "--num_frames", 9, geometry=EIGHT_IN_TIME), EIGHT_IN_TIME)
    assert "expected readable videos of 9 frames or more: " in str(error.value)
    assert f"{clips_dir / '01.mp4'} (too short: 7 frames sampled, 9 needed)" in str(error.value)
    with caplog.at_level(logging.WARNING, logger="training_utils.data.video"):
        clips = find_clips(video_args("--train_data_dir", clips_dir, "--num_frames", 17, "--skip_corrupt_images",
                                      geometry=EIGHT_IN_TIME), EIGHT_IN_TIME)
    assert [(clip.name.split("/")[-1], len(clip.indices)) for clip in clips] == [
        ("00.mp4", 9), ("02.mp4", 9), ("still.png", 1)]
    assert caplog.messages[-1] == "2 of 5 files left out (--skip_corrupt_images)"


def test_a_folder_gives_clips_with_captions_from_metadata_or_sidecars_and_stills_as_one_frame(clips_dir):
    clips = find_clips(video_args("--train_data_dir", clips_dir, "--num_frames", 9), WAN)
    found = {clip.name.split("/")[-1]: (clip.caption, len(clip.indices), clip.size) for clip in clips}
    assert found == {
        "00.mp4": ("a red circle on a white background", 9, (32, 32)),  # metadata.jsonl
        "01.mp4": ("a blue square on a black background", 5, (32, 32)),  # 7 frames: the 5-frame bucket
        "02.mp4": ("a green triangle on a gray background", 9, (32, 32)),  # sidecar .txt; 12 frames, first 9
        "03.mp4": ("a yellow circle on a black background", 5, (32, 32)),
        "still.png": ("a purple square on a white background", 1, (32, 32)),
    }
    rates = {clip.name.split("/")[-1]: clip.fps for clip in clips}
    assert rates == {"00.mp4": 8.0, "01.mp4": 8.0, "02.mp4": 8.0, "03.mp4": 8.0, "still.png": None}  # written at 8
    # Every other frame: the 7- and 6-frame clips give too few (left out, named in the log), the others 5.
    strided = find_clips(video_args("--train_data_dir", clips_dir, "--num_frames", 9, "--frame_stride", 2,
                                    "--skip_corrupt_images"), WAN)
    assert [(clip.name.split("/")[-1], clip.indices) for clip in strided] == [
        ("00.mp4", [0, 2, 4, 6, 8]), ("02.mp4", [0, 2, 4, 6, 8]), ("still.png", [0])]
    assert [clip.fps for clip in strided] == [4.0, 4.0, None]  # the frame rate the model sees, for its conditioning
    by_rate = find_clips(video_args("--train_data_dir", clips_dir, "--num_frames", 5, "--frame_rate", 4,
                                    "--skip_corrupt_images"), WAN)
    assert {clip.fps for clip in by_rate} == {4.0, None}


def test_frame_buckets_cut_each_clip_to_the_longest_bucket_it_fills_and_refuse_shorter_ones(clips_dir):
    """Clips of 9, 7, 12 and 6 frames and a still, in buckets 5 and 9 (of 4k+1: 1, 5, 9 are the VAE's); then
    buckets 9 and 13, where the 7- and 6-frame clips fill none: named, never trained short or as stills."""
    args = video_args("--train_data_dir", clips_dir, "--frame_buckets", "9,5")
    assert (args.frame_buckets, args.validation_num_frames) == ([5, 9], 9)
    clips = find_clips(args, WAN)
    assert [(clip.name.split("/")[-1], len(clip.indices)) for clip in clips] == [
        ("00.mp4", 9), ("01.mp4", 5), ("02.mp4", 9), ("03.mp4", 5), ("still.png", 1)]
    with pytest.raises(UsageError) as error:
        find_clips(video_args("--train_data_dir", clips_dir, "--frame_buckets", "9,13"), WAN)
    assert "expected readable videos of 9 frames or more: " in str(error.value)
    assert f"{clips_dir / '01.mp4'} (too short: 7 frames sampled, 9 needed)" in str(error.value)
    kept = find_clips(video_args("--train_data_dir", clips_dir, "--frame_buckets", "9,13", "--skip_corrupt_images"),
                      WAN)
    assert [(clip.name.split("/")[-1], len(clip.indices)) for clip in kept] == [
        ("00.mp4", 9), ("02.mp4", 9), ("still.png", 1)]


def test_frame_extraction_spreads_or_slides_windows_over_long_clips_with_their_frame_rates(clips_dir):
    """The 12-frame clip (8 frames a second) at 5 frames: its first 5, 5 spread over all 12 (at 8 · 4/11 frames a
    second), or the windows starting at 0 and 5 (each a sample, captioned alike), or 3 apart."""
    def extracted(*flags):
        args = video_args("--train_data_dir", clips_dir, "--num_frames", 5, *flags)
        return [(clip.indices, clip.fps, clip.caption) for clip in find_clips(args, WAN)
                if clip.name.endswith("02.mp4")]

    caption = "a green triangle on a gray background"
    assert extracted() == [([0, 1, 2, 3, 4], 8.0, caption)]
    assert extracted("--frame_extraction", "uniform") == [([0, 3, 6, 8, 11], 8.0 * 4 / 11, caption)]
    assert extracted("--frame_extraction", "slide") == [([0, 1, 2, 3, 4], 8.0, caption),
                                                        ([5, 6, 7, 8, 9], 8.0, caption)]
    assert [indices[0] for indices, _, _ in extracted("--frame_extraction", "slide", "--frame_extraction_stride", 3)] \
        == [0, 3, 6]
    every_other = extracted("--frame_extraction", "uniform", "--frame_stride", 2, "--skip_corrupt_images")  # 6 at 4/s
    assert every_other == [([0, 2, 6, 8, 10], 4.0 * 4 / 5, caption)]


def test_a_family_that_takes_no_stills_names_them_before_anything_loads(clips_dir):
    videos_only = WAN._replace(stills=False)
    with pytest.raises(UsageError) as error:
        find_clips(video_args("--train_data_dir", clips_dir, "--num_frames", 9, geometry=videos_only), videos_only)
    assert f"{clips_dir / 'still.png'} (a still image: this family trains on videos only)" in str(error.value)
    clips = find_clips(video_args("--train_data_dir", clips_dir, "--num_frames", 9, "--skip_corrupt_images",
                                  geometry=videos_only), videos_only)
    assert [clip.name.split("/")[-1] for clip in clips] == ["00.mp4", "01.mp4", "02.mp4", "03.mp4"]


def test_unreadable_too_short_and_uncaptioned_files_are_named_before_anything_loads(clips_dir, tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    for name in ("00.mp4", "03.mp4"):
        (folder / name).write_bytes((clips_dir / name).read_bytes())
    (folder / "metadata.jsonl").write_text((clips_dir / "metadata.jsonl").read_text().splitlines()[0])
    (folder / "broken.mp4").write_bytes(b"not a video")
    (folder / "broken.txt").write_text("a broken clip")
    write_mp4(folder / "short.mp4", moving_shape("square", "red", "white", 3), fps=8)
    (folder / "short.txt").write_text("a short clip")
    (folder / "03.txt").write_text("a yellow circle")
    with pytest.raises(UsageError) as error:
        find_clips(video_args("--train_data_dir", folder, "--num_frames", 9), WAN)
    assert str(error.value).startswith(f"--train_data_dir={str(folder)!r}: expected readable videos of 5 frames or "
                                       f"more: {folder / 'broken.mp4'} (unreadable: ")
    assert f"{folder / 'short.mp4'} (too short: 3 frames sampled, 5 needed) (--skip_corrupt_images leaves them " \
           "out)" in str(error.value)
    kept = find_clips(video_args("--train_data_dir", folder, "--num_frames", 9, "--skip_corrupt_images"), WAN)
    assert [clip.name.split("/")[-1] for clip in kept] == ["00.mp4", "03.mp4"]
    (folder / "03.txt").unlink()
    with pytest.raises(UsageError) as error:
        find_clips(video_args("--train_data_dir", folder, "--skip_corrupt_images"), WAN)
    assert str(error.value).endswith(f"a caption for every file, in metadata.jsonl or a sidecar .txt "
                                     f"({folder / '03.mp4'} have none)")
    (folder / "03.txt").write_bytes(b"a yellow \xff circle")  # Latin-1, as an old editor saves it
    with pytest.raises(UsageError, match=f"--train_data_dir={str(folder)!r}: expected UTF-8 caption files: "
                                         f"{folder / '03.txt'} is not"):
        find_clips(video_args("--train_data_dir", folder, "--skip_corrupt_images"), WAN)


def test_a_dataset_folder_with_a_video_column_gives_its_clips(clips_dir, tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"clip": str(clips_dir / name), "caption": f"clip {name}"}) + "\n" for name in ("00.mp4", "01.mp4")))
    clips = find_clips(video_args("--dataset_name", tmp_path, "--video_column", "clip", "--caption_column",
                                  "caption", "--num_frames", 5), WAN)
    assert [(clip.caption, len(clip.indices)) for clip in clips] == [("clip 00.mp4", 5), ("clip 01.mp4", 5)]
    with pytest.raises(UsageError) as error:
        find_clips(video_args("--dataset_name", tmp_path, "--caption_column", "caption"), WAN)
    assert str(error.value) == "--video_column='video': expected a column of the dataset: clip, caption"


def test_every_frame_of_a_clip_is_laid_out_alike_and_cached_parameters_follow_the_same_flip(clips_dir):
    clip = find_clips(video_args("--train_data_dir", clips_dir, "--num_frames", 5), WAN)[0]
    transform = VideoTransform(ImageTransform(16, center_crop=True, random_flip=True))
    assert transform.shape_of(clip) == (5, 16, 16)
    flips = []
    for seed in range(8):
        pixels, layout = transform(clip, torch.Generator().manual_seed(seed))
        assert pixels.shape == (3, 5, 16, 16) and -1 <= pixels.min() and pixels.max() <= 1
        frame = np.asarray(read_frames(clip.source, [4])[0].resize((16, 16), 2), dtype=np.float32) / 127.5 - 1
        expected = torch.from_numpy((frame[:, ::-1] if layout.flip else frame).copy()).permute(2, 0, 1)
        torch.testing.assert_close(pixels[:, 4], expected, rtol=0, atol=1e-6)
        cached = clip_sample(clip, transform, torch.Generator().manual_seed(seed),
                             (torch.stack([torch.zeros(1), torch.ones(1)]), (0, 0)))
        flips.append((layout.flip, float(cached)))
    assert {flip for flip, _ in flips} == {False, True} and all(float(flip) == value for flip, value in flips)


def test_a_rendered_video_is_written_as_a_decodable_mp4_and_a_frame_strip(tmp_path):
    frames = np.linspace(0, 1, 5 * 16 * 24 * 3, dtype=np.float32).reshape(5, 16, 24, 3)
    video = RenderedVideo(frames, fps=8)
    video.save(tmp_path / "v.png")
    assert probe(tmp_path / "v.mp4") == (5, 8.0, (24, 16))
    strip = np.asarray(read_frames(tmp_path / "v.png", [0])[0])
    assert strip.shape == (16, 5 * 24, 3) and np.array_equal(strip[:, 24:48], video.frames[1])
    decoded = np.asarray(read_frames(tmp_path / "v.mp4", [2])[0], dtype=np.int16)
    assert np.abs(decoded - video.frames[2]).mean() < 8  # H.264 is lossy


def gradient_video(frames=3, height=4, width=6):
    """A video whose every pixel differs from its neighbours': uint8 ``(frames, height, width, 3)``."""
    values = np.arange(frames * height * width * 3).reshape(frames, height, width, 3)
    return (values * 255 // values.max()).astype(np.uint8)


def test_a_pipelines_frames_read_alike_whatever_its_output_type_and_never_as_one_value():
    """``output_type="pil"`` (a list of PIL frames), ``"np"`` (floats in [0, 1], or uint8) and ``"pt"`` (``(frames,
    3, height, width)`` floats) give the same frames: PIL frames read as floats once came out all white."""
    from PIL import Image

    expected = gradient_video()
    floats = expected.astype(np.float32) / 255
    kinds = {"pil": [Image.fromarray(frame) for frame in expected], "np": floats, "np uint8": expected,
             "pt": torch.from_numpy(floats).permute(0, 3, 1, 2),
             "pil gray": [Image.fromarray(frame[..., 0]) for frame in expected]}
    for kind, video in kinds.items():
        frames = RenderedVideo(video, fps=8).frames
        assert frames.dtype == np.uint8 and len(np.unique(frames)) > 1, kind
        reference = np.repeat(expected[..., :1], 3, -1) if kind == "pil gray" else expected
        assert np.array_equal(frames, reference), kind
    with pytest.raises(ValueError, match="not \\(frames, height, width, channels\\)"):
        video_frames(np.zeros((4, 6, 3)))


def test_a_leading_byte_order_mark_leaves_metadata_and_sidecar_captions_of_clips(clips_dir, tmp_path):
    folder = tmp_path / "bom"
    folder.mkdir()
    for name in ("00.mp4", "02.mp4"):
        (folder / name).write_bytes((clips_dir / name).read_bytes())
    (folder / "metadata.jsonl").write_text('{"file_name": "00.mp4", "text": "sks circle"}\n', encoding="utf-8-sig")
    (folder / "02.txt").write_text("sks triangle", encoding="utf-8-sig")
    clips = find_clips(video_args("--train_data_dir", folder, "--num_frames", 9), WAN)
    assert [clip.caption for clip in clips] == ["sks circle", "sks triangle"]


def test_image_to_video_refuses_clips_of_one_frame_only_and_warns_of_many(clips_dir, tmp_path, caplog):
    stills = tmp_path / "stills"
    stills.mkdir()
    for name in ("still.png", "still.txt"):
        (stills / name).write_bytes((clips_dir / name).read_bytes())
    args = video_args("--train_data_dir", stills, "--num_frames", 9)
    with pytest.raises(UsageError) as error:
        check_image_to_video_clips(find_clips(args, WAN), args, WAN)
    assert str(error.value) == (
        f"--train_data_dir={str(stills)!r}: expected clips of more than one frame for image-to-video: all 1 train at "
        "1 frame (still images), so each sample's conditioning first frame would be its whole target and the model "
        "would learn to copy it")
    one_frame = video_args("--train_data_dir", clips_dir, "--num_frames", 1)
    with pytest.raises(UsageError, match="all 5 train at 1 frame \\(--num_frames=1\\)"):
        check_image_to_video_clips(find_clips(one_frame, WAN), one_frame, WAN)
    (stills / "00.mp4").write_bytes((clips_dir / "00.mp4").read_bytes())
    (stills / "00.txt").write_text("a red circle")
    with caplog.at_level(logging.WARNING, logger="training_utils.data.video"):
        check_image_to_video_clips(find_clips(args, WAN), args, WAN)
    assert caplog.messages == ["1 of 2 clips (50%) are one frame (still images): in those samples the image-to-video "
                               "model learns to copy its conditioning image"]
    caplog.clear()
    check_image_to_video_clips(find_clips(video_args("--train_data_dir", clips_dir, "--num_frames", 9), WAN), args, WAN)
    assert caplog.messages == []  # one still among five clips
