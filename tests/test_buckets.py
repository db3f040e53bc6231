"""Aspect-ratio buckets: which bucket an image trains in, how it is laid out there, and how batches are drawn."""

import collections
import math
from types import SimpleNamespace

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
from diffusers.configuration_utils import FrozenDict
from PIL import Image

from training_utils.data.buckets import (AspectRatioBuckets, BucketBatchSampler, on_the_fly_buckets, parse_buckets,
                                         size_multiple, validation_size)
from training_utils.data.datasets import (TrainDataset, captions_with_empty, drop_caption, dropped, make_dataloader,
                                          sample_generator)
from training_utils.data.images import ImageTransform, image_sizes
from training_utils.errors import UsageError


def pipe_with(vae_scale_factor, processor_factor, **model):
    """A stand-in pipeline with the configs `size_multiple` reads: a UNet's or a transformer's."""
    name = "unet" if "down_block_types" in model else "transformer"
    return SimpleNamespace(vae_scale_factor=vae_scale_factor,
                           image_processor=SimpleNamespace(config=FrozenDict(vae_scale_factor=processor_factor)),
                           **{name: SimpleNamespace(config=FrozenDict(**model))})


@pytest.mark.parametrize("pipe, multiple", [
    (pipe_with(8, 8, down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"]), 64),  # SD 1.x
    (pipe_with(8, 8, down_block_types=["DownBlock2D"] + ["CrossAttnDownBlock2D"] * 2), 32),  # SDXL
    (pipe_with(8, 8, patch_size=2), 16),  # SD3
    (pipe_with(8, 16, patch_size=1), 16),  # FLUX.2 [klein]: the 2×2 packing is the pipeline's
    (pipe_with(8, 16, all_patch_size=(2,)), 16),  # Z-Image
    (pipe_with(8, 16, patch_size=2), 16),  # Qwen-Image
    (pipe_with(2, 2, down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"]), 8),  # the tiny UNet: 4, and 8
])
def test_the_size_multiple_is_read_from_the_pipeline_configs(pipe, multiple):
    assert size_multiple(pipe) == multiple


@pytest.mark.parametrize("resolution, multiple", [(512, 64), (1024, 32), (1024, 16), (32, 8)])
def test_on_the_fly_buckets_have_about_the_area_and_sides_the_model_takes(resolution, multiple):
    buckets = on_the_fly_buckets(resolution, multiple)
    assert (resolution, resolution) in buckets
    for height, width in buckets:
        assert height % multiple == 0 and width % multiple == 0
        assert 1 / 4 <= height / width <= 4
        # The height is the nearest multiple to area / width: off by at most half a multiple's worth of rows.
        assert abs(height * width - resolution**2) <= width * multiple / 2
        assert (width, height) in buckets  # portrait and landscape alike
    ratios = sorted(height / width for height, width in buckets)
    assert ratios[0] == 1 / 4 and ratios[-1] == 4


def test_on_the_fly_buckets_at_512_for_sd():
    assert on_the_fly_buckets(512, 64) == [
        (256, 1024), (320, 832), (384, 704), (448, 576), (512, 512), (576, 448), (704, 384), (832, 320), (1024, 256)]


def test_parse_buckets_reads_pairs_and_refuses_anything_else():
    assert parse_buckets("512,768; 768,512;512,768;") == [(512, 768), (768, 512)]
    for bad in ["512x768", "512,768,1", "512,-8", "a,b", ";"]:
        with pytest.raises(UsageError, match="--aspect_ratio_buckets"):
            parse_buckets(bad)


def args_for(**flags):
    return SimpleNamespace(**{"use_aspect_ratio_buckets": False, "aspect_ratio_buckets": None, "resolution": 32,
                              "validation_height": None, "validation_width": None, **flags})


def test_buckets_from_args():
    pipe = pipe_with(8, 8, patch_size=2)
    assert AspectRatioBuckets.from_args(args_for(), pipe) is None
    made = AspectRatioBuckets.from_args(args_for(use_aspect_ratio_buckets=True, resolution=1024), pipe)
    assert made.buckets == on_the_fly_buckets(1024, 16) and made.cap_to_image
    listed = AspectRatioBuckets.from_args(args_for(aspect_ratio_buckets=[(512, 768), (768, 512)]), pipe)
    assert listed.buckets == [(512, 768), (768, 512)] and not listed.cap_to_image
    with pytest.raises(UsageError, match="multiples of 16"):
        AspectRatioBuckets.from_args(args_for(aspect_ratio_buckets=[(520, 768)]), pipe)


def test_an_image_goes_to_the_bucket_nearest_its_aspect_ratio():
    buckets = AspectRatioBuckets(on_the_fly_buckets(512, 64), 64)
    assert buckets.shape_of(3000, 2000) == (448, 576)  # 3:2 landscape, large: its bucket as is
    assert buckets.shape_of(2000, 3000) == (576, 448)
    assert buckets.shape_of(1000, 1000) == (512, 512)
    assert buckets.shape_of(3000, 300) == (256, 1024)  # 10:1 goes to the most elongated bucket
    assert buckets.shape_of(300, 3000) == (1024, 256)


def test_a_small_image_goes_to_a_smaller_bucket_of_its_shape_unless_the_buckets_are_listed():
    made = AspectRatioBuckets(on_the_fly_buckets(512, 64), 64)
    assert made.shape_of(300, 200) == (192, 256)  # 448x576 scaled to fit 200 rows, floored to multiples of 64
    assert made.shape_of(40, 40) == (64, 64)  # never below one multiple
    listed = AspectRatioBuckets([(448, 576)], 64, cap_to_image=False)
    assert listed.shape_of(300, 200) == (448, 576)


def position_image(width, height):
    """An image whose pixels encode their own position, so that a crop can be read back."""
    x = torch.arange(width).expand(height, width)
    y = torch.arange(height)[:, None].expand(height, width)
    pixels = torch.stack([x % 256, y % 256, torch.zeros_like(x)], dim=-1).to(torch.uint8).numpy()
    return Image.fromarray(pixels)


def test_the_transform_lays_an_image_out_at_its_bucket():
    buckets = AspectRatioBuckets([(32, 64), (64, 32), (48, 48)], 8, cap_to_image=False)
    transform = ImageTransform(48, center_crop=True, buckets=buckets)
    laid_out = transform(position_image(100, 40), sample_generator(0, 0, 0))
    assert laid_out.size == (32, 64) and laid_out.pixels.shape == (3, 32, 64)
    # Resized to cover 32x64 (80x32), the center 64 columns: the crop starts at column 8.
    assert laid_out.original_size == (40, 100) and laid_out.crop_top_left == (0, 8)
    portrait = transform(position_image(30, 90), sample_generator(0, 0, 0))
    assert portrait.size == (64, 32) and portrait.pixels.shape == (3, 64, 32)
    # An explicit shape (a DreamBooth class image takes its instance image's) overrides the image's own bucket.
    assert transform(position_image(30, 90), sample_generator(0, 0, 0), shape=(48, 48)).pixels.shape == (3, 48, 48)


def test_random_crops_and_flips_stay_inside_the_bucket_and_report_the_crop_in_the_flipped_image():
    buckets = AspectRatioBuckets([(16, 32)], 8, cap_to_image=False)
    transform = ImageTransform(16, random_flip=True, buckets=buckets)
    image = position_image(64, 16)  # resized to 64x16: no scaling, the crop moves along the width only
    flips = set()
    for seed in range(12):
        generator = sample_generator(seed, 0, 0)
        layout = transform.draw_layout(64, 16, sample_generator(seed, 0, 0))
        laid_out = transform(image, generator)
        columns = ((laid_out.pixels[0, 0] + 1) * 127.5).round().long().tolist()
        cropped = list(range(layout.left, layout.left + 32))
        assert columns == (cropped[::-1] if layout.flip else cropped)
        # SDXL's crop coordinate: the left edge in the image as flipped.
        assert laid_out.crop_top_left == (0, 64 - layout.left - 32 if layout.flip else layout.left)
        flips.add(layout.flip)
    assert flips == {False, True}


def shaped_dataset(shapes, seed=0, repeats=1):
    return TrainDataset(list(range(len(shapes))), lambda example, generator: example, seed, repeats, shapes)


SHAPES = [(16, 32)] * 5 + [(32, 16)] * 2 + [(24, 24)]


def test_every_batch_is_one_bucket_and_every_image_is_seen_each_epoch():
    dataset = shaped_dataset(SHAPES)
    sampler = BucketBatchSampler(dataset, 2, seed=1)
    assert len(sampler) == 3 + 1 + 1
    orders = []
    for epoch in range(3):
        dataset.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        assert all(len(batch) == 2 and len({SHAPES[index] for index in batch}) == 1 for batch in batches)
        assert {index for batch in batches for index in batch} == set(range(len(SHAPES)))
        orders.append(batches)
        assert list(sampler) == batches  # the order is the epoch's, drawn again the same
    assert orders[0] != orders[1] != orders[2]


def test_a_bucket_smaller_than_a_batch_fills_it_with_its_own_images():
    dataset = shaped_dataset([(16, 32), (32, 16), (32, 16)])
    batches = list(BucketBatchSampler(dataset, 3, seed=0))
    assert len(batches) == 2 and [0, 0, 0] in batches
    pair = next(batch for batch in batches if 0 not in batch)
    assert set(pair) == {1, 2} and pair[2] == pair[0]  # filled with the first of the bucket's order


def test_the_report_names_each_bucket_its_batches_and_what_is_left_over():
    report = BucketBatchSampler(shaped_dataset(SHAPES), 2, seed=0).report()
    assert report == [
        "bucket 16x32 (height x width): 5 images, 3 batches an epoch; 1 left over at the end of an epoch, batched "
        "with 1 of the bucket's images seen that epoch",
        "bucket 24x24 (height x width): 1 image, 1 batch an epoch; 1 left over at the end of an epoch, batched "
        "with 1 of the bucket's images seen that epoch",
        "bucket 32x16 (height x width): 2 images, 1 batch an epoch, none left over",
    ]


def test_two_processes_draw_their_own_batches_of_one_bucket_and_as_many_of_them():
    dataset = shaped_dataset(SHAPES)
    sampler = BucketBatchSampler(dataset, 2, seed=4)
    shards = [BatchSamplerShard(sampler, num_processes=2, process_index=rank) for rank in (0, 1)]
    for epoch in range(2):
        dataset.set_epoch(epoch)
        batches = [list(shard) for shard in shards]
        assert len(batches[0]) == len(batches[1]) == len(shards[0]) == 3
        assert batches[0] != batches[1]
        assert all(len({SHAPES[index] for index in batch}) == 1 for shard in batches for batch in shard)


def test_skipping_batches_resumes_the_epoch_where_it_stopped():
    dataset = shaped_dataset(SHAPES, seed=7)
    dataset.set_epoch(3)
    sampler = BucketBatchSampler(dataset, 2, seed=7)
    assert list(SkipBatchSampler(sampler, 2)) == list(sampler)[2:]


def test_the_loader_batches_by_bucket_and_logs_the_buckets(caplog):
    dataset = shaped_dataset(SHAPES)
    with caplog.at_level("INFO"):
        loader = make_dataloader(dataset, 2, 0, torch.tensor, seed=0)
    assert isinstance(loader.batch_sampler, BucketBatchSampler)
    assert sum("bucket " in message for message in caplog.messages) == 3
    assert all(len({SHAPES[index] for index in batch.tolist()}) == 1 for batch in loader)


def test_repeats_are_samples_of_their_own():
    dataset = TrainDataset(["a", "b"], lambda example, generator: (example, torch.rand((), generator=generator)),
                           seed=0, repeats=3, shapes=[(8, 8), (8, 16)])
    assert len(dataset) == 6
    samples = [dataset[index] for index in range(6)]
    assert [example for example, _ in samples] == ["a", "b"] * 3
    assert len({float(draw) for _, draw in samples}) == 6
    assert [dataset.shape_of(index) for index in range(6)] == [(8, 8), (8, 16)] * 3
    assert len(BucketBatchSampler(dataset, 2, seed=0)) == 4


def test_an_unreadable_image_is_replaced_by_one_of_its_bucket(tmp_path):
    paths = []
    for index, size in enumerate([(32, 16), (16, 32), (16, 32), (32, 16)]):
        paths.append(tmp_path / f"{index}.png")
        Image.new("RGB", size).save(paths[-1])
    paths[0].write_bytes(b"not a png")
    dataset = TrainDataset(paths, lambda path, generator: Image.open(path).size, 0,
                           shapes=[(16, 32), (32, 16), (32, 16), (16, 32)])
    unreadable = dataset[0]
    assert unreadable.source == str(paths[0]) and unreadable.substitute == (32, 16)  # image 3, not 1
    assert image_sizes(paths) == [(1, 1), (16, 32), (16, 32), (32, 16)]


def test_validation_renders_at_the_flags_else_the_most_common_bucket_else_the_resolution():
    assert validation_size(args_for(resolution=32)) == {"height": 32, "width": 32}
    assert validation_size(args_for(), SHAPES) == {"height": 16, "width": 32}
    assert validation_size(args_for(validation_width=40), SHAPES) == {"height": 16, "width": 40}
    # Equally common: the largest.
    assert validation_size(args_for(), [(16, 32), (32, 16)]) == {"height": 32, "width": 16}


def test_caption_dropout_rate_is_within_binomial_bounds_and_reproducible():
    probability, count = 0.3, 2000
    drops = [dropped(probability, sample_generator(0, 0, index)) for index in range(count)]
    bound = 4 * math.sqrt(count * probability * (1 - probability))
    assert abs(sum(drops) - count * probability) < bound
    assert drops == [dropped(probability, sample_generator(0, 0, index)) for index in range(count)]
    assert collections.Counter(drop_caption("a cat", 1.0, sample_generator(0, 0, 0)) for _ in range(3)) == {"": 3}


def test_no_dropout_draws_nothing_and_caches_no_empty_prompt():
    generator = sample_generator(0, 0, 0)
    assert drop_caption("a cat", 0.0, generator) == "a cat"
    assert torch.equal(torch.rand(3, generator=generator), torch.rand(3, generator=sample_generator(0, 0, 0)))
    assert captions_with_empty(["a", ["b", "c"]], 0.0) == ["a", ["b", "c"]]
    assert captions_with_empty(["a"], 0.1) == ["a", ""]
