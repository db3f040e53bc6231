"""Upstream CogVideoX's data layout, read into the clip folder that `video.find_clips` reads: ``--instance_data_root``
holding a file of prompts and a file of video paths (relative to the folder), one a line, named by
``--caption_column`` and ``--video_column`` (``prompts.txt``, ``videos.txt`` in upstream's README); or a local
``--dataset_name`` whose ``--video_column`` holds paths relative to it (upstream passes the folder as both). And
``--id_token``, put in front of every caption (`with_id_token`).

The lists are checked before anything loads, then laid out as a folder of links to the videos with a sidecar caption
each (`video_list_folder`), at a path that depends only on what the lists say, so that cached latents and resumed
runs find the same clips; the user's folder is never written to. `find_listed_clips` finds the clips, its messages
naming the lists' videos.
"""

import argparse
import hashlib
import os
import tempfile
from pathlib import Path

from ..errors import UsageError, require
from .video import find_clips


RESHAPE_MODES = ("center", "random", "none")
SKIPPED_FRAMES = ("each clip trains from its first frame (the clip reader shared by every video script, "
                  "training_utils/data/video.py, starts there): cut intros and outros out of the files")


def add_video_list_args(parser, video_reshape_mode="center"):
    """Upstream's data flags: its layout, and its names for the clips' size and length (``video_reshape_mode``:
    its default, where its script has the flag)."""
    group = parser.add_argument_group("upstream CogVideoX data")
    group.add_argument("--instance_data_root", default=None,
                       help="a folder holding --caption_column (a file of prompts, one a line) and --video_column (a "
                            "file of video paths relative to the folder, one a line), instead of --train_data_dir; "
                            "with --dataset_name, that dataset's local folder")
    group.add_argument("--id_token", default=None, help="a token put in front of every caption (e.g. a style's name)")
    group.add_argument("--height", type=int, default=None,
                       help="train every clip at this height (with --width; default: --resolution square)")
    group.add_argument("--width", type=int, default=None, help="train every clip at this width (with --height)")
    group.add_argument("--video_reshape_mode", choices=RESHAPE_MODES, default=video_reshape_mode,
                       help="where clips are cropped to --height×--width: the centre, or anywhere (random; none is "
                            "upstream's other name for it)")
    group.add_argument("--max_num_frames", dest="num_frames", type=int, default=argparse.SUPPRESS,
                       help="upstream's --num_frames")
    for flag in ("--skip_frames_start", "--skip_frames_end"):
        group.add_argument(flag, type=int, default=0, help=f"0 only: {SKIPPED_FRAMES}")


def fill_video_list_args(args, geometry):
    """Upstream's size flags in the shared ones, before the shared checks: ``--height``/``--width`` (multiples of
    the family's ``geometry.size_multiple``) as the one resolution bucket and the validation size,
    ``--video_reshape_mode`` as ``--center_crop``; its frame skips refused unless 0."""
    for flag in ("--skip_frames_start", "--skip_frames_end"):
        require(getattr(args, flag[2:]) == 0, flag, getattr(args, flag[2:]), f"0: {SKIPPED_FRAMES}")
    require((args.height is None) == (args.width is None), "--height/--width", f"{args.height}/{args.width}",
            "both or neither")
    if args.height is not None:
        multiple = geometry.size_multiple
        require(args.height > 0 and args.width > 0 and args.height % multiple == 0 and args.width % multiple == 0,
                "--height/--width", f"{args.height}/{args.width}", f"positive multiples of {multiple} (the VAE "
                f"divides sides by {geometry.spatial}, and the transformer takes whole patches)")
        args.aspect_ratio_buckets = [(args.height, args.width)]
        args.validation_height = args.validation_height or args.height
        args.validation_width = args.validation_width or args.width
    if args.video_reshape_mode is not None:
        args.center_crop = args.video_reshape_mode == "center"


