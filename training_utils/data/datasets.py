"""Datasets, captions and data loaders (the image transforms are `images`').

Randomness in preprocessing (crops, flips, caption choice) comes from a generator seeded by
(seed, epoch, sample index), never from the global RNG: the loader prefetches ahead of the
training step, so global draws would make a resumed run see different augmentations.

An image that cannot be read does not raise inside the loader (where the error would surface a
batch early, in a worker, on one process only): `TrainDataset` names its file and puts the next
readable sample in its place, and the batch comes out as a `BatchWithUnreadable` that the training
loop either stops on or counts (``--skip_corrupt_images``). Which sample replaces which depends on
the index and the files alone, so a resumed run skips exactly as the uninterrupted one did.
"""

import io
import itertools
import logging
import os
import random
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from ..errors import UsageError
from .buckets import BucketBatchSampler
from .captions import captions_without_bom, check_captions, check_metadata
from .images import IMAGE_EXTENSIONS, UNREADABLE_IMAGE_ERRORS, image_sizes

logger = logging.getLogger(__name__)

# How far past an unreadable sample to look for a readable one to take its place.
SUBSTITUTE_SEARCH_LIMIT = 32
# The flags naming a column of one image a row (an edit's --cond_image_column, which may hold lists, checks its own).
IMAGE_COLUMN_FLAGS = {"--image_column", "--conditioning_image_column",
                      "--edited_image_column", "--original_image_column"}  # InstructPix2Pix's


def load_train_dataset(args, columns):
    """The training split of ``--dataset_name`` or ``--train_data_dir``, checked to have ``columns`` and, in the
    ``--caption_column`` one, a caption in every row (`captions`).

    Reads metadata only, so it runs before any weights load and a wrong column fails in seconds.
    """
    from datasets import load_dataset

    jsonl = getattr(args, "jsonl_for_train", None)
    if jsonl is not None:
        return checked_dataset(args, columns, "--jsonl_for_train", jsonl, jsonl_dataset(args, jsonl))
    if (args.dataset_name is None) == (args.train_data_dir is None):
        raise UsageError("--dataset_name/--train_data_dir", args.dataset_name or args.train_data_dir,
                         "exactly one of the two")
    if args.train_data_dir is not None:
        data_dir = Path(args.train_data_dir)
        if not data_dir.is_dir():
            raise UsageError("--train_data_dir", args.train_data_dir, "an existing folder")
        if not any(p.suffix.lower() in IMAGE_EXTENSIONS for p in data_dir.rglob("*")):
            raise UsageError("--train_data_dir", args.train_data_dir, "a folder holding images")
    flag, value = ("--train_data_dir", args.train_data_dir) if args.train_data_dir else ("--dataset_name",
                                                                                         args.dataset_name)
    if Path(value).is_dir():  # an imagefolder, or a dataset folder that may be one
        for metadata in sorted(Path(value).rglob("metadata.jsonl")):
            check_metadata(metadata, flag, value, columns.get("--caption_column"))
    if args.train_data_dir is not None:
        dataset = load_dataset("imagefolder", data_dir=str(data_dir), cache_dir=args.cache_dir)
    else:
        try:
            dataset = load_dataset(args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir)
        except (FileNotFoundError, ValueError, ConnectionError) as error:
            raise UsageError("--dataset_name", args.dataset_name, f"a loadable dataset ({error})") from None
    if "train" not in dataset:
        raise UsageError("--dataset_name", args.dataset_name, f"a dataset with a train split, not {list(dataset)}")
    return checked_dataset(args, columns, flag, value, dataset["train"])


def jsonl_dataset(args, path):
    """The rows of a JSON Lines file (``--jsonl_for_train``, upstream's flag for a dataset of one file, its image
    paths absolute or relative to the working directory), alone among the data sources."""
    from datasets import load_dataset

    if args.dataset_name is not None or args.train_data_dir is not None:
        raise UsageError("--jsonl_for_train", path, "no --dataset_name or --train_data_dir beside it")
    if not Path(path).is_file():
        raise UsageError("--jsonl_for_train", path, "an existing JSON Lines file")
    try:
        return load_dataset("json", data_files={"train": str(path)}, cache_dir=args.cache_dir)["train"]
    except Exception as error:  # datasets wraps the JSON reader's errors in its own
        raise UsageError("--jsonl_for_train", path, f"a JSON Lines file, one JSON object a line ({error})") from None


def checked_dataset(args, columns, flag, value, dataset):
    """``dataset`` (read from ``flag``'s ``value``) checked to have ``columns``, at most ``--max_train_samples`` rows,
    its image columns images and its captions captions."""
    for flag_name, column in columns.items():
        if column not in dataset.column_names:
            raise UsageError(flag_name, column, f"a column of the dataset: {', '.join(dataset.column_names)}")
    if len(dataset) == 0:
        raise UsageError(flag, value, "a dataset with at least one example")
    if args.max_train_samples is not None:
        dataset = dataset.select(range(min(args.max_train_samples, len(dataset))))
    for image_flag in IMAGE_COLUMN_FLAGS.intersection(columns):
        dataset = images_in_column(dataset, image_flag, columns[image_flag],
                                   Path(value) if Path(value).is_dir() else None)
    if "--caption_column" in columns:
        check_captions(dataset, columns["--caption_column"])
        dataset = captions_without_bom(dataset, columns["--caption_column"])
    return dataset


