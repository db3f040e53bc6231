"""training_utils.data.dreambooth: checked inputs, instance and class data (prompts, repeats, caption dropout, buckets),
side-effect-free class images."""

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from training_utils.args import TrainingArgumentParser
from training_utils.data.buckets import AspectRatioBuckets, on_the_fly_buckets
from training_utils.data.datasets import make_dataloader, sample_generator
from training_utils.data.dreambooth import (EmbeddedImage, InstanceImages, add_dreambooth_args, check_dreambooth_args,
                                            dreambooth_dataset, dreambooth_prompts, generate_class_images,
                                            instance_images_from_args, instance_then_class_collate, list_images,
                                            training_captions)
from training_utils.data.flags import add_data_args
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform, read_image
from training_utils.data.prompts import cached_rows
from training_utils.errors import UsageError


def solid(path, value, size=(12, 8)):
    Image.new("RGB", size, (value, value, value)).save(path)
    return path


def gradient(path, size=(64, 16)):
    """An image whose columns all differ: where a random crop lands shows in its pixels."""
    width, height = size
    Image.fromarray(np.tile(np.arange(width, dtype=np.uint8)[None, :, None], (height, 1, 3))).save(path)
    return path


def buckets_of(resolution, multiple=8):
    """The on-the-fly buckets a script makes for ``--resolution`` (`AspectRatioBuckets.from_args`)."""
    return AspectRatioBuckets(on_the_fly_buckets(resolution, multiple), multiple)


def scaled(value):
    """A uint8 pixel value as ImageTransform scales it, computed the same way (float32)."""
    return float(np.float32(value) / np.float32(127.5) - np.float32(1.0))


def parse(*argv):
    parser = TrainingArgumentParser()
    add_data_args(parser)
    add_dreambooth_args(parser)
    return parser.parse_args([str(arg) for arg in argv])


def checked_instance_images(args):
    """What a script does with ``args``: check the flags (its parse_args), then list the images (its main)."""
    check_dreambooth_args(args)
    return instance_images_from_args(args)


@pytest.fixture
def instance_dir(tmp_path):
    folder = tmp_path / "instance"
    folder.mkdir()
    for index in range(3):
        solid(folder / f"{index}.png", 10 * index)
    return folder


# ---------------------------------------------------------------------------------------------
# Inputs


def test_list_images_keeps_image_files_sorted_by_name(tmp_path):
    for name in ("b.JPG", "a.png", "c.webp", "notes.txt", ".c.png.partial"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "sub.png").mkdir()
    assert [path.name for path in list_images(tmp_path)] == ["a.png", "b.JPG", "c.webp"]
    assert list_images(tmp_path / "missing") == []


def test_the_instance_images_are_the_folders_with_the_instance_prompt(instance_dir):
    args = parse("--instance_data_dir", instance_dir, "--instance_prompt", "a photo of sks dog")
    instance = checked_instance_images(args)
    assert [path.name for path in instance.images] == ["0.png", "1.png", "2.png"]
    assert instance.captions == ["a photo of sks dog"] * 3
    assert (args.num_class_images, args.prior_loss_weight, args.sample_batch_size) == (100, 1.0, 4)


def test_upstreams_pre_compute_text_embeddings_is_accepted_unless_the_text_encoder_trains(instance_dir):
    flags = ["--instance_data_dir", instance_dir, "--instance_prompt", "a dog", "--pre_compute_text_embeddings"]
    check_dreambooth_args(parse(*flags))
    args = parse(*flags)
    args.train_text_encoder = True
    with pytest.raises(UsageError, match="^--pre_compute_text_embeddings=True: expected no --train_text_encoder"):
        check_dreambooth_args(args)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--with_prior_preservation", "--class_prompt", "a dog"],
         "--class_data_dir=None: expected a folder for the class images with --with_prior_preservation"),
        (["--with_prior_preservation", "--class_data_dir", "{tmp}/class"],
         "--class_prompt=None: expected a non-empty prompt with --with_prior_preservation"),
        (["--with_prior_preservation", "--class_data_dir", "{tmp}/instance/0.png", "--class_prompt", "a dog"],
         "--class_data_dir='{tmp}/instance/0.png': expected a folder"),
        (["--num_class_images", "0"], "--num_class_images=0: expected a positive integer"),
        (["--sample_batch_size", "0"], "--sample_batch_size=0: expected a positive integer"),
        (["--class_inference_steps", "0"], "--class_inference_steps=0: expected a positive integer"),
        (["--prior_loss_weight", "-1"], "--prior_loss_weight=-1.0: expected a non-negative number"),
    ],
)
def test_check_rejects_bad_combinations(instance_dir, extra, message):
    tmp = instance_dir.parent
    args = parse("--instance_data_dir", instance_dir, "--instance_prompt", "a photo of sks dog",
                 *[value.format(tmp=tmp) for value in extra])
    with pytest.raises(UsageError) as error:
        check_dreambooth_args(args)
    assert str(error.value).startswith(message.format(tmp=tmp))


