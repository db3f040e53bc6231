"""Smoke tests: the text-to-image LoRA script end to end on the tiny fixtures, through ``accelerate launch``,
``--cache_latents`` included."""

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from diffusers import StableDiffusionPipeline
from helpers import (EXAMPLES, deleting_after_load, launch, launch_together, launched_usage_error, launching,
                     usage_error)
from training_utils.adapters import convert as convert_lora
from training_utils.adapters.export import converted_name
from training_utils.grids import progress_grid, step_grid
from training_utils.posthoc_ema.__main__ import main as synthesize
from training_utils.testing import (assert_checkpoint_is_the_output, assert_close_files, assert_close_validations,
                                    assert_lora_changes_pipeline_output, assert_resumes_exactly, assert_same_files,
                                    assert_same_tensors, assert_validated_at, checkpoint_names, checkpoint_weight_files,
                                    read_log, rendered_images, reported_buckets)

SCRIPT = "text_to_image/train_text_to_image_lora.py"
LORA = "pytorch_lora_weights.safetensors"
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]
CACHE_VALIDATION = ["--validation_prompt", "a red circle", "--num_validation_images", 1,
                    "--validation_inference_steps", 2, "--validation_steps", 2]


def common(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["sd"], "--train_data_dir", tiny["shapes"],
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3,
            "--random_flip", "--use_ema", "--ema_decay", 0.9, "--rank", 4, "--seed", 3, *extra]


def validation_flags(steps):
    return ["--validation_prompt", *PROMPTS, "--num_validation_images", 2, "--validation_inference_steps", 2,
            "--validation_steps", steps]


def full_flags(tiny, output_dir):
    """8 steps, validating every 3 steps (and at the final step), a checkpoint every 3, the newest kept."""
    return common(tiny, output_dir, "--max_train_steps", 8, *validation_flags(3), "--checkpointing_steps", 3,
                  "--checkpoints_total_limit", 1)


def cache_flags(tiny, output_dir, *extra, data="shapes_mixed"):
    """4 center-cropped steps, validating and checkpointing every 2 (mid-epoch), without an EMA; on images of mixed
    shapes in aspect-ratio buckets, each seen twice an epoch, with a third of the captions dropped."""
    buckets = ["--use_aspect_ratio_buckets", "--repeats", 2, "--caption_dropout", 0.3] if data == "shapes_mixed" else []
    return ["--pretrained_model_name_or_path", tiny["sd"], "--train_data_dir", tiny[data],
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3,
            "--center_crop", "--rank", 4, "--seed", 3, "--max_train_steps", 4, "--checkpointing_steps", 2,
            *CACHE_VALIDATION, *buckets, *extra]


# The adapters beside LoRA, each with a setting of its own; OFT has no rank.
ADAPTERS = {"dora": ["--lora_alpha", 6], "lokr": ["--lora_alpha", 6, "--lokr_factor", 4],
            "loha": ["--lora_alpha", 6], "oft": ["--oft_block_size", 8]}
# The adapters whose runs are resumed too: one of each checkpoint layout (DoRA's LoRA file with its magnitudes, a
# peft folder); LoKr's and LoHa's checkpoints go through OFT's path.
RESUMED_ADAPTERS = ("dora", "oft")


def adapter_flags(tiny, output_dir, adapter, *extra):
    """6 steps of ``adapter``, validating every 3 steps (raw, EMA and at the end a post-hoc EMA length), a checkpoint
    every 3, post-hoc EMA snapshots, every file also in the kohya and ComfyUI layouts."""
    flags = common(tiny, output_dir, "--adapter", adapter, *ADAPTERS[adapter], "--max_train_steps", 6,
                   "--validation_prompt", PROMPTS[0], "--num_validation_images", 1, "--validation_inference_steps", 2,
                   "--validation_steps", 3, "--checkpointing_steps", 3, "--ema_posthoc_sigma_rels", 0.05, 0.1,
                   "--ema_posthoc_snapshot_steps", 3, "--validation_sigma_rels", 0.08, "--export_formats", "comfyui",
                   "--output_kohya_format", *extra)
    rank = flags.index("--rank")
    return flags[:rank] + flags[rank + 2:] if adapter == "oft" else flags


