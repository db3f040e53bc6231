"""Smoke tests: the LCM distillation scripts (LCM-LoRA: SDXL, and SD 1.x and SDXL from WebDataset shards; full LCM
UNets: SD 1.x and SDXL from shards) end to end on the tiny fixtures, through ``accelerate launch``: the LoRA each
writes loads into a stock pipeline next to LCMScheduler and changes its 4-step images; the full UNet and its EMA (the
target network) load into the stock pipeline and render with LCMScheduler at a guidance scale they embed."""

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import LCMScheduler, StableDiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel
from PIL import Image
from safetensors.torch import load_file

from helpers import launch, launch_together, launching, usage_error
from training_utils.testing import (assert_checkpoint_is_the_output, assert_lora_changes_pipeline_output,
                                    assert_model_folder_loads, assert_resumes_exactly, assert_same_tensors,
                                    assert_validated_at, checkpoint_names, differing_keys, read_log)

SCRIPT = "consistency_distillation/train_lcm_distill_lora_sdxl.py"
WDS_SCRIPT = "consistency_distillation/train_lcm_distill_lora_sd_wds.py"
SDXL_WDS_SCRIPT = "consistency_distillation/train_lcm_distill_lora_sdxl_wds.py"
FULL_SCRIPTS = {"sd": "consistency_distillation/train_lcm_distill_sd_wds.py",
                "sdxl": "consistency_distillation/train_lcm_distill_sdxl_wds.py"}
LORA = "pytorch_lora_weights.safetensors"
UNET = "unet/diffusion_pytorch_model.safetensors"
EMA_UNET = f"ema/{UNET}"
PROMPT = "a red circle on a white background"
SEED = 3


def common(tiny, output_dir, *extra):
    """Upstream's spellings of the teacher and the rank; 4 steps of 2 images at 32 px, the EMA at decay 0.9."""
    return ["--pretrained_teacher_model", tiny["sdxl"], "--train_data_dir", tiny["shapes"], "--output_dir",
            output_dir, "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3, "--lora_rank", 4,
            "--random_flip", "--use_ema", "--ema_decay", 0.9, "--max_train_steps", 4, "--checkpointing_steps", 2,
            "--seed", SEED, *extra]


def wds(tiny, output_dir, *extra, model="sd"):
    """The SD 1.x (or ``model``'s) script on the tiny shards, named by a brace pattern, as `common` otherwise."""
    return ["--pretrained_teacher_model", tiny[model], "--train_shards_path_or_url",
            f"{tiny['shapes_wds']}/{{00000..00001}}.tar", "--output_dir", output_dir, "--resolution", 32,
            "--train_batch_size", 2, "--learning_rate", 1e-3, "--lora_rank", 4, "--use_ema", "--ema_decay", 0.9,
            "--max_train_steps", 4, "--checkpointing_steps", 2, "--seed", SEED, "--cast_teacher_unet", *extra]


