"""training_utils.data.edit and edit_samples: edit rows checked before weights load, samples of a target with 0..n
references batched by shape, references mirrored with their target, their latents cached equal to uncached,
validation references, the loading code of an edit."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL
from PIL import Image

from training_utils.args import training_parser
from training_utils.data.buckets import AspectRatioBuckets, BucketBatchSampler, on_the_fly_buckets
from training_utils.data.datasets import make_dataloader
from training_utils.data.edit import (EditRows, add_edit_args, check_edit_args, edit_rows_from_args, how_to_edit,
                                      validation_inputs, validation_references)
from training_utils.data.edit_samples import References, SampleShape, edit_collate, edit_dataset, edit_prompts
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.data.images import ImageTransform
from training_utils.errors import UsageError
from training_utils.outputs.hub import LORA_HOW_TO_LOAD, how_to_load
from training_utils.testing.tiny.data import EDIT_REFERENCE_COUNTS


def parse(*argv):
    parser = training_parser("edit")
    add_edit_args(parser)
    return parser.parse_args(["--pretrained_model_name_or_path", "unused", *map(str, argv)])


def checked_rows(args, **limits):
    """What a script does with ``args``: check the flags (its parse_args), then read the rows (its main)."""
    check_edit_args(args)
    return edit_rows_from_args(args, **limits)


def lay_out(image):
    """A family's reference layout, as the FLUX pipelines do it in small: at most 32x32 in area (aspect kept),
    each side a multiple of 8, pixels in [-1, 1]."""
    width, height = image.size
    scale = min(1.0, (32 * 32 / (width * height)) ** 0.5)
    width, height = max(8, int(width * scale) // 8 * 8), max(8, int(height * scale) // 8 * 8)
    pixels = np.asarray(image.resize((width, height), Image.BILINEAR), dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


@pytest.fixture
def edit_data(tiny, tmp_path):
    """A copy of the tiny edit dataset (tests may break it)."""
    return shutil.copytree(tiny["shapes_edit"], tmp_path / "edit")


def rewrite_metadata(folder, change):
    path = folder / "metadata.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(change(row)) + "\n" for row in rows))


def test_rows_of_a_dataset_hold_zero_one_or_two_references_and_the_count_without_is_logged(edit_data, caplog):
    with caplog.at_level(logging.INFO, logger="training_utils.data.edit"):
        rows = checked_rows(parse("--dataset_name", edit_data, "--cond_image_column", "reference",
                                  "--caption_column", "text"))
    assert [len(references) for references in rows.references] == list(EDIT_REFERENCE_COUNTS)
    assert rows.references[1][1] == edit_data / "references" / "0001-1.png"
    assert rows.targets[0] == edit_data / "0000.png" and rows.captions[0] == "make the circle yellow"
    assert "2 of 6 rows have no reference image: they train as text-to-image" in caplog.text


def test_a_single_image_column_and_rows_without_a_caption(edit_data):
    rewrite_metadata(edit_data, lambda row: {"file_name": row["file_name"], "text": None if row["text"].startswith(
        "a ") else row["text"], "reference_file_name": (row["reference_file_names"] or [None])[0]})
    rows = checked_rows(parse("--dataset_name", edit_data, "--cond_image_column", "reference",
                              "--caption_column", "text", "--instance_prompt", "draw it"))
    assert [len(references) for references in rows.references] == [min(count, 1) for count in EDIT_REFERENCE_COUNTS]
    assert rows.captions[2] == "draw it" and rows.captions[0] == "make the circle yellow"
    with pytest.raises(UsageError, match="line 3 has \"text\": null"):  # no --instance_prompt to fall back on
        checked_rows(parse("--dataset_name", edit_data, "--cond_image_column", "reference",
                           "--caption_column", "text"))


@pytest.mark.parametrize("argv, message", [
    (["--cond_image_column", "refs", "--caption_column", "text"], "--cond_image_column='refs': expected a column"),
    (["--cond_image_column", "reference", "--caption_column", "caption"], "--caption_column='caption': expected a "
                                                                          "column"),
    (["--cond_image_column", "text", "--caption_column", "text"], "a column of images or lists of images"),
    (["--cond_image_column", "reference"], "a column of instructions, or --instance_prompt"),
    (["--caption_column", "text", "--caption_extension", ".txt"], "no caption files with --dataset_name"),
])
def test_bad_columns_stop_in_one_line(edit_data, argv, message):
    with pytest.raises(UsageError, match=message):
        checked_rows(parse("--dataset_name", edit_data, *argv))


def test_too_many_references_for_the_model_stop(edit_data):
    with pytest.raises(UsageError, match="at most 1 reference images a row for this model \\(a row has 2\\)"):
        checked_rows(parse("--dataset_name", edit_data, "--cond_image_column", "reference", "--caption_column",
                           "text"), max_references=1)


def test_an_unreadable_reference_is_named_before_weights_load_or_its_row_skipped(edit_data, caplog):
    (edit_data / "references" / "0003-0.png").write_bytes(b"not a png")
    argv = ["--dataset_name", edit_data, "--cond_image_column", "reference", "--caption_column", "text"]
    with pytest.raises(UsageError, match=r"row 3's .*references/0003-0.png \(UnidentifiedImageError"):
        checked_rows(parse(*argv))
    with caplog.at_level(logging.WARNING, logger="training_utils.data.edit"):
        rows = checked_rows(parse(*argv, "--skip_corrupt_images"))
    assert len(rows.targets) == 5 and edit_data / "0003.png" not in rows.targets
    assert "1 rows left out for an unreadable reference image: row 3: " in caplog.text


def refuse_under_80(width, height):
    if min(width, height) < 80:
        raise ValueError(f"{width}x{height} is under 80 pixels")


def test_a_reference_size_the_pipeline_refuses_is_named_before_weights_load(edit_data):
    argv = ["--dataset_name", edit_data, "--cond_image_column", "reference", "--caption_column", "text"]
    with pytest.raises(UsageError, match=r"expected reference images the pipeline takes: row 0's .*0000-0.png is not "
                                         r"\(64x64 is under 80 pixels\)"):
        checked_rows(parse(*argv), check_size=refuse_under_80)
    with pytest.raises(UsageError, match=r"--validation_image='.*0001-0.png': expected reference images the pipeline "
                                         r"takes: .*0001-0.png is not \(96x64 is under 80 pixels\)"):
        validation_inputs(parse(*argv, "--validation_prompt", "a", "--validation_image",
                                edit_data / "references" / "0001-0.png"), check_size=refuse_under_80)


def test_an_instance_folder_holds_targets_only(edit_data, tmp_path):
    folder = tmp_path / "targets"
    folder.mkdir()
    for name in ("0000.png", "0002.png"):
        shutil.copy(edit_data / name, folder / name)
    (folder / "0000.txt").write_text("make it so\n")
    rows = checked_rows(parse("--instance_data_dir", folder, "--instance_prompt", "a shape"))
    assert rows == EditRows([folder / "0000.png", folder / "0002.png"], [(), ()], ["a shape", "a shape"])
    rows = checked_rows(parse("--instance_data_dir", folder, "--instance_prompt", "a shape",
                              "--caption_extension", ".txt"))
    assert rows.captions == ["make it so", "a shape"]
    for argv, message in ((["--cond_image_column", "reference"], "--dataset_name with it"),
                          ([], "an instruction for the targets"),
                          (["--dataset_name", edit_data], "not both")):
        with pytest.raises(UsageError, match=message):
            checked_rows(parse("--instance_data_dir", folder, *argv))


@pytest.fixture(scope="module")
def vae():
    """A VAE small enough to encode dozens of images in a blink (a 2x downsampling, 4 latent channels)."""
    torch.manual_seed(0)
    return AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         block_out_channels=(8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=4).eval()


@pytest.fixture(scope="module")
def edit_rows(tiny):
    return checked_rows(parse("--dataset_name", tiny["shapes_edit"], "--cond_image_column", "reference",
                              "--caption_column", "text", "--caption_dropout", "0.5"))


def dataset_of(rows, vae, cache_latents, cache_dir=None, buckets=False, repeats=1):
    transform = ImageTransform(32, center_crop=True, random_flip=True,
                               buckets=AspectRatioBuckets(on_the_fly_buckets(32, 8), 8) if buckets else None)
    encoders = FrozenEncoders(vae, [], transform, "cpu", torch.float32, cache_latents=cache_latents,
                              cache_dir=cache_dir)
    references = References(lay_out, encoders)
    return edit_dataset(rows, encoders, references, seed=0, repeats=repeats, caption_dropout=0.5), encoders, \
        references


def test_samples_batch_by_their_target_and_reference_shapes(edit_rows, vae):
    dataset, encoders, references = dataset_of(edit_rows, vae, cache_latents=False, buckets=True,
                                               repeats=2)
    assert dataset.shapes[0] == ((32, 32), (32, 32)) and dataset.shapes[1] == ((32, 32), (24, 32), (32, 24))
    assert dataset.shapes[2] == SampleShape([(24, 40)]) and dataset.target_shapes[2] == (24, 40)
    assert dataset.shape_of(8) == dataset.shapes[2]  # the second repeat
    assert "bucket target 24x40, references none: 4 images" in "\n".join(BucketBatchSampler(dataset, 2, 0).report())
    loader = make_dataloader(dataset, 2, 0, edit_collate, seed=0)
    for batch in loader:
        shape = dataset.shapes[batch["rows"][0]]
        assert all(dataset.shapes[row] == shape for row in batch["rows"])
        assert batch["images"].shape == (2, 3, *shape.target)
        assert [tuple(place.shape) for place in batch["references"]] == [(2, 3, *size) for size in shape[1:]]
        assert len(batch["flips"]) == 2 and all(isinstance(flip, bool) for flip in batch["flips"])
    assert set(edit_prompts(edit_rows, 0.5)) == {*edit_rows.captions, ""}


def test_references_are_mirrored_with_their_target(edit_rows, vae):
    dataset, _, references = dataset_of(edit_rows, vae, cache_latents=False)
    flips = set()
    for epoch in range(4):
        dataset.set_epoch(epoch)
        sample = dataset[1]
        target = dataset.examples[1]["target"]
        unflipped = ImageTransform(32, center_crop=True)(target, None).pixels
        flip = not torch.equal(sample["image"], unflipped)
        flips.add(flip)
        assert sample["flip"] == flip
        assert torch.equal(sample["image"], unflipped.flip(-1) if flip else unflipped)
        for reference, pixels in zip(edit_rows.references[1], sample["references"]):
            assert torch.equal(pixels, references.pixels(reference).flip(-1) if flip else references.pixels(reference))
    assert flips == {False, True}


@pytest.mark.parametrize("on_disk", [False, True])
def test_cached_reference_latents_equal_uncached(edit_rows, vae, tmp_path, on_disk):
    uncached, _, uncached_references = dataset_of(edit_rows, vae, cache_latents=False)
    cache_dir = tmp_path / "features" if on_disk else None
    for _ in range(2 if on_disk else 1):  # on disk, the second run reads what the first wrote
        cached, _, cached_references = dataset_of(edit_rows, vae, cache_latents=True, cache_dir=cache_dir)
    if on_disk:
        assert len(list(cache_dir.glob("reference_latents-*"))) == 1
    flips = set()
    for index in range(len(edit_rows.targets)):
        expected, got = uncached[index], cached[index]
        assert got["prompt"] == expected["prompt"] and got["row"] == expected["row"]
        if expected["references"]:
            unflipped = uncached_references.pixels(edit_rows.references[index][0])
            flips.add(not torch.equal(expected["references"][0], unflipped))
        with torch.no_grad():
            torch.testing.assert_close(got["image"], vae.encode(expected["image"][None]).latent_dist.parameters[0],
                                       atol=1e-5, rtol=1e-5)
            encoded = uncached_references.parameters([pixels[None] for pixels in expected["references"]])
        assert len(got["references"]) == len(encoded) == EDIT_REFERENCE_COUNTS[index]
        for parameters, batch in zip(cached_references.parameters([p[None] for p in got["references"]]), encoded):
            torch.testing.assert_close(parameters[0], batch[0], atol=1e-5, rtol=1e-5)
    assert flips == {False, True}  # the cache holds both mirrorings


def test_validation_references_once_for_every_prompt_or_once_each(edit_data, tmp_path):
    first, second = edit_data / "references" / "0001-0.png", edit_data / "references" / "0001-1.png"
    args = parse("--dataset_name", edit_data, "--validation_prompt", "a", "b", "--validation_image", first, second)
    assert [[image.size for image in images] for images in validation_references(args)] == [[(96, 64), (64, 80)]] * 2
    args = parse("--dataset_name", edit_data, "--validation_prompt", "a", "b", "--validation_image", first,
                 "--validation_image", second)
    assert [[image.size for image in images] for images in validation_references(args)] == [[(96, 64)], [(64, 80)]]
    assert validation_references(parse("--dataset_name", edit_data, "--validation_prompt", "a")) == [[]]
    (tmp_path / "broken.png").write_bytes(b"no")
    for argv, message in (([first, "--validation_image", first, "--validation_image", first], "one per prompt"),
                          ([tmp_path / "broken.png"], "broken.png'?: expected a readable image")):
        with pytest.raises(UsageError, match=message):
            validation_references(parse("--dataset_name", edit_data, "--validation_prompt", "a", "b",
                                        "--validation_image", *argv))


def test_validation_inputs_pass_the_references_as_the_pipelines_image_and_show_them(edit_data):
    first, second = edit_data / "references" / "0001-0.png", edit_data / "references" / "0001-1.png"
    args = parse("--dataset_name", edit_data, "--validation_prompt", "a", "b", "--validation_image", first,
                 "--validation_image", first, second)
    inputs = validation_inputs(args)
    assert inputs["conditioning_label"] == "references"
    assert [[image.size for image in kwargs["image"]] for kwargs in inputs["prompt_kwargs"]] == [
        [(96, 64)], [(96, 64), (64, 80)]]
    assert inputs["conditioning_images"][1] == inputs["prompt_kwargs"][1]["image"]
    with pytest.raises(UsageError, match="one reference image a prompt for this model"):
        validation_inputs(args, single_reference=True)
    single = validation_inputs(parse("--dataset_name", edit_data, "--validation_prompt", "a", "--validation_image",
                                     first), single_reference=True)
    assert single["prompt_kwargs"][0]["image"].size == (96, 64)
    assert validation_inputs(parse("--dataset_name", edit_data, "--validation_prompt", "a"))["prompt_kwargs"] == [{}]


def test_the_loading_code_renders_an_edit_of_the_validation_references(edit_data):
    args = parse("--dataset_name", edit_data, "--validation_prompt", "a", "--validation_image", "x.png", "y.png")
    template, fields = how_to_edit(LORA_HOW_TO_LOAD, args)
    code = how_to_load(template, args, object(), **fields)
    assert "from diffusers.utils import load_image\n" in code
    assert 'image = pipe("a", image=[load_image("x.png"), load_image("y.png")]).images[0]' in code
    args = parse("--dataset_name", edit_data)
    template, fields = how_to_edit(LORA_HOW_TO_LOAD, args, single_reference=True)
    assert 'pipe("a photo", image=load_image("reference.png"))' in how_to_load(template, args, object(), **fields)


def refuse_1x1(width, height):
    if min(width, height) < 2:
        raise ValueError(f"Image too small: {width}×{height}")


def test_a_truncated_reference_is_named_as_unreadable_or_its_row_skipped(edit_data, caplog):
    reference = edit_data / "references" / "0003-0.png"
    data = reference.read_bytes()
    reference.write_bytes(data[:len(data) // 2])  # an interrupted copy: the header whole, the pixels cut
    argv = ["--dataset_name", edit_data, "--cond_image_column", "reference", "--caption_column", "text"]
    with pytest.raises(UsageError, match=r"expected readable reference images: row 3's .*references/0003-0.png "
                                         r"\(OSError: .*truncated"):
        checked_rows(parse(*argv), check_size=refuse_1x1)
    with caplog.at_level(logging.WARNING, logger="training_utils.data.edit"):
        rows = checked_rows(parse(*argv, "--skip_corrupt_images"), check_size=refuse_1x1)
    assert len(rows.targets) == 5 and edit_data / "0003.png" not in rows.targets
    assert [record.getMessage() for record in caplog.records if "left out" in record.getMessage()] == [
        f"1 rows left out for an unreadable reference image: row 3: {reference} (OSError: image file is truncated)"]