def check_video_list_args(args):
    """Fail in one line on upstream's layout that cannot be read, before anything loads: a missing folder or list,
    lists of different lengths, a video that is not there; with ``--dataset_name``, a root that is not its folder."""
    if args.instance_data_root is None:
        return
    root = Path(args.instance_data_root)
    require(root.is_dir(), "--instance_data_root", args.instance_data_root, "an existing folder")
    require(args.train_data_dir is None, "--instance_data_root/--train_data_dir",
            f"{args.instance_data_root}/{args.train_data_dir}", "one of the two")
    if args.dataset_name is not None:
        require(Path(args.dataset_name).resolve() == root.resolve(), "--instance_data_root", args.instance_data_root,
                f"the folder of --dataset_name ({args.dataset_name}), which its --video_column's paths are relative "
                "to here (a hub dataset's videos: download the dataset to a folder and pass it as both)")
        return
    prompts, videos = video_lists(args)
    require(len(prompts) == len(videos), "--caption_column/--video_column", f"{args.caption_column}/"
            f"{args.video_column}", f"as many prompts as videos ({len(prompts)} prompts, {len(videos)} videos)")
    missing = [str(video) for video in videos if not video.is_file()]
    require(not missing, "--video_column", args.video_column,
            f"paths of video files relative to --instance_data_root ({', '.join(missing[:3])} are not there)")


def read_lines(root, name, flag, what):
    path = root / name
    require(path.is_file(), flag, name, f"a file in --instance_data_root listing {what}, one a line")
    return [line.strip() for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]


def video_lists(args):
    """``(prompts, video paths)`` of ``--instance_data_root``'s lists, blank lines left out, as upstream reads them."""
    root = Path(args.instance_data_root)
    prompts = read_lines(root, args.caption_column, "--caption_column", "the prompts")
    videos = [root / line for line in read_lines(root, args.video_column, "--video_column", "the videos' paths")]
    return prompts, videos


def video_list_layout(args):
    """``(folder, [(link, video, prompt)])``: where `video_list_folder` lays out ``--instance_data_root``'s lists (a
    temporary folder named by the lists' content) and what it puts there, a link to each video and its caption,
    named by its place in the lists."""
    prompts, videos = video_lists(args)
    key = hashlib.blake2b("\n".join(f"{video.resolve()}\t{prompt}" for prompt, video in zip(prompts, videos))
                          .encode(), digest_size=8).hexdigest()
    folder = Path(tempfile.gettempdir()) / f"instance-data-{key}"
    return folder, [(folder / f"{index:06d}{video.suffix.lower()}", video, prompt)
                    for index, (prompt, video) in enumerate(zip(prompts, videos))]


def video_list_folder(args):
    """The clip folder of ``--instance_data_root``'s lists (`check_video_list_args` passed), laid out as
    `video_list_layout` says. Each file is written whole (a link or caption is replaced, never half-written), so
    processes writing it at once agree."""
    folder, files = video_list_layout(args)
    folder.mkdir(exist_ok=True)
    for link, video, prompt in files:
        partial = folder / f".{link.stem}.{os.getpid()}"
        os.symlink(video.resolve(), partial)
        os.replace(partial, link)
        partial.write_text(prompt + "\n", encoding="utf-8")
        os.replace(partial, link.with_suffix(".txt"))
    return str(folder)


def find_listed_clips(args, geometry):
    """`video.find_clips` with ``--id_token`` (`with_id_token`), whose messages about upstream's lists name
    ``--instance_data_root`` and the listed videos, not the folder they are laid out in."""
    try:
        clips = find_clips(args, geometry)
    except UsageError as error:
        if args.instance_data_root is None or args.dataset_name is not None:
            raise
        folder, files = video_list_layout(args)
        message = str(error).replace(f"--train_data_dir={str(folder)!r}",
                                     f"--instance_data_root={args.instance_data_root!r}")
        for link, video, _ in files:
            message = message.replace(str(link), str(video))
        raise UsageError(None, None, message) from None
    return with_id_token(clips, args.id_token)


def with_id_token(clips, id_token):
    """``clips`` (`video.Clip`) with ``id_token`` and a space in front of each caption (each of a list)."""
    if not id_token:
        return clips

    def tokened(caption):
        return [tokened(text) for text in caption] if isinstance(caption, list) else f"{id_token} {caption}"

    return [clip._replace(caption=tokened(clip.caption)) for clip in clips]
