"""Smoke tests: the ControlNet script end to end on the tiny fixtures, through ``accelerate launch``."""

import functools
import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionPipeline
from PIL import Image

from helpers import (EXAMPLES, FSDP2, controlnet_flags, deleting_after_load, launch, launching, together,
                     usage_error)
from training_utils.errors import UsageError
from training_utils.testing import (assert_checkpoint_is_the_output, assert_close_files, assert_close_validations,
                                    assert_model_folder_loads, assert_resumes_exactly, assert_same_files,
                                    assert_validated_at, checkpoint_names, checkpoint_weight_files, differing_keys,
                                    most_common_bucket, read_log, rendered_images, reported_buckets)

SCRIPT = "controlnet/train_controlnet.py"
WEIGHTS = "diffusion_pytorch_model.safetensors"
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


def sharded_launch(script, *args):
    return launch(script, *args, processes=2, env=FSDP2)


def conditioning(tiny, index):
    return tiny["shapes_controlnet"] / "conditioning" / f"{index:04d}.png"


def common(tiny, output_dir, *extra, mixed=False):
    return controlnet_flags(tiny, "sd", output_dir, *extra, mixed=mixed)


def pretrained(tiny, output_dir, *extra, mixed=False):
    return common(tiny, output_dir, "--controlnet_model_name_or_path", tiny["controlnet"], *extra, mixed=mixed)


def validation_flags(tiny, steps, images=(0, 1)):
    return ["--validation_prompt", *PROMPTS, "--validation_image", *[conditioning(tiny, i) for i in images],
            "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", steps]


