"""Smoke tests: the SDXL ControlNet script end to end on the tiny fixtures, through ``accelerate launch``, and beside
its runs the SDXL T2I-Adapter script's (which trains on the same data and shares its conditioning code)."""

import importlib.util
import shutil

import numpy as np
import pytest
import torch
from diffusers import (ControlNetModel, StableDiffusionXLAdapterPipeline, StableDiffusionXLControlNetPipeline,
                       StableDiffusionXLPipeline, T2IAdapter)
from PIL import Image

from helpers import EXAMPLES, controlnet_flags, deleting_after_load, launch, launch_together, launching, usage_error
from training_utils.errors import UsageError
from training_utils.testing import (assert_checkpoint_is_the_output, assert_close_files, assert_close_validations,
                                    assert_model_folder_loads, assert_resumes_exactly, assert_same_files,
                                    assert_validated_at, checkpoint_names, checkpoint_weight_files, differing_keys,
                                    most_common_bucket, read_log, rendered_images, reported_buckets)

SCRIPT = "controlnet/train_controlnet_sdxl.py"
T2I_ADAPTER_SCRIPT = "t2i_adapter/train_t2i_adapter_sdxl.py"
WEIGHTS = "diffusion_pytorch_model.safetensors"
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


def conditioning(tiny, index):
    return tiny["shapes_controlnet"] / "conditioning" / f"{index:04d}.png"


def common(tiny, output_dir, *extra, mixed=False):
    return controlnet_flags(tiny, "sdxl", output_dir, *extra, mixed=mixed)


def pretrained(tiny, output_dir, *extra):
    """From tiny/sdxl_controlnet on the mixed shapes in buckets, checkpoints every 2 steps, the newest 2 kept."""
    return common(tiny, output_dir, "--controlnet_model_name_or_path", tiny["sdxl_controlnet"],
                  "--checkpointing_steps", 2, "--checkpoints_total_limit", 2, *extra, mixed=True)


def t2i_adapter_flags(tiny, output_dir, *extra):
    """The T2I-Adapter script from tiny/sdxl_t2i_adapter on tiny/sdxl_adapter_base, on the mixed shapes in buckets:
    4 steps, checkpoints every 2, the features scaled by 0.8."""
    flags = controlnet_flags(tiny, "sdxl_adapter_base", output_dir, "--adapter_model_name_or_path",
                             tiny["sdxl_t2i_adapter"], "--max_train_steps", 4, "--checkpointing_steps", 2,
                             "--adapter_conditioning_scale", 0.8, *extra, mixed=True)
    return flags


def validation_flags(tiny, steps, images=(0, 1)):
    return ["--validation_prompt", *PROMPTS, "--validation_image", *[conditioning(tiny, i) for i in images],
            "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", steps]


