"""Smoke tests of the edit scripts (a target rendered from reference images and an instruction), one row of
`EDIT_SCRIPTS` each: every script end to end on its tiny fixture and the edit dataset (``shapes_edit``: rows with
references and rows without), with the same runs and the same checks.

That each family's training step feeds its transformer what the pipeline's sampling loop feeds it, references
included, is the family's own unit test (``test_<family>.py``); the edit data (rows, references laid out and cached,
validation references) is `test_edit`'s. Here each script runs:

- full: 4 steps on the edit rows (each twice an epoch; the references of a row beyond what the model takes left
  out), centre crops (a cache keeps the crops it drew) and random flips, an EMA, validating with a fixed reference
  every 2 steps (and so at the end), checkpointing every 2, the VAE off the accelerator between steps (--offload);
- cached: the same 4 steps with --cache_latents, on disk (--feature_cache_dir), neither validating nor checkpointing;
- resumed: the full run resumed from its checkpoint-2, never validating;
- two processes: 2 steps on two CPU processes (gloo) on an int8 base, the latents cached, every file also in
  ComfyUI's layout.
"""

import contextlib
import functools
import json
import shutil
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

import pytest
import torch
from diffusers import FluxKontextPipeline, QwenImageEditPlusPipeline
from PIL import Image
from safetensors.torch import load_file

from helpers import launch, launch_processes, launch_together, launching, together, usage_error
from training_utils.adapter_export import converted_name
from training_utils.convert_lora import convert, read_lora
from training_utils.families import flux_kontext, qwen_image_edit
from training_utils.testing import assert_lora_changes_pipeline_output, assert_same_files, assert_validated_at, \
    checkpoint_names

LORA = "pytorch_lora_weights.safetensors"
PROMPT = "make the circle blue"
INT8 = ("--quantize_base", "int8", "--mixed_precision", "bf16")


@dataclass(frozen=True)
class EditScript:
    """An edit script and what its runs must show."""

    name: str  # the row's id, and its tiny fixture
    script: str
    pipeline: type
    module: ModuleType  # its `training_utils.families` module
    max_references: int  # the most a sample takes; the fixture's rows keep at most so many
    # ``(components, call kwargs, context)`` that render an edit of a reference at 32×32 as the run validated
    edit_render: Callable
    comfyui_family: str  # the converter's family whose ComfyUI layout the run writes
    flags: tuple = ()  # what every run adds (the family's prompt settings)
    refused: list = field(default_factory=list)  # (flags, message) of the script's own refusals and checks


def kontext_edit_render(tiny, reference):
    """FLUX.1 Kontext: the reference passed resized as training resizes it, which the pipeline keeps, at the runs'
    prompt length."""
    pipe = FluxKontextPipeline.from_pretrained(tiny["flux_kontext"])
    render = flux_kontext.render_kwargs({"height": 32, "width": 32})
    return {}, {**{key: value for key, value in render.items() if key not in ("height", "width")},
                "image": flux_kontext.reference_layout(pipe, 32 * 32)[0].resized(reference),
                "max_sequence_length": 32}, contextlib.nullcontext()


# The references' area of the Qwen-Image-Edit runs (the pipeline's 1024×1024 takes the tiny VAE seconds to encode).
QWEN_REFERENCE_AREA = 32 * 32


def qwen_image_edit_render(tiny, reference):
    """Qwen-Image-Edit: its processor loaded without torchvision, the reference resized by the pipeline at the runs'
    area."""
    return ({"processor": qwen_image_edit.load_processor(tiny["qwen_image_edit_plus"])}, {"image": [reference]},
            qwen_image_edit.references_at_area(QwenImageEditPlusPipeline, QWEN_REFERENCE_AREA))


EDIT_SCRIPTS = [
    EditScript("flux_kontext", "dreambooth/train_dreambooth_lora_flux_kontext.py", FluxKontextPipeline,
               flux_kontext, 1, kontext_edit_render, "flux", ("--max_sequence_length", 32), refused=[
                   (["--vae_encode_mode", "sample"],
                    "--vae_encode_mode is not supported here: the targets' latents are drawn from the VAE's "
                    "distribution, as every script here draws them, and a reference's are its mode, as "
                    "FluxKontextPipeline encodes references"),
                   (["--with_prior_preservation"],
                    "--with_prior_preservation is not supported here: prior preservation is not carried for edits: "
                    "an edit's class images would need references and edited targets, which text-to-image "
                    "generation does not make")]),
    # Edit Plus (one to three references; rows without one train as text-to-image), its references at a small area.
    EditScript("qwen_image_edit_plus", "dreambooth/train_dreambooth_lora_qwen_image_edit.py",
               QwenImageEditPlusPipeline, qwen_image_edit, 3, qwen_image_edit_render, "qwen_image",
               ("--reference_area", QWEN_REFERENCE_AREA), refused=[
                   (["--max_sequence_length", 32],
                    "--max_sequence_length is not supported here: the Qwen-Image-Edit pipelines never cut a prompt"),
                   (["--with_prior_preservation"],
                    "--with_prior_preservation is not supported here: no prior preservation: an edit model learns an "
                    "edit from its examples, not a subject"),
                   (["--reference_area", 100],
                    "--reference_area=100: expected a number of pixels of at least 32*32 (the pipeline rounds sides "
                    "to multiples of 32)")]),
]
SCRIPT_IDS = [script.name for script in EDIT_SCRIPTS]


