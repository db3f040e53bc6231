"""Images as training reads them: the training shape's resize, crop and flip (`ImageTransform`), and for a
ControlNet the conditioning image laid out alike (`ImageWithConditioningTransform`), without torchvision.

Every random draw of a layout comes from the generator it is given (`ImageTransform.draw_layout`), so that a
sample's layout is a function of (seed, epoch, index) and a cached latent can be drawn exactly as its pixels would.
"""

import io
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from .buckets import AspectRatioBuckets

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
# What PIL raises for missing, truncated or undecodable files (UnidentifiedImageError is an OSError).
UNREADABLE_IMAGE_ERRORS = (OSError, SyntaxError, Image.DecompressionBombError)
# PIL's resampling filters by the names of torchvision's interpolation modes (``--image_interpolation_mode``, as
# upstream names them; torchvision resizes a PIL image with PIL's filter of the same name, nearest_exact with NEAREST).
INTERPOLATIONS = {"nearest": Image.NEAREST, "nearest_exact": Image.NEAREST, "bilinear": Image.BILINEAR,
                  "bicubic": Image.BICUBIC, "box": Image.BOX, "hamming": Image.HAMMING, "lanczos": Image.LANCZOS}


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
        return self.lay_out(image, self.draw_layout(image.width, image.height, generator, shape=shape))

    def lay_out(self, image, layout):
        """``image`` as ``layout`` says, a `TrainingImage`."""
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
        """``image`` resized, cropped and flipped as ``layout`` says, as HWC float32 in [0, 255]."""
        height, width = layout.shape
        image = image.convert("RGB").resize(layout.size, INTERPOLATIONS[self.interpolation])
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
        layout = self.draw_layout(image.width, image.height, generator)
        return self.lay_out(image, layout)._replace(
            conditioning_pixels=self.conditioning_pixels(conditioning_image, layout))

    def conditioning_pixels(self, conditioning_image, layout):
        """The conditioning image laid out as its image (``layout``), CHW in [0, 1]."""
        return _chw_tensor(self.apply_layout(conditioning_image, layout) / 255.0)


def _chw_tensor(hwc):
    return torch.from_numpy(hwc).permute(2, 0, 1).contiguous()


def image_sizes(values):
    """The (width, height) of each image of ``values`` (paths, or datasets' undecoded ``{"path", "bytes"}``),
    from their headers; (1, 1) for one that cannot be opened (it fails, and is replaced, when a sample reads it)."""
    sizes = []
    for value in values:
        if isinstance(value, dict):
            value = io.BytesIO(value["bytes"]) if value["bytes"] else value["path"]
        try:
            with Image.open(value) as image:
                sizes.append(image.size)
        except UNREADABLE_IMAGE_ERRORS:
            sizes.append((1, 1))
    return sizes
