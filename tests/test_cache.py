"""Cached encoder outputs (training_utils.data.frozen_encoders); the scripts' --cache_latents runs are in their smoke tests."""

import logging

import pytest
import torch
from PIL import Image

from training_utils.data.captions import distinct_captions
from training_utils.data.datasets import sample_generator
from training_utils.data.frozen_encoders import (CACHE_INDEX_COLUMN, FrozenEncoders, UnreadableImage, cached_images,
                                                 cached_latent_parameters, cached_latent_parameters_with_conditioning,
                                                 latent_chunk_encoder, sample_latents)
from training_utils.data.images import ImageTransform, ImageWithConditioningTransform
from training_utils.families.base import tokenize


def cache_latent_parameters(images, transform, vae, batch_size):
    """``{index: CachedImage}`` for PIL ``images`` (or callables raising), encoded ``batch_size`` at a time."""
    opens = [image if callable(image) else (lambda image=image: image) for image in images]
    encode_chunk = latent_chunk_encoder(opens, transform, vae, "cpu", torch.float32)
    with torch.no_grad():
        blocks = [encode_chunk(list(range(start, min(start + batch_size, len(images)))))
                  for start in range(0, len(images), batch_size)]
    return cached_images(list(range(len(images))), blocks)


def test_cached_parameters_are_the_vae_encoding_of_each_draw_both_flips(tiny_sd_pipe):
    vae = tiny_sd_pipe.vae
    images = [Image.new("RGB", (48, 40), (200, 30, 30)), Image.new("RGB", (40, 56), (30, 30, 200))]
    images[0].paste((0, 255, 0), (0, 0, 10, 40))  # asymmetric, so a flip changes the latents
    images[1].paste((255, 255, 0), (0, 0, 12, 56))
    transform = ImageTransform(32, center_crop=True, random_flip=True)
    cache = cache_latent_parameters(images, transform, vae, batch_size=1)
    flips = set()
    for epoch in range(6):
        for key, image in enumerate(images):
            pixels, original_size, crop_top_left, size, _ = transform(image, sample_generator(0, epoch, key))
            flips.add(transform.draw_layout(*image.size, sample_generator(0, epoch, key)).flip)
            with torch.no_grad():
                expected = vae.encode(pixels[None]).latent_dist.parameters[0]
            cached = cached_latent_parameters(cache[key], transform, sample_generator(0, epoch, key))
            torch.testing.assert_close(cached.pixels, expected, atol=1e-5, rtol=1e-5)
            assert cached[1:] == (original_size, crop_top_left, size, None)
    assert flips == {False, True}
    assert not torch.allclose(cache[0].parameters[0], cache[0].parameters[1])


def test_cached_conditioning_gets_the_layout_the_cached_latents_were_drawn_with(tiny_sd_pipe):
    vae = tiny_sd_pipe.vae
    # The first resizes to 41x32: its center crop starts at left 4, or 5 measured in the flipped image.
    images = [Image.new("RGB", (51, 40), (200, 30, 30)), Image.new("RGB", (40, 56), (30, 30, 200))]
    # A conditioning image of another size is resized to its image's; all asymmetric, so a flip changes them.
    conditionings = [Image.new("RGB", (24, 20), (0, 0, 0)), Image.new("RGB", (40, 56), (0, 0, 0))]
    for image, conditioning_image in zip(images, conditionings):
        image.paste((0, 255, 0), (0, 0, 10, image.height))
        conditioning_image.paste((255, 255, 255), (0, 0, 6, conditioning_image.height))
    transform = ImageWithConditioningTransform(32, center_crop=True, random_flip=True)
    cache = cache_latent_parameters(images, transform, vae, batch_size=2)
    crops = set()
    for epoch in range(6):
        for key, (image, conditioning_image) in enumerate(zip(images, conditionings)):
            uncached_generator, cached_generator = sample_generator(0, epoch, key), sample_generator(0, epoch, key)
            uncached = transform(image, conditioning_image, uncached_generator)
            cached = cached_latent_parameters_with_conditioning(cache[key], conditioning_image, transform,
                                                                 cached_generator)
            with torch.no_grad():
                expected = vae.encode(uncached.pixels[None]).latent_dist.parameters[0]
            torch.testing.assert_close(cached.pixels, expected, atol=1e-5, rtol=1e-5)
            assert torch.equal(cached.conditioning_pixels, uncached.conditioning_pixels)
            # SDXL's time ids: the original size, and the crop measured after the flip.
            assert cached[1:4] == uncached[1:4]
            # Both leave the generator in one state: the caption is drawn from it next.
            assert torch.equal(torch.rand(4, generator=cached_generator), torch.rand(4, generator=uncached_generator))
            crops.add((key, cached.crop_top_left))
    assert crops == {(0, (0, 4)), (0, (0, 5)), (1, (6, 0))}


