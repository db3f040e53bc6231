"""Images as training reads them: upright and 8-bit RGB (`read_image`), then the training shape's resize, crop and
flip (`ImageTransform`), and for a ControlNet the conditioning image laid out alike
(`ImageWithConditioningTransform`), without torchvision.

Every path that reads an image reads it with `read_image`, and sizes it with `image_sizes`, which agree: a photo
whose EXIF orientation says it was shot rotated is upright in both (as ``datasets`` decodes it), and a 16-bit or
float image is scaled to 0-255, not clipped. Every random draw of a layout comes from the generator it is given
(`ImageTransform.draw_layout`), so that a sample's layout is a function of (seed, epoch, index) and a cached
latent can be drawn exactly as its pixels would.
"""

import io
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image, ImageOps

from .buckets import AspectRatioBuckets

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"}
# What PIL raises for missing, truncated or undecodable files (UnidentifiedImageError is an OSError).
UNREADABLE_IMAGE_ERRORS = (OSError, SyntaxError, Image.DecompressionBombError)
# PIL's resampling filters by the names of torchvision's interpolation modes (``--image_interpolation_mode``, as
# upstream names them; torchvision resizes a PIL image with PIL's filter of the same name, nearest_exact with NEAREST).
INTERPOLATIONS = {"nearest": Image.NEAREST, "nearest_exact": Image.NEAREST, "bilinear": Image.BILINEAR,
                  "bicubic": Image.BICUBIC, "box": Image.BOX, "hamming": Image.HAMMING, "lanczos": Image.LANCZOS}
ORIENTATION = Image.ExifTags.Base.Orientation
# The EXIF orientations that turn the picture a quarter: its stored width is its upright height.
QUARTER_TURNS = {5, 6, 7, 8}
# Modes of more than 8 bits a channel, by the ranges their values may span, as each range's largest value: an image
# spans the first range that holds all its values (a 32-bit integer image holding 16-bit values, as 16-bit PNGs open
# in earlier versions of PIL; a float image in [0, 1], or in an integer range).
HIGH_BIT_DEPTH_MODES = {**dict.fromkeys(["I;16", "I;16L", "I;16B", "I;16N"], (65535,)), "I": (65535, 2**31 - 1),
                        "F": (1.0, 255.0, 65535.0)}
# How `read_image` reads images, for the keys of caches of what was made from them: a change here is new content.
READING = "upright by EXIF orientation; 16-bit and float scaled to 8-bit RGB"


def read_image(source):
    """``source`` as training reads every image: upright and 8-bit RGB, a PIL image. ``source`` is a path, datasets'
    undecoded ``{"path", "bytes"}``, or a PIL image (datasets' decoded one, already upright).

    The EXIF orientation, as cameras and phones record a shot taken rotated, is applied, and removed, so it is
    applied once however often an image passes here. Images of more than 8 bits a channel are scaled to 0-255 from
    their range (`HIGH_BIT_DEPTH_MODES`): 16-bit PNG and TIFF from 0-65535, float from 0-1 (or 0-255, 0-65535 where
    their values exceed the range before)."""
    if not isinstance(source, Image.Image):
        with Image.open(openable(source)) as image:
            image.load()
            return read_image(image)
    image = source
    if image.getexif().get(ORIENTATION, 1) != 1:
        image = ImageOps.exif_transpose(image)
    if image.mode in HIGH_BIT_DEPTH_MODES:
        image = Image.fromarray(_eight_bit(np.asarray(image), HIGH_BIT_DEPTH_MODES[image.mode]))
    return image if image.mode == "RGB" else image.convert("RGB")


def _eight_bit(values, ranges):
    """``values`` scaled to 0-255 as bytes from the first of ``ranges`` (their largest values) that holds them all."""
    values = np.nan_to_num(values.astype(np.float64))
    peak = values.max() if values.size else 0.0
    maximum = next((bound for bound in ranges if peak <= bound), ranges[-1])
    return np.round(np.clip(values / maximum, 0.0, 1.0) * 255).astype(np.uint8)


def openable(source):
    """What ``Image.open`` (and PyAV's ``av.open``) takes for a path or datasets' undecoded ``{"path", "bytes"}``."""
    if isinstance(source, dict):
        return io.BytesIO(source["bytes"]) if source["bytes"] else source["path"]
    return source


class TrainingImage(NamedTuple):
    """An image laid out for training: its pixels (CHW in [-1, 1]; or, from a latent cache, its latent
    parameters), what SDXL-style micro-conditioning needs (the original (height, width), the crop's (top, left)
    in resized coordinates, the (height, width) it trains at) and, for ControlNet, its conditioning image's pixels
    laid out the same way (CHW in [0, 1])."""

    pixels: torch.Tensor
    original_size: tuple
    crop_top_left: tuple
    size: tuple
    conditioning_pixels: torch.Tensor = None