def edit_rows(tiny, folder, max_references):
    """The edit fixture with at most ``max_references`` references a row (each row's first), in ``folder``."""
    shutil.copytree(tiny["shapes_edit"], folder)
    metadata = folder / "metadata.jsonl"
    rows = [json.loads(line) for line in metadata.read_text().splitlines()]
    metadata.write_text("".join(json.dumps({**row, "reference_file_names": row["reference_file_names"][
        :max_references]}) + "\n" for row in rows))
    return folder, rows


def common(tiny, edit, data, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny[edit.name], "--dataset_name", data, "--cond_image_column",
            "reference", "--caption_column", "text", "--output_dir", output_dir, "--resolution", 32,
            "--train_batch_size", 2, "--learning_rate", 1e-3, "--center_crop", "--random_flip", "--use_ema",
            "--ema_decay", 0.9,
            "--rank", 4, "--seed", 3, "--use_aspect_ratio_buckets", "--repeats", 2, *edit.flags, *extra]


def validating(data):
    return ("--validation_prompt", PROMPT, "--validation_image", data / "references" / "0000-0.png",
            "--num_validation_images", 1, "--validation_inference_steps", 2)


def two_processes(tiny, edit, data, prepare):
    """``(output_dir, result)`` of 2 steps on two processes (in the folder ``prepare()`` makes), on an int8 base,
    the latents cached, also in ComfyUI's layout."""
    return launch_processes(edit.script, prepare, lambda output_dir: common(
        tiny, edit, data, output_dir, "--max_train_steps", 2, *INT8, "--cache_latents", "--export_formats",
        "comfyui", "--checkpointing_steps", 1000))


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{(script name, run): (output_dir, result)}``: the full, cached and two-process runs side by side, then the
    resumed ones (once the full ones have left checkpoint-2)."""
    root = tmp_path_factory.mktemp("dreambooth_edit")
    calls, data = {}, {}
    for edit in EDIT_SCRIPTS:
        folder = root / edit.name
        data[edit.name], _ = edit_rows(tiny, folder / "data", edit.max_references)
        calls[edit.name, "full"] = functools.partial(launch, edit.script, *common(
            tiny, edit, data[edit.name], folder / "full", "--max_train_steps", 4, *validating(data[edit.name]),
            "--validation_steps", 2, "--checkpointing_steps", 2, "--offload"))
        calls[edit.name, "cached"] = functools.partial(launch, edit.script, *common(
            tiny, edit, data[edit.name], folder / "cached", "--max_train_steps", 4, "--checkpointing_steps", 1000,
            "--cache_latents", "--feature_cache_dir", folder / "features"))
        calls[edit.name, "two_processes"] = functools.partial(
            two_processes, tiny, edit, data[edit.name], functools.partial(tmp_path_factory.mktemp, "two_processes"))
    results = together(calls)
    resumed = {}
    for edit in EDIT_SCRIPTS:
        folder = root / edit.name
        shutil.copytree(folder / "full" / "checkpoint-2", folder / "resumed" / "checkpoint-2")
        resumed[edit.name, "resumed"] = (edit.script, *common(
            tiny, edit, data[edit.name], folder / "resumed", "--max_train_steps", 4, "--checkpointing_steps", 1000,
            "--resume_from_checkpoint", "latest"))
    results.update(launch_together(resumed))
    return {(name, run): result if run == "two_processes" else (root / name / run, result)
            for (name, run), result in results.items()}


@pytest.fixture(params=EDIT_SCRIPTS, ids=SCRIPT_IDS)
def edit(request):
    return request.param


def test_trains_rows_with_and_without_a_reference_and_validates_with_the_reference_shown(runs, edit):
    output_dir, result = runs[edit.name, "full"]
    raw, ema = load_file(output_dir / LORA), load_file(output_dir / "ema" / LORA)
    assert raw.keys() == ema.keys() and all(key.startswith("transformer.") and "lora" in key for key in raw)
    assert any(not torch.equal(raw[key], ema[key]) for key in raw)
    assert "2 of 6 rows have no reference image: they train as text-to-image" in result.stderr
    assert "references none" in result.stderr and "references 32x32" in result.stderr, result.stderr[-3000:]
    # A model that takes several trains the rows with two references too, in batches of their own.
    assert ("references 32x32, 32x32:" in result.stderr) == (edit.max_references > 1)
    assert_validated_at(output_dir, [2, 4], ("raw", "ema"), [PROMPT], num_images=1)
    # The grid's first row is the reference as given; the renders are the most common target bucket's size.
    data = output_dir.parent / "data"
    shown = Image.open(output_dir / "validation" / "conditioning-p00-00.png")
    assert shown.tobytes() == Image.open(data / "references" / "0000-0.png").convert("RGB").tobytes()
    assert Image.open(output_dir / "validation" / "step-000004" / "raw-p00-00.png").size == (32, 32)
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    card = (output_dir / "README.md").read_text()  # its loading code renders the first prompt from its reference
    reference = f'load_image("{data / "references" / "0000-0.png"}")'
    image = reference if edit.max_references == 1 else f"[{reference}]"  # a pipeline taking several takes a list
    assert edit.pipeline.__name__ in card and f'"{PROMPT}", image={image})' in card


def test_a_run_resumed_mid_epoch_ends_with_the_weights_of_the_uninterrupted_one(runs, edit):
    (output_dir, result), (straight_dir, _) = runs[edit.name, "resumed"], runs[edit.name, "full"]
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in result.stdout
    for name in (LORA, f"ema/{LORA}"):
        assert_same_files(output_dir / name, straight_dir / name)


def test_cached_targets_and_references_train_like_encoding_every_step(runs, edit):
    cached_dir, encoded_dir = runs[edit.name, "cached"][0], runs[edit.name, "full"][0]
    for name in (LORA, f"ema/{LORA}"):
        cached, encoded = load_file(cached_dir / name), load_file(encoded_dir / name)
        assert cached.keys() == encoded.keys()
        for key in cached:  # the VAE ran on other batch sizes: equal up to float rounding
            torch.testing.assert_close(cached[key], encoded[key], rtol=1e-4, atol=1e-5)
    features = cached_dir.parent / "features"
    assert list(features.glob("reference_latents-*")) and list(features.glob("latents-*"))


def test_the_lora_loads_in_the_pipeline_and_changes_an_edit(tiny, runs, edit):
    full_dir, processes_dir = runs[edit.name, "full"][0], runs[edit.name, "two_processes"][0]
    reference = Image.open(full_dir.parent / "data" / "references" / "0000-0.png").convert("RGB")
    components, render, context = edit.edit_render(tiny, reference)
    with context:
        assert_lora_changes_pipeline_output(tiny[edit.name], full_dir, full_dir / "ema", processes_dir,
                                            prompt=PROMPT, components=components, **render)


def test_two_processes_on_an_int8_base_write_once_with_comfyuis_layout(runs, edit):
    output_dir, result = runs[edit.name, "two_processes"]
    assert result.stdout.count(f"raw LoRA: {output_dir / LORA}") == 1
    # ComfyUI's file is the base model's layout of the same LoRA (Kontext is FLUX.1's transformer, Qwen-Image-Edit
    # Qwen-Image's), at the trained alphas.
    for folder in (output_dir, output_dir / "ema"):
        comfyui = load_file(folder / converted_name("comfyui"))
        expected = convert(*read_lora(folder / LORA), "comfyui", family=edit.comfyui_family)
        assert comfyui.keys() == expected.keys() and all(key.startswith("diffusion_model.") for key in comfyui)
        assert all(torch.equal(comfyui[key], expected[key]) for key in comfyui)


@pytest.mark.parametrize("edit, flags, message", [
    pytest.param(edit, flags, message, id=f"{edit.name}-{flags[0]}") for edit in EDIT_SCRIPTS
    for flags, message in edit.refused])
def test_bad_flags_fail_in_one_line_before_anything_loads(tiny, tmp_path, edit, flags, message):
    data, _ = edit_rows(tiny, tmp_path / "data", edit.max_references)
    assert usage_error(edit.script, *common(tiny, edit, data, tmp_path / "out", *flags)) == f"error: {message}"
    assert not (tmp_path / "out").exists()


def test_a_row_with_more_references_than_the_model_takes_fails_in_one_line(tiny, tmp_path, edit):
    data, rows = edit_rows(tiny, tmp_path / "data", edit.max_references)
    most = edit.max_references + 1  # the first row's reference, repeated
    rows[0]["reference_file_names"] = rows[0]["reference_file_names"][:1] * most
    (data / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert usage_error(edit.script, *common(tiny, edit, data, tmp_path / "out")) == (
        f"error: --cond_image_column='reference': expected at most {edit.max_references} reference images a row for "
        f"this model (a row has {most})")


def test_the_first_qwen_image_edit_takes_its_one_reference_in_every_row(tiny, tmp_path):
    edit = next(edit for edit in EDIT_SCRIPTS if edit.name == "qwen_image_edit_plus")
    data, _ = edit_rows(tiny, tmp_path / "data", 1)
    argv = common(tiny, edit, data, tmp_path / "out")
    argv[argv.index(tiny[edit.name])] = tiny["qwen_image_edit"]
    assert usage_error(edit.script, *argv) == ("error: --cond_image_column='reference': expected 1 reference image in "
                                               "every row for QwenImageEditPipeline")
