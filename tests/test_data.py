"""Datasets and preprocessing of training_utils.data.datasets: exact crops, seeded augmentations, checked inputs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from training_utils.args import training_parser
from training_utils.data.datasets import TrainDataset, load_train_dataset, pick_caption, sample_generator
from training_utils.data.images import ImageTransform
from training_utils.errors import UsageError
from training_utils.testing.tiny.data import COLORS, SHAPES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLUMNS = {"--image_column": "image", "--caption_column": "text"}


def position_image(height, width):
    """An RGB image whose pixel (y, x) is (x, y, 7): its values say where they came from."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[..., 0] = np.arange(width)[None, :]
    pixels[..., 1] = np.arange(height)[:, None]
    pixels[..., 2] = 7
    return Image.fromarray(pixels)


def decode(tensor):
    """The uint8 values a [-1, 1] CHW tensor was made from, as HWC."""
    values = np.rint((tensor.permute(1, 2, 0).numpy() + 1.0) * 127.5)
    return values.astype(np.int64)


def generator(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# ImageTransform


def test_output_shape_dtype_and_range():
    image = Image.fromarray(np.array([[[0, 255, 128]] * 40] * 24, dtype=np.uint8))
    pixels, original_size, crop, _, _ = ImageTransform(16, center_crop=True)(image, generator(0))
    assert pixels.shape == (3, 16, 16)
    assert pixels.dtype == torch.float32
    assert pixels.is_contiguous()
    assert original_size == (24, 40)
    # 0 -> -1, 255 -> 1 exactly; 128 just above 0
    assert torch.all(pixels[0] == -1.0)
    assert torch.all(pixels[1] == 1.0)
    assert torch.allclose(pixels[2], torch.full((16, 16), 128 / 127.5 - 1.0), atol=1e-6)
    assert pixels.min() >= -1.0 and pixels.max() <= 1.0


def test_grayscale_and_rgba_become_three_channels():
    gray = Image.fromarray(np.full((8, 8), 200, dtype=np.uint8), mode="L")
    rgba = Image.fromarray(np.full((8, 8, 4), 50, dtype=np.uint8), mode="RGBA")
    for image in (gray, rgba):
        pixels = ImageTransform(8, center_crop=True)(image, generator(0)).pixels
        assert pixels.shape == (3, 8, 8)
    pixels = ImageTransform(8, center_crop=True)(gray, generator(0)).pixels
    assert torch.allclose(pixels, torch.full((3, 8, 8), 200 / 127.5 - 1.0), atol=1e-6)


@pytest.mark.parametrize("height, width", [(32, 48), (48, 32), (32, 33), (40, 40)])
def test_center_crop_takes_the_exact_centre(height, width):
    # the short side already equals the resolution, so nothing is resampled
    resolution = min(height, width)
    image = position_image(height, width)
    pixels, original_size, (top, left), _, _ = ImageTransform(resolution, center_crop=True)(image, generator(0))
    assert original_size == (height, width)
    assert (top, left) == ((height - resolution) // 2, (width - resolution) // 2)
    values = decode(pixels)
    assert np.array_equal(values[..., 0], np.broadcast_to(np.arange(left, left + resolution)[None, :],
                                                          (resolution, resolution)))
    assert np.array_equal(values[..., 1], np.broadcast_to(np.arange(top, top + resolution)[:, None],
                                                          (resolution, resolution)))
    assert np.all(values[..., 2] == 7)


def test_center_crop_ignores_generator():
    image = position_image(32, 64)
    transform = ImageTransform(32, center_crop=True, random_flip=False)
    outputs = [transform(image, generator(seed)) for seed in range(5)]
    for pixels, size, crop, _, _ in outputs[1:]:
        assert torch.equal(pixels, outputs[0][0])
        assert crop == outputs[0][2] == (0, 16)


def test_resize_scales_the_short_side_to_the_resolution():
    image = position_image(64, 96)
    pixels, original_size, (top, left), _, _ = ImageTransform(32, center_crop=True)(image, generator(0))
    # resized to 32 x 48: centre crop at left 8, and the original size is the size before resizing
    assert original_size == (64, 96)
    assert (top, left) == (0, 8)
    assert pixels.shape == (3, 32, 32)
    values = decode(pixels)
    # x coordinate of the resized column c is about 2c (+0.5 from bilinear sampling)
    columns = values[0, :, 0]
    assert np.all(np.abs(columns - (2 * (np.arange(32) + 8) + 0.5)) <= 1.0)


@pytest.mark.parametrize("interpolation, resample", [("bilinear", Image.BILINEAR), ("lanczos", Image.LANCZOS),
                                                     ("nearest_exact", Image.NEAREST)])
def test_the_interpolation_names_the_resize_filter(interpolation, resample):
    # A checkerboard shrinks to other pixels under each filter: the transform's are those of PIL's filter named.
    image = Image.fromarray((np.indices((48, 48)).sum(0) % 2 * 255).astype(np.uint8)).convert("RGB")
    pixels = ImageTransform(16, center_crop=True, interpolation=interpolation)(image, generator(0)).pixels
    expected = np.asarray(image.resize((16, 16), resample), dtype=np.float32) / 127.5 - 1
    assert torch.equal(pixels, torch.from_numpy(expected).permute(2, 0, 1))
    args = training_parser("test", interpolation="lanczos").parse_args(["--pretrained_model_name_or_path", "x"])
    assert args.image_interpolation_mode == "lanczos"


def test_small_image_is_upscaled():
    image = position_image(10, 20)
    pixels, original_size, (top, left), _, _ = ImageTransform(16, center_crop=True)(image, generator(0))
    assert pixels.shape == (3, 16, 16)
    assert original_size == (10, 20)
    assert top == 0 and left == (32 - 16) // 2


def random_crop_matches_returned_position(image, pixels, top, left, resolution, flipped):
    """Whether the output is the crop (after an optional flip) at the returned (top, left)."""
    values = decode(pixels)
    width = image.width
    xs, ys = values[..., 0], values[..., 1]
    if flipped:
        # in the flipped image, column c shows original column width - 1 - c
        xs = width - 1 - xs
    expected_x = np.broadcast_to(np.arange(left, left + resolution)[None, :], (resolution, resolution))
    expected_y = np.broadcast_to(np.arange(top, top + resolution)[:, None], (resolution, resolution))
    return np.array_equal(xs, expected_x) and np.array_equal(ys, expected_y)


def is_flipped(pixels):
    values = decode(pixels)
    return values[0, 0, 0] > values[0, -1, 0]


@pytest.mark.parametrize("height, width", [(32, 56), (56, 32)])
def test_random_crop_returns_its_position(height, width):
    # the short side equals the resolution: no resampling, the crop slides along the long side
    image = position_image(height, width)
    transform = ImageTransform(32, center_crop=False, random_flip=False)
    positions = set()
    for seed in range(20):
        pixels, original_size, (top, left), _, _ = transform(image, generator(seed))
        assert original_size == (height, width)
        assert 0 <= top <= height - 32 and 0 <= left <= width - 32
        assert not is_flipped(pixels)
        assert random_crop_matches_returned_position(image, pixels, top, left, 32, flipped=False)
        positions.add((top, left))
    assert len(positions) > 5


@pytest.mark.parametrize("height, width", [(32, 56), (56, 32)])
def test_random_crop_with_flip_returns_position_in_flipped_image(height, width):
    image = position_image(height, width)
    transform = ImageTransform(32, center_crop=False, random_flip=True)
    flips = []
    for seed in range(30):
        pixels, original_size, (top, left), _, _ = transform(image, generator(seed))
        flipped = is_flipped(pixels)
        flips.append(flipped)
        assert original_size == (height, width)
        assert 0 <= top <= height - 32 and 0 <= left <= width - 32
        assert random_crop_matches_returned_position(image, pixels, top, left, 32, flipped)
    assert any(flips) and not all(flips)


def test_center_crop_with_flip_reports_mirrored_left():
    image = position_image(32, 51)
    transform = ImageTransform(32, center_crop=True, random_flip=True)
    seen = set()
    for seed in range(20):
        pixels, _, (top, left), _, _ = transform(image, generator(seed))
        flipped = is_flipped(pixels)
        seen.add(flipped)
        # the centre crop's left is 9 in the image and 51 - 9 - 32 = 10 in the mirrored one
        assert left == (10 if flipped else 9)
        assert random_crop_matches_returned_position(image, pixels, top, left, 32, flipped)
    assert seen == {True, False}


def test_random_augmentation_is_a_function_of_the_generator():
    image = position_image(48, 64)
    transform = ImageTransform(32, center_crop=False, random_flip=True)
    first = transform(image, generator(123))
    again = transform(image, generator(123))
    assert torch.equal(first[0], again[0])
    assert first[1:] == again[1:]
    # the global RNG plays no part
    torch.manual_seed(1)
    a = transform(image, generator(5))
    torch.manual_seed(2)
    b = transform(image, generator(5))
    assert torch.equal(a[0], b[0]) and a[2] == b[2]
    differs = [not torch.equal(transform(image, generator(seed))[0], first[0]) for seed in range(20)]
    assert any(differs)


def test_no_flip_without_random_flip():
    image = position_image(32, 32)
    transform = ImageTransform(32, center_crop=False, random_flip=False)
    for seed in range(10):
        pixels, _, crop, _, _ = transform(image, generator(seed))
        assert crop == (0, 0)
        assert np.array_equal(decode(pixels), np.asarray(image, dtype=np.int64))


# ---------------------------------------------------------------------------------------------
# captions and tokens


def test_pick_caption_string_is_returned_as_is():
    assert pick_caption("a red circle", generator(0)) == "a red circle"


def test_pick_caption_from_list_follows_the_generator():
    captions = ["one", "two", "three", "four"]
    for seed in range(10):
        expected = captions[int(torch.randint(0, 4, (1,), generator=generator(seed)))]
        assert pick_caption(captions, generator(seed)) == expected
        assert pick_caption(tuple(captions), generator(seed)) == expected
    chosen = {pick_caption(captions, generator(seed)) for seed in range(40)}
    assert chosen == set(captions)
    assert pick_caption(["only"], generator(3)) == "only"


@pytest.mark.parametrize("value", [None, 5, [], (), {"text": "x"}, b"bytes"])
def test_pick_caption_bad_type_raises_usage_error(value):
    with pytest.raises(UsageError, match="--caption_column"):
        pick_caption(value, generator(0))


def test_pick_caption_names_the_given_flag():
    with pytest.raises(UsageError, match="--text_column"):
        pick_caption(3.5, generator(0), flag="--text_column")


# ---------------------------------------------------------------------------------------------
# per-sample generators and the dataset


def first_draws(gen, n=4):
    return torch.randint(0, 2**62, (n,), generator=gen).tolist()


def test_sample_generator_is_deterministic():
    assert first_draws(sample_generator(0, 1, 2)) == first_draws(sample_generator(0, 1, 2))
    assert sample_generator(3, 4, 5).initial_seed() == sample_generator(3, 4, 5).initial_seed()


def test_sample_generator_differs_across_epoch_index_and_seed():
    draws = {}
    for seed in (0, 1):
        for epoch in range(4):
            for index in range(16):
                draws[(seed, epoch, index)] = tuple(first_draws(sample_generator(seed, epoch, index)))
    assert len(set(draws.values())) == len(draws)
    # swapping epoch and index is a different sample
    assert first_draws(sample_generator(0, 1, 2)) != first_draws(sample_generator(0, 2, 1))


def test_sample_generator_does_not_depend_on_python_hash_seed():
    # a resumed run is a new process: its augmentations must match those of the first run
    code = ("from training_utils.data.datasets import sample_generator; "
            "print(sample_generator(7, 3, 11).initial_seed())")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                            check=True)
    assert int(result.stdout.strip().splitlines()[-1]) == sample_generator(7, 3, 11).initial_seed()


def test_sample_generator_ignores_global_rng():
    torch.manual_seed(0)
    a = first_draws(sample_generator(1, 0, 0))
    torch.manual_seed(99)
    torch.rand(10)
    b = first_draws(sample_generator(1, 0, 0))
    assert a == b


def test_train_dataset_uses_per_sample_generators():
    calls = []

    def preprocess(example, gen):
        calls.append(example)
        return example, torch.rand((), generator=gen).item()

    dataset = TrainDataset(["a", "b", "c"], preprocess, seed=5)
    assert len(dataset) == 3
    assert dataset[1][0] == "b"
    epoch0 = [dataset[i][1] for i in range(3)]
    assert [dataset[i][1] for i in range(3)] == epoch0  # same epoch, same draws
    assert len(set(epoch0)) == 3
    assert epoch0[2] == torch.rand((), generator=sample_generator(5, 0, 2)).item()
    dataset.set_epoch(1)
    epoch1 = [dataset[i][1] for i in range(3)]
    assert all(a != b for a, b in zip(epoch0, epoch1))
    assert epoch1[0] == torch.rand((), generator=sample_generator(5, 1, 0)).item()
    dataset.set_epoch(0)
    assert [dataset[i][1] for i in range(3)] == epoch0


def test_train_dataset_set_epoch_changes_image_augmentation():
    image = position_image(48, 64)
    transform = ImageTransform(32, center_crop=False, random_flip=True)
    dataset = TrainDataset([image] * 4, lambda example, gen: transform(example, gen), seed=0)
    by_epoch = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        by_epoch.append([(dataset[i][2], is_flipped(dataset[i][0])) for i in range(4)])
    dataset.set_epoch(0)
    assert [(dataset[i][2], is_flipped(dataset[i][0])) for i in range(4)] == by_epoch[0]
    assert by_epoch[0] != by_epoch[1] and by_epoch[1] != by_epoch[2]


# ---------------------------------------------------------------------------------------------
# load_train_dataset


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("datasets_cache")


def data_args(*argv):
    return training_parser("x").parse_args(["--pretrained_model_name_or_path", "a/b", *map(str, argv)])


def test_load_tiny_shapes(tiny, cache_dir):
    dataset = load_train_dataset(data_args("--train_data_dir", tiny["shapes"], "--cache_dir", cache_dir), COLUMNS)
    assert len(dataset) == 36
    assert set(dataset.column_names) == {"image", "text"}
    example = dataset[0]
    assert isinstance(example["image"], Image.Image)
    assert example["image"].size == (64, 64)
    records = [json.loads(line) for line in (tiny["shapes"] / "metadata.jsonl").read_text().splitlines()]
    assert sorted(dataset["text"]) == sorted(record["text"] for record in records)
    assert any(color in example["text"] for color in COLORS) and any(shape in example["text"] for shape in SHAPES)


def test_max_train_samples(tiny, cache_dir):
    dataset = load_train_dataset(data_args("--train_data_dir", tiny["shapes"], "--cache_dir", cache_dir,
                                           "--max_train_samples", 5), COLUMNS)
    full = load_train_dataset(data_args("--train_data_dir", tiny["shapes"], "--cache_dir", cache_dir), COLUMNS)
    assert len(dataset) == 5
    assert dataset["text"] == full["text"][:5]
    more = load_train_dataset(data_args("--train_data_dir", tiny["shapes"], "--cache_dir", cache_dir,
                                        "--max_train_samples", 1000), COLUMNS)
    assert len(more) == 36


@pytest.mark.parametrize("flag, column", [("--caption_column", "caption"), ("--image_column", "picture")])
def test_missing_column_names_the_flag(tiny, cache_dir, flag, column):
    args = data_args("--train_data_dir", tiny["shapes"], "--cache_dir", cache_dir, flag, column)
    columns = {"--image_column": args.image_column, "--caption_column": args.caption_column}
    with pytest.raises(UsageError) as raised:
        load_train_dataset(args, columns)
    message = str(raised.value)
    assert message.startswith(f"{flag}={column!r}")
    assert "image" in message and "text" in message  # lists what the dataset has


def test_empty_folder(tmp_path, cache_dir):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="--train_data_dir"):
        load_train_dataset(data_args("--train_data_dir", tmp_path / "empty", "--cache_dir", cache_dir), COLUMNS)


