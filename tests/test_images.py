"""Images as cameras and editors write them (training_utils.data.images.read_image, image_sizes): upright by their
EXIF orientation, and 8-bit however many bits they have, on every path that reads one. Every file is made here."""

import numpy as np
import pytest
import torch
from PIL import Image

from training_utils.args import training_parser
from training_utils.data.buckets import AspectRatioBuckets, on_the_fly_buckets
from training_utils.data.datasets import dataset_shapes, load_train_dataset
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ORIENTATION, ImageTransform, image_sizes, read_image

# How a camera stores a picture it tags with each EXIF orientation: the transpose that the tag then undoes.
STORED_FOR_ORIENTATION = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
                          4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE,
                          6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_270}


def upright_picture(width=24, height=40):
    """An RGB picture whose every pixel differs from its mirror images and rotations."""
    rows, columns = np.mgrid[0:height, 0:width]
    return Image.fromarray(np.stack([rows * 6, columns * 10, (rows * width + columns) % 251], -1).astype(np.uint8))


def save_rotated(upright, path, orientation):
    """``upright`` stored as a camera stores it with ``orientation`` in its EXIF data (losslessly: PNG's eXIf)."""
    exif = Image.Exif()
    exif[ORIENTATION] = orientation
    upright.transpose(STORED_FOR_ORIENTATION[orientation]).save(path, exif=exif)
    return path


def gradient():
    """An 8-bit grayscale gradient over the whole range, as the reference of the deeper images."""
    return np.tile(np.arange(256, dtype=np.uint8), (4, 1))


def pixels(image):
    return np.asarray(image)


@pytest.mark.parametrize("orientation", sorted(STORED_FOR_ORIENTATION))
def test_an_image_stored_rotated_is_read_upright_and_sized_upright(tmp_path, orientation):
    upright = upright_picture()
    path = save_rotated(upright, tmp_path / "photo.png", orientation)
    assert Image.open(path).size != upright.size or orientation in (2, 3, 4)
    read = read_image(path)
    assert np.array_equal(pixels(read), pixels(upright))
    assert image_sizes([path, {"path": None, "bytes": path.read_bytes()}]) == [upright.size] * 2
    assert np.array_equal(pixels(read_image(read)), pixels(upright)), "the orientation must apply once only"


def test_a_jpeg_from_a_camera_is_sized_and_read_upright(tmp_path):
    path = save_rotated(upright_picture(32, 48), tmp_path / "photo.jpg", 6)
    assert Image.open(path).size == (48, 32)
    assert read_image(path).size == image_sizes([path])[0] == (32, 48)


# How editors and instruments store the 8-bit gradient in more bits: (file suffix, the values as stored).
DEEP_IMAGES = {
    "16-bit PNG": (".png", lambda levels: levels.astype(np.uint16) * 257),
    "16-bit TIFF": (".tif", lambda levels: levels.astype(np.uint16) * 257),
    "32-bit float TIFF in [0, 1]": (".tif", lambda levels: (levels / 255).astype(np.float32)),
    "32-bit float TIFF in [0, 255]": (".tif", lambda levels: levels.astype(np.float32)),
    "32-bit integer TIFF of 16-bit values": (".tif", lambda levels: levels.astype(np.int32) * 257),
}


@pytest.mark.parametrize("mode", DEEP_IMAGES)
def test_a_deep_image_is_scaled_to_8_bits_not_clipped(tmp_path, mode):
    suffix, stored = DEEP_IMAGES[mode]
    path = tmp_path / f"deep{suffix}"
    Image.fromarray(stored(gradient())).save(path)
    read = read_image(path)
    assert read.mode == "RGB" and Image.open(path).mode != "RGB"
    assert np.array_equal(pixels(read), np.repeat(gradient()[..., None], 3, -1)), mode


def test_datasets_images_train_as_the_upright_8_bit_pictures_they_show(tmp_path):
    """An imagefolder's rows, decoded by datasets, laid out with buckets: the rotated photo goes to the bucket of its
    upright shape and trains as the upright picture; the 16-bit gradient trains as the 8-bit one."""
    folder = tmp_path / "data"
    folder.mkdir()
    upright = upright_picture(64, 128)
    save_rotated(upright, folder / "rotated.png", 8)
    Image.fromarray(np.repeat(gradient(), 32, 0).astype(np.uint16) * 257).save(folder / "deep.png")
    (folder / "metadata.jsonl").write_text('{"file_name": "rotated.png", "text": "a"}\n'
                                           '{"file_name": "deep.png", "text": "b"}\n')
    args = training_parser("test").parse_args(["--pretrained_model_name_or_path", "x/y", "--train_data_dir",
                                               str(folder), "--cache_dir", str(tmp_path / "cache")])
    dataset = load_train_dataset(args, {"--image_column": "image", "--caption_column": "text"})
    transform = ImageTransform(64, center_crop=True, buckets=AspectRatioBuckets(on_the_fly_buckets(64, 8), 8))
    shapes = dataset_shapes(transform, dataset, "image")
    references = [upright, Image.fromarray(np.repeat(gradient(), 32, 0))]
    for row, shape, reference in zip(dataset, shapes, references):
        assert shape == transform.shape_of(*reference.size)
        generator = torch.Generator().manual_seed(0)
        expected = transform(reference, torch.Generator().manual_seed(0), shape).pixels
        assert torch.equal(transform(row["image"], generator, shape).pixels, expected)


@pytest.mark.parametrize("cache_latents", [False, True])
def test_dreambooth_files_train_upright(tmp_path, cache_latents, tiny_sd_pipe):
    upright = upright_picture(32, 48)
    rotated = save_rotated(upright, tmp_path / "rotated.png", 6)
    upright.save(tmp_path / "upright.png")
    transform = ImageTransform(16, center_crop=True, buckets=AspectRatioBuckets(on_the_fly_buckets(16, 8), 8))
    laid_out = []
    for path in (rotated, tmp_path / "upright.png"):
        encoders = FrozenEncoders(tiny_sd_pipe.vae, [], transform, "cpu", torch.float32, cache_latents=cache_latents)
        shape = transform.shapes(image_sizes([path]))[0]
        encoders.cache_image_files([(path, shape)])
        laid_out.append(encoders.image_file(path, torch.Generator().manual_seed(0), shape))
    assert laid_out[0].original_size == laid_out[1].original_size == (48, 32)
    assert torch.equal(laid_out[0].pixels, laid_out[1].pixels)