def test_check_rejects_a_missing_or_empty_instance_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("no images")
    for folder, expected in (("missing", "an existing folder"), ("empty", "a folder holding images")):
        args = parse("--instance_data_dir", tmp_path / folder, "--instance_prompt", "a dog")
        with pytest.raises(UsageError, match=expected):
            checked_instance_images(args)


def test_an_empty_instance_prompt_trains_unprompted_with_a_warning_where_an_image_takes_it(tmp_path, caplog):
    for name in ("a.png", "b.png"):
        (tmp_path / name).write_bytes(b"")
    args = parse("--instance_data_dir", tmp_path, "--instance_prompt", "")
    assert checked_instance_images(args).captions == ["", ""]
    assert "--instance_prompt='' is empty: the adapter learns the subject without a trigger word" in caplog.text
    caplog.clear()
    (tmp_path / "a.txt").write_text("a red circle")
    (tmp_path / "b.txt").write_text("a blue square")
    args = parse("--instance_data_dir", tmp_path, "--instance_prompt", " ", "--caption_extension", ".txt")
    assert checked_instance_images(args).captions == ["a red circle", "a blue square"]
    assert "--instance_prompt" not in caplog.text


# ---------------------------------------------------------------------------------------------
# Dataset and collate


def captioned(images, prompt=""):
    return InstanceImages.captioned_by(images, prompt)


def pixels_of(transform, vae=None):
    """`FrozenEncoders` that give the images' pixels (or, with ``vae``, their cached latent parameters)."""
    return FrozenEncoders(vae, [], transform, "cpu", torch.float32, cache_latents=vae is not None, batch_size=3)


def test_dataset_pairs_every_instance_image_with_a_cycling_class_image(tmp_path, instance_dir):
    class_dir = tmp_path / "class"
    class_dir.mkdir()
    class_images = [solid(class_dir / f"{index}.png", 100 + 10 * index) for index in range(5)]
    pixels = pixels_of(ImageTransform(8, center_crop=True))
    dataset = dreambooth_dataset(captioned(list_images(instance_dir), "sks"), class_images, pixels, 0,
                                 class_prompt="dog")
    assert len(dataset) == 5
    for index in range(5):
        example = dataset[index]
        assert example.keys() == {"instance", "class", "instance_layout", "class_layout", "prompt", "class_prompt"}
        assert (example["prompt"], example["class_prompt"]) == ("sks", "dog")
        assert example["instance"].shape == (3, 8, 8)
        # Solid grey images: the pixel value says which file was read.
        assert torch.all(example["instance"] == scaled(10 * (index % 3)))
        assert torch.all(example["class"] == scaled(100 + 10 * index))


def test_dataset_without_class_images_has_the_instance_images_only(instance_dir):
    dataset = dreambooth_dataset(captioned(list_images(instance_dir), "sks"), None, pixels_of(ImageTransform(8)), 0)
    assert len(dataset) == 3
    assert dataset[1].keys() == {"instance", "instance_layout", "prompt"} and dataset[1]["prompt"] == "sks"


def test_random_crops_are_seeded_per_sample_and_epoch(tmp_path):
    images = [gradient(tmp_path / "wide.png")]

    def crops(seed, epoch):
        dataset = dreambooth_dataset(captioned(images), None, pixels_of(ImageTransform(16)), seed)
        dataset.set_epoch(epoch)
        return [dataset[0]["instance"] for _ in range(2)]

    first, again = crops(0, 0)
    assert torch.equal(first, again)
    assert torch.equal(first, crops(0, 0)[0])
    others = [crops(seed, epoch)[0] for seed, epoch in ((1, 0), (0, 1), (2, 0), (0, 2))]
    assert any(not torch.equal(first, other) for other in others)


