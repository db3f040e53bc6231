"""Frozen encoders run once, before training, instead of in every step: `FrozenEncoders`.

A frozen VAE or text encoder gives the same output for the same input at every step, so it can run
once, in batches, and then leave the accelerator until validation brings it back. What is random
must stay random in the same way, so that a cached run matches an uncached one to float tolerance
and resumes exactly:

* the VAE's latent *distribution* is cached (``latent_dist.parameters``: mean and log-variance), not
  a sample of it; `sample_latents` draws from the global RNG exactly as ``latent_dist.sample()`` does;
* each image is cached unflipped and flipped, and a sample's flip is drawn from its per-sample
  generator by the same `ImageTransform.draw_layout` call the uncached path makes. A center crop is the
  same every epoch; a random crop is drawn once per image, when it is cached (from the run's seed and the
  image's place), and kept, as the upstream scripts do: a cached run then sees one crop of each image. With
  aspect-ratio buckets each image is cached at its bucket, one store per bucket;
* text embeddings are cached per distinct caption, so a caption drawn at random (`pick_caption`)
  still finds its embedding.

Each process encodes its share and then holds all of it (`feature_store.encode_once`; with text encoders sharded,
``--fsdp_text_encoder``, every process makes as many calls as the busiest: `text_encoder_sharding`); with ``cache_dir``
(``--feature_cache_dir``) the outputs live on disk, memory-mapped, and a later run with the same encoders,
data and settings reuses them without running, or moving to the accelerator, any encoder.
"""

import contextlib
import hashlib
import logging
import os

import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from PIL import Image

from ..sharding.text_encoders import is_sharded
from .cache_keys import describe, digest
from .captions import cut_captions_warning, distinct_captions
from .feature_store import Block, FeatureStore, block_bytes, encode_once, encoders_on
from .images import READING, UNREADABLE_IMAGE_ERRORS, ImageTransform, TrainingImage, read_image
from .prompts import embeddings_by_caption, text_chunk_encoder

logger = logging.getLogger(__name__)

CACHE_INDEX_COLUMN = "__cache_index__"


class CachedImage:
    """An image's original ``size`` (width, height), the ``crop`` (top, left) and ``shape`` (height, width; None:
    the transform's for the image) its latents were encoded from, and its latent parameters,
    ``[unflipped, flipped]``."""

    def __init__(self, size, crop, parameters, shape=None):
        self.size = size
        self.crop = crop
        self.parameters = parameters
        self.shape = shape


class UnreadableImage(OSError):
    """An image that could not be read when the cache was made; raised when a sample draws it, as reading it
    would have raised, so that `TrainDataset` replaces the sample."""


def latent_chunk_encoder(open_images, transform, vae, device, dtype, crop_seed=0, shape=None):
    """``encode_chunk(indices)`` for `feature_store.encode_once`: the latent parameters of the images
    ``open_images[index]()`` (PIL images), cropped as ``transform`` crops (to ``shape``, by default the image's
    own; a random crop drawn from ``crop_seed`` and the index), unflipped and flipped, as a `Block` with
    ``parameters`` (``[n, 2, ...]``), ``sizes`` (``[n, 2]``, width and height) and ``crops`` (``[n, 2]``, top and
    left); an image that cannot be read is a `Block` error. Every image of a chunk must train at one shape."""
    unflipped = ImageTransform(transform.resolution, center_crop=transform.center_crop, buckets=transform.buckets,
                               interpolation=transform.interpolation)

    def encode_chunk(indices):
        readable, sizes, crops, pixels, errors = [], [], [], [], {}
        for index in indices:
            try:
                image = open_images[index]()
                laid_out = unflipped(image, torch.Generator().manual_seed(crop_seed * 1_000_003 + index), shape)
            except UNREADABLE_IMAGE_ERRORS as error:
                errors[index] = f"{type(error).__name__}: {error}"
                continue
            readable.append(index)
            sizes.append(image.size)
            crops.append(laid_out.crop_top_left)
            pixels += [laid_out.pixels, laid_out.pixels.flip(-1)]
        tensors = {}
        if readable:
            parameters = vae.encode(torch.stack(pixels).to(device, dtype)).latent_dist.parameters.cpu()
            tensors = {"parameters": parameters.unflatten(0, (len(readable), 2)), "sizes": torch.tensor(sizes),
                       "crops": torch.tensor(crops)}
        return Block(torch.tensor(readable, dtype=torch.int64), tensors, errors)

    return encode_chunk


