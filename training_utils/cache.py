"""Frozen encoders run once, before training, instead of in every step: `FrozenEncoders`.

A frozen VAE or text encoder gives the same output for the same input at every step, so it can run
once, in batches, and then leave the accelerator until validation brings it back. What is random
must stay random in the same way, so that a cached run matches an uncached one to float tolerance
and resumes exactly:

* the VAE's latent *distribution* is cached (``latent_dist.parameters``: mean and log-variance), not
  a sample of it; `sample_latents` draws from the global RNG exactly as ``latent_dist.sample()`` does;
* each image is cached unflipped and flipped, and a sample's flip is drawn from its per-sample
  generator by the same `ImageTransform.draw_layout` call the uncached path makes (so only center
  crops can be cached: a random crop changes every epoch);
* text embeddings are cached per distinct caption, so a caption drawn at random (`pick_caption`)
  still finds its embedding.
"""

import contextlib
import logging

import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from PIL import Image

from .data import UNREADABLE_IMAGE_ERRORS, ImageTransform

logger = logging.getLogger(__name__)

CACHE_INDEX_COLUMN = "__cache_index__"


class CachedImage:
    """An image's original ``size`` (width, height) and its latent parameters, ``[unflipped, flipped]``."""

    def __init__(self, size, parameters):
        self.size = size
        self.parameters = parameters


def cache_latent_parameters(images, transform, vae, device, dtype, batch_size):
    """``{key: CachedImage}`` for ``images``, an iterable of ``(key, open_image)`` where ``open_image()``
    returns a PIL image; an image that cannot be read maps to its error instead, raised again by
    `cached_latent_parameters` so `TrainDataset` replaces the sample as it would uncached."""
    if not transform.center_crop:
        raise ValueError("latents can only be cached for center crops")
    unflipped = ImageTransform(transform.resolution, center_crop=True)
    cache, pending = {}, []

    def encode():
        pixels = torch.stack([both for _, _, pair in pending for both in pair]).to(device, dtype)
        with torch.no_grad():
            parameters = vae.encode(pixels).latent_dist.parameters.cpu()
        for position, (key, size, _) in enumerate(pending):
            cache[key] = CachedImage(size, parameters[2 * position:2 * position + 2].clone())
        pending.clear()

    for key, open_image in images:
        try:
            image = open_image()
            pixels = unflipped(image, None)[0]
        except UNREADABLE_IMAGE_ERRORS as error:
            cache[key] = error
            continue
        pending.append((key, image.size, (pixels, pixels.flip(-1))))
        if len(pending) == batch_size:
            encode()
    if pending:
        encode()
    return cache


def cached_latent_parameters(cached, transform, generator):
    """What ``transform(image, generator)`` returns, with the cached latent parameters in place of the
    pixels: ``(parameters, (height, width), crop_top_left)``; the flipped parameters when the draw flips."""
    parameters, layout = _drawn(cached, transform, generator)
    width, height = cached.size
    return parameters, (height, width), layout.crop_top_left


def cached_latent_parameters_with_conditioning(cached, conditioning_image, transform, generator):
    """What an `ImageWithConditioningTransform` returns for an image and its conditioning image, with the image's
    cached latent parameters in place of its pixels. The conditioning image (not cached: a ControlNet
    reads it) is laid out by the same draw, so it is flipped exactly when the latents are."""
    parameters, layout = _drawn(cached, transform, generator)
    width, height = cached.size
    return parameters, transform.conditioning_pixels(conditioning_image, layout), (height, width), \
        layout.crop_top_left


def _drawn(cached, transform, generator):
    """The parameters of one draw of ``transform``'s layout for a cached image, and that layout; the
    draw takes from ``generator`` exactly what the uncached transform takes."""
    if isinstance(cached, BaseException):
        raise cached.with_traceback(None)
    layout = transform.draw_layout(*cached.size, generator)
    return cached.parameters[int(layout.flip)], layout


def sample_latents(parameters):
    """A sample of the distribution with these parameters, drawn like ``latent_dist.sample()`` (global RNG)."""
    return DiagonalGaussianDistribution(parameters).sample()


def distinct_captions(values):
    """Each caption once, in order of appearance, from strings and lists of strings."""
    captions = {}
    for value in values:
        for caption in [value] if isinstance(value, str) else value:
            captions[caption] = None
    return list(captions)


def cache_text_embeddings(captions, encode, batch_size):
    """``{caption: embedding}`` (on the CPU), ``encode(list of captions)`` called ``batch_size`` at a time.

    ``encode`` returns a batch tensor, or a tuple of them (e.g. SDXL's hidden states and pooled
    embeddings); then each caption maps to a tuple of its rows. The cache lives in host memory and
    grows with the number of distinct captions (SDXL: ~0.3 MB each in half precision), so its size
    is logged."""
    embeddings, size = {}, 0
    with torch.no_grad():
        for start in range(0, len(captions), batch_size):
            chunk = captions[start:start + batch_size]
            encoded = encode(chunk)
            single = isinstance(encoded, torch.Tensor)
            parts = [part.cpu() for part in ((encoded,) if single else encoded)]
            size += sum(part.nbytes for part in parts)
            embeddings.update(zip(chunk, parts[0] if single else zip(*parts)))
    logger.info(f"text embeddings of {len(embeddings)} distinct captions cached: {size / 2**20:.1f} MiB of host memory")
    return embeddings