@pytest.mark.parametrize("instance_sizes, buckets", [([(40, 32), (40, 32)], None),
                                                    ([(40, 32), (24, 48)], buckets_of(32))])
def test_with_cached_latents_the_dataset_draws_the_flips_the_uncached_one_draws(tmp_path, tiny_sd_pipe,
                                                                                instance_sizes, buckets):
    # With buckets the one class image pairs with instance images of two buckets: it is cached at both shapes.
    for kind, colour, sizes in (("instance", (200, 30, 30), instance_sizes), ("class", (30, 30, 200), [(40, 32)])):
        (tmp_path / kind).mkdir()
        for index, (width, height) in enumerate(sizes):
            image = Image.new("RGB", (width, height), colour)
            image.paste((0, 255, 0), (0, 0, 6 + 4 * index, height))  # asymmetric: a flip changes the latents
            image.save(tmp_path / kind / f"{index}.png")
    transform = ImageTransform(32, center_crop=True, random_flip=True, buckets=buckets)
    instance_images, class_images = list_images(tmp_path / "instance"), list_images(tmp_path / "class")
    uncached = dreambooth_dataset(captioned(instance_images), class_images, pixels_of(transform), 5)
    cached = dreambooth_dataset(captioned(instance_images), class_images, pixels_of(transform, tiny_sd_pipe.vae), 5)
    stripe_on_the_left = set()
    for epoch in range(3):
        uncached.set_epoch(epoch)
        cached.set_epoch(epoch)
        for index in range(2):
            latents = instance_then_class_collate([cached[index]])["images"]
            pixels = instance_then_class_collate([uncached[index]])["images"]
            stripe_on_the_left.add(bool(pixels[0, 1, 0, 0] > 0))  # green: unflipped
            with torch.no_grad():
                expected = tiny_sd_pipe.vae.encode(pixels).latent_dist.parameters
            torch.testing.assert_close(latents, expected, atol=1e-5, rtol=1e-5)
    assert stripe_on_the_left == {False, True}  # both flips drawn
    shapes = {tuple(uncached[index]["instance"].shape[1:]) for index in range(2)}
    assert len(shapes) == (1 if buckets is None else 2)


def test_the_collate_puts_the_instance_half_first_each_image_with_its_layout_and_prompt():
    examples = [{"instance": torch.full((3, 2, 2), float(i)), "class": torch.full((3, 2, 2), 10.0 + i),
                 "instance_layout": torch.full((6,), i), "class_layout": torch.full((6,), 10 + i),
                 "prompt": ["sks", ""][i % 2], "class_prompt": "dog"} for i in range(3)]
    batch = instance_then_class_collate(examples)
    assert batch.keys() == {"images", "layouts", "prompts"}
    assert batch["images"][:, 0, 0, 0].tolist() == [0, 1, 2, 10, 11, 12]
    assert batch["layouts"][:, 0].tolist() == [0, 1, 2, 10, 11, 12] and batch["layouts"].shape == (6, 6)
    assert batch["prompts"] == ["sks", "", "sks", "dog", "dog", "dog"]
    instance_only = instance_then_class_collate([{key: e[key] for key in ("instance", "instance_layout", "prompt")}
                                                 for e in examples])
    assert instance_only["images"][:, 0, 0, 0].tolist() == [0, 1, 2]
    assert instance_only["layouts"][:, 0].tolist() == [0, 1, 2]
    assert instance_only["prompts"] == ["sks", "", "sks"]


def test_each_images_layout_is_its_original_size_crop_and_training_shape(tmp_path):
    # A wide image randomly cropped to its bucket and a small square one: what SDXL's time ids are made of.
    images = [gradient(tmp_path / "wide.png", (80, 16)), solid(tmp_path / "small.png", 10, (24, 24))]
    transform = ImageTransform(32, buckets=buckets_of(32))
    dataset = dreambooth_dataset(captioned(images), None, pixels_of(transform), 3)
    for index, path in enumerate(images):
        generator = sample_generator(3, 0, index)
        expected = transform(read_image(path), generator, dataset.shapes[index])
        assert dataset[index]["instance_layout"].tolist() == [*expected.original_size, *expected.crop_top_left,
                                                              *expected.size]
    assert dataset[0]["instance_layout"][:2].tolist() == [16, 80]