class ImageTransform:
    """Resize to cover the training shape, crop it, maybe flip, and scale to [-1, 1] CHW float.

    The training shape is a ``resolution`` square, or with ``buckets`` (`buckets.AspectRatioBuckets`) the
    bucket of the image's aspect ratio; images are resized with the filter that ``interpolation`` names
    (`INTERPOLATIONS`). Calls return a `TrainingImage`.
    """

    def __init__(self, resolution, center_crop=False, random_flip=False, buckets=None, interpolation="bilinear"):
        self.resolution = resolution
        self.center_crop = center_crop
        self.random_flip = random_flip
        self.buckets = buckets
        self.interpolation = interpolation

    @classmethod
    def from_args(cls, args, pipe):
        """The transform the data flags ask for, with the aspect-ratio buckets of ``pipe``'s model
        (`AspectRatioBuckets.from_args`)."""
        return cls(args.resolution, args.center_crop, args.random_flip, AspectRatioBuckets.from_args(args, pipe),
                   args.image_interpolation_mode)

    def __call__(self, image, generator, shape=None):
        image = read_image(image)
        return self.lay_out(image, self.draw_layout(image.width, image.height, generator, shape=shape))

    def lay_out(self, image, layout):
        """``image`` (as `read_image` reads it) as ``layout`` says, a `TrainingImage`."""
        pixels = _chw_tensor(self.apply_layout(image, layout) / 127.5 - 1.0)
        return TrainingImage(pixels, (image.height, image.width), layout.crop_top_left, layout.shape)

    def shape_of(self, width, height):
        """The (height, width) an image of ``width``×``height`` trains at."""
        if self.buckets is None:
            return self.resolution, self.resolution
        return self.buckets.shape_of(width, height)

    def shapes(self, sizes):
        """The training shape of each (width, height) of ``sizes``."""
        return [self.shape_of(*size) for size in sizes]

    def draw_layout(self, width, height, generator, crop=None, shape=None):
        """The resize, crop and flip for an image of this size; all random draws happen here. A ``crop``
        (top, left) drawn before (when the image's latents were cached) is kept: only the flip is drawn. The
        crop is ``shape`` (height, width), by default `shape_of` the image."""
        crop_height, crop_width = shape or self.shape_of(width, height)
        scale = max(crop_width / width, crop_height / height)
        width, height = max(crop_width, round(width * scale)), max(crop_height, round(height * scale))
        if crop is not None:
            top, left = crop
        elif self.center_crop:
            top, left = (height - crop_height) // 2, (width - crop_width) // 2
        else:
            top = int(torch.randint(0, height - crop_height + 1, (1,), generator=generator))
            left = int(torch.randint(0, width - crop_width + 1, (1,), generator=generator))
        flip = bool(self.random_flip and torch.rand((), generator=generator) < 0.5)
        return Layout((width, height), top, left, flip, (crop_height, crop_width))

    def apply_layout(self, image, layout):
        """``image`` (as `read_image` reads it) resized, cropped and flipped as ``layout`` says, as HWC float32 in
        [0, 255]."""
        height, width = layout.shape
        image = image.resize(layout.size, INTERPOLATIONS[self.interpolation])
        image = image.crop((layout.left, layout.top, layout.left + width, layout.top + height))
        if layout.flip:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return np.asarray(image, dtype=np.float32)


class Layout(NamedTuple):
    """Where a crop of ``shape`` (height, width) comes from: resized (width, height), crop corner, flip."""

    size: tuple
    top: int
    left: int
    flip: bool
    shape: tuple

    @property
    def crop_top_left(self):
        # After a flip the crop's left edge is measured in the mirrored image.
        left = self.size[0] - self.left - self.shape[1] if self.flip else self.left
        return self.top, left


class ImageWithConditioningTransform(ImageTransform):
    """`ImageTransform` for an image and its conditioning image (ControlNet-style): one resize, crop and flip for both.

    The conditioning image is resized to the image's resized size (so one crop fits both, whatever
    its own size) and scaled to [0, 1], the diffusers ControlNet convention; the image goes to
    [-1, 1]. Returns a `TrainingImage` with ``conditioning_pixels``.
    """

    def __call__(self, image, conditioning_image, generator):
        image = read_image(image)
        layout = self.draw_layout(image.width, image.height, generator)
        return self.lay_out(image, layout)._replace(
            conditioning_pixels=self.conditioning_pixels(conditioning_image, layout))

    def conditioning_pixels(self, conditioning_image, layout):
        """The conditioning image laid out as its image (``layout``), CHW in [0, 1]."""
        return _chw_tensor(self.apply_layout(read_image(conditioning_image), layout) / 255.0)


def _chw_tensor(hwc):
    return torch.from_numpy(hwc).permute(2, 0, 1).contiguous()


def image_sizes(values):
    """The upright (width, height) of each image of ``values`` (paths, or datasets' undecoded ``{"path", "bytes"}``),
    as `read_image` reads it, from their headers; (1, 1) for one that cannot be opened (it fails, and is replaced,
    when a sample reads it)."""
    sizes = []
    for value in values:
        try:
            with Image.open(openable(value)) as image:
                width, height = image.size
                sizes.append((height, width) if image.getexif().get(ORIENTATION) in QUARTER_TURNS else (width, height))
        except UNREADABLE_IMAGE_ERRORS:
            sizes.append((1, 1))
    return sizes
