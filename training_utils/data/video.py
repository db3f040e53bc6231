"""Videos as training reads them, with PyAV: clips found and checked before anything loads (`find_clips`), their
frames sampled (`--frame_rate` or `--frame_stride`), cut to their frame bucket (`--frame_extraction`) and laid out
(`VideoTransform`), and their latents cached per clip (`cache_clip_latents`). Validation writes its videos with
`rendered_video`.

What a family's clips may be is its module's ``VIDEO`` (`families.base.VideoGeometry`), which every function here
that needs it takes: nothing here knows a family. The frame counts a run trains at, its frame buckets, are
``--frame_buckets`` (each a count the VAE takes, ``temporal·k + 1``) or, by default, every such count up to
``--num_frames`` (`training_frame_counts`). A clip trains at the longest bucket its sampled frames fill; a video too
short for the shortest (or for the family's ``min_frames``) never trains as a still: it stops the run before
anything loads. A clip is never padded or looped. A still image is a clip of one frame, where the family takes
stills. How a longer clip gives its bucket's frames is ``--frame_extraction`` (`extract_windows`): its first frames
(``head``), frames spread over all of it (``uniform``), or every window of them (``slide``, each window a sample of
its own). Every batch holds clips of one (frames, height, width) shape (`datasets.TrainDataset`'s ``shapes``), so
frame buckets and resolution buckets batch alike. A clip's crop and flip are drawn once per sample for all its
frames, as an image's are. A clip carries the frame rate of its frames, which the family's ``model_inputs`` takes
as ``frame_rate``.
"""

import inspect
import json
import logging
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import UsageError, few, require
from .cache_keys import describe
from .captions import (captions_without_bom, check_captions, check_metadata, is_caption, read_caption_file,
                       without_bom)
from .feature_store import Block, block_bytes, encode_once, encoders_on
from .frozen_encoders import image_source, many, sample_latents
from .images import IMAGE_EXTENSIONS, UNREADABLE_IMAGE_ERRORS, openable, read_image

logger = logging.getLogger(__name__)

VIDEO_EXTENSIONS = {".mp4", ".webm", ".mov", ".gif", ".mkv", ".avi"}
# The share of one-frame clips (stills) in an image-to-video run from which it warns that they teach copying.
ONE_FRAME_WARNING_SHARE = 0.25
# How a clip longer than its frame bucket gives the bucket's frames (`extract_windows`).
EXTRACTIONS = ("head", "uniform", "slide")
# What PyAV and PIL raise for missing, truncated or undecodable files.
UNREADABLE_VIDEO_ERRORS = (*UNREADABLE_IMAGE_ERRORS, ValueError, IndexError)


def add_video_args(parser, pipeline_class, num_frames=None):
    """The video flags: frames per clip (by default what ``pipeline_class`` renders, or ``num_frames`` where its call
    states none, as LTX-2's, which then renders a length of its own), their sampling, the dataset's video column,
    validation length."""
    num_frames = inspect.signature(pipeline_class.__call__).parameters["num_frames"].default or num_frames
    group = parser.add_argument_group("video")
    group.add_argument("--num_frames", type=int, default=num_frames,
                       help=f"frames per training clip (default: the pipeline's, {num_frames}), a count the VAE takes "
                            "(the family's temporal factor times k, plus 1); shorter clips train at the longest such "
                            "count they have")
    group.add_argument("--frame_rate", type=float, default=None,
                       help="sample each video at this many frames a second (default: every frame)")
    group.add_argument("--frame_stride", type=int, default=None, help="sample every N-th frame (default: 1)")
    group.add_argument("--frame_buckets", default=None,
                       help="the frame counts clips train at, comma-separated (e.g. 9,17,33), each a count the VAE "
                            "takes; a clip trains at the longest it fills (default: every such count up to "
                            "--num_frames)")
    group.add_argument("--frame_extraction", choices=EXTRACTIONS, default="head",
                       help="how a clip longer than its bucket gives the bucket's frames: head, its first frames; "
                            "uniform, frames spread evenly from its first to its last (the whole clip, at a lower "
                            "frame rate); slide, every window of them, each a sample of its own (default: head)")
    group.add_argument("--frame_extraction_stride", type=int, default=None,
                       help="with --frame_extraction slide, the sampled frames between one window's start and the "
                            "next's (default: a window's length, so windows do not overlap)")
    group.add_argument("--video_column", default="video", help="the column of --dataset_name holding the videos")
    group.add_argument("--validation_num_frames", type=int, default=None,
                       help="frames per validation video (default: --num_frames, or the longest of --frame_buckets)")
    group.add_argument("--validation_fps", type=int, default=None,
                       help="frame rate of the validation mp4s (default: the family's native rate)")
    group.add_argument("--enable_vae_tiling", action="store_true",
                       help="the VAE encodes and decodes in overlapping tiles: validation videos at full size fit "
                            "where training fits (sides above 256 pixels are tiled)")