def cache_flags(tiny, output_dir, *extra):
    """4 steps from tiny/sdxl_controlnet with center crops, random flips, empty prompts and repeats, validating one
    prompt every 2 steps. Learning rate 1e-4: the VAE's float noise (its result depends on the batch it encodes)
    reaches the weights through Adam in proportion to the learning rate, while a wrong layout, caption or time id
    would move them by about the learning rate itself, far beyond the tolerance."""
    return pretrained(tiny, output_dir, "--center_crop", "--learning_rate", 1e-4, "--max_train_steps", 4,
                      "--validation_prompt", PROMPTS[0], "--validation_image", conditioning(tiny, 0),
                      "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", 2, *extra)


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}`` of every run here that starts from scratch, launched together:

    - full: 8 steps from tiny/sdxl_controlnet (`pretrained`), validating every 3 steps (and at the final step);
    - from_unet: no --controlnet_model_name_or_path (the ControlNet is made from the UNet), a replacement VAE
      (``../vae``), EMA decay 0, one image for both prompts, validating at 16x32; the base model's folder
      (``../model``) and the VAE's are deleted as soon as the pipeline has loaded;
    - uncached, cached: `cache_flags` without and with --cache_latents (text always cached);
    - t2i_adapter: the T2I-Adapter script (`t2i_adapter_flags`), validating every 2 steps.
    """
    root = tmp_path_factory.mktemp("runs")
    model, vae = root / "model", root / "vae"
    shutil.copytree(tiny["sdxl"], model)
    shutil.copytree(tiny["sdxl"] / "vae", vae)
    wrapper = deleting_after_load(EXAMPLES / SCRIPT, [model, vae], root)
    from_unet_args = common(tiny, root / "from_unet", "--max_train_steps", 4, *validation_flags(tiny, 2, images=(5,)),
                            "--ema_decay", 0, "--checkpointing_steps", 1000, "--pretrained_vae_model_name_or_path", vae,
                            "--validation_height", 16, "--validation_width", 32)
    from_unet_args[1] = model
    results = launch_together({
        "full": (SCRIPT, *pretrained(tiny, root / "full", "--max_train_steps", 8, *validation_flags(tiny, 3))),
        "from_unet": (wrapper, *from_unet_args),
        "uncached": (SCRIPT, *cache_flags(tiny, root / "uncached")),
        "cached": (SCRIPT, *cache_flags(tiny, root / "cached", "--cache_latents")),
        "t2i_adapter": (T2I_ADAPTER_SCRIPT, *t2i_adapter_flags(tiny, root / "t2i_adapter", *validation_flags(tiny, 2))),
    })
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_raw_and_ema_controlnet_that_load_and_differ(tiny, runs):
    output_dir, result = runs["full"]
    raw, ema = (assert_model_folder_loads(ControlNetModel, folder, initial=tiny["sdxl_controlnet"])
                for folder in (output_dir, output_dir / "ema"))
    assert raw.config.addition_embed_type == "text_time"
    raw, ema = raw.state_dict(), ema.state_dict()
    initial = ControlNetModel.from_pretrained(tiny["sdxl_controlnet"]).state_dict()
    # The zero convolutions, where a new ControlNet starts learning, and SDXL's added embedding both trained.
    changed = differing_keys(raw, initial)
    assert any(key.startswith("controlnet_down_blocks") for key in changed)
    assert any(key.startswith("add_embedding") for key in changed)
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


def test_saves_the_conditioning_images_beside_the_samples_and_in_the_card(tiny, runs):
    output_dir, _ = runs["full"]
    saved = sorted(path.name for path in (output_dir / "validation").glob("conditioning-*.png"))
    assert saved == ["conditioning-p00.png", "conditioning-p01.png"]
    for index in (0, 1):
        with Image.open(output_dir / "validation" / saved[index]) as image:
            given = Image.open(conditioning(tiny, index)).convert("RGB")
            assert np.array_equal(np.asarray(image), np.asarray(given))
    card = (output_dir / "README.md").read_text()
    assert "StableDiffusionXLControlNetPipeline.from_pretrained" in card and "ControlNetModel.from_pretrained" in card
    assert "AutoencoderKL" not in card
    assert "validation/conditioning-p00.png" in card and "validation/conditioning-p01.png" in card
    assert read_log(output_dir)[-1]["progress"] in card
    assert list((output_dir / "logs" / "sd_xl_train_controlnet").rglob("events.out.tfevents.*"))


def test_prunes_checkpoints_and_resumes_to_the_uninterrupted_weights(tiny, tmp_path, runs):
    full_dir, _ = runs["full"]
    assert checkpoint_names(full_dir) == ["checkpoint-6", "checkpoint-8"]

    def resumed_flags(output_dir):
        return pretrained(tiny, output_dir, "--max_train_steps", 8, "--checkpointing_steps", 1)

    # The uninterrupted run validated at steps 3, 6 (after writing checkpoint-6) and 8, the resumed one never:
    # resuming mid-epoch (of 12 bucketed batches) with random crops, flips, empty prompts and repeats, and
    # validating, both leave the weights bit for bit as they would be.
    assert_resumes_exactly(SCRIPT, resumed_flags, full_dir, tmp_path, 6, [WEIGHTS, f"ema/{WEIGHTS}"], launch=launch)
    assert checkpoint_names(tmp_path) == ["checkpoint-7", "checkpoint-8"]
    assert not list(tmp_path.glob(".checkpoint-*")), "an incomplete checkpoint was left behind"
    assert checkpoint_weight_files(tmp_path / "checkpoint-8") == {f"controlnet/{WEIGHTS}", f"ema/controlnet/{WEIGHTS}"}
    assert not (tmp_path / "validation").exists()


def test_saved_controlnet_changes_a_fresh_pipelines_output(tiny, runs):
    output_dir, _ = runs["full"]
    sdxl_pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"])
    image = Image.open(conditioning(tiny, 0)).convert("RGB")

    def render(controlnet):
        pipe = StableDiffusionXLControlNetPipeline(**sdxl_pipe.components, controlnet=controlnet)
        pipe.set_progress_bar_config(disable=True)
        return pipe(PROMPTS[0], image=image, num_inference_steps=2, height=32, width=32, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    initial = render(ControlNetModel.from_pretrained(tiny["sdxl_controlnet"]))
    trained = render(ControlNetModel.from_pretrained(output_dir))
    assert not np.allclose(initial, trained, atol=1e-4)
    # The final step's checkpoint holds the same ControlNets, raw and EMA, each a folder that loads.
    checkpoint = output_dir / "checkpoint-8"
    assert_checkpoint_is_the_output(checkpoint, output_dir, {f"controlnet/{WEIGHTS}": WEIGHTS,
                                                             f"ema/controlnet/{WEIGHTS}": f"ema/{WEIGHTS}"})
    assert np.array_equal(render(ControlNetModel.from_pretrained(checkpoint / "controlnet")), trained)
    ControlNetModel.from_pretrained(checkpoint / "ema" / "controlnet")


def test_controlnet_from_the_unet_trains_without_rereading_the_base_model(tiny, runs):
    output_dir, result = runs["from_unet"]
    model, vae = output_dir.parent / "model", output_dir.parent / "vae"
    assert not model.exists() and not vae.exists()
    unet = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"]).unet.state_dict()
    raw = ControlNetModel.from_pretrained(output_dir)
    assert list(raw.config.conditioning_embedding_out_channels) == [16, 32]  # halves, like the tiny VAE
    assert raw.config.addition_embed_type == "text_time"
    raw = raw.state_dict()
    # Started as the UNet's encoder, SDXL's added embedding included, and moved away from it.
    assert raw["add_embedding.linear_1.weight"].shape == unet["add_embedding.linear_1.weight"].shape
    assert not torch.equal(raw["conv_in.weight"], unet["conv_in.weight"])
    assert torch.any(raw["controlnet_mid_block.weight"] != 0)
    # The final step (4) is also a due step (every 2): validated once, raw and EMA; one image for both prompts,
    # rendered at --validation_height x --validation_width.
    log = assert_validated_at(output_dir, [2, 4], ("raw", "ema"), PROMPTS)
    assert sorted(p.name for p in (output_dir / "validation").glob("conditioning-*.png")) == ["conditioning-p00.png"]
    assert {Image.open(output_dir / record["images"][0]).size for record in log} == {(32, 16)}
    assert f"VAE: {vae}" in result.stdout
    assert f'vae=AutoencoderKL.from_pretrained("{vae}")' in (output_dir / "README.md").read_text()


def test_ema_decay_zero_equals_the_raw_weights(runs):
    output_dir, _ = runs["from_unet"]
    assert_same_files(output_dir / WEIGHTS, output_dir / "ema" / WEIGHTS)


def test_bad_input_fails_with_one_line_before_anything_loads(tiny, tmp_path):
    output_dir = tmp_path / "out"
    error = usage_error(SCRIPT, *common(tiny, output_dir, "--conditioning_image_column", "hint"))
    assert error.startswith("error: --conditioning_image_column='hint': expected a column of the dataset")
    assert not output_dir.exists()


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_controlnet_sdxl", EXAMPLES / SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_follow_the_upstream_script(tiny, tmp_path, script):
    args = script.parse_args(list(map(str, common(tiny, tmp_path))))
    assert args.resolution == 32 and args.tracker_project_name == "sd_xl_train_controlnet"
    defaults = script.parse_args(["--pretrained_model_name_or_path", str(tiny["sdxl"])])
    assert defaults.resolution == 512 and defaults.conditioning_image_column == "conditioning_image"
    assert defaults.controlnet_model_name_or_path is None and defaults.pretrained_vae_model_name_or_path is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--validation_prompt", "a", "b", "c", "--validation_image", "IMAGE", "IMAGE"],
         "expected one conditioning image per --validation_prompt (3), or one image for all prompts"),
        (["--proportion_empty_prompts", 1.5], "--proportion_empty_prompts=1.5: expected a number in [0, 1]"),
        (["--controlnet_model_name_or_path", "SDXL"], "expected a ControlNetModel folder (with config.json)"),
        (["--pretrained_vae_model_name_or_path", "UNET"], "its config.json names 'UNet2DConditionModel'"),
        (["--pretrained_vae_model_name_or_path", "./no_vae"], "--pretrained_vae_model_name_or_path='./no_vae': "
                                                              "expected an AutoencoderKL folder"),
    ],
)
def test_bad_flags_are_usage_errors(tiny, tmp_path, script, flags, message):
    replacements = {"IMAGE": conditioning(tiny, 0), "SDXL": tiny["sdxl"], "UNET": tiny["sdxl"] / "unet"}
    flags = [str(replacements.get(flag, flag)) for flag in flags]
    with pytest.raises(UsageError) as error:
        script.load_validation_pairs(script.parse_args(list(map(str, common(tiny, tmp_path, *flags)))))
    assert message in str(error.value)


def test_cached_latents_train_as_the_uncached_run(tiny, runs):
    (uncached, _), (cached, result) = runs["uncached"], runs["cached"]
    assert len(reported_buckets(result.stderr)) >= 3, result.stderr[-3000:]
    initial = ControlNetModel.from_pretrained(tiny["sdxl_controlnet"]).state_dict()
    for weights in (WEIGHTS, f"ema/{WEIGHTS}"):
        cached_weights = assert_close_files(uncached / weights, cached / weights)
        assert cached_weights.keys() == initial.keys()
        assert any(key.startswith("add_embedding") for key in differing_keys(cached_weights, initial))


def test_validation_renders_with_the_offloaded_encoders_back(runs):
    (uncached, _), (cached, _) = runs["uncached"], runs["cached"]
    assert_close_validations(uncached, cached, [(2, "raw"), (2, "ema"), (4, "raw"), (4, "ema")])


# The T2I-Adapter script.

def test_t2i_adapter_writes_raw_and_ema_adapters_that_change_the_adapter_pipelines_output(tiny, runs):
    output_dir, result = runs["t2i_adapter"]
    raw, ema = (assert_model_folder_loads(T2IAdapter, folder, initial=tiny["sdxl_t2i_adapter"])
                for folder in (output_dir, output_dir / "ema"))
    assert raw.config.adapter_type == "full_adapter_xl"
    assert differing_keys(raw.state_dict(), ema.state_dict())
    assert f"raw T2I-Adapter: {output_dir}" in result.stdout
    assert f"ema T2I-Adapter: {output_dir / 'ema'}" in result.stdout
    sdxl_pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl_adapter_base"])
    image = Image.open(conditioning(tiny, 0)).convert("RGB")

    def render(folder):
        pipe = StableDiffusionXLAdapterPipeline(**sdxl_pipe.components, adapter=T2IAdapter.from_pretrained(folder))
        pipe.set_progress_bar_config(disable=True)
        return pipe(PROMPTS[0], image=image, num_inference_steps=2, height=32, width=32, output_type="np",
                    adapter_conditioning_scale=0.8, generator=torch.Generator().manual_seed(0)).images

    trained = render(output_dir)
    assert not np.allclose(render(tiny["sdxl_t2i_adapter"]), trained, atol=1e-4)
    assert not np.allclose(render(output_dir / "ema"), trained, atol=1e-4)
    # The final step's checkpoint holds the same adapters, raw and EMA.
    assert_checkpoint_is_the_output(output_dir / "checkpoint-4", output_dir, {
        f"adapter/{WEIGHTS}": WEIGHTS, f"ema/adapter/{WEIGHTS}": f"ema/{WEIGHTS}"})


def test_t2i_adapter_validates_each_prompt_with_its_conditioning_beside_raw_and_ema(tiny, runs):
    output_dir, _ = runs["t2i_adapter"]
    log = assert_validated_at(output_dir, [2, 4], ("raw", "ema"), PROMPTS, num_images=1)
    assert sorted(path.name for path in (output_dir / "validation").glob("conditioning-*.png")) == [
        "conditioning-p00.png", "conditioning-p01.png"]
    # Each prompt's grid: the conditioning row above the raw and EMA rows.
    grid = Image.open(output_dir / log[-1]["grid"])
    sample = Image.open(output_dir / log[-1]["images"][0])
    assert grid.height > 3 * sample.height
    card = (output_dir / "README.md").read_text()
    assert "T2IAdapter.from_pretrained" in card and "StableDiffusionXLAdapterPipeline.from_pretrained" in card
    assert "adapter_conditioning_scale=0.8" in card and "validation/conditioning-p01.png" in card
    assert list((output_dir / "logs" / "sd_xl_train_t2iadapter").rglob("events.out.tfevents.*"))


def test_t2i_adapter_resumes_to_the_uninterrupted_weights(tiny, tmp_path, runs):
    output_dir, _ = runs["t2i_adapter"]
    # The uninterrupted run validated at steps 2 and 4, the resumed one never: both end bit for bit alike.
    assert_resumes_exactly(T2I_ADAPTER_SCRIPT, lambda folder: t2i_adapter_flags(tiny, folder), output_dir, tmp_path,
                           2, [WEIGHTS, f"ema/{WEIGHTS}"], launch=launch)
    assert not (tmp_path / "validation").exists()