def cache_flags(tiny, output_dir, *extra):
    """4 steps from tiny/controlnet on the mixed shapes in buckets, with center crops, random flips, empty prompts
    and repeats, a checkpoint every 2 steps, validating one prompt every 2 steps; a batch of 1 on each of the two
    processes these runs have (as much work as a batch of 2 on one). Learning rate 1e-4: the VAE's
    float noise (its result depends on the batch it encodes) reaches the weights through Adam in proportion to
    the learning rate, while a wrong layout or caption would move them by about the learning rate itself, far
    beyond the tolerance."""
    return pretrained(tiny, output_dir, "--center_crop", "--learning_rate", 1e-4, "--max_train_steps", 4,
                      "--checkpointing_steps", 2,
                      "--validation_prompt", PROMPTS[0], "--validation_image", conditioning(tiny, 0),
                      "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", 2,
                      "--train_batch_size", 1, *extra, mixed=True)


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}`` of every run here that starts from scratch, launched together:

    - full: from tiny/controlnet on the mixed shapes in buckets, 8 steps, validation every 3 (and at the final
      step), a checkpoint every 3, the newest kept;
    - from_unet: no --controlnet_model_name_or_path (the ControlNet is made from the UNet), EMA decay 0, one image
      for both prompts, validating at 16x32; the base model's folder (``../model``) is deleted as soon as the
      pipeline has loaded;
    - uncached, cached: `cache_flags` without and with --cache_latents (text always cached), on two processes:
      uncached as DDP, cached sharded (FSDP2), the ControlNet family's sharded launch (a full fine-tune's).
    """
    root = tmp_path_factory.mktemp("runs")
    model = root / "model"
    shutil.copytree(tiny["sd"], model)
    wrapper = deleting_after_load(EXAMPLES / SCRIPT, [model], root)
    from_unet_args = common(tiny, root / "from_unet", "--max_train_steps", 4, *validation_flags(tiny, 2, images=(5,)),
                            "--validation_height", 16, "--validation_width", 32, "--ema_decay", 0,
                            "--checkpointing_steps", 1000)
    from_unet_args[1] = model
    results = together({
        "full": functools.partial(launch, SCRIPT, *pretrained(
            tiny, root / "full", "--max_train_steps", 8, *validation_flags(tiny, 3), "--checkpointing_steps", 3,
            "--checkpoints_total_limit", 1, mixed=True)),
        "from_unet": functools.partial(launch, wrapper, *from_unet_args),
        "uncached": functools.partial(launch, SCRIPT, *cache_flags(tiny, root / "uncached"), processes=2),
        "cached": functools.partial(sharded_launch, SCRIPT, *cache_flags(tiny, root / "cached", "--cache_latents")),
    })
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_raw_and_ema_controlnet_that_load_and_differ(tiny, runs):
    output_dir, result = runs["full"]
    raw, ema = (assert_model_folder_loads(ControlNetModel, folder, initial=tiny["controlnet"]).state_dict()
                for folder in (output_dir, output_dir / "ema"))
    initial = ControlNetModel.from_pretrained(tiny["controlnet"]).state_dict()
    # The zero convolutions are where a new ControlNet starts learning.
    assert any(key.startswith("controlnet_down_blocks") for key in differing_keys(raw, initial))
    assert differing_keys(raw, ema)
    assert f"raw ControlNet: {output_dir}" in result.stdout
    assert f"ema ControlNet: {output_dir / 'ema'}" in result.stdout


def test_trains_in_several_buckets_and_validates_at_the_due_steps_in_the_most_common_one(runs):
    output_dir, result = runs["full"]
    buckets = reported_buckets(result.stderr)
    assert len(buckets) >= 3, result.stderr[-3000:]
    # The (square) conditioning images rendered at the most common bucket's size (the largest among equals).
    height, width = most_common_bucket(buckets)
    assert height != width
    log = assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"), PROMPTS, num_images=1)
    assert {Image.open(output_dir / record["images"][0]).size for record in log} == {(width, height)}
    assert len(rendered_images(output_dir)) == 3 * 2 * 2


def test_saves_each_conditioning_image_once_and_shows_it_in_the_card(tiny, runs):
    output_dir, _ = runs["full"]
    saved = sorted(path.name for path in (output_dir / "validation").glob("conditioning-*.png"))
    assert saved == ["conditioning-p00.png", "conditioning-p01.png"]
    for index in (0, 1):
        with Image.open(output_dir / "validation" / saved[index]) as image:
            given = Image.open(conditioning(tiny, index))
            assert np.array_equal(np.asarray(image), np.asarray(given.convert("RGB")))
    card = (output_dir / "README.md").read_text()
    assert "StableDiffusionControlNetPipeline" in card and "ControlNetModel.from_pretrained" in card
    assert "validation/conditioning-p00.png" in card and "validation/conditioning-p01.png" in card
    assert read_log(output_dir)[-1]["progress"] in card
    assert list((output_dir / "logs").rglob("events.out.tfevents.*")), "no tensorboard events written"


def test_keeps_the_newest_checkpoint_within_the_limit(runs):
    output_dir, _ = runs["full"]
    assert checkpoint_names(output_dir) == ["checkpoint-6"]
    assert not list(output_dir.glob(".checkpoint-*")), "an incomplete checkpoint was left behind"
    assert checkpoint_weight_files(output_dir / "checkpoint-6") == {f"controlnet/{WEIGHTS}",
                                                                    f"ema/controlnet/{WEIGHTS}"}


def test_resumed_run_that_never_validates_prunes_and_ends_with_the_same_weights(tiny, tmp_path, runs):
    # From the full run's checkpoint-6, mid-epoch (of 12 bucketed batches), with random crops, flips, empty prompts
    # and repeats: the uninterrupted run, bit for bit. The full run validated after writing checkpoint-6 and at the
    # final step, the resumed one never: validation and checkpointing leave the weights, the EMA, the optimizer and
    # the RNG untouched.
    def resumed_flags(output_dir):
        return pretrained(tiny, output_dir, "--max_train_steps", 8, "--checkpointing_steps", 1,
                          "--checkpoints_total_limit", 2, mixed=True)

    assert_resumes_exactly(SCRIPT, resumed_flags, runs["full"][0], tmp_path, 6, [WEIGHTS, f"ema/{WEIGHTS}"],
                           launch=launch)
    assert checkpoint_names(tmp_path) == ["checkpoint-7", "checkpoint-8"]
    assert not (tmp_path / "validation").exists()
    # The final step's checkpoint holds the output's ControlNets, raw and EMA, as folders that load.
    checkpoint = tmp_path / "checkpoint-8"
    assert_checkpoint_is_the_output(checkpoint, tmp_path, {f"controlnet/{WEIGHTS}": WEIGHTS,
                                                           f"ema/controlnet/{WEIGHTS}": f"ema/{WEIGHTS}"})
    for folder in (checkpoint / "controlnet", checkpoint / "ema" / "controlnet"):
        assert_model_folder_loads(ControlNetModel, folder, initial=tiny["controlnet"])


def test_saved_controlnet_changes_a_fresh_pipelines_output(tiny, runs):
    output_dir, _ = runs["full"]
    sd_pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    image = Image.open(conditioning(tiny, 0)).convert("RGB")

    def render(controlnet):
        pipe = StableDiffusionControlNetPipeline(**sd_pipe.components, controlnet=controlnet,
                                                 requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)
        return pipe(PROMPTS[0], image=image, num_inference_steps=2, height=32, width=32, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    initial = render(ControlNetModel.from_pretrained(tiny["controlnet"]))
    trained = render(ControlNetModel.from_pretrained(output_dir))
    assert not np.allclose(initial, trained, atol=1e-4)


def test_controlnet_from_the_unet_trains_without_rereading_the_base_model(tiny, runs):
    output_dir, _ = runs["from_unet"]
    assert not (output_dir.parent / "model").exists()
    unet = StableDiffusionPipeline.from_pretrained(tiny["sd"]).unet.state_dict()
    raw = ControlNetModel.from_pretrained(output_dir)
    assert raw.config.conditioning_embedding_out_channels == [16, 32]  # halves, like the tiny VAE
    raw = raw.state_dict()
    # Started as the UNet's encoder, and moved away from it.
    assert not torch.equal(raw["conv_in.weight"], unet["conv_in.weight"])
    assert torch.any(raw["controlnet_mid_block.weight"] != 0)
    # The final step (4) is also a due step (every 2): validated once, raw and EMA; one image for both prompts,
    # rendered at --validation_height x --validation_width.
    log = assert_validated_at(output_dir, [2, 4], ("raw", "ema"), PROMPTS)
    assert sorted(p.name for p in (output_dir / "validation").glob("conditioning-*.png")) == ["conditioning-p00.png"]
    assert {Image.open(output_dir / record["images"][0]).size for record in log} == {(32, 16)}


def test_ema_decay_zero_equals_the_raw_weights(runs):
    output_dir, _ = runs["from_unet"]
    assert_same_files(output_dir / WEIGHTS, output_dir / "ema" / WEIGHTS)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--validation_prompt", *PROMPTS[:2], "a green circle", "--validation_image", "IMAGE", "IMAGE"],
         "error: --validation_image="),
        (["--conditioning_image_column", "hint"],
         "error: --conditioning_image_column='hint': expected a column of the dataset"),
    ],
)
def test_bad_input_fails_with_one_line_before_anything_loads(tiny, tmp_path, flags, message):
    output_dir = tmp_path / "out"
    flags = [conditioning(tiny, 0) if flag == "IMAGE" else flag for flag in flags]
    assert usage_error(SCRIPT, *common(tiny, output_dir, *flags)).startswith(message)
    assert not output_dir.exists()


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_controlnet", EXAMPLES / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--validation_prompt", "a", "b", "c", "--validation_image", "IMAGE", "IMAGE"],
         "expected one conditioning image per --validation_prompt (3), or one image for all prompts"),
        (["--validation_prompt", "a"], "expected one conditioning image per --validation_prompt (1)"),
        (["--validation_image", "IMAGE"], "expected one conditioning image per --validation_prompt (0)"),
        (["--validation_prompt", "a", "--validation_image", "missing.png"],
         "--validation_image='missing.png': expected an existing image file"),
        (["--proportion_empty_prompts", 1.5], "--proportion_empty_prompts=1.5: expected a number in [0, 1]"),
        (["--controlnet_model_name_or_path", "SD"], "expected a ControlNetModel folder (with config.json)"),
    ],
)
def test_bad_validation_and_controlnet_flags_are_usage_errors(tiny, tmp_path, script, flags, message):
    replacements = {"IMAGE": conditioning(tiny, 0), "SD": tiny["sd"]}
    flags = [str(replacements.get(flag, flag)) for flag in flags]
    with pytest.raises(UsageError) as error:
        script.load_validation_pairs(script.parse_args(list(map(str, common(tiny, tmp_path, *flags)))))
    assert message in str(error.value)


def test_validation_pairs_follow_the_upstream_rules(tiny, tmp_path, script):
    def pairs(prompts, images):
        args = script.parse_args(list(map(str, common(tiny, tmp_path, "--validation_prompt", *prompts,
                                                       "--validation_image", *images))))
        return [(prompt, np.asarray(image).sum()) for prompt, image in script.load_validation_pairs(args)]

    first, second = conditioning(tiny, 0), conditioning(tiny, 1)
    sums = [np.asarray(Image.open(path).convert("RGB")).sum() for path in (first, second)]
    assert pairs(["a", "b"], [first, second]) == [("a", sums[0]), ("b", sums[1])]
    assert pairs(["a", "b"], [first]) == [("a", sums[0]), ("b", sums[0])]
    assert pairs(["a"], [first, second]) == [("a", sums[0]), ("a", sums[1])]


def test_cached_latents_train_sharded_as_the_uncached_run_as_ddp(tiny, runs):
    """Sharded (FSDP2) and cached, as the DDP run uncached: to 1e-5, the outputs and a checkpoint of the stock
    class."""
    (uncached, ddp), (cached, result) = runs["uncached"], runs["cached"]
    assert len(reported_buckets(result.stderr)) >= 3, result.stderr[-3000:]
    assert "FSDP2 units: 1 ControlNetModel" in result.stderr and "FSDP2 units" not in ddp.stderr
    assert json.loads((cached / "checkpoint-2" / "training_state.json").read_text())["sharded"] is True
    for folder in (cached, cached / "checkpoint-2" / "controlnet", cached / "checkpoint-2" / "ema" / "controlnet"):
        assert json.loads((folder / "config.json").read_text())["_class_name"] == "ControlNetModel"
    initial = ControlNetModel.from_pretrained(tiny["controlnet"]).state_dict()
    for weights in (WEIGHTS, f"ema/{WEIGHTS}"):
        cached_weights = assert_close_files(uncached / weights, cached / weights)
        assert cached_weights.keys() == initial.keys()
        assert differing_keys(cached_weights, initial)


def test_validation_renders_with_the_offloaded_encoders_back(runs):
    (uncached, _), (cached, _) = runs["uncached"], runs["cached"]
    assert_close_validations(uncached, cached, [(2, "raw"), (2, "ema"), (4, "raw"), (4, "ema")])


def test_cached_run_resumed_mid_epoch_is_the_uninterrupted_one(tiny, tmp_path, runs):
    def resumed_flags(output_dir):
        return cache_flags(tiny, output_dir, "--cache_latents")

    assert_resumes_exactly(SCRIPT, resumed_flags, runs["cached"][0], tmp_path, 2, [WEIGHTS, f"ema/{WEIGHTS}"],
                           launch=sharded_launch)