def two_image_dataset(directory):
    import datasets

    paths = []
    for index, colour in enumerate([(200, 30, 30), (30, 30, 200)]):
        image = Image.new("RGB", (48, 40), colour)
        image.paste((0, 255, 0), (0, 0, 10 + index, 40))  # asymmetric, so a flip changes the latents
        image.save(directory / f"{index}.png")
        paths.append(str(directory / f"{index}.png"))
    dataset = datasets.Dataset.from_dict({"image": paths, "text": ["a", "b"]}).cast_column("image", datasets.Image())
    return dataset, paths


def test_frozen_encoders_draw_from_cached_dataset_images_what_the_transform_draws_and_leave_them_undecoded(
        tiny_sd_pipe, tmp_path):
    dataset, paths = two_image_dataset(tmp_path)
    transform = ImageTransform(32, center_crop=True, random_flip=True)
    frozen = FrozenEncoders(tiny_sd_pipe.vae, [], transform, "cpu", torch.float32, cache_latents=True, batch_size=2)
    examples = frozen.cache_dataset_images(dataset, "image")
    assert examples.column_names == ["image", "text", CACHE_INDEX_COLUMN]
    for index, example in enumerate(examples):
        assert example["image"]["path"] == paths[index]  # undecoded, so an unreadable file can be named
        for epoch in range(4):
            drawn = frozen.dataset_image(example, sample_generator(0, epoch, index))
            pixels, *layout = transform(dataset[index]["image"], sample_generator(0, epoch, index))
            with torch.no_grad():
                expected = tiny_sd_pipe.vae.encode(pixels[None]).latent_dist.parameters[0]
            torch.testing.assert_close(drawn.pixels, expected, atol=1e-5, rtol=1e-5)
            assert drawn[1:] == tuple(layout)


def test_frozen_encoders_without_caching_give_the_transforms_pixels_and_encode_in_the_step(tiny_sd_pipe, tmp_path):
    dataset, paths = two_image_dataset(tmp_path)
    transform = ImageTransform(32, random_flip=True)
    frozen = FrozenEncoders(tiny_sd_pipe.vae, [], transform, "cpu", torch.float32)
    assert frozen.cache_dataset_images(dataset, "image") is dataset
    pixels = [frozen.dataset_image(dataset[index], sample_generator(0, 1, index))[0] for index in range(2)]
    for index, drawn in enumerate(pixels):
        assert torch.equal(drawn, transform(dataset[index]["image"], sample_generator(0, 1, index))[0])
        assert torch.equal(frozen.image_file(paths[index], sample_generator(0, 1, index)).pixels, drawn)
    images = torch.stack(pixels)
    torch.manual_seed(5)
    latents = frozen.latents(images)
    torch.manual_seed(5)
    with torch.no_grad():
        expected = tiny_sd_pipe.vae.encode(images).latent_dist.sample()
    assert latents.is_contiguous() and torch.equal(latents.detach(), expected)


def test_frozen_encoders_draw_cached_image_files_and_sample_batches_from_the_global_rng(tiny_sd_pipe, tmp_path):
    _, paths = two_image_dataset(tmp_path)
    transform = ImageTransform(32, center_crop=True, random_flip=True)
    frozen = FrozenEncoders(tiny_sd_pipe.vae, [], transform, "cpu", torch.float32, cache_latents=True)
    frozen.cache_image_files([(path, None) for path in paths + paths[:1]])  # a file listed twice is encoded once
    assert list(frozen.latent_cache) == [(path, None) for path in paths]
    parameters = torch.stack([frozen.image_file(path, sample_generator(0, 2, index)).pixels
                              for index, path in enumerate(paths)])
    for index, path in enumerate(paths):
        with Image.open(path) as image:
            pixels = transform(image, sample_generator(0, 2, index))[0]
        with torch.no_grad():
            expected = tiny_sd_pipe.vae.encode(pixels[None]).latent_dist.parameters[0]
        torch.testing.assert_close(parameters[index], expected, atol=1e-5, rtol=1e-5)
    torch.manual_seed(5)
    latents = frozen.latents(parameters)
    torch.manual_seed(5)
    assert latents.is_contiguous() and torch.equal(latents, sample_latents(parameters))