def adapter_files(adapter):
    """The files an adapter's output holds, its own layout's and the UI layouts'."""
    own = [LORA] if adapter == "dora" else ["unet/adapter_config.json", "unet/adapter_model.safetensors"]
    return [*own, converted_name("kohya"), converted_name("comfyui")]


def feature_flags(root):
    """Caching on disk, in ``root``'s feature cache."""
    return ["--feature_cache_dir", Path(root) / "features"]


def cache_run(cache_latents, random_flip):
    return f"cache_latents{int(cache_latents)}-random_flip{int(random_flip)}"


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}`` of every run here that starts from scratch, launched together:

    - full: `full_flags`; plain: the same 8 steps without checkpoints, nor validation (a prompt, but
      ``--num_validation_images 0``, as upstream's commands may say);
    - deleted_model: 4 steps with ``--ema_decay 0``, validating every 2, the base model's folder deleted as soon
      as the pipeline has loaded;
    - posthoc: 6 steps, post-hoc EMA snapshots every 2 steps and two more sigma_rels rendered at validation, a
      checkpoint at the end, ``--lora_alpha`` twice the rank, and every LoRA also in the kohya and ComfyUI layouts;
    - `cache_run` (cache_latents, random_flip): `cache_flags` (aspect-ratio buckets) with and without
      ``--cache_latents`` and ``--random_flip``; with both, the cache is on disk (`feature_flags`); with flips only,
      the VAE leaves the accelerator between steps (``--offload``);
    - square_cached, random_crops_cached: cached runs with flips on the square shapes, center-cropped and not;
    - each adapter of `ADAPTERS` (`adapter_flags`), and for `RESUMED_ADAPTERS` the same run resumed from its
      checkpoint-3 (``<adapter>-resumed``).
    """
    root = tmp_path_factory.mktemp("runs")
    model = root / "model"
    shutil.copytree(tiny["sd"], model)
    wrapper = deleting_after_load(EXAMPLES / SCRIPT, [model], root)
    deleted_model_args = common(tiny, root / "deleted_model", "--max_train_steps", 4, *validation_flags(2),
                                "--checkpointing_steps", 2, "--ema_decay", 0)
    deleted_model_args[1] = model
    launches = {
        "full": (SCRIPT, *full_flags(tiny, root / "full")),
        "plain": (SCRIPT, *common(tiny, root / "plain", "--max_train_steps", 8, "--checkpointing_steps", 1000,
                                  "--validation_prompt", PROMPTS[0], "--num_validation_images", 0)),
        "deleted_model": (wrapper, *deleted_model_args),
        "posthoc": (SCRIPT, *common(tiny, root / "posthoc", "--max_train_steps", 6, *validation_flags(3),
                                    "--ema_posthoc_sigma_rels", 0.05, 0.1, "--ema_posthoc_snapshot_steps", 2,
                                    "--validation_sigma_rels", 0.05, 0.08, "--checkpointing_steps", 6,
                                    "--lora_alpha", 8, "--export_formats", "comfyui", "--output_kohya_format")),
    }
    for cache_latents in (False, True):
        for random_flip in (False, True):
            name = cache_run(cache_latents, random_flip)
            extra = ["--cache_latents"] if cache_latents else []
            extra += ["--random_flip"] if random_flip else []
            extra += feature_flags(root) if cache_latents and random_flip else []
            extra += ["--offload"] if random_flip and not cache_latents else []
            launches[name] = (SCRIPT, *cache_flags(tiny, root / name, *extra))
    for name in ("square_cached", "random_crops_cached"):
        flags = cache_flags(tiny, root / name, "--cache_latents", "--random_flip", data="shapes")
        launches[name] = (SCRIPT, *[flag for flag in flags if name == "square_cached" or flag != "--center_crop"])
    for adapter in ADAPTERS:
        launches[adapter] = (SCRIPT, *adapter_flags(tiny, root / adapter, adapter))
    results = launch_together(launches)
    # The run resumed from its checkpoint-3, mid-epoch, rendering no validation images.
    resumed = {}
    for adapter in RESUMED_ADAPTERS:
        shutil.copytree(root / adapter / "checkpoint-3", root / f"{adapter}-resumed" / "checkpoint-3")
        resumed[f"{adapter}-resumed"] = (SCRIPT, *adapter_flags(tiny, root / f"{adapter}-resumed", adapter,
                                                                "--num_validation_images", 0,
                                                                "--resume_from_checkpoint", "latest"))
    results.update(launch_together(resumed))
    return {name: (root / name, result) for name, result in results.items()}


def test_writes_raw_and_ema_lora_with_equal_keys_and_different_values(runs):
    output_dir, result = runs["full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and len(raw) > 0
    assert all(key.startswith("unet.") and "lora" in key for key in raw)
    assert all(raw[key].shape == ema[key].shape and raw[key].dtype == torch.float32 for key in raw)
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert f"raw LoRA: {output_dir / LORA}" in result.stdout
    assert f"ema LoRA: {output_dir / 'ema' / LORA}" in result.stdout


def test_validates_at_the_due_steps_and_the_final_step_once(runs):
    output_dir, _ = runs["full"]
    log = assert_validated_at(output_dir, [3, 6, 8], ("raw", "ema"), PROMPTS, num_images=2)
    pngs = rendered_images(output_dir)
    assert len(pngs) == 3 * 2 * 2 * 2  # steps x variants x prompts x images
    card = (output_dir / "README.md").read_text()
    assert "load_lora_weights" in card and log[-1]["progress"] in card
    assert list((output_dir / "logs").rglob("events.out.tfevents.*")), "no tensorboard events written"


def test_keeps_the_newest_checkpoint_within_the_limit(runs):
    output_dir, _ = runs["full"]
    assert checkpoint_names(output_dir) == ["checkpoint-6"]
    assert not list(output_dir.glob(".checkpoint-*")), "an incomplete checkpoint was left behind"
    # The adapters once each, as the final output has them.
    assert checkpoint_weight_files(output_dir / "checkpoint-6") == {LORA, f"ema/{LORA}"}
    assert (output_dir / "checkpoint-6" / "training_state.json").is_file()


def test_validation_and_checkpointing_leave_the_weights_untouched(runs):
    (output_dir, _), (plain_dir, plain) = runs["full"], runs["plain"]
    assert_same_files(output_dir / LORA, plain_dir / LORA)
    assert_same_files(output_dir / "ema" / LORA, plain_dir / "ema" / LORA)
    assert not (plain_dir / "validation").exists()
    assert plain.stderr.count("--num_validation_images 0: no validation images are rendered") == 1


def test_resumed_run_prunes_and_ends_with_the_same_weights(tiny, tmp_path, runs):
    # From the full run's checkpoint-6, mid-epoch, with random flips, never validating, checkpointing at every
    # step and keeping two: the uninterrupted run's weights, bit for bit, and the checkpoint it resumed from pruned.
    def resumed_flags(output_dir):
        return common(tiny, output_dir, "--max_train_steps", 8, "--checkpointing_steps", 1,
                      "--checkpoints_total_limit", 2)

    assert_resumes_exactly(SCRIPT, resumed_flags, runs["full"][0], tmp_path, 6, [LORA, f"ema/{LORA}"], launch=launch)
    assert checkpoint_names(tmp_path) == ["checkpoint-7", "checkpoint-8"]


def test_ema_decay_zero_equals_the_raw_weights(runs):
    output_dir, _ = runs["deleted_model"]
    assert_same_files(output_dir / LORA, output_dir / "ema" / LORA)


def test_outputs_load_into_a_fresh_pipeline_and_change_its_output(tiny, runs):
    output_dir, _ = runs["full"]
    _, with_raw, with_ema = assert_lora_changes_pipeline_output(tiny["sd"], output_dir, output_dir / "ema",
                                                                prompt=PROMPTS[0])
    assert not np.allclose(with_raw, with_ema, atol=1e-6)


def test_a_checkpoint_loads_as_the_final_output_does(tiny, runs):
    output_dir, _ = runs["deleted_model"]
    checkpoint = output_dir / "checkpoint-4"  # the final step's
    assert_checkpoint_is_the_output(checkpoint, output_dir, [LORA, f"ema/{LORA}"])
    assert_lora_changes_pipeline_output(tiny["sd"], checkpoint, checkpoint / "ema")


def test_never_reads_the_base_model_after_start_up(runs):
    """The base model folder is deleted right after the pipeline loads; validation and saving still work."""
    output_dir, _ = runs["deleted_model"]
    assert not (output_dir.parent / "model").exists()
    # The final step (4) is also a due step (every 2): validated once, raw and EMA.
    assert_validated_at(output_dir, [2, 4], ("raw", "ema"), PROMPTS, num_images=2)
    assert (output_dir / LORA).is_file() and (output_dir / "ema" / LORA).is_file()


BAD_INPUT = [
    (["--resolution", 30], "error: --resolution=30: expected a positive multiple of 8"),
    (["--caption_column", "caption"], "error: --caption_column='caption': expected a column of the dataset"),
    (["--ema_decay", 1.0], "error: --ema_decay=1.0: expected a number in [0, 1)"),
    (["--adapter", "oft"], "error: --rank=4: expected no --rank with --adapter oft (a setting of LoRA, DoRA, LoKr, "
                           "LoHa)"),
]


@pytest.mark.parametrize("flags, message", BAD_INPUT)
def test_bad_input_fails_with_one_line_before_anything_loads(tiny, tmp_path, flags, message):
    output_dir = tmp_path / "out"
    assert usage_error(SCRIPT, *common(tiny, output_dir, *flags)).startswith(message)
    assert not output_dir.exists()


@pytest.fixture(scope="module")
def synthesized(runs):
    """The post-hoc run's folder, once ``python -m training_utils.posthoc_ema`` (its ``main``, in this process) has
    synthesized sigma_rel 0.05 and 0.08 there."""
    output_dir, _ = runs["posthoc"]
    synthesize(["--output_dir", str(output_dir), "--sigma_rel", "0.05", "0.08"])
    return output_dir


def test_posthoc_ema_sweep_snapshots_and_synthesis(tiny, runs, synthesized):
    output_dir, _ = runs["posthoc"]
    snapshots = sorted(path.name for path in (output_dir / "posthoc_ema").glob("snapshot-*.safetensors"))
    assert len(snapshots) == 3 * 2 and snapshots[0].startswith("snapshot-00000002-")
    log = read_log(output_dir)
    assert [(r["step"], r["variant"]) for r in log[::2]] == [
        (0, "base"), (3, "raw"), (3, "ema"), (6, "raw"), (6, "ema"), (6, "ema_sigma_rel-0.05"),
        (6, "ema_sigma_rel-0.08")]
    # The final step's grid: a row per variant, the sweep's included, each the logged images.
    final = [record for record in log if record["step"] == 6 and record["prompt"] == PROMPTS[0]]
    assert [record["variant"] for record in final] == ["raw", "ema", "ema_sigma_rel-0.05", "ema_sigma_rel-0.08"]
    expected, layout = step_grid(6, PROMPTS[0], [(record["variant"], [Image.open(output_dir / path)
                                                                       for path in record["images"]])
                                                  for record in final])
    with Image.open(output_dir / final[0]["grid"]) as grid:
        assert np.array_equal(np.asarray(grid), np.asarray(expected)) and layout.cell_size == (32, 32)
    # The progress grid: the sweep rows are blank at step 3, where only raw and EMA were rendered.
    with Image.open(output_dir / final[0]["progress"]) as progress:
        expected = progress_grid([record for record in log if record["prompt"] == PROMPTS[0]], PROMPTS[0], output_dir)
        assert np.array_equal(np.asarray(progress), np.asarray(expected[0]))

    tracked = load_file(output_dir / "posthoc_ema" / "sigma_rel-0.05" / LORA)
    assert_lora_changes_pipeline_output(tiny["sd"], output_dir / "posthoc_ema" / "sigma_rel-0.08")
    synthesized = load_file(output_dir / "posthoc_ema" / "sigma_rel-0.08" / LORA)
    assert tracked.keys() == synthesized.keys() == load_file(output_dir / LORA).keys()
    assert any(not torch.equal(tracked[key], synthesized[key]) for key in tracked)


def test_every_lora_written_is_also_in_the_asked_layouts_and_the_kohya_one_renders_the_same(tiny, synthesized):
    output_dir = synthesized
    checkpoint = output_dir / "checkpoint-6"
    folders = [output_dir, output_dir / "ema", checkpoint, checkpoint / "ema", *(
        output_dir / "posthoc_ema" / f"sigma_rel-{sigma_rel}" for sigma_rel in ("0.05", "0.08"))]
    for folder in folders:
        diffusers_file = folder / LORA
        for layout in ("kohya", "comfyui"):
            converted = load_file(folder / converted_name(layout))
            assert_same_tensors(converted, convert_lora.convert(*convert_lora.read_lora(diffusers_file), layout,
                                                                family="StableDiffusionPipeline"))
            # The strength is in the file, as the tools read it: the trained alpha, not the rank.
            alphas = [tensor for key, tensor in converted.items() if key.endswith(".alpha")]
            assert alphas and all(alpha.item() == 8 for alpha in alphas)
    # Besides the post-hoc EMA's own state, the checkpoint holds the adapters once per layout.
    assert checkpoint_weight_files(checkpoint) == {LORA, f"ema/{LORA}", "posthoc_ema.safetensors"} | {
        f"{prefix}{converted_name(layout)}" for prefix in ("", "ema/") for layout in ("kohya", "comfyui")}

    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    pipe.set_progress_bar_config(disable=True)

    def render(weight_name):
        pipe.load_lora_weights(output_dir, weight_name=weight_name)
        images = pipe(PROMPTS[0], num_inference_steps=2, height=32, width=32, output_type="np",
                      generator=torch.Generator().manual_seed(0)).images
        pipe.unload_lora_weights()
        return images

    np.testing.assert_allclose(render(converted_name("kohya")), render(LORA), atol=1e-6)


@pytest.mark.parametrize("random_flip", [False, True])
def test_cached_run_matches_the_uncached_one(runs, random_flip):
    uncached, cached = runs[cache_run(False, random_flip)][0], runs[cache_run(True, random_flip)][0]
    assert_close_files(uncached / LORA, cached / LORA)


@pytest.mark.parametrize("random_flip", [False, True])
def test_validation_renders_with_the_offloaded_encoders_back(runs, random_flip):
    uncached, cached = runs[cache_run(False, random_flip)][0], runs[cache_run(True, random_flip)][0]
    assert_close_validations(uncached, cached, [(2, "raw"), (4, "raw")])


def test_flips_change_the_cached_run(runs):
    unflipped, flipped = (load_file(runs[cache_run(True, random_flip)][0] / LORA) for random_flip in (False, True))
    assert any(not torch.equal(unflipped[key], flipped[key]) for key in unflipped)


def test_cached_run_resumed_mid_epoch_is_the_uninterrupted_one(tiny, tmp_path, runs):
    straight = runs[cache_run(True, True)][0]

    def resumed_flags(output_dir):
        return cache_flags(tiny, output_dir, "--cache_latents", "--random_flip", *feature_flags(straight.parent))

    resumed = assert_resumes_exactly(SCRIPT, resumed_flags, straight, tmp_path, 2, [LORA], launch=launch)
    assert "latents 24x40: reusing" in resumed.stderr


def test_a_second_run_on_the_feature_cache_runs_no_encoder_and_ends_bitwise_equal(tiny, tmp_path, runs):
    first = runs[cache_run(True, True)][0]
    assert "text embeddings: encoding 13 items into" in runs[cache_run(True, True)][1].stderr  # and the empty one
    second = launch(SCRIPT, *cache_flags(tiny, tmp_path, "--cache_latents", "--random_flip",
                                         *feature_flags(first.parent))).stderr
    reused = re.findall(rf"(text embeddings|latents \d+x\d+): reusing {first.parent / 'features'}", second)
    assert "text embeddings" in reused and len(reused) == 1 + len(MIXED_BUCKETS)
    assert ": encoding" not in second
    assert_same_files(first / LORA, tmp_path / LORA)
    assert_close_validations(first, tmp_path, [(2, "raw"), (4, "raw")], max_difference=0)


# The buckets of the mixed shapes at 32 pixels, multiples of 8 (`tiny.MIXED_SIZES`: the 2:1 and 4:3 landscapes
# share one; the 24-pixel square is not upscaled), and how many images each holds, each image seen twice an epoch.
MIXED_BUCKETS = {(16, 64): 4, (24, 24): 4, (24, 40): 8, (32, 32): 4, (40, 24): 4}


def test_trains_in_aspect_ratio_buckets_and_validates_at_the_most_common_one(runs):
    output_dir, result = runs[cache_run(False, False)]
    assert reported_buckets(result.stderr) == MIXED_BUCKETS
    assert "bucket 24x40 (height x width): 8 images, 4 batches an epoch, none left over" in result.stderr
    # At the most common bucket.
    assert {Image.open(path).size for path in rendered_images(output_dir)} == {(40, 24)}


def test_random_crops_are_cached_once_and_the_square_shapes_train_as_center_cropped(runs):
    # The shapes are square: resized to the resolution, every crop is the whole image, as the center crop is.
    output_dir, result = runs["random_crops_cached"]
    assert "random crop is drawn once, now (seed 3), and kept for the whole run" in result.stderr
    assert_same_files(output_dir / LORA, runs["square_cached"][0] / LORA)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_each_adapter_trains_and_validates_raw_ema_and_posthoc_and_writes_its_files(runs, adapter):
    output_dir, result = runs[adapter]
    log = read_log(output_dir)
    assert [(record["step"], record["variant"]) for record in log] == [
        (0, "base"), (3, "raw"), (3, "ema"), (6, "raw"), (6, "ema"), (6, "ema_sigma_rel-0.08")]
    title = {"dora": "DoRA", "lokr": "LoKr", "loha": "LoHa", "oft": "OFT"}[adapter]
    own = output_dir / LORA if adapter == "dora" else output_dir
    assert f"raw {title}: {own}" in result.stdout
    for folder in (output_dir, output_dir / "ema", output_dir / "checkpoint-6", output_dir / "checkpoint-6" / "ema"):
        assert all((folder / name).is_file() for name in adapter_files(adapter)), folder
    raw, ema = (load_file(folder / adapter_files(adapter)[-3]) for folder in (output_dir, output_dir / "ema"))
    assert raw.keys() == ema.keys() and any(not torch.equal(raw[key], ema[key]) for key in raw)
    card = (output_dir / "README.md").read_text()
    assert (("load_lora_weights" in card) if adapter == "dora" else ("PeftModel.from_pretrained" in card))


@pytest.mark.parametrize("adapter", RESUMED_ADAPTERS)
def test_each_checkpoint_layout_of_the_adapters_resumes_exactly(runs, adapter):
    (output_dir, result), (straight_dir, _) = runs[f"{adapter}-resumed"], runs[adapter]
    assert f"resumed from {output_dir / 'checkpoint-3'} at step 3" in result.stdout
    for folder in ("", "ema/"):
        for name in adapter_files(adapter):
            if name.endswith(".safetensors"):
                assert_same_files(output_dir / folder / name, straight_dir / folder / name)


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_each_adapters_outputs_and_checkpoints_load_as_users_load_them(tiny, runs, adapter):
    output_dir, _ = runs[adapter]
    checkpoint = output_dir / "checkpoint-6"  # the final step's: the output's files, once
    weights = [name for name in adapter_files(adapter) if name.endswith(".safetensors")]
    files = {*weights, *(f"ema/{name}" for name in weights)}
    assert checkpoint_weight_files(checkpoint) == files | {"posthoc_ema.safetensors"}
    for name in files:
        assert_same_files(checkpoint / name, output_dir / name)
    # A post-hoc EMA length chosen after training is written as the run's outputs are (an OFT's difference from the
    # base model's folder).
    synthesize(["--output_dir", str(output_dir), "--sigma_rel", "0.08"])
    synthesized = output_dir / "posthoc_ema" / "sigma_rel-0.08"
    assert all((synthesized / name).is_file() for name in adapter_files(adapter))
    assert_lora_changes_pipeline_output(tiny["sd"], output_dir, output_dir / "ema", checkpoint, synthesized,
                                        prompt=PROMPTS[0])


@pytest.mark.slow
def test_resuming_with_another_adapter_is_refused_naming_the_flag(tiny, runs, tmp_path):
    shutil.copytree(runs["lokr"][0] / "checkpoint-3", tmp_path / "checkpoint-3")
    result = launch(SCRIPT, *adapter_flags(tiny, tmp_path, "loha", "--resume_from_checkpoint", "latest"), check=False)
    error = launched_usage_error(result)
    assert error.startswith(f"error: --resume_from_checkpoint='{tmp_path / 'checkpoint-3'}': expected the flags the "
                            f"checkpoint was trained with (--adapter was 'lokr', now 'loha'"), error
    assert not (tmp_path / "unet").exists()