class FrozenEncoders:
    """A run's frozen encoders: their outputs computed once before training where they can be, and the
    encoders kept off the accelerator afterwards, except while validation renders (`on_device`).

    A script makes one, has it cache (`text_embeddings`; `cache_dataset_images` or `cache_image_files`),
    calls `offload`, then asks it for what a sample needs (`dataset_image`, `image_file`: pixels, or with
    ``cache_latents`` the image's cached latent distribution) and, in the step, for a batch's `latents`.

    Args:
        vae: the pipeline's VAE.
        transform: the run's `ImageTransform` (or `ImageWithConditioningTransform`); it must center-crop to
            cache latents.
        device, dtype: where and in which dtype the encoders run (the frozen weights' dtype).
        cache_latents: encode every image (both flips) once before training, instead of in every step.
        batch_size: how many inputs an encoder takes at once while caching.
    """

    def __init__(self, vae, transform, device, dtype, cache_latents=False, batch_size=16):
        self.vae = vae
        self.transform = transform
        self.device = device
        self.dtype = dtype
        self.batch_size = batch_size
        self.latent_cache = {} if cache_latents else None
        self.cached_encoders = [vae] if cache_latents else []
        self.image_column = None

    def text_embeddings(self, captions, encode, encoders):
        """``{caption: embedding}`` for each distinct caption of ``captions`` (strings, or lists of them), from
        ``encode(list of captions)``; ``encoders``, whose outputs these are, leave the accelerator at `offload`."""
        embeddings = cache_text_embeddings(distinct_captions(captions), encode, self.batch_size)
        self.cached_encoders += encoders
        return embeddings

    def cache_dataset_images(self, dataset, image_column):
        """The examples to train on, for a `datasets.Dataset` with images in ``image_column``: the dataset
        itself, or, caching latents, the dataset with its images left undecoded (the cache holds them; a
        `TrainDataset` still names the file of an unreadable one) and each row's index in `CACHE_INDEX_COLUMN`."""
        self.image_column = image_column
        if self.latent_cache is None:
            return dataset
        import datasets

        images = dataset.select_columns(image_column)  # decode nothing else (e.g. conditioning images)
        self.latent_cache.update(self._encode(
            (index, lambda index=index: images[index][image_column]) for index in range(len(images))))
        undecoded = dataset.cast_column(image_column, datasets.Image(decode=False))
        return undecoded.add_column(CACHE_INDEX_COLUMN, list(range(len(dataset))))

    def dataset_image(self, example, generator):
        """What ``transform(image, generator)`` returns for a row of `cache_dataset_images`' examples:
        ``(pixels or cached latent parameters, original size, crop_top_left)``."""
        if self.latent_cache is None:
            return self.transform(example[self.image_column], generator)
        return cached_latent_parameters(self.latent_cache[example[CACHE_INDEX_COLUMN]], self.transform, generator)

    def dataset_image_with_conditioning(self, example, conditioning_image, generator):
        """`dataset_image` with a conditioning image (not cached: a ControlNet reads it) laid out as the image:
        ``(pixels or cached latent parameters, conditioning pixels, original size, crop_top_left)``."""
        if self.latent_cache is None:
            return self.transform(example[self.image_column], conditioning_image, generator)
        return cached_latent_parameters_with_conditioning(self.latent_cache[example[CACHE_INDEX_COLUMN]],
                                                          conditioning_image, self.transform, generator)

    def cache_image_files(self, paths):
        """Caching latents, encode each of the image files ``paths`` once (`image_file` then draws from them)."""
        if self.latent_cache is not None:
            paths = dict.fromkeys(paths)
            self.latent_cache.update(self._encode((path, lambda path=path: Image.open(path)) for path in paths))

    def image_file(self, path, generator):
        """What ``transform(Image.open(path), generator)`` returns, from the cache when caching latents."""
        if self.latent_cache is None:
            with Image.open(path) as image:
                return self.transform(image, generator)
        return cached_latent_parameters(self.latent_cache[path], self.transform, generator)

    def latents(self, images):
        """A batch's latents, before the VAE's scaling: drawn from the cached distributions (from the global
        RNG, as ``latent_dist.sample()`` draws) or encoded now. Contiguous either way: the CPU VAE returns
        channels-last, and noise drawn ``randn_like`` them follows their layout."""
        if self.latent_cache is not None:
            return sample_latents(images).contiguous()
        return self.vae.encode(images.to(self.dtype)).latent_dist.sample().contiguous()

    def offload(self):
        """Move the encoders whose outputs are all cached off the accelerator (to the CPU)."""
        for module in self.cached_encoders:
            module.to("cpu")

    @contextlib.contextmanager
    def on_device(self):
        """The offloaded encoders back on the accelerator while the block runs (validation renders with them)."""
        for module in self.cached_encoders:
            module.to(self.device)
        try:
            yield
        finally:
            self.offload()

    def _encode(self, images):
        return cache_latent_parameters(images, self.transform, self.vae, self.device, self.dtype, self.batch_size)