def check_video_args(args, geometry):
    """Fail in one line on a bad video flag for a family of ``geometry`` (its ``VIDEO``), before anything loads: a
    frame count its VAE does not take, a size off its multiple; ``--frame_buckets`` becomes a sorted list of counts;
    unset, ``--validation_num_frames`` is the longest bucket given and ``--validation_fps`` the native rate."""
    counts = ", ".join(map(str, geometry.frame_counts()))
    expected = f"a frame count the VAE takes: {geometry.temporal}k+1 ({counts}, ...)"
    for flag, value in (("--num_frames", args.num_frames), ("--validation_num_frames", args.validation_num_frames)):
        require(value is None or geometry.takes(value), flag, value, expected)
    if args.frame_buckets is not None:
        buckets = args.frame_buckets.split(",")
        require(all(bucket.strip().isdigit() for bucket in buckets), "--frame_buckets", args.frame_buckets,
                "frame counts separated by commas, such as 9,17,33")
        args.frame_buckets = sorted({int(bucket) for bucket in buckets})
        wrong = [bucket for bucket in args.frame_buckets if not geometry.takes(bucket)]
        require(not wrong, "--frame_buckets", ",".join(buckets), f"{expected}; {wrong[0] if wrong else ''} is not")
        if args.validation_num_frames is None:
            args.validation_num_frames = args.frame_buckets[-1]
    require(args.frame_extraction_stride is None or args.frame_extraction == "slide", "--frame_extraction_stride",
            args.frame_extraction_stride, "nothing unless --frame_extraction is slide (windows a stride apart)")
    require(args.frame_extraction_stride is None or args.frame_extraction_stride > 0, "--frame_extraction_stride",
            args.frame_extraction_stride, "a positive integer")
    for flag in ("--resolution", "--validation_height", "--validation_width"):
        value = getattr(args, flag[2:], None)
        require(value is None or value % geometry.size_multiple == 0, flag, value,
                f"a multiple of {geometry.size_multiple} (the VAE divides sides by {geometry.spatial}, and the "
                "pipeline takes whole patches)")
    if args.validation_fps is None:
        args.validation_fps = geometry.fps
    require(args.frame_rate is None or args.frame_rate > 0, "--frame_rate", args.frame_rate, "a positive number")
    require(args.frame_stride is None or args.frame_stride > 0, "--frame_stride", args.frame_stride,
            "a positive integer")
    require(args.frame_rate is None or args.frame_stride is None, "--frame_rate/--frame_stride",
            f"{args.frame_rate}/{args.frame_stride}", "one of the two")
    require(args.validation_fps > 0, "--validation_fps", args.validation_fps, "a positive integer")


def is_still(source):
    """Whether ``source`` (a path, or datasets' ``{"path", "bytes"}``) is a still image."""
    path = source["path"] if isinstance(source, dict) else source
    return Path(path or "").suffix.lower() in IMAGE_EXTENSIONS


