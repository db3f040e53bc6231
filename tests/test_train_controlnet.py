"""Smoke tests: the ControlNet script end to end on the tiny fixtures, through ``accelerate launch``."""

import importlib.util
import shutil
from functools import partial

import numpy as np
import pytest
import torch
from diffusers import ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionPipeline
from PIL import Image

from conftest import (EXAMPLES, assert_close_files, assert_close_validations, assert_resume_is_exact, assert_same_files,
                      differing, launch, read_log, runs_with_and_without_cached_latents)
from training_utils.args import UsageError

SCRIPT = "controlnet/train_controlnet.py"
WEIGHTS = "diffusion_pytorch_model.safetensors"
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


def conditioning(tiny, index):
    return tiny["shapes_controlnet"] / "conditioning" / f"{index:04d}.png"


def common(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["sd"], "--train_data_dir", tiny["shapes_controlnet"],
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3,
            "--random_flip", "--use_ema", "--ema_decay", 0.9, "--seed", 3, "--proportion_empty_prompts", 0.3, *extra]


def pretrained(tiny, output_dir, *extra):
    return common(tiny, output_dir, "--controlnet_model_name_or_path", tiny["controlnet"], *extra)


def validation_flags(tiny, steps, images=(0, 1)):
    return ["--validation_prompt", *PROMPTS, "--validation_image", *[conditioning(tiny, i) for i in images],
            "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", steps]


@pytest.fixture(scope="module")
def full_run(tiny, tmp_path_factory):
    """From tiny/controlnet: 8 steps, validation every 3 (and at the final step), a checkpoint every 3."""
    output_dir = tmp_path_factory.mktemp("full")
    result = launch(SCRIPT, *pretrained(tiny, output_dir, "--max_train_steps", 8, *validation_flags(tiny, 3),
                                        "--checkpointing_steps", 3, "--checkpoints_total_limit", 1))
    return output_dir, result


@pytest.fixture(scope="module")
def plain_run(tiny, tmp_path_factory):
    """The same 8 steps without validation and without checkpoints."""
    output_dir = tmp_path_factory.mktemp("plain")
    launch(SCRIPT, *pretrained(tiny, output_dir, "--max_train_steps", 8, "--checkpointing_steps", 1000))
    return output_dir


@pytest.fixture(scope="module")
def from_unet_run(tiny, tmp_path_factory):
    """No --controlnet_model_name_or_path (the ControlNet is made from the UNet), EMA decay 0, one image for
    both prompts; the base model's folder is deleted as soon as the pipeline has loaded."""
    root = tmp_path_factory.mktemp("from_unet")
    model = root / "model"
    shutil.copytree(tiny["sd"], model)
    wrapper = root / "train_then_delete_model.py"
    wrapper.write_text(
        "import runpy, shutil, sys\n"
        "import training_utils.pipeline as pipeline\n"
        "load = pipeline.load_pipeline\n"
        "def load_then_delete(*args, **kwargs):\n"
        "    pipe = load(*args, **kwargs)\n"
        f"    shutil.rmtree({str(model)!r})\n"
        "    return pipe\n"
        "pipeline.load_pipeline = load_then_delete\n"
        f"sys.argv[0] = {str(EXAMPLES / SCRIPT)!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    args = common(tiny, root / "out", "--max_train_steps", 4, *validation_flags(tiny, 2, images=(5,)),
                  "--ema_decay", 0, "--checkpointing_steps", 1000)
    args[1] = model
    launch(wrapper, *args)
    return root / "out", model


def test_writes_raw_and_ema_controlnet_that_load_and_differ(tiny, full_run):
    output_dir, result = full_run
    raw, ema = ControlNetModel.from_pretrained(output_dir), ControlNetModel.from_pretrained(output_dir / "ema")
    initial = ControlNetModel.from_pretrained(tiny["controlnet"])
    raw, ema, initial = raw.state_dict(), ema.state_dict(), initial.state_dict()
    assert raw.keys() == ema.keys() == initial.keys()
    assert all(tensor.dtype == torch.float32 for tensor in raw.values())
    # The zero convolutions are where a new ControlNet starts learning.
    assert any(key.startswith("controlnet_down_blocks") for key in differing(raw, initial))
    assert differing(ema, initial) and differing(raw, ema)
    assert f"raw ControlNet: {output_dir}" in result.stdout
    assert f"ema ControlNet: {output_dir / 'ema'}" in result.stdout


def test_validates_at_the_due_steps_and_the_final_step_once(tiny, full_run):
    output_dir, _ = full_run
    log = read_log(output_dir)
    assert [(r["step"], r["variant"], r["prompt"]) for r in log] == [
        (step, variant, prompt) for step in (3, 6, 8) for variant in ("raw", "ema") for prompt in PROMPTS]
    assert all(len(r["images"]) == 1 and (output_dir / r["images"][0]).is_file() for r in log)
    assert len(list((output_dir / "validation").rglob("step-*/*.png"))) == 3 * 2 * 2


def test_saves_each_conditioning_image_once_and_shows_it_in_the_card(tiny, full_run):
    output_dir, _ = full_run
    saved = sorted(path.name for path in (output_dir / "validation").glob("*.png"))
    assert saved == ["conditioning-p00.png", "conditioning-p01.png"]
    for index in (0, 1):
        with Image.open(output_dir / "validation" / saved[index]) as image:
            given = Image.open(conditioning(tiny, index))
            assert np.array_equal(np.asarray(image), np.asarray(given.convert("RGB")))
    card = (output_dir / "README.md").read_text()
    assert "StableDiffusionControlNetPipeline" in card and "ControlNetModel.from_pretrained" in card
    assert "validation/conditioning-p00.png" in card and "validation/conditioning-p01.png" in card
    assert read_log(output_dir)[-1]["images"][0] in card
    assert list((output_dir / "logs").rglob("events.out.tfevents.*")), "no tensorboard events written"


