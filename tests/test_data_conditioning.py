"""ImageWithConditioningTransform: an image and its conditioning image get one resize, crop and flip (to the
image's bucket, with aspect-ratio buckets), cached latents or not."""

from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from test_data import decode, generator, position_image
from training_utils.data.buckets import AspectRatioBuckets, parse_buckets
from training_utils.data.datasets import dataset_shapes, sample_generator
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform, ImageWithConditioningTransform


def from_unit(tensor):
    """The uint8 values a [0, 1] CHW tensor was made from, as HWC."""
    return np.rint(tensor.permute(1, 2, 0).numpy() * 255.0).astype(np.int64)


@pytest.mark.parametrize("height, width", [(32, 56), (56, 32), (48, 64)])
def test_both_images_get_the_same_crop_and_flip(height, width):
    image = position_image(height, width)
    transform = ImageWithConditioningTransform(32, center_crop=False, random_flip=True)
    flips, crops = set(), set()
    for seed in range(30):
        laid_out = transform(image, image.copy(), generator(seed))
        assert laid_out.original_size == (height, width) and laid_out.size == (32, 32)
        assert np.array_equal(decode(laid_out.pixels), from_unit(laid_out.conditioning_pixels))
        values = decode(laid_out.pixels)
        flips.add(bool(values[0, 0, 0] > values[0, -1, 0]))
        crops.add(laid_out.crop_top_left)
    assert flips == {True, False}
    assert len(crops) > 3


@pytest.mark.parametrize("center_crop, random_flip", [(False, True), (True, True), (False, False)])
def test_image_matches_image_transform_with_the_same_generator(center_crop, random_flip):
    image, conditioning = position_image(40, 72), position_image(40, 72).rotate(180)
    with_conditioning = ImageWithConditioningTransform(32, center_crop, random_flip)
    single = ImageTransform(32, center_crop, random_flip)
    for seed in range(10):
        laid_out = with_conditioning(image, conditioning, generator(seed))
        expected = single(image, generator(seed))
        assert torch.equal(laid_out.pixels, expected.pixels)
        assert laid_out[1:4] == expected[1:4]  # original size, crop, training size


def test_ranges_dtypes_and_shapes():
    image = Image.fromarray(np.array([[[0, 255, 128]] * 40] * 24, dtype=np.uint8))
    laid_out = ImageWithConditioningTransform(16, center_crop=True)(image, image, generator(0))
    pixels, conditioning = laid_out.pixels, laid_out.conditioning_pixels
    for tensor in (pixels, conditioning):
        assert tensor.shape == (3, 16, 16) and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert torch.all(pixels[0] == -1.0) and torch.all(pixels[1] == 1.0)
    assert torch.all(conditioning[0] == 0.0) and torch.all(conditioning[1] == 1.0)
    assert torch.allclose(conditioning[2], torch.tensor(128 / 255))


def test_grayscale_and_rgba_conditioning_become_three_channels():
    image = position_image(32, 32)
    for mode, white in (("L", 255), ("RGBA", (255, 255, 255, 255)), ("1", 1)):
        conditioning = Image.new(mode, (32, 32), white)
        pixels = ImageWithConditioningTransform(32)(image, conditioning, generator(0)).conditioning_pixels
        assert pixels.shape == (3, 32, 32) and torch.all(pixels == 1.0), mode