def probe(source):
    """``(frame count, frames a second, (width, height))`` of a video (its rate None where the file states none),
    or ``(1, None, size)`` of a still image; raises one of `UNREADABLE_VIDEO_ERRORS` for a file that cannot be
    read."""
    if is_still(source):
        return 1, None, read_image(source if isinstance(source, dict) else str(source)).size
    import av

    with av.open(openable(source)) as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else None
        count = sum(1 for _ in container.decode(stream))
        return count, fps, (stream.codec_context.width, stream.codec_context.height)


def frame_indices(count, fps, frame_rate=None, frame_stride=None):
    """The indices of the frames sampled from a video of ``count`` frames at ``fps``: every ``frame_stride``-th,
    or one every ``1 / frame_rate`` seconds (the frame shown at that time), or every frame."""
    if frame_rate is not None and fps:
        step = fps / frame_rate
        return [int(k * step + 1e-6) for k in range(int((count - 1) / step + 1e-6) + 1)]
    return list(range(0, count, frame_stride or 1))


def training_frame_counts(args, geometry):
    """The frame buckets: ``--frame_buckets``, or every count the VAE takes from a video's fewest frames up to
    ``--num_frames`` (`VideoGeometry.counts_up_to`), shortest first."""
    return args.frame_buckets or geometry.counts_up_to(args.num_frames)