def test_keeps_the_newest_checkpoint_within_the_limit(full_run):
    output_dir, _ = full_run
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-6"]
    assert not list(output_dir.glob(".checkpoint-*")), "an incomplete checkpoint was left behind"
    files = {path.name for path in (output_dir / "checkpoint-6").iterdir()}
    assert {"trained_parameters.safetensors", "ema.safetensors", "training_state.json"} <= files


def test_validation_and_checkpointing_leave_the_weights_untouched(full_run, plain_run):
    output_dir, _ = full_run
    assert_same_files(output_dir / WEIGHTS, plain_run / WEIGHTS)
    assert_same_files(output_dir / "ema" / WEIGHTS, plain_run / "ema" / WEIGHTS)
    assert not (plain_run / "validation").exists()


def test_resumed_run_prunes_and_ends_with_the_same_weights(tiny, tmp_path, full_run):
    # Mid-epoch, with random flips and empty prompts: the resumed run is the uninterrupted one, bit for bit.
    assert_resume_is_exact(SCRIPT, partial(pretrained, tiny), tmp_path, full_run[0], [WEIGHTS, f"ema/{WEIGHTS}"])


def test_saved_controlnet_changes_a_fresh_pipelines_output(tiny, full_run):
    output_dir, _ = full_run
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


def test_controlnet_from_the_unet_trains_without_rereading_the_base_model(tiny, from_unet_run):
    output_dir, model = from_unet_run
    assert not model.exists()
    unet = StableDiffusionPipeline.from_pretrained(tiny["sd"]).unet.state_dict()
    raw = ControlNetModel.from_pretrained(output_dir)
    assert raw.config.conditioning_embedding_out_channels == [16, 32]  # halves, like the tiny VAE
    raw = raw.state_dict()
    # Started as the UNet's encoder, and moved away from it.
    assert not torch.equal(raw["conv_in.weight"], unet["conv_in.weight"])
    assert torch.any(raw["controlnet_mid_block.weight"] != 0)
    # The final step (4) is also a due step (every 2): validated once, raw and EMA; one image for both prompts.
    assert [(r["step"], r["variant"]) for r in read_log(output_dir)[::2]] == [(2, "raw"), (2, "ema"), (4, "raw"),
                                                                             (4, "ema")]
    assert sorted(p.name for p in (output_dir / "validation").glob("*.png")) == ["conditioning-p00.png"]


def test_ema_decay_zero_equals_the_raw_weights(from_unet_run):
    output_dir, _ = from_unet_run
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
    result = launch(SCRIPT, *common(tiny, output_dir, *flags), check=False, quiet=True)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(message), result.stderr[-2000:]
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


def cache_flags(tiny, output_dir, *extra):
    """4 steps from tiny/controlnet with center crops, random flips and empty prompts, a checkpoint every 2 steps,
    validating one prompt every 2 steps. Learning rate 1e-4: the VAE's float noise (its result depends on the
    batch it encodes) reaches the weights through Adam in proportion to the learning rate, while a wrong
    layout or caption would move them by about the learning rate itself, far beyond the tolerance."""
    return pretrained(tiny, output_dir, "--center_crop", "--learning_rate", 1e-4, "--max_train_steps", 4,
                      "--checkpointing_steps", 2,
                      "--validation_prompt", PROMPTS[0], "--validation_image", conditioning(tiny, 0),
                      "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", 2, *extra)


@pytest.fixture(scope="module")
def cache_runs(tiny, tmp_path_factory):
    """``{cache_latents: output_dir}``: the same 4 steps with and without --cache_latents (text always cached)."""
    return runs_with_and_without_cached_latents(SCRIPT, partial(cache_flags, tiny), tmp_path_factory.mktemp("cache"))


def test_cached_latents_train_as_the_uncached_run(tiny, cache_runs):
    initial = ControlNetModel.from_pretrained(tiny["controlnet"]).state_dict()
    for weights in (WEIGHTS, f"ema/{WEIGHTS}"):
        cached = assert_close_files(cache_runs[False] / weights, cache_runs[True] / weights)
        assert cached.keys() == initial.keys()
        assert differing(cached, initial)


def test_validation_renders_with_the_offloaded_encoders_back(cache_runs):
    assert_close_validations(cache_runs[False], cache_runs[True], [(2, "raw"), (2, "ema"), (4, "raw"), (4, "ema")])


def test_cached_run_resumed_mid_epoch_is_the_uninterrupted_one(tiny, tmp_path, cache_runs):
    shutil.copytree(cache_runs[True] / "checkpoint-2", tmp_path / "checkpoint-2")
    result = launch(SCRIPT, *cache_flags(tiny, tmp_path, "--cache_latents", "--resume_from_checkpoint", "latest"))
    assert f"resumed from {tmp_path / 'checkpoint-2'} at step 2" in result.stdout
    assert_same_files(tmp_path / WEIGHTS, cache_runs[True] / WEIGHTS)
    assert_same_files(tmp_path / "ema" / WEIGHTS, cache_runs[True] / "ema" / WEIGHTS)
