import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from diffusers import DDPMScheduler, StableDiffusionPipeline
from PIL import Image

from training_utils import validation
from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_lora
from training_utils.ema import EMA
from training_utils.grids import progress_grid
from training_utils.pipeline import trainable_parameters
from training_utils.pipeline import preserved_state
from training_utils.validation import Validator, validation_due


@pytest.mark.parametrize(
    "validation_steps, max_steps, expected",
    [(4, 10, [4, 8, 10]), (5, 10, [5, 10]), (3, 3, [3]), (100, 7, [7]), (1, 3, [1, 2, 3])],
)
def test_validation_due_by_steps_includes_the_final_step_once(validation_steps, max_steps, expected):
    due = [step for step in range(1, max_steps + 1) if validation_due(step, max_steps, validation_steps)]
    assert due == expected


def test_validation_due_by_epochs():
    # 4 steps per epoch, every 2nd epoch, 14 steps: ends of epochs 2 (step 8) and the final step.
    due = [step for step in range(1, 15) if validation_due(step, 14, None, validation_epochs=2, steps_per_epoch=4)]
    assert due == [8, 14]


def test_validation_due_by_steps_and_epochs_is_their_union():
    due = [step for step in range(1, 13) if validation_due(step, 12, 5, validation_epochs=1, steps_per_epoch=3)]
    assert due == [3, 5, 6, 9, 10, 12]


def test_preserved_state_restores_scheduler_and_modes_even_on_error():
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout())
    module.train()
    module[1].eval()
    timesteps_before = scheduler.timesteps.clone()
    with pytest.raises(RuntimeError):
        with preserved_state([scheduler], [module]):
            scheduler.set_timesteps(7)
            module.eval()
            raise RuntimeError("render failed")
    assert torch.equal(scheduler.timesteps, timesteps_before)
    assert scheduler.num_inference_steps is None
    assert module.training and module[0].training and not module[1].training


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


@pytest.fixture()
def lora_pipe(tiny):
    """A fresh tiny pipeline with a non-zero LoRA on the UNet, as after some training."""
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)
    add_lora(pipe.unet, 4, ATTENTION_PROJECTIONS)
    parameters = trainable_parameters({"unet": pipe.unet})
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in parameters.values():
            parameter.add_(torch.randn_like(parameter) * 0.5)
    return pipe, parameters


def make_validator(pipe, accelerator, output_dir, **kwargs):
    return Validator(pipe, accelerator, output_dir, ["a red circle", "a blue square"], num_images=2,
                     num_inference_steps=3, seed=7, call_kwargs={"height": 32, "width": 32}, **kwargs)


def test_validator_has_no_side_effects(lora_pipe, accelerator, tmp_path):
    pipe, parameters = lora_pipe
    training_scheduler = DDPMScheduler.from_config(pipe.scheduler.config)
    training_scheduler.set_timesteps(50)
    ema = EMA(parameters, decay=0.5)
    ema.update(1)
    with torch.no_grad():
        for parameter in parameters.values():
            parameter.mul_(2)
    pipe.unet.train()
    pipe.text_encoder.eval()
    before = {name: parameter.detach().clone() for name, parameter in parameters.items()}
    scheduler_before = {key: value.clone() if torch.is_tensor(value) else value
                        for key, value in vars(training_scheduler).items() if key != "config"}
    pipe_scheduler_state = dict(vars(pipe.scheduler))
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()

    make_validator(pipe, accelerator, tmp_path, ema=ema, schedulers=[training_scheduler])(5)

    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(parameters[name], before[name]) for name in before)
    assert pipe.unet.training and not pipe.text_encoder.training
    for key, value in scheduler_before.items():
        after = vars(training_scheduler)[key]
        assert torch.equal(after, value) if torch.is_tensor(value) else after == value, key
    assert pipe.scheduler.num_inference_steps == pipe_scheduler_state["num_inference_steps"]
    assert all(parameter.requires_grad for parameter in parameters.values())