def extract_windows(indices, frames, extraction="head", stride=None):
    """The frame windows, of ``frames`` frames each, that a clip of sampled frames ``indices`` trains on:

    - ``head``: its first ``frames``;
    - ``uniform``: ``frames`` spread evenly from its first to its last (the nearest sampled frame to each even
      step), so the window spans the whole clip;
    - ``slide``: every window of ``frames`` consecutive sampled frames starting ``stride`` apart (by default
      ``frames``: windows side by side), the last frames that fill no window left out.
    """
    if extraction == "head" or frames == 1 or frames == len(indices):
        return [indices[:frames]]
    if extraction == "uniform":
        span = len(indices) - 1
        return [[indices[(2 * k * span + frames - 1) // (2 * (frames - 1))] for k in range(frames)]]
    step = stride or frames
    return [indices[start:start + frames] for start in range(0, len(indices) - frames + 1, step)]


def window_rate(rate, indices, window):
    """The frames a second of ``window``'s frames, taken from sampled frames ``indices`` at ``rate``: ``rate``, or
    lower when the window spreads them over more of the clip (``uniform``)."""
    if rate is None or len(window) < 2:
        return rate
    spanned = indices.index(window[-1]) - indices.index(window[0])
    return rate * (len(window) - 1) / spanned


def sampled_rate(fps, frame_rate=None, frame_stride=None):
    """The frames a second of frames sampled as `frame_indices` samples them from a video at ``fps``: ``frame_rate``,
    or ``fps`` over the stride; None where the file states no rate."""
    if not fps:
        return None
    return float(frame_rate) if frame_rate is not None else fps / (frame_stride or 1)


def read_frames(source, indices):
    """The frames ``indices`` of a video (or a still image, index 0) as upright RGB PIL images."""
    if is_still(source):
        return [read_image(source if isinstance(source, dict) else str(source))]
    import av

    wanted, frames = set(indices), {}
    with av.open(openable(source)) as container:
        for index, frame in enumerate(container.decode(container.streams.video[0])):
            if index in wanted:
                frames[index] = frame.to_image().convert("RGB")
            if index >= max(indices):
                break
    missing = [index for index in indices if index not in frames]
    if missing:
        raise ValueError(f"frame {missing[0]} of {source!r} could not be decoded")
    return [frames[index] for index in indices]


class Clip(NamedTuple):
    """A training clip: its file (path or ``{"path", "bytes"}``), caption, the frames sampled from it, its original
    (width, height), and the frames a second of its sampled frames (`sampled_rate`; None for a still image or a file
    stating no rate), which the family's ``model_inputs`` takes as ``frame_rate``."""

    source: object
    caption: object
    indices: list
    size: tuple
    fps: object = None

    @property
    def name(self):
        return self.source["path"] if isinstance(self.source, dict) else str(self.source)


def _folder_rows(folder):
    """``[(path, caption or None)]`` of a folder of videos and images: captions from ``metadata.jsonl``
    (``file_name``, ``text``) where it lists the file, else from a sidecar ``.txt`` beside it, else, in upstream's
    Cosmos layout (``videos/<name>.mp4`` beside ``metas/<name>.txt``), from its ``metas`` file."""
    captions = {}
    for metadata in sorted(folder.rglob("metadata.jsonl")):
        check_metadata(metadata, "--train_data_dir", str(folder), "text")
        for line in metadata.read_text(encoding="utf-8-sig").splitlines():
            if line.strip():
                row = json.loads(line)
                captions[(metadata.parent / row["file_name"]).resolve()] = without_bom(row.get("text"))
    rows = []
    for path in sorted(folder.rglob("*")):
        if path.suffix.lower() in VIDEO_EXTENSIONS | IMAGE_EXTENSIONS:
            caption = captions.get(path.resolve())
            for sidecar in (path.with_suffix(".txt"), path.parent.parent / "metas" / f"{path.stem}.txt"):
                if caption is None:
                    caption = read_caption_file(sidecar, "--train_data_dir", str(folder))
            rows.append((path, caption))
    return rows


def find_clips(args, geometry):
    """The training clips of ``--train_data_dir`` (videos and still images, captions from ``metadata.jsonl`` or
    sidecar ``.txt`` files) or ``--dataset_name`` (``--video_column``, ``--caption_column``), each probed: a file
    that cannot be read, a video giving fewer frames than the shortest bucket (or than the family's
    ``geometry.min_frames``: too short to be a video for its VAE), or a still image where the family takes none,
    stops the run in one line naming it, before any weights load (with ``--skip_corrupt_images``, a warning names
    them and they are left out). Each video gives the windows of its bucket's frames that ``--frame_extraction``
    cuts (`extract_windows`), each a clip."""
    if (args.dataset_name is None) == (args.train_data_dir is None):
        raise UsageError("--dataset_name/--train_data_dir", args.dataset_name or args.train_data_dir,
                         "exactly one of the two")
    if args.train_data_dir is not None:
        folder = Path(args.train_data_dir)
        require(folder.is_dir(), "--train_data_dir", args.train_data_dir, "an existing folder")
        rows = _folder_rows(folder)
        require(rows, "--train_data_dir", args.train_data_dir, "a folder holding videos or images")
        uncaptioned = [str(path) for path, caption in rows if not is_caption(caption)]
        require(not uncaptioned, "--train_data_dir", args.train_data_dir,
                f"a caption for every file, in metadata.jsonl or a sidecar .txt ({few(uncaptioned, 3)} have none)")
    else:
        rows = _dataset_rows(args)
    if args.max_train_samples is not None:
        rows = rows[:args.max_train_samples]
    flag, value = data_flag(args)
    buckets = training_frame_counts(args, geometry)
    fewest = max(geometry.min_frames, buckets[0])
    clips, bad = [], []
    for source, caption in rows:
        try:
            count, fps, size = probe(source)
        except UNREADABLE_VIDEO_ERRORS as error:
            bad.append(f"{_name(source)} (unreadable: {type(error).__name__}: {error})")
            continue
        if is_still(source):
            if geometry.stills:
                clips.append(Clip(source, caption, [0], size))
            else:
                bad.append(f"{_name(source)} (a still image: this family trains on videos only)")
            continue
        indices = frame_indices(count, fps, args.frame_rate, args.frame_stride)
        if len(indices) < fewest:
            bad.append(f"{_name(source)} (too short: {len(indices)} frames sampled, {fewest} needed)")
            continue
        rate = sampled_rate(fps, args.frame_rate, args.frame_stride)
        frames = max(bucket for bucket in buckets if bucket <= len(indices))
        clips.extend(Clip(source, caption, window, size, window_rate(rate, indices, window))
                     for window in extract_windows(indices, frames, args.frame_extraction,
                                                   args.frame_extraction_stride))
    if bad and not args.skip_corrupt_images:
        raise UsageError(flag, value, f"readable videos of {fewest} frames or more: {few(bad, 3)} "
                         "(--skip_corrupt_images leaves them out)")
    for line in bad:
        logger.warning(f"left out: {line}")
    if bad:
        logger.warning(f"{len(bad)} of {len(rows)} files left out (--skip_corrupt_images)")
    require(clips, flag, value, "at least one readable clip")
    return clips


def data_flag(args):
    """``(flag, value)`` of where the clips come from, for messages."""
    return ("--train_data_dir", args.train_data_dir) if args.train_data_dir else ("--dataset_name", args.dataset_name)


def check_image_to_video_clips(clips, args, geometry):
    """Stop in one line if no clip trains at more than one latent frame (still images, or ``--num_frames 1``): the
    first frame conditions an image-to-video sample, so a one-latent-frame sample's target is its conditioning
    and the model learns to copy its image. Warn in one line when such clips are `ONE_FRAME_WARNING_SHARE` or more
    of them."""
    one_frame = sum((len(clip.indices) - 1) // geometry.temporal == 0 for clip in clips)
    flag, value = data_flag(args)
    cause = "--num_frames=1" if args.num_frames == 1 else "still images"
    require(one_frame < len(clips), flag, value, f"clips of more than one frame for image-to-video: all {len(clips)} "
            f"train at 1 frame ({cause}), so each sample's conditioning first frame would be its whole target and "
            "the model would learn to copy it")
    if one_frame >= ONE_FRAME_WARNING_SHARE * len(clips):
        logger.warning(f"{one_frame} of {len(clips)} clips ({one_frame / len(clips):.0%}) are one frame (still "
                       "images): in those samples the image-to-video model learns to copy its conditioning image")


def _name(source):
    return source["path"] if isinstance(source, dict) else str(source)


def _dataset_rows(args):
    from datasets import load_dataset

    try:
        dataset = load_dataset(args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir)["train"]
    except (FileNotFoundError, ValueError, ConnectionError, KeyError) as error:
        raise UsageError("--dataset_name", args.dataset_name, f"a loadable dataset with a train split ({error})") \
            from None
    for flag, column in (("--video_column", args.video_column), ("--caption_column", args.caption_column)):
        require(column in dataset.column_names, flag, column,
                f"a column of the dataset: {', '.join(dataset.column_names)}")
    check_captions(dataset, args.caption_column)
    dataset = captions_without_bom(dataset, args.caption_column)
    feature = dataset.features[args.video_column]
    if hasattr(feature, "decode"):  # datasets' Video or Image feature: read the files with PyAV, not its decoders
        dataset = dataset.cast_column(args.video_column, type(feature)(decode=False))
    root = Path(args.dataset_name)
    return [(value if isinstance(value, dict) or not root.is_dir() else str(root / value), caption)
            for value, caption in zip(dataset[args.video_column], dataset[args.caption_column])]


class VideoTransform:
    """A clip's frames resized to cover its training shape, cropped and maybe flipped, one layout for every frame
    (drawn as `images.ImageTransform` draws an image's), as a ``(3, frames, height, width)`` tensor in [-1, 1]."""

    def __init__(self, image_transform):
        self.images = image_transform

    def shape_of(self, clip):
        """The (frames, height, width) ``clip`` trains at."""
        return (len(clip.indices), *self.images.shape_of(*clip.size))

    def __call__(self, clip, generator, crop=None, flip=None):
        frames = read_frames(clip.source, clip.indices)
        layout = self.images.draw_layout(*clip.size, generator, crop=crop, shape=self.shape_of(clip)[1:])
        if flip is not None:
            layout = layout._replace(flip=flip)
        pixels = [torch.from_numpy(self.images.apply_layout(frame, layout) / 127.5 - 1.0) for frame in frames]  # HWC
        return torch.stack(pixels).permute(3, 0, 1, 2).contiguous(), layout


def clip_latent_encoder(clips, transform, vae, device, dtype, seed):
    """``encode_chunk(indices)`` for `feature_store.encode_once`: each clip's latent parameters, unflipped and
    (with ``--random_flip``) flipped, with the crop drawn once from ``seed`` and the clip's place."""
    flips = [False, True] if transform.images.random_flip else [False]

    def encode_chunk(indices):
        parameters, crops = [], []
        for index in indices:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
            pixels, layout = transform(clips[index], generator, flip=False)
            crops.append((layout.top, layout.left))
            videos = torch.stack([pixels.flip(-1) if flip else pixels for flip in flips]).to(device, dtype)
            parameters.append(vae.encode(videos).latent_dist.parameters.cpu())
        return Block(torch.tensor(indices, dtype=torch.int64),
                     {"parameters": torch.stack(parameters), "crops": torch.tensor(crops)}, {})

    return encode_chunk


def cache_clip_latents(frozen, clips, transform, shapes):
    """``[(latent parameters per flip, crop)]`` for every clip, encoded once by ``frozen``'s VAE (in memory, or
    with ``--feature_cache_dir`` on disk), a store per training shape."""
    by_shape = {}
    for index, shape in enumerate(shapes):
        by_shape.setdefault(shape, []).append(index)
    cached = [None] * len(clips)
    for shape, indices in sorted(by_shape.items()):
        group = [clips[index] for index in indices]
        store = frozen.store("latents", {
            "vae": describe(frozen.vae), "clips": many([(image_source(c.source), c.indices) for c in group], "clips"),
            "transform": f"{'x'.join(map(str, shape))} {'center' if transform.images.center_crop else 'random'} crop, "
                         f"flips {transform.images.random_flip}, {transform.images.interpolation} resize"})
        encode_chunk = clip_latent_encoder(group, transform, frozen.vae, frozen.device, frozen.dtype, frozen.seed)
        blocks = encode_once(f"latents {'x'.join(map(str, shape))}", len(group), encode_chunk,
                             lambda: block_bytes(encode_chunk([0])), lambda: encoders_on(frozen.device, [frozen.vae]),
                             1, store)
        for block in blocks:
            for row, position in enumerate(block.indices.tolist()):
                cached[indices[position]] = (block.tensors["parameters"][row],
                                             tuple(block.tensors["crops"][row].tolist()))
    return cached


def clip_sample(clip, transform, generator, cached=None):
    """A sample's video: pixels, or from ``cached`` (`cache_clip_latents`) the latent parameters of the flip drawn,
    the draws taken from ``generator`` exactly as the pixels' would be."""
    if cached is None:
        return transform(clip, generator)[0]
    parameters, crop = cached
    layout = transform.images.draw_layout(*clip.size, generator, crop=crop, shape=transform.shape_of(clip)[1:])
    return parameters[int(layout.flip)]


def clip_sample_with_first_frame(clip, transform, generator, cached=None):
    """`clip_sample` and the clip's first frame laid out as its frames are (``(3, height, width)`` in [-1, 1]), the
    image that conditions an image-to-video model."""
    if cached is None:
        pixels = transform(clip, generator)[0]
        return pixels, pixels[:, 0]
    parameters, crop = cached
    layout = transform.images.draw_layout(*clip.size, generator, crop=crop, shape=transform.shape_of(clip)[1:])
    first = transform.images.apply_layout(read_frames(clip.source, clip.indices[:1])[0], layout) / 127.5 - 1.0
    return parameters[int(layout.flip)], torch.from_numpy(first).permute(2, 0, 1).contiguous()


def clip_latents(frozen, videos):
    """A batch's VAE latents: drawn from cached parameters, or encoded now (`frozen_encoders.FrozenEncoders.latents`)."""
    if frozen.cache_latents:
        return sample_latents(videos).contiguous()
    return frozen.latents(videos)