def images_in_column(dataset, flag, column, folder=None):
    """``dataset`` with ``column`` holding images: datasets' Image feature, or strings naming image files (relative
    to ``folder``, a local dataset's, where given), which become that feature. Any other column (captions, say) stops
    the run in one line naming its first row that is no image file; no image is decoded."""
    import datasets

    feature = dataset.features[column]
    if isinstance(feature, datasets.Image):
        return dataset
    values = list(dataset[column]) if getattr(feature, "dtype", None) in ("string", "large_string") else []
    paths = [Path(folder or "", value) if isinstance(value, str) else Path() for value in values]
    problem = next((index for index, path in enumerate(paths)
                    if path.suffix.lower() not in IMAGE_EXTENSIONS or not path.is_file()), None)
    if not values or problem is not None:
        found = f"row {problem} has {values[problem]!r}" if values else f"it holds {feature}"
        raise UsageError(flag, column, f"a column of images (or of image files' paths): {found}")
    paths = [str(path) for path in paths]
    return dataset.remove_columns(column).add_column(column, paths).cast_column(column, datasets.Image())


def sample_generator(seed, epoch, index):
    """A generator private to one sample of one epoch."""
    return torch.Generator().manual_seed(hash((seed, epoch, index)) & 0x7FFF_FFFF_FFFF_FFFF)


def pick_caption(value, generator, flag="--caption_column"):
    """A caption from a string or a list of strings (one drawn at random, as for multi-caption data)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value:
        return value[int(torch.randint(0, len(value), (1,), generator=generator))]
    raise UsageError(flag, value, "captions that are strings or lists of strings")


def dropped(probability, generator):
    """Whether a sample's caption is dropped (``--caption_dropout``, for classifier-free guidance): True with
    ``probability``, drawn from the sample's generator only when ``probability`` is positive."""
    return bool(probability > 0 and torch.rand((), generator=generator) < probability)


def drop_caption(caption, probability, generator):
    """The empty prompt if the caption is `dropped`, else ``caption``."""
    return "" if dropped(probability, generator) else caption


def captions_with_empty(values, caption_dropout):
    """``values`` (captions, or lists of them) and, with ``caption_dropout``, the empty prompt that it draws, so
    that its embedding is computed once, with the others."""
    return [*values, ""] if caption_dropout > 0 else list(values)


def dataset_shapes(transform, dataset, column):
    """With aspect-ratio buckets, the training shape (`ImageTransform.shape_of`) of each image in ``column`` of a
    `datasets.Dataset`, read from the images' headers; None without."""
    if transform.buckets is None:
        return None
    import datasets

    undecoded = dataset.select_columns(column).cast_column(column, datasets.Image(decode=False))
    return transform.shapes(image_sizes(row[column] for row in undecoded))


def stack_collate(examples):
    """Batch a list of ``{name: value}`` samples into ``{name: batch}``: tensors stacked, anything else (a prompt)
    listed."""
    return {key: torch.stack(values) if isinstance(values[0], torch.Tensor) else values
            for key, values in ((key, [example[key] for example in examples]) for key in examples[0])}


class TrainDataset(torch.utils.data.Dataset):
    """A map-style dataset that runs ``preprocess(example, generator)`` with a per-sample generator.

    ``examples`` is a `datasets.Dataset` or a list of dicts (e.g. of image paths), seen ``repeats`` times an
    epoch (``--repeats``: each repeat a sample of its own, with its own draws). ``shapes``, with aspect-ratio
    buckets, gives each example's training (height, width): `make_dataloader` then batches by bucket. A sample
    whose image cannot be read comes back as an `UnreadableSample` naming its file(s) and carrying the next
    readable sample of the same shape; `make_dataloader`'s collate turns it into a `BatchWithUnreadable`.
    ``set_epoch`` is called by accelerate's loader at the start of each epoch.
    """

    def __init__(self, examples, preprocess, seed, repeats=1, shapes=None):
        self.examples = examples
        self.preprocess = preprocess
        self.seed = seed
        self.repeats = repeats
        self.shapes = shapes
        self.epoch = 0
        self._undecoded_examples = None

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.examples) * self.repeats

    def shape_of(self, index):
        return None if self.shapes is None else self.shapes[index % len(self.examples)]

    def __getitem__(self, index):
        try:
            return self._load(index)
        except UNREADABLE_IMAGE_ERRORS as error:
            reason = f"{type(error).__name__}: {error}"
        return UnreadableSample(self.source_of(index), reason, self._substitute(index))

    def _load(self, index):
        return self.preprocess(self.examples[index % len(self.examples)],
                               sample_generator(self.seed, self.epoch, index))

    def _substitute(self, index):
        """The next readable sample of the same shape after ``index`` (wrapping around), or None within the
        search limit."""
        candidates = ((index + offset) % len(self) for offset in range(1, len(self)))
        same_shape = (other for other in candidates if self.shape_of(other) == self.shape_of(index))
        for other in itertools.islice(same_shape, SUBSTITUTE_SEARCH_LIMIT):
            try:
                return self._load(other)
            except UNREADABLE_IMAGE_ERRORS:
                continue
        return None

    def source_of(self, index):
        """The image file(s) of sample ``index``: those that fail to open if that can be told, else all."""
        row = self._undecoded()[index % len(self.examples)]
        values = row.values() if isinstance(row, dict) else [row]
        images = [value for value in values if _image_reference(value) is not None]
        names = [_image_reference(value) or f"row {index}" for value in images]
        unreadable = [name for name, value in zip(names, images) if not _opens(value)]
        return ", ".join(unreadable or names) or f"sample {index}"

    def _undecoded(self):
        # datasets decodes images on row access; the same rows with decoding off give {"path", "bytes"}.
        if self._undecoded_examples is None:
            examples = self.examples
            features = getattr(examples, "features", None) or {}
            import datasets

            for column, feature in features.items():
                if isinstance(feature, datasets.Image):
                    examples = examples.cast_column(column, datasets.Image(decode=False))
            self._undecoded_examples = examples
        return self._undecoded_examples