def stand_in(name, moves):
    """A module whose moves are recorded as ``(name, device)``."""
    module = torch.nn.Linear(2, 2)
    module.to = lambda device: moves.append((name, str(device))) or module
    return module


@pytest.mark.parametrize("cache_latents, offload", [(False, False), (True, False), (False, True)])
def test_frozen_encoders_are_on_the_accelerator_only_while_they_run(cache_latents, offload):
    moves = []
    vae, text_encoder = stand_in("vae", moves), stand_in("text", moves)
    vae.encode = lambda pixels: type("Encoded", (), {"latent_dist": type("Dist", (), {
        "sample": lambda self: pixels})()})()
    frozen = FrozenEncoders(vae, [text_encoder], ImageTransform(32, center_crop=True), "cuda:0", torch.float32,
                            cache_latents=cache_latents, offload=offload)
    vae_off = cache_latents or offload
    assert moves == [*([("vae", "cpu")] if vae_off else []), ("text", "cpu"),
                     *([] if vae_off else [("vae", "cuda:0")])]
    moves.clear()
    embeddings = frozen.text_embeddings(["a", ["b", "a"]], lambda captions: torch.zeros(len(captions), 1))
    assert list(embeddings) == ["a", "b"]
    assert moves == [("text", "cuda:0"), ("text", "cpu")]  # on the device while it encodes, then off again
    moves.clear()
    with frozen.on_device():  # validation
        assert moves == [*([("vae", "cuda:0")] if vae_off else []), ("text", "cuda:0")]
    assert moves[len(moves) // 2:] == [*([("vae", "cpu")] if vae_off else []), ("text", "cpu")]
    if not cache_latents:
        moves.clear()
        frozen.latents(torch.zeros(1, 4, 4, 4))
        assert moves == ([("vae", "cuda:0"), ("vae", "cpu")] if offload else [])
    moves.clear()
    with frozen.vae_on_device():  # a family encoding a ControlNet's conditioning image itself
        assert moves == ([("vae", "cuda:0")] if vae_off else [])
    assert moves == ([("vae", "cuda:0"), ("vae", "cpu")] if vae_off else [])


def test_unreadable_image_raises_its_error_when_drawn(tiny_sd_pipe):
    def broken():
        raise OSError("cannot identify image file 'bad.png'")

    transform = ImageTransform(32, center_crop=True)
    cache = cache_latent_parameters([broken], transform, tiny_sd_pipe.vae, 4)
    with pytest.raises(UnreadableImage, match="^OSError: cannot identify image file 'bad.png'$"):
        cached_latent_parameters(cache[0], transform, sample_generator(0, 0, 0))


def test_a_random_crop_is_drawn_once_per_image_when_cached_and_kept_while_flips_are_drawn(tiny_sd_pipe):
    vae = tiny_sd_pipe.vae
    # Resized to 32 high, both are wider than a 32px crop: a random crop has 17 and 13 places to start.
    images = [Image.new("RGB", (96, 64), (200, 30, 30)), Image.new("RGB", (72, 48), (30, 30, 200))]
    for image in images:
        for left in range(0, image.width, 12):
            image.paste((0, 255, 0), (left, 0, left + 4, image.height))  # stripes: every crop and flip differs
    transform = ImageWithConditioningTransform(32, random_flip=True)
    opens = [lambda image=image: image for image in images]
    encode_chunk = latent_chunk_encoder(opens, transform, vae, "cpu", torch.float32, crop_seed=5)
    with torch.no_grad():
        cache = cached_images([0, 1], [encode_chunk([0, 1])])
        again = cached_images([0, 1], [latent_chunk_encoder(opens, transform, vae, "cpu", torch.float32,
                                                            crop_seed=5)([0, 1])])
        other_seed = cached_images([0, 1], [latent_chunk_encoder(opens, transform, vae, "cpu", torch.float32,
                                                                 crop_seed=6)([0, 1])])
    assert [cache[key].crop for key in cache] == [again[key].crop for key in again]
    assert [cache[key].crop for key in cache] != [other_seed[key].crop for key in other_seed]
    flips = set()
    for key, image in enumerate(images):
        top, left = cache[key].crop
        assert top == 0 and 0 <= left <= image.width * 32 // image.height - 32
        for epoch in range(6):
            parameters, original_size, crop_top_left, _, conditioning = cached_latent_parameters_with_conditioning(
                cache[key], image, transform, sample_generator(0, epoch, key))
            layout = transform.draw_layout(*image.size, sample_generator(0, epoch, key), crop=cache[key].crop)
            flips.add(layout.flip)
            # The kept crop, flipped as drawn: the latents of those pixels, and the conditioning cut alike.
            pixels = torch.from_numpy(transform.apply_layout(image, layout)).permute(2, 0, 1) / 127.5 - 1
            with torch.no_grad():
                expected = vae.encode(pixels[None]).latent_dist.parameters[0]
            torch.testing.assert_close(parameters, expected, atol=1e-5, rtol=1e-5)
            assert torch.equal(conditioning, transform.conditioning_pixels(image, layout))
            assert (original_size, crop_top_left) == ((image.height, image.width), layout.crop_top_left)
    assert flips == {False, True}


def test_sampling_draws_from_the_global_rng_like_latent_dist_sample(tiny_sd_pipe):
    with torch.no_grad():
        latent_dist = tiny_sd_pipe.vae.encode(torch.rand(2, 3, 32, 32) * 2 - 1).latent_dist
    torch.manual_seed(7)
    expected = latent_dist.sample()
    after_expected = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(sample_latents(latent_dist.parameters.clone()), expected)
    assert torch.equal(torch.rand(3), after_expected)


def test_text_embeddings_per_distinct_caption_match_encoding_one_by_one(tiny_sd_pipe):
    tokenizer, text_encoder = tiny_sd_pipe.tokenizer, tiny_sd_pipe.text_encoder
    captions = distinct_captions(["a red circle", ["a blue square", "a red circle"], "a green triangle"])
    assert captions == ["a red circle", "a blue square", "a green triangle"]

    def encode(texts):
        return text_encoder(tokenize(tokenizer, texts), return_dict=False)[0]

    frozen = FrozenEncoders(None, [text_encoder], ImageTransform(32), "cpu", torch.float32, batch_size=2)
    embeddings = frozen.text_embeddings(captions, encode)
    assert list(embeddings) == captions
    with torch.no_grad():
        for caption in captions:
            (row,) = embeddings[caption]
            torch.testing.assert_close(row, encode([caption])[0], atol=1e-5, rtol=1e-5)


def test_text_embeddings_of_an_encoder_returning_several_tensors_are_tuples_per_caption(caplog):
    caplog.set_level(logging.INFO, logger="training_utils.data.feature_store")
    captions = ["a", "b", "c"]

    def encode(texts):  # like SDXL's (hidden states, pooled): a batch of each
        codes = torch.tensor([float(ord(text)) for text in texts])
        return codes[:, None, None].expand(-1, 512, 512), codes[:, None] * 10

    frozen = FrozenEncoders(None, [], ImageTransform(32), "cpu", torch.float32, batch_size=2)
    embeddings = frozen.text_embeddings(captions, encode)
    for caption in captions:
        hidden, pooled = embeddings[caption]
        assert torch.equal(hidden, torch.full((512, 512), float(ord(caption))))
        assert torch.equal(pooled, torch.tensor([ord(caption) * 10.0]))
    # The host memory the cache will hold is said before encoding: 3 captions of 1 MiB of hidden states (and 4
    # bytes pooled).
    assert "text embeddings: 3 items, about 3.0 MiB of host memory in each of 1 process(es)" in caplog.text


@pytest.mark.parametrize("captions", [["a", "b", "c"], ["a", "b"]])
def test_a_part_returned_once_for_all_the_captions_is_each_captions_whole(captions):
    # Like FluxPipeline.encode_prompt: (prompt_embeds, pooled_prompt_embeds) a row per prompt, and text_ids
    # (sequence length, 3) once for all of them, here as many rows as one chunk of captions could have.
    def encode(texts):
        codes = torch.tensor([float(ord(text)) for text in texts])
        return codes[:, None, None].expand(-1, 2, 4), codes[:, None], torch.arange(6.0).reshape(2, 3)

    frozen = FrozenEncoders(None, [], ImageTransform(32), "cpu", torch.float32, batch_size=2)
    embeddings = frozen.text_embeddings(captions, encode)
    for caption in captions:
        hidden, pooled, text_ids = embeddings[caption]
        assert torch.equal(hidden, torch.full((2, 4), float(ord(caption))))
        assert torch.equal(pooled, torch.tensor([float(ord(caption))]))
        assert torch.equal(text_ids, torch.arange(6.0).reshape(2, 3))


def counting_text_encoder(text_encoder, tokenizer, calls):
    def encode_text(captions):
        calls.append(captions)
        return text_encoder(tokenize(tokenizer, captions), return_dict=False)[0]

    return encode_text


def test_a_disk_cache_is_reused_without_running_or_moving_an_encoder_and_gives_the_same_tensors(
        tiny_sd_pipe, tmp_path):
    dataset, _ = two_image_dataset(tmp_path)
    vae, text_encoder, tokenizer = tiny_sd_pipe.vae, tiny_sd_pipe.text_encoder, tiny_sd_pipe.tokenizer
    transform = ImageTransform(32, center_crop=True, random_flip=True)

    def cached(calls, device="cpu"):
        frozen = FrozenEncoders(vae, [text_encoder], transform, device, torch.float32, cache_latents=True,
                                cache_dir=tmp_path / "features")
        embeddings = frozen.text_embeddings(dataset["text"], counting_text_encoder(text_encoder, tokenizer, calls),
                                            [tokenizer])
        examples = frozen.cache_dataset_images(dataset, "image")
        return embeddings, [frozen.dataset_image(example, sample_generator(0, 0, index))
                            for index, example in enumerate(examples)]

    calls = []
    first = cached(calls)
    assert calls == [["a"], ["a", "b"]]  # the size estimate's probe, then the chunk
    moves, again = [], []
    with pytest.MonkeyPatch.context() as patch:
        for module in (vae, text_encoder):
            patch.setattr(module, "to", lambda device, module=module: moves.append(str(device)) or module)
        patch.setattr(vae, "encode", lambda *args: pytest.fail("the VAE ran"))
        second = cached(again, device="cuda:0")  # the accelerator, which nothing reaches
    assert again == [] and set(moves) == {"cpu"}
    assert first[0].keys() == second[0].keys()
    assert all(torch.equal(first[0][caption][0], second[0][caption][0]) for caption in first[0])
    for (parameters, *layout), (parameters_again, *layout_again) in zip(first[1], second[1]):
        assert torch.equal(parameters, parameters_again) and layout == layout_again


def test_a_disk_cache_is_not_used_for_another_resolution_image_or_caption(tiny_sd_pipe, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="training_utils.data.feature_store")
    dataset, paths = two_image_dataset(tmp_path)
    vae, text_encoder, tokenizer = tiny_sd_pipe.vae, tiny_sd_pipe.text_encoder, tiny_sd_pipe.tokenizer
    features = tmp_path / "features"

    def cache(resolution, captions):
        frozen = FrozenEncoders(vae, [text_encoder], ImageTransform(resolution, center_crop=True), "cpu",
                                torch.float32, cache_latents=True, cache_dir=features)
        frozen.text_embeddings(captions, counting_text_encoder(text_encoder, tokenizer, []), [tokenizer])
        frozen.cache_dataset_images(dataset, "image")

    cache(32, ["a", "b"])
    cache(48, ["a", "b"])
    assert ("made for another transform '32px center crop, both flips, bilinear resize', now '48px center crop, both "
            "flips, bilinear resize'") in caplog.text
    Image.new("RGB", (48, 40), (0, 0, 0)).save(paths[1])  # the same file name, another picture
    cache(48, ["a", "c"])
    assert "made for another images" in caplog.text and "made for another captions" in caplog.text
    assert sorted(path.name.split("-")[0] for path in features.iterdir()) == ["latents"] * 3 + ["text_embeddings"] * 2