def cached_images(keys, blocks, shape=None):
    """``{key: CachedImage or UnreadableImage}`` from the blocks of `latent_chunk_encoder` (for images cropped to
    ``shape``), in ``keys``' order."""
    found = {}
    for block in blocks:
        for row, index in enumerate(block.indices.tolist()):
            found[index] = CachedImage(tuple(block.tensors["sizes"][row].tolist()),
                                       tuple(block.tensors["crops"][row].tolist()), block.tensors["parameters"][row],
                                       shape)
        found.update({index: UnreadableImage(message) for index, message in block.errors.items()})
    return {key: found[index] for index, key in enumerate(keys)}


def cached_latent_parameters(cached, transform, generator):
    """What ``transform(image, generator)`` returns (a `images.TrainingImage`), with the cached latent parameters in
    place of the pixels: the flipped parameters when the draw flips."""
    return _drawn(cached, transform, generator)[0]


def cached_latent_parameters_with_conditioning(cached, conditioning_image, transform, generator):
    """What an `ImageWithConditioningTransform` returns for an image and its conditioning image, with the image's
    cached latent parameters in place of its pixels. The conditioning image (not cached: a ControlNet
    reads it) is laid out by the same draw, so it is flipped exactly when the latents are."""
    laid_out, layout = _drawn(cached, transform, generator)
    return laid_out._replace(conditioning_pixels=transform.conditioning_pixels(conditioning_image, layout))


def _drawn(cached, transform, generator):
    """The `images.TrainingImage` of one draw of ``transform``'s layout for a cached image, with its cached
    parameters as pixels, and that layout; the draw takes from ``generator`` exactly what the uncached transform
    takes."""
    if isinstance(cached, UnreadableImage):
        raise cached
    layout = transform.draw_layout(*cached.size, generator, crop=cached.crop, shape=cached.shape)
    width, height = cached.size
    return TrainingImage(cached.parameters[int(layout.flip)], (height, width), layout.crop_top_left,
                         layout.shape), layout


def sample_latents(parameters):
    """A sample of the distribution with these parameters, drawn like ``latent_dist.sample()`` (global RNG)."""
    return DiagonalGaussianDistribution(parameters).sample()