def prompt_args(with_prior_preservation, caption_dropout):
    return SimpleNamespace(instance_prompt="a photo of sks dog", class_prompt="a photo of a dog",
                           with_prior_preservation=with_prior_preservation, caption_dropout=caption_dropout)


@pytest.mark.parametrize("with_prior_preservation, caption_dropout, expected", [
    (False, 0.0, ["a photo of sks dog"]),
    (True, 0.0, ["a photo of sks dog", "a photo of a dog"]),
    (False, 0.3, ["a photo of sks dog", ""]),
    (True, 1.0, ["a photo of sks dog", "a photo of a dog", ""]),
])
def test_the_prompts_are_the_instance_prompt_then_the_class_prompt_then_the_empty_one(
        with_prior_preservation, caption_dropout, expected):
    instance = captioned(["0.png", "1.png"], "a photo of sks dog")
    assert dreambooth_prompts(prompt_args(with_prior_preservation, caption_dropout), instance) == expected


def test_repeats_see_each_instance_image_repeats_times_each_with_draws_of_its_own(tmp_path):
    instance_images = [gradient(tmp_path / f"{index}.png") for index in range(2)]
    (tmp_path / "class").mkdir()
    class_images = [solid(tmp_path / "class" / f"{index}.png", 100 + 10 * index) for index in range(5)]
    dataset = dreambooth_dataset(captioned(instance_images), class_images, pixels_of(ImageTransform(16)), 0,
                                 repeats=3)
    # 2 images 3 times: 6 samples, more than the 5 class images, which cycle.
    assert len(dataset) == 6
    assert [example["instance"] for example in dataset.examples] == instance_images * 3
    assert [example["class"] for example in dataset.examples] == class_images + class_images[:1]
    # The same image, repeated, is cropped anew each time (the repeats are samples of their own), and again the
    # same way for the same seed and epoch.
    crops = [dataset[index]["instance"] for index in (0, 2, 4)]
    assert any(not torch.equal(crops[0], other) for other in crops[1:])
    assert all(torch.equal(crop, dataset[index]["instance"]) for crop, index in zip(crops, (0, 2, 4)))
    assert len(dreambooth_dataset(captioned(instance_images), class_images, pixels_of(ImageTransform(16)), 0,
                                  repeats=2)) == 5


def test_with_buckets_each_pair_trains_at_its_instance_images_bucket(tmp_path):
    # Landscape, portrait, square and 4:1 instance images; square class images, each paired with several shapes.
    sizes = [(64, 32), (32, 64), (48, 48), (96, 24)]
    (tmp_path / "instance").mkdir()
    (tmp_path / "class").mkdir()
    instance_images = [solid(tmp_path / "instance" / f"{index}.png", 10 * index, size)
                       for index, size in enumerate(sizes)]
    class_images = [solid(tmp_path / "class" / f"{index}.png", 100 + 10 * index, (40, 40)) for index in range(3)]
    transform = ImageTransform(32, center_crop=True, buckets=buckets_of(32))
    dataset = dreambooth_dataset(captioned(instance_images), class_images, pixels_of(transform), 0, repeats=2,
                                 class_prompt="a triangle")
    expected = [transform.shape_of(*size) for size in sizes] * 2
    assert len(set(expected)) == 4 and all(shape != (32, 32) for shape in expected[:2])
    assert dataset.shapes == expected
    for index, shape in enumerate(expected):
        sample = dataset[index]
        assert sample["instance"].shape[1:] == sample["class"].shape[1:] == shape
        assert torch.all(sample["instance"] == scaled(10 * (index % 4)))
        assert torch.all(sample["class"] == scaled(100 + 10 * (index % 3)))
    # Batched by bucket: each batch is one tensor of one shape, its halves lined up.
    batches = list(make_dataloader(dataset, 2, 0, instance_then_class_collate, seed=0))
    assert len(batches) == 4
    for batch in batches:
        assert batch["images"].shape[0] == 4 and tuple(batch["images"].shape[2:]) in expected
        assert batch["prompts"] == ["", "", "a triangle", "a triangle"]