def test_folder_without_images(tmp_path, cache_dir):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "metadata.jsonl").write_text('{"file_name": "x.png", "text": "a"}\n')
    with pytest.raises(UsageError, match="--train_data_dir"):
        load_train_dataset(data_args("--train_data_dir", tmp_path / "texts", "--cache_dir", cache_dir), COLUMNS)


def test_nonexistent_folder(tmp_path, cache_dir):
    with pytest.raises(UsageError, match="--train_data_dir") as raised:
        load_train_dataset(data_args("--train_data_dir", tmp_path / "nope", "--cache_dir", cache_dir), COLUMNS)
    assert "nope" in str(raised.value)


def test_a_file_is_not_a_folder(tmp_path, cache_dir):
    path = tmp_path / "image.png"
    position_image(8, 8).save(path)
    with pytest.raises(UsageError, match="--train_data_dir"):
        load_train_dataset(data_args("--train_data_dir", path, "--cache_dir", cache_dir), COLUMNS)


@pytest.mark.parametrize("both", [True, False])
def test_exactly_one_of_dataset_name_and_train_data_dir(tiny, cache_dir, both):
    argv = ["--cache_dir", cache_dir]
    if both:
        argv += ["--train_data_dir", tiny["shapes"], "--dataset_name", "some/dataset"]
    with pytest.raises(UsageError, match="--dataset_name/--train_data_dir"):
        load_train_dataset(data_args(*argv), COLUMNS)


def test_dataset_name_local_folder(tiny, cache_dir):
    # --dataset_name also takes a local dataset folder, as load_dataset does
    dataset = load_train_dataset(data_args("--dataset_name", tiny["shapes"], "--cache_dir", cache_dir), COLUMNS)
    assert len(dataset) == 36
    assert set(dataset.column_names) == {"image", "text"}


@pytest.mark.parametrize("line, problem", [('{"file_name": "a.png", "text": "a"', "is not"),
                                           ('["a.png"]', "is a list")])
def test_a_malformed_metadata_line_names_the_file_and_line(tmp_path, line, problem):
    from training_utils.data.datasets import load_train_dataset
    from training_utils.errors import UsageError

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    metadata = tmp_path / "metadata.jsonl"
    metadata.write_text('{"file_name": "a.png", "text": "a"}\n' + line + "\n")
    args = training_parser("test").parse_args(["--pretrained_model_name_or_path", "x/y", "--train_data_dir",
                                               str(tmp_path)])
    with pytest.raises(UsageError, match=f"^--train_data_dir='{tmp_path}': expected one JSON object per line in "
                                         f"{metadata}: line 2 {problem}"):
        load_train_dataset(args, {})