def image_source(value):
    """What identifies an image for the cache: a file by path, size and modification time, embedded bytes by
    their hash (``value`` is a path, or a datasets image left undecoded: ``{"path", "bytes"}``)."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return hashlib.blake2b(value["bytes"], digest_size=16).hexdigest()
        value = value["path"]
    try:
        stat = os.stat(value)
    except OSError:
        return f"{value} (unreadable)"
    return f"{value} {stat.st_size} {stat.st_mtime_ns}"


def many(items, noun):
    """A determinant naming a list by its length and hash, e.g. "12 captions 3f2a…"."""
    return f"{len(items)} {noun} {digest(repr(items))}"


class FrozenEncoders:
    """A run's frozen encoders: their outputs computed once before training where they can be, and the
    encoders on the accelerator only while they run (for caching, for validation with `on_device`, and the
    VAE in every step when latents are not cached, unless ``offload``).

    A script makes one (`pipeline.prepare_components` left the encoders on the CPU), has it cache
    (`text_embeddings`; `cache_dataset_images` or `cache_image_files`), then asks it for what a sample needs
    (`dataset_image`, `image_file`: pixels, or with ``cache_latents`` the image's cached latent distribution)
    and, in the step, for a batch's `latents`.

    Args:
        vae: the pipeline's VAE.
        text_encoders: the text encoders whose outputs are cached (not those that train, or run in every step).
        transform: the run's `ImageTransform` (or `ImageWithConditioningTransform`).
        device, dtype: where and in which dtype the encoders run (the frozen weights' dtype).
        cache_latents: encode every image (both flips) once before training, instead of in every step; without
            a center crop, each image's random crop is drawn then, once, from ``seed`` (the run's).
        cache_dir: keep the cached outputs on disk there (``--feature_cache_dir``), for this and later runs.
        offload: keep the VAE off the accelerator between steps too, when it encodes in every step
            (``--offload``: less memory, more transfers).
        batch_size: how many inputs an encoder takes at once while caching.
    """

    def __init__(self, vae, text_encoders, transform, device, dtype, cache_latents=False, cache_dir=None,
                 offload=False, seed=0, batch_size=16):
        self.vae = vae
        self.text_encoders = list(text_encoders)
        self.transform = transform
        self.device = device
        self.dtype = dtype
        self.cache_latents = cache_latents
        self.cache_dir = cache_dir
        self.seed = seed
        self.batch_size = batch_size
        self.latent_cache = None
        self.image_column = None
        # The encoders kept off the accelerator; validation brings them.
        self.off_device = [*([vae] if cache_latents or offload else []), *self.text_encoders]
        for module in self.off_device:
            if not is_sharded(module):  # a sharded text encoder stays where FSDP2 put it
                module.to("cpu")
        if vae is not None and vae not in self.off_device:
            vae.to(device)

    def text_embeddings(self, captions, encode, depends_on=()):
        """``{caption: row}`` for each distinct caption of ``captions`` (strings, or lists of them), from ``encode(list
        of captions)``, which runs the frozen text encoders (`text_chunk_encoder`): a row is a tuple of tensors, the
        caption's slice of each part that ``encode`` returns. ``depends_on`` lists what else the
        embeddings depend on (tokenizers, settings such as a maximum length): with ``cache_dir`` it keys the
        cache, with the text encoders, their dtype, ``encode``'s code and the captions."""
        captions = distinct_captions(captions)
        warning = cut_captions_warning(captions, depends_on)
        if warning:
            logger.warning(warning)
        store = self.store("text_embeddings", {
            "encoders": [describe(encoder) for encoder in self.text_encoders],
            "depends_on": [describe(thing) for thing in depends_on],
            "encode": describe(encode), "captions": many(captions, "captions")})
        encode_chunk = text_chunk_encoder(captions, encode)
        blocks = encode_once("text embeddings", len(captions), encode_chunk,
                             lambda: _bytes_per_item(encode_chunk([0])),
                             lambda: encoders_on(self.device, self.text_encoders), self.batch_size, store,
                             lockstep=any(map(is_sharded, self.text_encoders)))
        return embeddings_by_caption(captions, blocks)

    def cache_dataset_images(self, dataset, image_column, shapes=None):
        """The examples to train on, for a `datasets.Dataset` with images in ``image_column``: the dataset
        itself, or, caching latents, the dataset with its images left undecoded (the cache holds them; a
        `TrainDataset` still names the file of an unreadable one) and each row's index in `CACHE_INDEX_COLUMN`.
        ``shapes`` (with aspect-ratio buckets) are the rows' training shapes, at which their latents are cached."""
        self.image_column = image_column
        if not self.cache_latents:
            return dataset
        import datasets

        undecoded = dataset.cast_column(image_column, datasets.Image(decode=False))
        images = dataset.select_columns(image_column)  # decode nothing else (e.g. conditioning images)
        sources = [image_source(row[image_column]) for row in undecoded.select_columns(image_column)]
        self.latent_cache = self._cache_latents(
            list(range(len(dataset))), sources, [lambda index=index: read_image(images[index][image_column])
                                                 for index in range(len(dataset))], shapes)
        return undecoded.add_column(CACHE_INDEX_COLUMN, list(range(len(dataset))))

    def dataset_image(self, example, generator):
        """What ``transform(image, generator)`` returns for a row of `cache_dataset_images`' examples: a
        `images.TrainingImage` of pixels or of the cached latent parameters."""
        if self.latent_cache is None:
            return self.transform(example[self.image_column], generator)
        return cached_latent_parameters(self.latent_cache[example[CACHE_INDEX_COLUMN]], self.transform, generator)

    def dataset_image_with_conditioning(self, example, conditioning_image, generator):
        """`dataset_image` with a conditioning image (not cached: a ControlNet reads it) laid out as the image, in
        its ``conditioning_pixels``."""
        if self.latent_cache is None:
            return self.transform(example[self.image_column], conditioning_image, generator)
        return cached_latent_parameters_with_conditioning(self.latent_cache[example[CACHE_INDEX_COLUMN]],
                                                          conditioning_image, self.transform, generator)

    def cache_image_files(self, files):
        """Caching latents, encode each of the image ``files``, ``(path, shape)`` pairs, once, cropped to
        ``shape`` (height, width; None: the transform's for the image); `image_file` then draws from them."""
        if self.cache_latents:
            files = list(dict.fromkeys(files))
            self.latent_cache = self._cache_latents(files, [image_source(path) for path, _ in files],
                                                    [lambda path=path: read_image(path) for path, _ in files],
                                                    [shape for _, shape in files])

    def image_file(self, path, generator, shape=None):
        """What ``transform(read_image(path), generator, shape)`` returns, from the cache when caching latents."""
        if self.latent_cache is None:
            return self.transform(read_image(path), generator, shape)
        return cached_latent_parameters(self.latent_cache[path, shape], self.transform, generator)

    def image_file_with_flip(self, path, generator, shape=None):
        """`image_file`'s `images.TrainingImage`, and whether its draw mirrored the image (an edit sample's
        references are mirrored with their target). The draw is the same as `image_file`'s."""
        if self.latent_cache is None:
            image = read_image(path)
            layout = self.transform.draw_layout(image.width, image.height, generator, shape=shape)
            return self.transform.lay_out(image, layout), layout.flip
        laid_out, layout = _drawn(self.latent_cache[path, shape], self.transform, generator)
        return laid_out, layout.flip

    def latents(self, images):
        """A batch's latents, before the VAE's scaling: drawn from the cached distributions (from the global
        RNG, as ``latent_dist.sample()`` draws) or encoded now. Contiguous either way: the CPU VAE returns
        channels-last, and noise drawn ``randn_like`` them follows their layout."""
        if self.latent_cache is not None:
            return sample_latents(images).contiguous()
        return self.encoded(images)

    def encoded(self, pixels):
        """Latents of ``pixels`` (in [-1, 1]) encoded now, whatever is cached: a sample of the VAE's distribution,
        drawn as `latents` draws it, before the VAE's scaling (a Control model's conditioning images, which are not
        cached, go through here)."""
        with encoders_on(self.device, [self.vae]) if self.vae in self.off_device else contextlib.nullcontext():
            return self.vae.encode(pixels.to(self.dtype)).latent_dist.sample().contiguous()

    @contextlib.contextmanager
    def on_device(self):
        """The encoders kept off the accelerator back on it while the block runs (validation renders with them)."""
        with encoders_on(self.device, self.off_device):
            yield

    def store(self, kind, determinants):
        """The `FeatureStore` of ``kind`` keyed by ``determinants`` and the dtype under ``cache_dir``; None without
        one (the outputs are then held in memory)."""
        if self.cache_dir is None:
            return None
        return FeatureStore(self.cache_dir, kind, {**determinants, "dtype": str(self.dtype)})

    def _cache_latents(self, keys, sources, open_images, shapes=None):
        """``{key: CachedImage or UnreadableImage}`` for the images ``open_images[i]()`` of ``keys``, which
        ``sources`` identify (`image_source`), cropped to ``shapes[i]`` (None: the transform's for the image;
        with aspect-ratio buckets, their training shapes): one cache per shape."""
        crops = "center crop"
        if not self.transform.center_crop:
            crops = f"random crop drawn once (seed {self.seed})"
            logger.info(f"caching latents without --center_crop: each image's random crop is drawn once, now "
                        f"(seed {self.seed}), and kept for the whole run; flips are still drawn per sample")
        by_shape = {}
        for position, shape in enumerate(shapes or [None] * len(keys)):
            by_shape.setdefault(shape, []).append(position)
        cached = {}
        for shape, positions in sorted(by_shape.items(), key=lambda item: item[0] or ()):
            size = f"{self.transform.resolution}px" if shape is None else "{}x{}".format(*shape)
            store = self.store("latents", {
                "vae": describe(self.vae), "images": many([sources[p] for p in positions], "images"),
                "reading": READING, "transform": f"{size} {crops}, both flips, {self.transform.interpolation} resize"})
            group = [open_images[position] for position in positions]
            encode_chunk = latent_chunk_encoder(group, self.transform, self.vae, self.device, self.dtype,
                                                self.seed, shape)
            height, width = shape or (self.transform.resolution,) * 2
            blank = Image.new("RGB", (width, height))
            blocks = encode_once("latents" if shape is None else f"latents {size}", len(group), encode_chunk,
                                 lambda: _bytes_per_item(latent_chunk_encoder(
                                     [lambda: blank], self.transform, self.vae, self.device, self.dtype,
                                     shape=(height, width))([0])),
                                 lambda: encoders_on(self.device, [self.vae]), self.batch_size, store)
            cached.update(cached_images([keys[p] for p in positions], blocks, shape))
        return {key: cached[key] for key in keys}


def _bytes_per_item(block):
    return block_bytes(block) // max(len(block.indices), 1)