def test_caption_dropout_drops_instance_prompts_at_its_rate_reproducibly(tmp_path):
    probability, repeats = 0.3, 1000
    image = solid(tmp_path / "0.png", 10, size=(8, 8))
    class_image = solid(tmp_path / "1.png", 20, size=(8, 8))

    def prompts(seed, epoch, samples=repeats):
        """The prompts of the dataset's first ``samples`` samples (their instance images', then their class
        images')."""
        dataset = dreambooth_dataset(captioned([image], "sks"), [class_image], pixels_of(ImageTransform(8)), seed,
                                     repeats, caption_dropout=probability, class_prompt="dog")
        dataset.set_epoch(epoch)
        return instance_then_class_collate([dataset[index] for index in range(samples)])["prompts"]

    drawn = prompts(0, 0)
    instance_half, class_half = drawn[:repeats], drawn[repeats:]
    assert class_half == ["dog"] * repeats, "a class prompt was dropped"
    assert set(instance_half) == {"sks", ""}
    # Binomial(1000, 0.3): 300 ± 14.5; 4 sigmas fail a correct implementation once in 16,000 seeds.
    dropped = instance_half.count("")
    sigma = math.sqrt(repeats * probability * (1 - probability))
    assert abs(dropped - repeats * probability) <= 4 * sigma, dropped
    # The same seed and epoch draw the same drops; another epoch or seed others (compared on 100 samples).
    assert drawn == prompts(0, 0)
    assert prompts(0, 0, 100)[:100] == instance_half[:100]
    assert prompts(0, 1, 100)[:100] != instance_half[:100]
    assert prompts(1, 0, 100)[:100] != instance_half[:100]


# ---------------------------------------------------------------------------------------------
# Captions: caption files beside the images, a dataset's caption column


def with_caption_files(folder, captions):
    """Write ``{image name: caption}`` as ``.txt`` files beside the images of ``folder``."""
    for name, caption in captions.items():
        (folder / name).with_suffix(".txt").write_text(caption)


def test_caption_files_caption_their_images_and_the_others_take_the_instance_prompt(instance_dir, caplog):
    with_caption_files(instance_dir, {"0.png": "  sks dog, running\n", "2.png": ""})
    args = parse("--instance_data_dir", instance_dir, "--instance_prompt", "a photo of sks dog",
                 "--caption_extension", ".txt")
    with caplog.at_level("WARNING"):
        instance = checked_instance_images(args)
    assert [path.name for path in instance.images] == ["0.png", "1.png", "2.png"]
    # Stripped; an empty file is the empty caption, on purpose.
    assert instance.captions == ["sks dog, running", "a photo of sks dog", ""]
    assert "1 of 3 instance images have no .txt caption file beside them; they train on --instance_prompt" \
        in caplog.text
    # Without --caption_extension the files are not read.
    assert checked_instance_images(parse("--instance_data_dir", instance_dir, "--instance_prompt", "sks")).captions \
        == ["sks"] * 3


@pytest.mark.parametrize("extension, content, message", [
    ("txt", b"a dog", "--caption_extension='txt': expected a file extension, e.g. .txt"),
    (".txt", b"\xffa dog", "--caption_extension='.txt': expected UTF-8 caption files: {folder}/0.txt is not"),
])
def test_bad_caption_files_fail_in_one_line(instance_dir, extension, content, message):
    (instance_dir / "0.txt").write_bytes(content)
    args = parse("--instance_data_dir", instance_dir, "--instance_prompt", "sks", "--caption_extension", extension)
    with pytest.raises(UsageError) as error:
        checked_instance_images(args)
    assert str(error.value) == message.format(folder=instance_dir)


def imagefolder(folder, captions):
    """An imagefolder dataset: a solid image per caption, ``metadata.jsonl`` with each one's ``text``."""
    folder.mkdir()
    with open(folder / "metadata.jsonl", "w") as metadata:
        for index, caption in enumerate(captions):
            solid(folder / f"{index}.png", 10 * index)
            metadata.write(json.dumps({"file_name": f"{index}.png", "text": caption}) + "\n")
    return folder