def _image_reference(value):
    """A printable name for a value that refers to an image (a path, or datasets' undecoded dict), else None."""
    if isinstance(value, dict) and value.keys() >= {"path", "bytes"}:
        return value["path"] or ""
    if isinstance(value, (str, os.PathLike)) and Path(value).suffix.lower() in IMAGE_EXTENSIONS:
        return str(value)
    return None


def _opens(value):
    if isinstance(value, dict):
        value = io.BytesIO(value["bytes"]) if value["bytes"] else value["path"]
    try:
        with Image.open(value) as image:
            image.load()
        return True
    except UNREADABLE_IMAGE_ERRORS:
        return False


class UnreadableSample(NamedTuple):
    """A sample whose image could not be read: its file(s), why, and the sample taking its place (or None)."""

    source: str
    reason: str
    substitute: object


class BatchWithUnreadable(NamedTuple):
    """A batch in which unreadable samples were replaced (``batch`` is None when no substitute was found)."""

    batch: object
    unreadable: list


class _CollateReplacingUnreadable:
    """Wraps a collate function: unreadable samples give their place to their substitutes, and the
    batch comes out wrapped so the training loop learns of them in order, on its own process."""

    def __init__(self, collate_fn):
        self.collate_fn = collate_fn

    def __call__(self, examples):
        unreadable = [example for example in examples if isinstance(example, UnreadableSample)]
        if not unreadable:
            return self.collate_fn(examples)
        if any(example.substitute is None for example in unreadable):
            return BatchWithUnreadable(None, [(u.source, u.reason) for u in unreadable])
        batch = self.collate_fn([e.substitute if isinstance(e, UnreadableSample) else e for e in examples])
        return BatchWithUnreadable(batch, [(u.source, u.reason) for u in unreadable])


def make_dataloader(dataset, batch_size, num_workers, collate_fn, seed, shuffle=True):
    """A plain loader; ``accelerate.prepare`` swaps in its seedable sampler so each epoch's order
    depends on (seed, epoch) alone, which is what makes resuming mid-epoch exact. A `TrainDataset` with
    ``shapes`` (aspect-ratio buckets) is batched by bucket instead (`buckets.BucketBatchSampler`, whose order
    depends on (seed, epoch) alone too); its buckets are reported.

    The loader gets its own generator: without one, every new iterator (each epoch, and once
    more after resuming) draws a worker base seed from the global RNG and shifts the noise that
    training draws from it.
    """
    batching = {"batch_size": batch_size, "shuffle": shuffle, "drop_last": False}
    if getattr(dataset, "shapes", None) is not None:
        batching = {"batch_sampler": BucketBatchSampler(dataset, batch_size, seed)}
        for line in batching["batch_sampler"].report():
            logger.info(line)
    return torch.utils.data.DataLoader(
        dataset, num_workers=num_workers, collate_fn=_CollateReplacingUnreadable(collate_fn),
        worker_init_fn=_seed_worker, generator=torch.Generator().manual_seed(seed), **batching,
    )


def _seed_worker(worker_id):
    # Workers never draw random numbers of their own, but libraries inside them might.
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def epoch_batches(accelerator, dataloader, epoch, skip_batches=0):
    """The prepared loader for ``epoch``, skipping the first ``skip_batches`` (when resuming mid-epoch)."""
    dataloader.set_epoch(epoch)
    if skip_batches:
        dataloader = accelerator.skip_first_batches(dataloader, skip_batches)
        dataloader.set_epoch(epoch)
    return dataloader
