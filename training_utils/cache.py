"""Outputs of frozen encoders computed once before training and held in memory.

A frozen VAE or text encoder gives the same output for the same input at every step, so it can run
once, in batches, instead of in every step, and then leave the accelerator (`offload`) until
validation needs it. What is random must stay random in the same way, so that a cached run matches
an uncached one to float tolerance and resumes exactly:

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


def cached_paired_latent_parameters(cached, conditioning_image, transform, generator):
    """What a `PairedImageTransform` returns for an image and its conditioning image, with the image's
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


class DatasetLatents:
    """The latent parameters of every image of a `datasets.Dataset` (`cache_latent_parameters`, each
    image decoded once), and ``examples``: the dataset to train on instead, its images left undecoded
    (the cache holds them) and each row's index in `CACHE_INDEX_COLUMN`. A `TrainDataset` over
    ``examples`` still names the file of an unreadable image. ``draw`` and ``draw_paired`` stand in
    for the transform in a script's ``preprocess``."""

    def __init__(self, dataset, image_column, transform, vae, device, dtype, batch_size):
        import datasets

        images = dataset.select_columns(image_column)  # decode nothing else (e.g. conditioning images)
        self.cache = cache_latent_parameters(
            ((index, lambda index=index: images[index][image_column]) for index in range(len(images))),
            transform, vae, device, dtype, batch_size)
        self.transform = transform
        undecoded = dataset.cast_column(image_column, datasets.Image(decode=False))
        self.examples = undecoded.add_column(CACHE_INDEX_COLUMN, list(range(len(dataset))))

    def draw(self, example, generator):
        """`cached_latent_parameters` for a row of ``examples``."""
        return cached_latent_parameters(self.cache[example[CACHE_INDEX_COLUMN]], self.transform, generator)

    def draw_paired(self, example, conditioning_image, generator):
        """`cached_paired_latent_parameters` for a row of ``examples`` and its conditioning image."""
        return cached_paired_latent_parameters(self.cache[example[CACHE_INDEX_COLUMN]], conditioning_image,
                                               self.transform, generator)


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


def offload(modules, device):
    """Move ``modules`` off ``device`` (to the CPU) now that their outputs are cached; returns a context
    manager factory that puts them back on ``device`` while it is entered (e.g. during validation)."""
    for module in modules:
        module.to("cpu")

    @contextlib.contextmanager
    def on_device():
        for module in modules:
            module.to(device)
        try:
            yield
        finally:
            for module in modules:
                module.to("cpu")

    return on_device