def train_a_few_steps(pipe, parameters, steps=3):
    """Steps of the LoRA on noise drawn from the global RNG, as a training loop draws it."""
    optimizer = torch.optim.SGD(parameters.values(), lr=0.1)
    for _ in range(steps):
        latents = torch.randn(1, pipe.unet.config.in_channels, 4, 4)
        text = torch.randn(1, 4, pipe.unet.config.cross_attention_dim)
        pipe.unet(latents, torch.randint(0, 1000, (1,)), text).sample.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def test_drawing_the_base_before_training_leaves_the_trained_weights_bitwise_the_same(tiny, accelerator, tmp_path):
    trained = []
    for draw_base in (False, True):
        pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
        pipe.set_progress_bar_config(disable=True)
        torch.manual_seed(0)
        add_lora(pipe.unet, 4, ATTENTION_PROJECTIONS)
        parameters = trainable_parameters({"unet": pipe.unet})
        pipe.unet.train()
        initial = {name: parameter.detach().clone() for name, parameter in parameters.items()}
        if draw_base:
            make_validator(pipe, accelerator, tmp_path).draw_base()
        train_a_few_steps(pipe, parameters)
        trained.append({name: parameter.detach().clone() for name, parameter in parameters.items()})
    assert not all(torch.equal(initial[name], trained[1][name]) for name in initial)
    assert all(torch.equal(trained[0][name], trained[1][name]) for name in trained[0])
    assert (tmp_path / "validation" / "step-000000").is_dir()


def test_the_base_is_step_0_of_the_log_and_the_progress_grids_and_drawn_once(tiny_sd_pipe, accelerator, tmp_path):
    validator = make_validator(tiny_sd_pipe, accelerator, tmp_path)
    validator.draw_base()
    validator.draw_base()  # a run started over in its folder
    validator(2)
    log = validation.read_log(tmp_path)
    assert [(record["step"], record["variant"]) for record in log] == [(0, "base")] * 2 + [(2, "raw")] * 2
    base, raw = (_open(tmp_path, log[index]["images"][0]) for index in (0, 2))
    assert np.array_equal(np.asarray(base), np.asarray(raw))  # the same weights and seeds: the same picture
    with Image.open(tmp_path / log[0]["progress"]) as progress:
        assert progress.size == progress_grid(log[::2], "a red circle", tmp_path)[0].size


def test_validator_writes_images_and_log_raw_then_ema(lora_pipe, accelerator, tmp_path):
    pipe, parameters = lora_pipe
    ema = EMA(parameters, decay=0.5)
    ema.update(1)
    with torch.no_grad():
        for parameter in parameters.values():
            parameter.mul_(3)
    records = make_validator(pipe, accelerator, tmp_path, ema=ema)(12)

    lines = [json.loads(line) for line in (tmp_path / "validation" / "log.jsonl").read_text().splitlines()]
    assert lines == records
    assert [(r["step"], r["variant"], r["prompt"]) for r in lines] == [
        (12, "raw", "a red circle"), (12, "raw", "a blue square"),
        (12, "ema", "a red circle"), (12, "ema", "a blue square"),
    ]
    for record in lines:
        assert len(record["images"]) == 2
        for path in record["images"]:
            assert (tmp_path / path).is_file() and not path.startswith("/")
    raw = np.asarray(_open(tmp_path, lines[0]["images"][0]))
    ema_image = np.asarray(_open(tmp_path, lines[2]["images"][0]))
    assert not np.array_equal(raw, ema_image), "EMA weights were not swapped in"


def test_images_are_identical_across_repeated_validations_and_batching(lora_pipe, accelerator, tmp_path):
    pipe, _ = lora_pipe
    first = make_validator(pipe, accelerator, tmp_path / "a")(1)
    second = make_validator(pipe, accelerator, tmp_path / "a")(2)
    for a, b in zip(first, second):
        for path_a, path_b in zip(a["images"], b["images"]):
            assert np.array_equal(np.asarray(_open(tmp_path / "a", path_a)), np.asarray(_open(tmp_path / "a", path_b)))
    # Different seeds per image: the two images of a prompt differ.
    images = [np.asarray(_open(tmp_path / "a", path)) for path in first[0]["images"]]
    assert not np.array_equal(images[0], images[1])


def test_batched_images_match_one_at_a_time(tiny_sd_pipe, accelerator, tmp_path):
    # The same noise per image either way; CPU kernels round differently for another batch size,
    # so the pixels agree to one level of 255.
    batched = make_validator(tiny_sd_pipe, accelerator, tmp_path / "a")(1)
    single = Validator(tiny_sd_pipe, accelerator, tmp_path / "b", ["a red circle"], num_images=1,
                       num_inference_steps=3, seed=7, call_kwargs={"height": 32, "width": 32})(1)
    alone = np.asarray(_open(tmp_path / "b", single[0]["images"][0])).astype(int)
    together = np.asarray(_open(tmp_path / "a", batched[0]["images"][0])).astype(int)
    assert np.abs(alone - together).max() <= 1