def full(tiny, model, output_dir, *extra):
    """A full distillation script on ``model`` and the tiny shards (their folder): an 8-wide guidance embedding, the
    target network (the EMA, kept without --use_ema) at decay 0.9, 4 steps as `wds`."""
    return ["--pretrained_teacher_model", tiny[model], "--train_shards_path_or_url", tiny["shapes_wds"],
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3,
            "--unet_time_cond_proj_dim", 8, "--ema_decay", 0.9, "--max_train_steps", 4, "--checkpointing_steps", 2,
            "--seed", SEED, *extra]


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: output_dir}`` of the runs, launched together:

    - l2: `common`, validating one prompt every 2 steps (LCMScheduler, its default 4 steps);
    - huber: `common` with the pseudo-Huber loss, a 10-step DDIM solver and guidance scales in [1, 2], no
      validation;
    - wds: the SD 1.x script on the shards (`wds`), validating at the final step;
    - sdxl_wds: the SDXL script on the shards, 2 steps, micro-conditioned on fixed sizes and crops, no validation;
    - full_sd: the full SD 1.x distillation (`full`), validating one prompt every 2 steps, raw and EMA;
    - full_sdxl: the full SDXL distillation, 2 steps with fixed sizes and crops, validating at the final step;
    - full_sd_decay0: full_sd at EMA decay 0 (the target network the student itself), no validation.
    """
    root = tmp_path_factory.mktemp("runs")
    launch_together({
        "l2": (SCRIPT, *common(tiny, root / "l2", "--validation_prompt", PROMPT, "--num_validation_images", 1,
                               "--validation_steps", 2)),
        "huber": (SCRIPT, *common(tiny, root / "huber", "--loss_type", "huber", "--huber_c", 0.01,
                                  "--num_ddim_timesteps", 10, "--w_min", 1, "--w_max", 2)),
        "wds": (WDS_SCRIPT, *wds(tiny, root / "wds", "--validation_prompt", PROMPT, "--num_validation_images", 1,
                                 "--validation_steps", 100)),
        "sdxl_wds": (SDXL_WDS_SCRIPT, *wds(tiny, root / "sdxl_wds", "--max_train_steps", 2, "--use_fix_crop_and_size",
                                           model="sdxl")),
        "full_sd": (FULL_SCRIPTS["sd"], *full(tiny, "sd", root / "full_sd", "--validation_prompt", PROMPT,
                                              "--num_validation_images", 1, "--validation_steps", 2)),
        "full_sdxl": (FULL_SCRIPTS["sdxl"], *full(tiny, "sdxl", root / "full_sdxl", "--max_train_steps", 2,
                                                  "--use_fix_crop_and_size", "--validation_prompt", PROMPT,
                                                  "--num_validation_images", 1)),
        "full_sd_decay0": (FULL_SCRIPTS["sd"], *full(tiny, "sd", root / "full_sd_decay0", "--ema_decay", 0)),
    })
    return {name: root / name for name in ("l2", "huber", "wds", "sdxl_wds", "full_sd", "full_sdxl", "full_sd_decay0")}


LORA_RUNS = {"l2": "sdxl", "huber": "sdxl", "wds": "sd", "sdxl_wds": "sdxl"}


def use_lcm_scheduler(pipe):
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)


def test_the_lcm_lora_and_its_ema_load_next_to_lcm_scheduler_and_change_its_4_step_images(tiny, runs):
    for name, model in LORA_RUNS.items():
        output_dir = runs[name]
        raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
        assert raw and all("lora" in key for key in raw) and raw.keys() == ema.keys()
        # Upstream's LCM-LoRA layers: attention, feed-forward and ResNet convolutions, time projections.
        assert any(".conv1." in key for key in raw) and any("time_emb_proj" in key for key in raw)
        assert any(not torch.equal(raw[key], ema[key]) for key in raw)
        assert_lora_changes_pipeline_output(tiny[model], output_dir, output_dir / "ema", prompt=PROMPT,
                                            num_inference_steps=4, prepare=use_lcm_scheduler, guidance_scale=1.0)
    assert any(not torch.equal(load_file(runs["l2"] / LORA)[key], tensor)
               for key, tensor in load_file(runs["huber"] / LORA).items())


def test_validation_renders_what_a_stock_pipeline_renders_with_lcm_scheduler_in_4_steps(tiny, runs):
    output_dir = runs["l2"]
    log = assert_validated_at(output_dir, [2, 4], ("raw", "ema"), [PROMPT], num_images=1)
    assert {record["guidance_scale"] for record in log} == {1.0}
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"])
    pipe.set_progress_bar_config(disable=True)
    use_lcm_scheduler(pipe)
    for variant, lora_dir in (("raw", output_dir), ("ema", output_dir / "ema")):
        pipe.load_lora_weights(lora_dir)
        expected = pipe(PROMPT, num_inference_steps=4, guidance_scale=1.0, height=32, width=32,
                        generator=torch.Generator().manual_seed(SEED)).images[0]
        pipe.unload_lora_weights()
        rendered = next(record for record in log if record["step"] == 4 and record["variant"] == variant)
        difference = np.abs(np.asarray(Image.open(output_dir / rendered["images"][0])).astype(int)
                            - np.asarray(expected).astype(int))
        assert difference.max() <= 1, variant
    card = (output_dir / "README.md").read_text()
    assert "pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)" in card
    assert "num_inference_steps=4, guidance_scale=1.0" in card
    assert read_log(output_dir)[-1]["progress"] in card


def test_checkpoints_hold_the_output_and_resume_to_the_uninterrupted_weights(tiny, tmp_path, runs):
    output_dir = runs["l2"]
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    assert_checkpoint_is_the_output(output_dir / "checkpoint-4", output_dir, [LORA, f"ema/{LORA}"])

    # The uninterrupted run validated at step 2 (after writing checkpoint-2) and 4, the resumed one never.
    assert_resumes_exactly(SCRIPT, lambda directory: common(tiny, directory), output_dir, tmp_path, 2,
                           [LORA, f"ema/{LORA}"], launch=launch)


@pytest.mark.parametrize("flags, message", [
    (["--w_min", 5, "--w_max", 1], "error: --w_max=1.0: expected at least --w_min (5.0)"),
    (["--vae_encode_batch_size", 4], "error: --vae_encode_batch_size is not supported here: the VAE encodes each "
                                     "training batch whole (or each image once, --cache_latents)"),
])
def test_bad_distillation_flags_stop_before_loading_in_one_line(tiny, tmp_path, flags, message):
    assert usage_error(SCRIPT, *common(tiny, tmp_path, *flags)) == message


def test_the_shards_train_and_validate_as_a_dataset_does(tiny, runs):
    output_dir = runs["wds"]
    assert_validated_at(output_dir, [4], ("raw", "ema"), [PROMPT], num_images=1)
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    card = (output_dir / "README.md").read_text()
    assert "StableDiffusionPipeline.from_pretrained" in card and "LCMScheduler.from_config" in card


@pytest.mark.parametrize("flags, message", [
    (["--dataset_name", "x"], "error: --dataset_name is not supported here: the data are WebDataset shards: "
                              "--train_shards_path_or_url"),
])
def test_the_wds_scripts_flags_stop_before_loading_in_one_line(tiny, tmp_path, flags, message):
    assert usage_error(WDS_SCRIPT, *wds(tiny, tmp_path, *flags)) == message


def test_the_sdxl_lcm_lora_trains_from_shards_and_refuses_dataset_flags(tiny, tmp_path, runs):
    output_dir = runs["sdxl_wds"]
    assert checkpoint_names(output_dir) == ["checkpoint-2"]
    assert_checkpoint_is_the_output(output_dir / "checkpoint-2", output_dir, [LORA, f"ema/{LORA}"])
    card = (output_dir / "README.md").read_text()
    assert "StableDiffusionXLPipeline.from_pretrained" in card and "LCMScheduler.from_config" in card
    assert usage_error(SDXL_WDS_SCRIPT, *wds(tiny, tmp_path, "--caption_column", "x", model="sdxl")) == (
        "error: --caption_column is not supported here: the data are WebDataset shards: --train_shards_path_or_url")


PIPELINES = {"sd": StableDiffusionPipeline, "sdxl": StableDiffusionXLPipeline}


def render(pipe, **call_kwargs):
    """``pipe``'s 4-step image of `PROMPT` at 32 px with LCMScheduler (swapped in), seeded as validation seeds."""
    use_lcm_scheduler(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe(PROMPT, num_inference_steps=4, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(SEED), **call_kwargs).images[0]


@pytest.mark.parametrize("model", ["sd", "sdxl"])
def test_the_distilled_unet_and_its_ema_load_into_the_stock_pipeline_and_change_its_4_step_images(tiny, runs,
                                                                                                   model):
    output_dir = runs[f"full_{model}"]
    initial = Path(tiny[model]) / "unet"
    raw = assert_model_folder_loads(UNet2DConditionModel, output_dir / "unet")
    ema = assert_model_folder_loads(UNet2DConditionModel, output_dir / "ema" / "unet")
    assert raw.config.time_cond_proj_dim == ema.config.time_cond_proj_dim == 8
    # The teacher's tensors and the new guidance embedding's projection, trained; the EMA (the target network) apart.
    teacher = UNet2DConditionModel.from_pretrained(initial).state_dict()
    weights = raw.state_dict()
    assert weights.keys() - teacher.keys() == {"time_embedding.cond_proj.weight"}
    assert differing_keys({name: weights[name] for name in teacher}, teacher)
    assert differing_keys(weights, ema.state_dict())

    pipe = PIPELINES[model].from_pretrained(output_dir)
    assert pipe.unet.config.time_cond_proj_dim == 8
    distilled = render(pipe)
    pipe.unet = ema
    target = render(pipe)
    base = render(PIPELINES[model].from_pretrained(tiny[model]))
    assert not np.allclose(distilled, base, atol=1e-4) and not np.allclose(target, distilled, atol=1e-4)


def test_full_validation_renders_the_student_and_its_ema_as_the_stock_pipeline_does_with_lcm_scheduler(runs):
    output_dir = runs["full_sd"]
    log = assert_validated_at(output_dir, [2, 4], ("raw", "ema"), [PROMPT], num_images=1)
    assert {record["guidance_scale"] for record in log} == {7.5}
    pipe = StableDiffusionPipeline.from_pretrained(output_dir)
    for variant in ("raw", "ema"):
        if variant == "ema":
            pipe.unet = UNet2DConditionModel.from_pretrained(output_dir / "ema" / "unet")
        expected = (render(pipe) * 255).round()
        rendered = next(record for record in log if record["step"] == 4 and record["variant"] == variant)
        difference = np.abs(np.asarray(Image.open(output_dir / rendered["images"][0])).astype(int) - expected)
        assert difference.max() <= 1, variant
    card = (output_dir / "README.md").read_text()
    assert f'StableDiffusionPipeline.from_pretrained("{output_dir}")' in card
    assert "pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)" in card
    assert "num_inference_steps=4, guidance_scale=7.5" in card
    assert f'UNet2DConditionModel.from_pretrained("{output_dir}/ema/unet")' in card
    assert_validated_at(runs["full_sdxl"], [2], ("raw", "ema"), [PROMPT], num_images=1)


def test_full_checkpoints_hold_the_output_and_resume_to_the_uninterrupted_weights(tiny, tmp_path, runs):
    output_dir = runs["full_sd"]
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    assert_checkpoint_is_the_output(output_dir / "checkpoint-4", output_dir, [UNET, EMA_UNET])
    assert_checkpoint_is_the_output(runs["full_sdxl"] / "checkpoint-2", runs["full_sdxl"], [UNET, EMA_UNET])

    # The uninterrupted run validated at step 2 (after writing checkpoint-2) and 4, the resumed one never.
    assert_resumes_exactly(FULL_SCRIPTS["sd"], lambda directory: full(tiny, "sd", directory), output_dir, tmp_path,
                           2, [UNET, EMA_UNET], launch=launch)


def test_the_target_network_is_the_ema_so_its_decay_changes_what_the_student_learns(runs):
    # The EMA's first update copies the student: the targets first differ at step 3, where decay 0.9's EMA still
    # holds some of step 1's weights and decay 0's is the student itself.
    at_decay_0 = runs["full_sd_decay0"]
    assert_same_tensors(load_file(at_decay_0 / EMA_UNET), load_file(at_decay_0 / UNET))
    assert differing_keys(load_file(at_decay_0 / UNET), load_file(runs["full_sd"] / UNET))


@pytest.mark.parametrize("script, flags, message", [
    (FULL_SCRIPTS["sd"], ["--unet_time_cond_proj_dim", 0], "error: --unet_time_cond_proj_dim=0: expected a positive "
                                                           "size"),
    (FULL_SCRIPTS["sd"], ["--pretrained_vae_model_name_or_path", "vae"],
     "error: --pretrained_vae_model_name_or_path is not supported here: the VAE is the pipeline's own "
     "(--pretrained_teacher_model); a replacement VAE is carried by the SDXL scripts only"),
    (FULL_SCRIPTS["sdxl"], ["--vae_encode_batch_size", 4], "error: --vae_encode_batch_size is not supported here: "
                                                           "the VAE encodes each training batch whole (or each image "
                                                           "once, --cache_latents)"),
])
def test_the_full_scripts_bad_flags_stop_before_loading_in_one_line(tiny, tmp_path, script, flags, message):
    model = "sdxl" if "sdxl" in script else "sd"
    assert usage_error(script, *full(tiny, model, tmp_path, *flags)) == message