def edge(height, width):
    """A white right part from 5/8 of the width on, on black: where it starts shows a crop and a flip."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, width * 5 // 8:] = 255
    return Image.fromarray(pixels)


def assert_edges_line_up(laid_out):
    """The image's and the conditioning image's edge in one place: resampling from another size may move it by
    a pixel, never more. Returns whether the (flipped) image starts white."""
    image_row = decode(laid_out.pixels)[0, :, 0] > 127
    conditioning_row = from_unit(laid_out.conditioning_pixels)[0, :, 0] > 127
    assert np.count_nonzero(image_row != conditioning_row) <= 1
    return bool(image_row[0])


def test_conditioning_of_another_size_is_mapped_onto_the_image_geometry():
    # An image, and a conditioning image twice its size.
    transform = ImageWithConditioningTransform(32, center_crop=False, random_flip=True)
    flips = {assert_edges_line_up(transform(edge(40, 64), edge(80, 128), generator(seed))) for seed in range(20)}
    assert flips == {True, False}


def buckets():
    """The buckets of ``--aspect_ratio_buckets "16,64;24,48;32,32;48,24"`` for a model taking multiples of 8."""
    return AspectRatioBuckets(parse_buckets("16,64;24,48;32,32;48,24"), 8, cap_to_image=False)


@pytest.mark.parametrize("center_crop", [False, True])
def test_with_buckets_the_conditioning_image_gets_its_images_bucket_crop_and_flip(center_crop):
    # 90x40 (width x height) trains in the 24x48 bucket (height x width): resized to 54x24, a crop leaves 6
    # columns. The conditioning image, twice the size, is resized to 54x24 too and cut by the same crop.
    with_conditioning = ImageWithConditioningTransform(32, center_crop, random_flip=True, buckets=buckets())
    single = ImageTransform(32, center_crop, random_flip=True, buckets=buckets())
    image, conditioning_image = edge(40, 90), edge(80, 180)
    flips, crops = set(), set()
    for seed in range(30):
        laid_out = with_conditioning(image, conditioning_image, generator(seed))
        expected = single(image, generator(seed))
        assert laid_out.size == (24, 48) and laid_out.conditioning_pixels.shape == (3, 24, 48)
        assert torch.equal(laid_out.pixels, expected.pixels) and laid_out[1:4] == expected[1:4]
        flips.add(assert_edges_line_up(laid_out))
        crops.add(laid_out.crop_top_left)
    assert flips == {True, False}
    assert crops == {(0, 3)} if center_crop else len(crops) > 3


class PixelsAsLatents(torch.nn.Module):
    """Stands in for a VAE: an image's "latent distribution" is its pixels (mean) and zeros (log-variance), so
    that cached latents show the pixels they were encoded from."""

    def encode(self, pixels):
        parameters = torch.cat([pixels, torch.zeros_like(pixels)], dim=1)
        return SimpleNamespace(latent_dist=SimpleNamespace(parameters=parameters))


def test_with_buckets_cached_latents_draw_the_conditioning_as_the_uncached_images(tmp_path):
    # A landscape and a portrait (each in a bucket of its own), their conditioning images of other sizes.
    columns = {"image": [], "conditioning_image": []}
    for index, (height, width) in enumerate([(40, 90), (72, 40)]):
        for column, scale in (("image", 1), ("conditioning_image", 2)):
            path = tmp_path / f"{column}-{index}.png"
            edge(height * scale, width * scale).save(path)
            columns[column].append(str(path))
    dataset = datasets.Dataset.from_dict(columns)
    dataset = dataset.cast_column("image", datasets.Image()).cast_column("conditioning_image", datasets.Image())
    transform = ImageWithConditioningTransform(32, center_crop=True, random_flip=True, buckets=buckets())
    shapes = dataset_shapes(transform, dataset, "image")
    assert shapes == [(24, 48), (48, 24)]

    uncached = FrozenEncoders(PixelsAsLatents(), [], transform, "cpu", torch.float32)
    cached = FrozenEncoders(PixelsAsLatents(), [], transform, "cpu", torch.float32, cache_latents=True)
    assert uncached.cache_dataset_images(dataset, "image", shapes) is dataset
    examples = cached.cache_dataset_images(dataset, "image", shapes)
    flips = set()
    for index, shape in enumerate(shapes):
        for epoch in range(6):
            expected = uncached.dataset_image_with_conditioning(dataset[index], dataset[index]["conditioning_image"],
                                                                sample_generator(0, epoch, index))
            drawn = cached.dataset_image_with_conditioning(examples[index], examples[index]["conditioning_image"],
                                                           sample_generator(0, epoch, index))
            assert expected.size == drawn.size == shape
            assert torch.equal(drawn.pixels[:3], expected.pixels)  # the means: the pixels encoded
            assert torch.equal(drawn.conditioning_pixels, expected.conditioning_pixels)
            assert drawn[1:4] == expected[1:4]
            flips.add(assert_edges_line_up(expected))
    assert flips == {True, False}


def test_output_is_a_function_of_the_generator_alone():
    image, conditioning = position_image(48, 64), position_image(48, 64).rotate(90)
    transform = ImageWithConditioningTransform(32, center_crop=False, random_flip=True)
    torch.manual_seed(1)
    first = transform(image, conditioning, generator(5))
    torch.manual_seed(2)
    again = transform(image, conditioning, generator(5))
    assert torch.equal(first.pixels, again.pixels) and first[1:4] == again[1:4]
    assert torch.equal(first.conditioning_pixels, again.conditioning_pixels)
    assert any(not torch.equal(transform(image, conditioning, generator(seed)).conditioning_pixels,
                               first.conditioning_pixels) for seed in range(10))