def test_validator_checks_prompt_kwargs_length(tiny_sd_pipe, accelerator, tmp_path):
    with pytest.raises(ValueError, match="prompt_kwargs"):
        make_validator(tiny_sd_pipe, accelerator, tmp_path, prompt_kwargs=[{}])


def _open(root, relative):
    from PIL import Image

    with Image.open(root / relative) as image:
        return image.copy()


def test_zero_images_asked_makes_no_validator_and_says_so_once(caplog):
    args = SimpleNamespace(validation_prompt=["a red circle"], num_validation_images=0)
    with caplog.at_level(logging.INFO, logger="training_utils.validation"):
        assert validation.make_validator(args, None, SimpleNamespace(is_main_process=True)) is None
    assert caplog.text.count("--num_validation_images 0: no validation images are rendered") == 1


def test_an_unconditional_pipeline_validates_without_prompts_one_batch_each_seeded_and_side_effect_free(
        tiny, accelerator, tmp_path):
    from diffusers import DDPMPipeline

    pipe = DDPMPipeline.from_pretrained(tiny["ddpm"])
    pipe.set_progress_bar_config(disable=True)
    args = SimpleNamespace(validation_prompt=None, num_validation_images=2, validation_inference_steps=2, seed=7,
                           output_dir=tmp_path, validation_sigma_rels=None, validation_guidance_scale=None,
                           validation_true_cfg_scale=None)
    validator = validation.make_validator(args, pipe, accelerator)
    assert validator.prompts == [validation.UNCONDITIONAL]
    timesteps = pipe.scheduler.timesteps.clone()
    torch.manual_seed(0)
    expected_draw = torch.rand(1)
    torch.manual_seed(0)
    records = validator(1)
    assert torch.equal(torch.rand(1), expected_draw)  # no global random state consumed
    assert torch.equal(pipe.scheduler.timesteps, timesteps)  # the scheduler restored
    assert [(record["variant"], record["prompt"], len(record["images"])) for record in records] == [("raw", "", 2)]
    # Each image from its own seeded generator, as the pipeline renders a batch of them.
    rendered = pipe(batch_size=2, num_inference_steps=2, output_type="np",
                    generator=[torch.Generator().manual_seed(7 + i) for i in range(2)]).images
    for path, image in zip(records[0]["images"], rendered):
        assert np.abs(np.asarray(_open(tmp_path, path)).astype(int) - np.round(image * 255).astype(int)).max() <= 1
    # A pipeline that takes prompts still makes no validator without them.
    assert validation.make_validator(args, StableDiffusionPipeline.from_pretrained(tiny["sd"]), accelerator) is None


def test_a_render_scheduler_renders_in_place_of_the_pipelines_only_while_validating(lora_pipe, accelerator, tmp_path):
    from diffusers import LCMScheduler

    pipe, _ = lora_pipe
    own = pipe.scheduler
    lcm_scheduler = LCMScheduler.from_config(own.config)
    records = make_validator(pipe, accelerator, tmp_path / "lcm", render_scheduler=lcm_scheduler)(1)
    assert pipe.scheduler is own and type(pipe.scheduler).__name__ in pipe.config["scheduler"]
    assert lcm_scheduler.num_inference_steps is None  # its state restored too
    rendered = np.asarray(_open(tmp_path / "lcm", records[0]["images"][0]))
    pipe.scheduler = lcm_scheduler
    try:
        expected = pipe("a red circle", num_inference_steps=3, height=32, width=32, output_type="pil",
                        generator=torch.Generator().manual_seed(7)).images[0]
    finally:
        pipe.scheduler = own
    # The same render, but some CPUs' kernels (seen on AMD EPYC) round a last bit by the data's alignment: a pixel
    # level at most.
    assert np.abs(rendered.astype(int) - np.asarray(expected).astype(int)).max() <= 1
    own_records = make_validator(pipe, accelerator, tmp_path / "own")(1)
    assert not np.array_equal(rendered, np.asarray(_open(tmp_path / "own", own_records[0]["images"][0])))