def test_a_datasets_caption_column_captions_each_image_and_without_one_the_instance_prompt_does(tmp_path):
    # Lists of captions (a caption drawn per sample); a column holds lists or strings, not both.
    folder = imagefolder(tmp_path / "data", [["sks dog"], ["sks dog, left", "sks dog, right"], ["sks dog"]])
    flags = ["--dataset_name", folder, "--instance_prompt", "a photo of sks dog", "--cache_dir", tmp_path / "cache"]
    instance = checked_instance_images(parse(*flags, "--caption_column", "text"))
    assert [Path(path).name for path in instance.images] == ["0.png", "1.png", "2.png"]
    assert all(isinstance(path, Path) for path in instance.images)  # files keep their paths (the cache keys)
    assert instance.captions == [["sks dog"], ["sks dog, left", "sks dog, right"], ["sks dog"]]
    assert training_captions(instance) == ["sks dog", "sks dog, left", "sks dog, right"]
    assert checked_instance_images(parse(*flags)).captions == ["a photo of sks dog"] * 3


@pytest.mark.parametrize("extra, message", [
    (["--caption_column", "prompt"], "--caption_column='prompt': expected a column of the dataset: image, text"),
    (["--image_column", "picture"], "--image_column='picture': expected a column of the dataset: image, text"),
    (["--caption_extension", ".txt"], "--caption_extension='.txt': expected no caption files with --dataset_name "
                                      "(its captions are in --caption_column)"),
    (["--instance_data_dir", "{tmp}"], "--instance_data_dir='{tmp}': expected a folder of images, or "
                                       "--dataset_name, not both"),
])
def test_bad_dataset_flags_fail_in_one_line(tmp_path, extra, message):
    folder = imagefolder(tmp_path / "data", ["sks dog"])
    args = parse("--dataset_name", folder, "--instance_prompt", "sks", "--cache_dir", tmp_path / "cache",
                 *[str(value).format(tmp=tmp_path) for value in extra])
    with pytest.raises(UsageError) as error:
        checked_instance_images(args)
    assert str(error.value) == message.format(tmp=tmp_path)


def test_neither_a_folder_nor_a_dataset_fails_and_text_to_image_data_flags_are_refused(tmp_path):
    with pytest.raises(UsageError, match="^--instance_data_dir=None: expected a folder of images, or --dataset_name"):
        checked_instance_images(parse("--instance_prompt", "sks"))
    with pytest.raises(UsageError, match="^--train_data_dir is not supported here: DreamBooth's images come from"):
        parse("--instance_prompt", "sks", "--train_data_dir", tmp_path)
    tmp_path.joinpath("0.png").write_bytes(b"")
    with pytest.raises(UsageError, match="^--caption_column='text': expected --dataset_name with it"):
        checked_instance_images(parse("--instance_prompt", "sks", "--instance_data_dir", tmp_path, "--caption_column",
                                      "text"))


def test_images_held_in_a_dataset_train_and_cache_like_files(tmp_path, tiny_sd_pipe):
    import datasets

    folder = tmp_path / "parquet"
    folder.mkdir()
    pictures = [Image.new("RGB", (16, 16), (value, 0, 0)) for value in (10, 200)]
    datasets.Dataset.from_dict({"image": pictures, "text": ["sks dark", "sks bright"]}).cast_column(
        "image", datasets.Image()).to_parquet(folder / "train.parquet")
    instance = checked_instance_images(parse("--dataset_name", folder, "--instance_prompt", "sks", "--caption_column",
                                             "text", "--cache_dir", tmp_path / "cache"))
    assert all(isinstance(image, EmbeddedImage) for image in instance.images)
    assert len({hash(image) for image in instance.images}) == 2
    transform = ImageTransform(16, center_crop=True)
    uncached = dreambooth_dataset(instance, None, pixels_of(transform), 0)
    cached = dreambooth_dataset(instance, None, pixels_of(transform, tiny_sd_pipe.vae), 0)
    for index, (value, caption) in enumerate([(10, "sks dark"), (200, "sks bright")]):
        assert uncached[index]["prompt"] == cached[index]["prompt"] == caption
        assert torch.all(uncached[index]["instance"][0] == scaled(value))
        with torch.no_grad():
            expected = tiny_sd_pipe.vae.encode(uncached[index]["instance"][None]).latent_dist.parameters
        torch.testing.assert_close(cached[index]["instance"][None], expected, atol=1e-5, rtol=1e-5)


