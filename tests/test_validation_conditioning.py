"""Validator's conditioning images: saved once, logged to the trackers, shown in the model card; same log schema."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionPipeline
from PIL import Image

from training_utils.grids import step_grid
from training_utils.validation import Validator

PROMPTS = ["a red circle", "a blue square", "a green triangle"]


def mask(box):
    image = Image.new("RGB", (32, 32))
    image.paste((255, 255, 255), box)
    return image


@pytest.fixture(scope="module")
def controlnet_pipe(tiny):
    """The tiny SD pipeline with the tiny ControlNet, its zero convolutions made non-zero so the image matters."""
    controlnet = ControlNetModel.from_pretrained(tiny["controlnet"])
    torch.manual_seed(0)
    with torch.no_grad():
        for block in [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                      controlnet.controlnet_cond_embedding.conv_out]:
            block.weight.normal_(0, 0.5)
    pipe = StableDiffusionControlNetPipeline(**StableDiffusionPipeline.from_pretrained(tiny["sd"]).components,
                                             controlnet=controlnet, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stub_accelerator(is_main_process=True):
    """Enough of an Accelerator for constructing a Validator (which renders nothing)."""
    return SimpleNamespace(is_main_process=is_main_process, process_index=0 if is_main_process else 1, num_processes=2)


def make_validator(pipe, accelerator, output_dir, images, prompts=PROMPTS):
    # Rendered at another size, and shape, than the 32x32 conditioning images (e.g. a bucket's).
    return Validator(pipe, accelerator, output_dir, prompts, num_images=1, num_inference_steps=2, seed=3,
                     call_kwargs={"height": 24, "width": 40}, prompt_kwargs=[{"image": image} for image in images],
                     conditioning_images=images)


def test_each_distinct_conditioning_image_is_saved_once_at_construction(tmp_path):
    shared, other = mask((4, 4, 20, 20)), mask((10, 0, 32, 12))
    validator = make_validator(None, stub_accelerator(), tmp_path, [shared, other, shared])
    assert validator.conditioning_paths == ["validation/conditioning-p00.png", "validation/conditioning-p01.png",
                                            "validation/conditioning-p00.png"]
    assert sorted(path.name for path in (tmp_path / "validation").iterdir()) == ["conditioning-p00.png",
                                                                                "conditioning-p01.png"]
    for path, image in (("conditioning-p00.png", shared), ("conditioning-p01.png", other)):
        with Image.open(tmp_path / "validation" / path) as saved:
            assert np.array_equal(np.asarray(saved), np.asarray(image))


def test_only_the_main_process_writes_but_every_process_knows_the_paths(tmp_path):
    validator = make_validator(None, stub_accelerator(is_main_process=False), tmp_path, [mask((0, 0, 8, 8))],
                               prompts=PROMPTS[:1])
    assert validator.conditioning_paths == ["validation/conditioning-p00.png"]
    assert not (tmp_path / "validation").exists()


def test_without_conditioning_images_nothing_changes(tmp_path):
    validator = Validator(None, stub_accelerator(), tmp_path, PROMPTS, 1, 2, 0)
    assert validator.conditioning_paths == [None] * len(PROMPTS)
    assert not (tmp_path / "validation").exists()
    records = [{"step": 4, "variant": "raw", "prompt": prompt, "images": ["x.png"]} for prompt in PROMPTS]
    assert validator.card_records(records) == records


def test_prompts_without_a_conditioning_image_are_allowed(tmp_path):
    image = mask((0, 0, 8, 8))
    validator = make_validator(None, stub_accelerator(), tmp_path, [None, image, None])
    assert validator.conditioning_paths == [None, "validation/conditioning-p01.png", None]
    records = [{"step": 2, "variant": "raw", "prompt": prompt, "images": ["x.png"]} for prompt in PROMPTS]
    assert validator.card_records(records)[0] == {"step": 2, "variant": "conditioning", "prompt": PROMPTS[1],
                                                  "images": ["validation/conditioning-p01.png"]}


def test_a_prompt_may_have_several_conditioning_images(tmp_path):
    first, second, shared = mask((0, 0, 8, 8)), mask((8, 8, 16, 16)), mask((0, 0, 4, 4))
    validator = Validator(None, stub_accelerator(), tmp_path, PROMPTS, 1, 2, 0,
                          conditioning_images=[[first, second], [], shared])
    assert validator.conditioning_paths == [
        ["validation/conditioning-p00-00.png", "validation/conditioning-p00-01.png"], [],
        "validation/conditioning-p02.png"]
    assert sorted(path.name for path in (tmp_path / "validation").iterdir()) == [
        "conditioning-p00-00.png", "conditioning-p00-01.png", "conditioning-p02.png"]
    records = [{"step": 2, "variant": "raw", "prompt": prompt, "images": ["x.png"]} for prompt in PROMPTS]
    assert validator.card_records(records)[:2] == [
        {"step": 2, "variant": "conditioning", "prompt": PROMPTS[0], "images": validator.conditioning_paths[0]},
        {"step": 2, "variant": "conditioning", "prompt": PROMPTS[2], "images": [validator.conditioning_paths[2]]}]


def test_conditioning_images_must_match_the_prompts(tmp_path):
    with pytest.raises(ValueError, match="2 conditioning_images for 3 prompts"):
        Validator(None, stub_accelerator(), tmp_path, PROMPTS, 1, 2, 0, conditioning_images=[mask((0, 0, 1, 1))] * 2)


def test_card_records_lead_with_each_prompts_conditioning_image(tmp_path):
    images = [mask((0, 0, 8, 8)), mask((8, 8, 16, 16)), mask((16, 16, 24, 24))]
    validator = make_validator(None, stub_accelerator(), tmp_path, images)
    records = [{"step": 6, "variant": variant, "prompt": prompt, "images": [f"{variant}-{prompt}.png"]}
               for variant in ("raw", "ema") for prompt in PROMPTS]
    card = validator.card_records(records)
    assert card[3:] == records
    assert card[:3] == [{"step": 6, "variant": "conditioning", "prompt": prompt, "images": [path]}
                        for prompt, path in zip(PROMPTS, validator.conditioning_paths)]
    assert validator.card_records([]) == []


def test_renders_each_prompt_with_its_conditioning_image_and_keeps_the_log_schema(controlnet_pipe, tmp_path):
    # One prompt twice, with two conditioning images: the renders differ only if the image reaches the pipeline.
    prompts, images = PROMPTS[:1] * 2, [mask((0, 0, 12, 12)), mask((16, 16, 32, 32))]
    accelerator = Accelerator(cpu=True, log_with="tensorboard", project_dir=str(tmp_path / "logs"))
    accelerator.init_trackers("test")
    validator = make_validator(controlnet_pipe, accelerator, tmp_path, images, prompts)
    first, second = validator(1), validator(2)
    accelerator.end_training()

    lines = [json.loads(line) for line in (tmp_path / "validation" / "log.jsonl").read_text().splitlines()]
    assert lines == first + second
    assert all(set(record) == {"step", "variant", "prompt", "images", "grid", "progress", "guidance_scale"}
               for record in lines)
    assert [(record["step"], record["prompt"]) for record in lines] == [(step, p) for step in (1, 2) for p in prompts]
    # Saved at construction, never again.
    assert sorted(path.name for path in (tmp_path / "validation").glob("conditioning-*")) == [
        "conditioning-p00.png", "conditioning-p01.png"]
    rendered = [Image.open(tmp_path / record["images"][0]) for record in first]
    assert [image.size for image in rendered] == [(40, 24)] * 2  # the pipeline resized the conditioning images
    assert not np.array_equal(np.asarray(rendered[0]), np.asarray(rendered[1]))
    # Each step's grid shows the conditioning image, fitted to the cells, above the render.
    for record, image, render in zip(second, images, rendered):
        expected = step_grid(2, record["prompt"], [("raw", [Image.open(tmp_path / record["images"][0])])],
                             ("conditioning", [image]))[0]
        assert np.array_equal(np.asarray(Image.open(tmp_path / record["grid"])), np.asarray(expected))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "logs").rglob("events.out.tfevents.*")))).Reload()
    tags = events.Tags()["images"]
    assert {"validation/conditioning/p00", "validation/conditioning/p01"} <= set(tags)
    assert [event.step for event in events.Images("validation/conditioning/p01")] == [1, 2]
