"""ImageWithConditioningTransform: an image and its conditioning image get one resize, crop and flip."""

import numpy as np
import pytest
import torch
from PIL import Image

from test_data import decode, generator, position_image
from training_utils.data import ImageTransform, ImageWithConditioningTransform


def from_unit(tensor):
    """The uint8 values a [0, 1] CHW tensor was made from, as HWC."""
    return np.rint(tensor.permute(1, 2, 0).numpy() * 255.0).astype(np.int64)


@pytest.mark.parametrize("height, width", [(32, 56), (56, 32), (48, 64)])
def test_both_images_get_the_same_crop_and_flip(height, width):
    image = position_image(height, width)
    transform = ImageWithConditioningTransform(32, center_crop=False, random_flip=True)
    flips, crops = set(), set()
    for seed in range(30):
        pixels, conditioning, original_size, crop = transform(image, image.copy(), generator(seed))
        assert original_size == (height, width)
        assert np.array_equal(decode(pixels), from_unit(conditioning))
        values = decode(pixels)
        flips.add(bool(values[0, 0, 0] > values[0, -1, 0]))
        crops.add(crop)
    assert flips == {True, False}
    assert len(crops) > 3


@pytest.mark.parametrize("center_crop, random_flip", [(False, True), (True, True), (False, False)])
def test_image_matches_image_transform_with_the_same_generator(center_crop, random_flip):
    image, conditioning = position_image(40, 72), position_image(40, 72).rotate(180)
    with_conditioning = ImageWithConditioningTransform(32, center_crop, random_flip)
    single = ImageTransform(32, center_crop, random_flip)
    for seed in range(10):
        pixels, _, original_size, crop = with_conditioning(image, conditioning, generator(seed))
        expected_pixels, expected_size, expected_crop = single(image, generator(seed))
        assert torch.equal(pixels, expected_pixels)
        assert (original_size, crop) == (expected_size, expected_crop)


def test_ranges_dtypes_and_shapes():
    image = Image.fromarray(np.array([[[0, 255, 128]] * 40] * 24, dtype=np.uint8))
    pixels, conditioning, _, _ = ImageWithConditioningTransform(16, center_crop=True)(image, image, generator(0))
    for tensor in (pixels, conditioning):
        assert tensor.shape == (3, 16, 16) and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert torch.all(pixels[0] == -1.0) and torch.all(pixels[1] == 1.0)
    assert torch.all(conditioning[0] == 0.0) and torch.all(conditioning[1] == 1.0)
    assert torch.allclose(conditioning[2], torch.tensor(128 / 255))


def test_grayscale_and_rgba_conditioning_become_three_channels():
    image = position_image(32, 32)
    for mode, white in (("L", 255), ("RGBA", (255, 255, 255, 255)), ("1", 1)):
        conditioning = Image.new(mode, (32, 32), white)
        _, pixels, _, _ = ImageWithConditioningTransform(32)(image, conditioning, generator(0))
        assert pixels.shape == (3, 32, 32) and torch.all(pixels == 1.0), mode


def test_conditioning_of_another_size_is_mapped_onto_the_image_geometry():
    # A vertical edge at 5/8 of the width, in an image and in a conditioning image twice its size.
    def edge(height, width):
        pixels = np.zeros((height, width, 3), dtype=np.uint8)
        pixels[:, width * 5 // 8:] = 255
        return Image.fromarray(pixels)

    transform = ImageWithConditioningTransform(32, center_crop=False, random_flip=True)
    flips = set()
    for seed in range(20):
        pixels, conditioning, _, _ = transform(edge(40, 64), edge(80, 128), generator(seed))
        image_row = decode(pixels)[0, :, 0] > 127
        conditioning_row = from_unit(conditioning)[0, :, 0] > 127
        # Resampling from another size may move the edge by a pixel, never more.
        assert np.count_nonzero(image_row != conditioning_row) <= 1
        flips.add(bool(image_row[0]))
    assert flips == {True, False}


def test_output_is_a_function_of_the_generator_alone():
    image, conditioning = position_image(48, 64), position_image(48, 64).rotate(90)
    transform = ImageWithConditioningTransform(32, center_crop=False, random_flip=True)
    torch.manual_seed(1)
    first = transform(image, conditioning, generator(5))
    torch.manual_seed(2)
    again = transform(image, conditioning, generator(5))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1]) and first[2:] == again[2:]
    assert any(not torch.equal(transform(image, conditioning, generator(seed))[1], first[1]) for seed in range(10))