def test_each_sample_trains_on_its_own_captions_embedding(tmp_path):
    # Three images of distinct greys with captions of their own (one a list: a caption drawn per sample), each seen
    # twice, beside class images and with dropped captions; batched as the scripts batch them, each sample's text
    # conditioning is its own caption's embedding, each caption embedded once.
    images = [solid(tmp_path / f"{index}.png", 10 * index) for index in range(3)]
    (tmp_path / "class").mkdir()
    class_images = [solid(tmp_path / "class" / "0.png", 200)]
    captions = ["sks dog", ["sks dog, left", "sks dog, right"], "a sks dog on grass"]
    instance = InstanceImages(images, captions)
    encoders = pixels_of(ImageTransform(8, center_crop=True))
    args = prompt_args(True, 0.3)

    def encode(prompts):  # a caption's embedding: its characters' codes
        return torch.tensor([[float(ord(c)) for c in prompt.ljust(20)] for prompt in prompts])

    prompts = dreambooth_prompts(args, instance)
    assert prompts == ["sks dog", "sks dog, left", "sks dog, right", "a sks dog on grass", args.class_prompt, ""]
    embeddings = encoders.text_embeddings(prompts, encode)
    assert list(embeddings) == prompts
    dataset = dreambooth_dataset(instance, class_images, encoders, 0, repeats=2, caption_dropout=0.3,
                                 class_prompt=args.class_prompt)
    rows = cached_rows(embeddings, "cpu")
    drawn = set()
    for batch in make_dataloader(dataset, 3, 0, instance_then_class_collate, seed=0):
        instance_half = batch["images"][: len(batch["images"]) // 2]
        for image, prompt, row in zip(instance_half, batch["prompts"], rows(batch["prompts"])):
            own = captions[round((float(image[0, 0, 0]) + 1) * 127.5) // 10]
            assert prompt in ([own] if isinstance(own, str) else own) + [""]
            assert torch.equal(row[0], encode([prompt])[0])
            drawn.add(prompt)
        assert batch["prompts"][len(instance_half):] == [args.class_prompt] * len(instance_half)
    assert drawn >= {"sks dog", "a sks dog on grass"}


# ---------------------------------------------------------------------------------------------
# Class images


class FakeAccelerator:
    """What generate_class_images uses of an Accelerator, recording waits and messages."""

    def __init__(self, is_main_process=True):
        self.is_main_process = self.is_local_main_process = is_main_process
        self.device = torch.device("cpu")
        self.waits = 0
        self.messages = []

    def wait_for_everyone(self):
        self.waits += 1

    def print(self, message):
        self.messages.append(message)


def generate(pipe, class_dir, num_images, accelerator=None, batch_size=2, seed=7):
    accelerator = accelerator or FakeAccelerator()
    count = generate_class_images(pipe, "a photo of a triangle", class_dir, num_images, accelerator, seed,
                                  batch_size, num_inference_steps=2,
                                  call_kwargs={"height": 32, "width": 32})
    return count, accelerator


def snapshot(folder):
    return {path.name: (path.stat().st_mtime_ns, path.read_bytes()) for path in list_images(folder)}


@pytest.fixture(scope="module")
def generated(tiny_sd_pipe, tmp_path_factory):
    """3 class images generated into a folder that already held one image of its own, and what the
    global RNG, the pipeline's scheduler and the UNet's train mode looked like before and after."""
    class_dir = tmp_path_factory.mktemp("class")
    solid(class_dir / "mine.png", 50, size=(32, 32))
    (class_dir / ".class-00000.png.partial").write_bytes(b"what a killed generation left half written")

    def state():
        return (torch.random.get_rng_state(), tiny_sd_pipe.unet.training,
                {key: repr(value) for key, value in vars(tiny_sd_pipe.scheduler).items()})

    tiny_sd_pipe.unet.train()  # generation renders in eval mode; it must hand the training mode back
    try:
        before = state()
        count, accelerator = generate(tiny_sd_pipe, class_dir, 4)
        after = state()
    finally:
        tiny_sd_pipe.unet.eval()
    return class_dir, count, accelerator, before, after


def test_generates_only_the_missing_class_images(generated):
    class_dir, count, accelerator, _, _ = generated
    assert count == 3
    assert sorted(path.name for path in class_dir.iterdir()) == ["class-00000.png", "class-00001.png",
                                                                 "class-00002.png", "mine.png"]
    assert Image.open(class_dir / "class-00000.png").size == (32, 32)
    assert any("generated 3 class images" in message for message in accelerator.messages)


def test_a_full_folder_is_left_alone(tiny_sd_pipe, generated):
    class_dir, *_ = generated
    before = snapshot(class_dir)
    count, accelerator = generate(tiny_sd_pipe, class_dir, 4)
    assert count == 0 and snapshot(class_dir) == before
    assert accelerator.messages == [f"{class_dir} holds 4 class images; none generated"]
    assert generate(tiny_sd_pipe, class_dir, 2)[0] == 0


def test_generation_is_seeded_by_the_image_position(tiny_sd_pipe, generated, tmp_path):
    class_dir, *_ = generated
    # The same folder state (one image already there) gives the same images, byte for byte.
    shutil.copy(class_dir / "mine.png", tmp_path / "mine.png")
    generate(tiny_sd_pipe, tmp_path, 3)
    for name in ("class-00000.png", "class-00001.png"):
        assert (tmp_path / name).read_bytes() == (class_dir / name).read_bytes()
    # Adding one more image continues the sequence: it is drawn with the next seed, not the first again.
    generate(tiny_sd_pipe, tmp_path, 4)
    assert (tmp_path / "class-00002.png").read_bytes() == (class_dir / "class-00002.png").read_bytes()
    assert (tmp_path / "class-00002.png").read_bytes() != (tmp_path / "class-00000.png").read_bytes()


def test_names_never_overwrite_existing_files(tiny_sd_pipe, tmp_path):
    solid(tmp_path / "class-00000.png", 50, size=(32, 32))
    before = (tmp_path / "class-00000.png").read_bytes()
    assert generate(tiny_sd_pipe, tmp_path, 2)[0] == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["class-00000.png", "class-00001.png"]
    assert (tmp_path / "class-00000.png").read_bytes() == before


def test_generation_leaves_rng_scheduler_and_modes_as_they_were(generated):
    _, _, _, (rng, training, scheduler), (rng_after, training_after, scheduler_after) = generated
    assert torch.equal(rng, rng_after)
    assert training and training_after
    assert scheduler == scheduler_after


def test_other_processes_wait_and_write_nothing(tiny_sd_pipe, tmp_path):
    count, accelerator = generate(tiny_sd_pipe, tmp_path / "class", 2, accelerator=FakeAccelerator(False))
    assert count == 2 and not (tmp_path / "class").exists()
    assert accelerator.waits == 2  # before counting, and until the main process has written


def test_class_images_from_args_generates_only_with_prior_preservation(tmp_path, monkeypatch):
    import training_utils.data.dreambooth as dreambooth

    calls = []
    monkeypatch.setattr(dreambooth, "generate_class_images", lambda *args, **kwargs: calls.append((args, kwargs)))
    args = SimpleNamespace(with_prior_preservation=False)
    assert dreambooth.class_images_from_args(args, "pipe", "accelerator") is None and not calls

    for index in range(3):
        (tmp_path / f"{index}.png").write_bytes(b"")
    args = SimpleNamespace(with_prior_preservation=True, class_prompt="a triangle", class_data_dir=str(tmp_path),
                           num_class_images=2, seed=5, sample_batch_size=1, class_inference_steps=3, resolution=32)
    images = dreambooth.class_images_from_args(args, "pipe", "accelerator", ["scheduler"])
    assert [path.name for path in images] == ["0.png", "1.png"]
    (positional, keywords), = calls
    assert positional == ("pipe", "a triangle", str(tmp_path), 2, "accelerator", 5, 1)
    assert keywords["num_inference_steps"] == 3 and keywords["call_kwargs"] == {"height": 32, "width": 32}
    assert keywords["schedulers"] == ["scheduler"]
