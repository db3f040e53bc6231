"""Smoke tests of the edit scripts (a target rendered from reference images and an instruction), one row of
`EDIT_FAMILIES` each: every script end to end on its tiny fixture and the tiny edit dataset (`shapes_edit`: rows with
0, 1 and 2 references of several sizes; for a model that takes one reference, each row's first), with the same runs
and the same checks.

That each family's training step, references included, feeds its transformer what the pipeline's sampling loop
feeds it is the family's own unit test (``test_<family>.py``); the data machinery's is ``test_edit.py``. Here each
script runs:

- full: 4 steps in sample shapes (a target's bucket and its references' sizes), each row twice an epoch, random
  flips (the references mirrored with their target), 30% of the samples on the empty instruction, an EMA and a
  post-hoc EMA, validating with two references (one, for a model that takes one) at step 2 and at the end (there the
  post-hoc EMA's lengths too), checkpointing at step 2, writing ComfyUI's layout too (as every run does), its LoRA's
  alpha twice its rank;
- cached: the same steps with --cache_latents (targets and references), on disk, neither validating nor
  checkpointing;
- resumed: the full run resumed from its checkpoint-2, checkpointing at every step.

What is particular to a family is its row's: its prompt settings (Qwen-Image-Edit's references at a small area, for
the tiny VAE, where the others cut prompts), the shapes its pipeline lays references out in, the components and
context an edit renders with outside the script (Qwen-Image-Edit's processor loaded without torchvision, its
references at the runs' area), the module its ComfyUI file adapts, the most references a row may have and its own
refusals. The template (FLUX.2 [klein]) and Qwen-Image-Edit (its own training step) also train on two processes:
the template on an int8 base (DDP), Qwen-Image-Edit sharded (FSDP2, the edit family's sharded launch). A new edit
family is one row.
"""

import contextlib
import functools
import json
import shutil
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Optional

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline, FluxKontextPipeline, QwenImageEditPlusPipeline
from PIL import Image
from safetensors.torch import load_file

from comfyui import comfyui_weight, delta_shape, module_weights
from helpers import FSDP2, launch, launch_processes, launching, together, usage_error
from training_utils.adapters.export import converted_name
from training_utils.data.images import read_image
from training_utils.families import flux2, flux2_dev, flux_kontext, qwen_image_edit
from training_utils.grids import read_log, step_grid
from training_utils.pipeline import from_pretrained
from training_utils.testing import assert_lora_changes_pipeline_output, assert_same_files, checkpoint_names

LORA = "pytorch_lora_weights.safetensors"
PROMPT = "make the square blue"
# The validation references: a shape and a background (two sizes, neither the target's).
REFERENCES = ("references/0000-0.png", "references/0001-1.png")
# Each row's sample shape (twice an epoch): its target's bucket and its references' sizes as FLUX.2 lays them out.
FLUX2_SAMPLE_SHAPES = ("target 24x40, references none", "target 32x32, references 64x64",
                       "target 32x32, references 64x96, 80x64")
CLASS_DATA_DIR_REFUSED = (["--class_data_dir", "class"],
                          "--class_data_dir is not supported here: an edit trains on its rows alone, without prior "
                          "preservation (upstream's image-to-image scripts take the flag and never read it)")
INT8 = ("--quantize_base", "int8", "--mixed_precision", "bf16")
# The references' area of the Qwen-Image-Edit runs (the pipeline's 1024x1024 takes the tiny VAE seconds to encode).
QWEN_REFERENCE_AREA = 32 * 32


def qwen_image_edit_components(path):
    """Qwen-Image-Edit's processor, loaded without torchvision."""
    return {"processor": qwen_image_edit.load_processor(path)}


@dataclass(frozen=True)
class EditFamily:
    """An edit script and what its runs must show."""

    name: str  # the row's id
    fixture: str  # its tiny pipeline
    script: str
    pipeline: type
    module: ModuleType  # its `training_utils.families` module
    flags: tuple = ()  # what every run adds (the family's prompt settings)
    # A linear layer of the transformer and the module of the ComfyUI file that adapts it.
    comfyui_module: tuple = ("single_transformer_blocks.0.attn.to_out", "diffusion_model.single_blocks.0.linear2")
    # Also trained on two processes: "int8" on an int8 base (DDP: FSDP2 refuses a quantised base), or "fsdp2" sharded.
    two_processes: Optional[str] = None
    refused: tuple = ()  # (flags, message) of the family's own refusals and checks
    data: str = "shapes_edit"  # its edit dataset's fixture
    references: tuple = REFERENCES  # the validation references, in the dataset's folder
    sample_shapes: tuple = FLUX2_SAMPLE_SHAPES  # each row's sample shape, as the run reports its buckets
    single_reference: bool = False  # the pipeline's image= is one image (the card's loading code passes one)
    max_references: Optional[int] = None  # the most references a row may have, where the script checks it
    components: Optional[Callable] = None  # (path) -> the components an edit's pipeline loads with, beyond its own
    render_context: Callable = contextlib.nullcontext  # () -> the context an edit renders in as the run validated


EDIT_FAMILIES = [
    EditFamily("flux2_klein_img2img", "flux2_klein", "dreambooth/train_dreambooth_lora_flux2_klein_img2img.py",
               Flux2KleinPipeline, flux2, ("--max_sequence_length", 32), two_processes="int8",
               refused=((["--guidance_scale", 1], "--guidance_scale is not supported here: FLUX.2 [klein]'s "
                                                  "transformer takes no guidance embedding (Flux2KleinPipeline passes "
                                                  "none, and upstream's script ignores the flag for it)"),
                        CLASS_DATA_DIR_REFUSED)),
    EditFamily("flux2_img2img", "flux2_dev", "dreambooth/train_dreambooth_lora_flux2_img2img.py", Flux2Pipeline,
               flux2_dev, ("--max_sequence_length", 48, "--guidance_scale", 2.5), refused=(CLASS_DATA_DIR_REFUSED,)),
    # One reference a row (Kontext takes one), laid out at the targets' area: Kontext's preferred resolution nearest
    # its aspect ratio (64x64: 32x32; 96x64, a 3:2 one: 24x36).
    EditFamily("flux_kontext", "flux_kontext", "dreambooth/train_dreambooth_lora_flux_kontext.py", FluxKontextPipeline,
               flux_kontext, ("--max_sequence_length", 32),
               comfyui_module=("transformer_blocks.0.attn.to_out.0", "diffusion_model.double_blocks.0.img_attn.proj"),
               data="shapes_edit_one_reference", references=REFERENCES[:1], single_reference=True, max_references=1,
               sample_shapes=("target 24x40, references none", "target 32x32, references 32x32",
                              "target 32x32, references 24x36"),
               refused=((["--vae_encode_mode", "sample"],
                         "--vae_encode_mode is not supported here: the targets' latents are drawn from the VAE's "
                         "distribution, as every script here draws them, and a reference's are its mode, as "
                         "FluxKontextPipeline encodes references"),
                        (["--with_prior_preservation"],
                         "--with_prior_preservation is not supported here: prior preservation is not carried for "
                         "edits: an edit's class images would need references and edited targets, which "
                         "text-to-image generation does not make"))),
    # Edit Plus: one to three references, each laid out at --reference_area (every one 32x32 at 32*32); its prompts
    # are never cut. Qwen-Image's module names are diffusers'.
    EditFamily("qwen_image_edit_plus", "qwen_image_edit_plus", "dreambooth/train_dreambooth_lora_qwen_image_edit.py",
               QwenImageEditPlusPipeline, qwen_image_edit, ("--reference_area", QWEN_REFERENCE_AREA),
               comfyui_module=("transformer_blocks.0.attn.to_out.0",
                               "diffusion_model.transformer_blocks.0.attn.to_out.0"),
               sample_shapes=("target 24x40, references none", "target 32x32, references 32x32",
                              "target 32x32, references 32x32, 32x32"),
               max_references=3, components=qwen_image_edit_components, two_processes="fsdp2",
               render_context=functools.partial(qwen_image_edit.references_at_area, QwenImageEditPlusPipeline,
                                                QWEN_REFERENCE_AREA),
               refused=((["--max_sequence_length", 32],
                         "--max_sequence_length is not supported here: the Qwen-Image-Edit pipelines never cut a "
                         "prompt"),
                        (["--with_prior_preservation"],
                         "--with_prior_preservation is not supported here: no prior preservation: an edit model "
                         "learns an edit from its examples, not a subject"),
                        (["--reference_area", 100],
                         "--reference_area=100: expected a number of pixels of at least 32*32 (the pipeline rounds "
                         "sides to multiples of 32)"))),
]
FAMILY_IDS = [family.name for family in EDIT_FAMILIES]


def common(tiny, family, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny[family.fixture], "--dataset_name", tiny[family.data],
            "--cond_image_column", "reference", "--caption_column", "text", "--output_dir", output_dir,
            "--resolution", 32, "--train_batch_size", 2, "--learning_rate", 1e-3, "--center_crop", "--random_flip",
            "--use_ema", "--ema_decay", 0.9, "--ema_posthoc_sigma_rels", 0.05, 0.1, "--rank", 4, "--lora_alpha", 8,
            "--seed", 3, "--use_aspect_ratio_buckets", "--repeats", 2, "--caption_dropout", 0.3,
            "--max_train_steps", 4, "--export_formats", "comfyui", *family.flags, *extra]


def full_flags(tiny, family, output_dir):
    return common(tiny, family, output_dir, "--validation_prompt", PROMPT, "--validation_image",
                  *(tiny[family.data] / path for path in family.references), "--num_validation_images", 1,
                  "--validation_inference_steps", 2, "--validation_steps", 2, "--checkpointing_steps", 2)


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{(family name, run): (output_dir, result)}`` of every family's runs: the full and cached ones together,
    then the resumed ones (once the full ones have left their checkpoint-2) beside the two-process ones."""
    root = tmp_path_factory.mktemp("edit")

    def run(family, name, flags):
        output_dir = root / family.name / name
        return lambda: (output_dir, launch(family.script, *flags(output_dir)))

    def resumed(family):
        output_dir = root / family.name / "resumed"
        shutil.copytree(root / family.name / "full" / "checkpoint-2", output_dir / "checkpoint-2")
        return output_dir, launch(family.script, *common(tiny, family, output_dir, "--checkpointing_steps", 1,
                                                         "--resume_from_checkpoint", "latest"))

    def two_processes(family):
        sharded = family.two_processes == "fsdp2"
        return launch_processes(family.script, lambda: tmp_path_factory.mktemp(f"{family.name}-two_processes"),
                                lambda output_dir: common(tiny, family, output_dir, *(() if sharded else INT8),
                                                          "--checkpointing_steps", 1000),
                                env=FSDP2 if sharded else None)

    runs = together({
        **{(family.name, "full"): run(family, "full", functools.partial(full_flags, tiny, family))
           for family in EDIT_FAMILIES},
        **{(family.name, "cached"): run(family, "cached", lambda output_dir, family=family: common(
            tiny, family, output_dir, "--cache_latents", "--feature_cache_dir", output_dir.parent / "features",
            "--checkpointing_steps", 1000)) for family in EDIT_FAMILIES}})
    runs.update(together({
        **{(family.name, "resumed"): functools.partial(resumed, family) for family in EDIT_FAMILIES},
        **{(family.name, "two_processes"): functools.partial(two_processes, family) for family in EDIT_FAMILIES
           if family.two_processes}}))
    return runs


@pytest.fixture(params=EDIT_FAMILIES, ids=FAMILY_IDS)
def family(request):
    return request.param


def validation_references(tiny, family):
    return [read_image(tiny[family.data] / path) for path in family.references]


def edit_kwargs(pipe, family, tiny):
    """What an edit at 32x32 passes to the pipeline besides the prompt: the validation references, or for a
    pipeline that takes one (Kontext), it resized as training lays it out and the size's area (`render_kwargs`)."""
    images = validation_references(tiny, family)
    if not family.single_reference:
        return {"image": images}
    layout, _ = family.module.reference_layout(pipe, 32 * 32)
    size = {"height": 32, "width": 32}
    return {"image": layout.resized(images[0]),
            **{key: value for key, value in family.module.render_kwargs(size).items() if key not in size}}


def test_trains_on_rows_with_0_1_and_2_references_and_validates_showing_the_references(tiny, runs, family):
    output_dir, result = runs[family.name, "full"]
    assert "2 of 6 rows have no reference image: they train as text-to-image" in result.stderr
    # Each row's sample shape, twice an epoch: its target's bucket and its references' sizes as the pipeline's.
    for shape in family.sample_shapes:
        assert f"bucket {shape}: 4 images, 2 batches an epoch" in result.stderr, result.stderr[-3000:]
    # Raw and EMA at step 2 and at the end; there also the post-hoc EMAs of the two lengths, from the snapshots.
    log = read_log(output_dir)
    assert [(record["step"], record["variant"]) for record in log] == [
        (0, "base"), (2, "raw"), (2, "ema"), (4, "raw"), (4, "ema"), (4, "ema_sigma_rel-0.05"),
        (4, "ema_sigma_rel-0.1")]
    assert all(record["prompt"] == PROMPT and len(record["images"]) == 1 for record in log)
    # Each step's grid: the references, then raw, then EMA (then the post-hoc EMAs).
    final = [record for record in log if record["step"] == 4]
    rendered = [(record["variant"], [Image.open(output_dir / record["images"][0])]) for record in final]
    expected = step_grid(4, PROMPT, rendered, ("references", validation_references(tiny, family)))[0]
    assert np.array_equal(np.asarray(Image.open(output_dir / final[0]["grid"])), np.asarray(expected))
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    card = (output_dir / "README.md").read_text()
    image = "image=load_image(" if family.single_reference else "image=[load_image("
    last = f"validation/conditioning-p00-{len(family.references) - 1:02d}.png"
    assert f'pipe("{PROMPT}", {image}' in card and last in card


def test_a_run_resumed_mid_epoch_ends_with_the_weights_of_the_uninterrupted_one(runs, family):
    (output_dir, result), (straight_dir, _) = runs[family.name, "resumed"], runs[family.name, "full"]
    assert f"resumed from {output_dir / 'checkpoint-2'} at step 2" in result.stdout
    for name in (LORA, f"ema/{LORA}"):
        assert_same_files(output_dir / name, straight_dir / name)


def test_cached_targets_and_references_train_like_encoding_every_step(tiny, runs, family):
    (cached_dir, result), (encoded_dir, _) = runs[family.name, "cached"], runs[family.name, "full"]
    rows = [json.loads(line) for line in (tiny[family.data] / "metadata.jsonl").read_text().splitlines()]
    references = {name for row in rows for name in row["reference_file_names"]}
    assert f"reference latents: {len(references)} items encoded" in result.stderr
    assert len(list((cached_dir.parent / "features").glob("reference_latents-*/shard-*"))) == 1
    for name in (LORA, f"ema/{LORA}"):
        cached, encoded = load_file(cached_dir / name), load_file(encoded_dir / name)
        assert cached.keys() == encoded.keys()
        for key in cached:  # the VAE ran on other batch sizes: equal up to float rounding
            torch.testing.assert_close(cached[key], encoded[key], rtol=1e-4, atol=1e-5)


def test_the_lora_changes_an_edit_and_comfyui_applies_it_at_the_trained_strength(tiny, runs, family):
    output_dir, _ = runs[family.name, "full"]
    prompt_settings = {key.removeprefix("--"): value for key, value in zip(family.flags[::2], family.flags[1::2])
                       if key == "--max_sequence_length"}  # the runs' prompt length, where the pipeline cuts prompts
    components = family.components(tiny[family.fixture]) if family.components else {}
    pipe = from_pretrained(family.pipeline, tiny[family.fixture], **components)
    with family.render_context():
        assert_lora_changes_pipeline_output(tiny[family.fixture], output_dir, output_dir / "ema", prompt=PROMPT,
                                            components=components, **prompt_settings,
                                            **edit_kwargs(pipe, family, tiny))
    # ComfyUI adds to the original model's layer what diffusers adds to the transformer's, at strength 1.
    layer, comfyui_module = family.comfyui_module
    module = module_weights(load_file(output_dir / converted_name("comfyui")))[0][comfyui_module]
    base = pipe.transformer.get_submodule(layer).weight.detach().clone()
    pipe.load_lora_weights(output_dir)
    pipe.fuse_lora()
    fused = pipe.transformer.get_submodule(f"{layer}.base_layer").weight  # peft's wrapper keeps the fused weight
    torch.testing.assert_close(comfyui_weight(module, torch.zeros(delta_shape(module))), fused - base)


def test_two_processes_train_on_an_int8_base_or_sharded(runs):
    for family in (family for family in EDIT_FAMILIES if family.two_processes):
        output_dir, result = runs[family.name, "two_processes"]
        raw = load_file(output_dir / LORA)
        assert raw and all(tensor.dtype == torch.float32 for tensor in raw.values())
        assert (output_dir / "ema" / LORA).is_file() and f"raw LoRA: {output_dir / LORA}" in result.stdout
        assert ("FSDP2 units:" in result.stderr) == (family.two_processes == "fsdp2"), family.name


@pytest.mark.parametrize("family, flags, message", [pytest.param(family, flags, message, id=f"{family.name}-{flags[0]}")
                                                    for family in EDIT_FAMILIES for flags, message in [
    (["--cond_image_column", "references"], "--cond_image_column='references': expected a column of the dataset: "
                                            "image, reference, text"),
    *family.refused]])
def test_bad_flags_fail_in_one_line_before_anything_loads(tiny, tmp_path, family, flags, message):
    assert usage_error(family.script, *common(tiny, family, tmp_path / "out", *flags)) == f"error: {message}"
    assert not (tmp_path / "out").exists()


def test_a_reference_the_pipeline_refuses_fails_in_one_line_before_anything_loads(tiny, tmp_path):
    small = tmp_path / "small.png"
    Image.new("RGB", (48, 64)).save(small)
    family = EDIT_FAMILIES[0]
    error = usage_error(family.script, *common(tiny, family, tmp_path / "out", "--validation_prompt", PROMPT,
                                               "--validation_image", small))
    assert error.startswith(f"error: --validation_image='{small}': expected reference images the pipeline takes: "
                            f"{small} is not (Image too small: 48×64.")


@pytest.mark.parametrize("family", [family for family in EDIT_FAMILIES if family.max_references],
                         ids=lambda family: family.name)
def test_a_row_with_more_references_than_the_model_takes_fails_in_one_line(tiny, tmp_path, family):
    data = shutil.copytree(tiny["shapes_edit"], tmp_path / "data")
    rows = [json.loads(line) for line in (data / "metadata.jsonl").read_text().splitlines()]
    most = family.max_references + 1  # the first row's first reference, repeated
    rows[0]["reference_file_names"] = rows[0]["reference_file_names"][:1] * most
    (data / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    flags = common(tiny, family, tmp_path / "out")
    flags[flags.index(tiny[family.data])] = data
    assert usage_error(family.script, *flags) == (
        f"error: --cond_image_column='reference': expected at most {family.max_references} reference images a row "
        f"for this model (a row has {most})")


def test_the_first_qwen_image_edit_takes_its_one_reference_in_every_row(tiny, tmp_path):
    family = next(family for family in EDIT_FAMILIES if family.name == "qwen_image_edit_plus")
    flags = common(tiny, family, tmp_path / "out")
    flags[flags.index(tiny[family.data])] = tiny["shapes_edit_one_reference"]
    flags[flags.index(tiny[family.fixture])] = tiny["qwen_image_edit"]
    assert usage_error(family.script, *flags) == ("error: --cond_image_column='reference': expected 1 reference image "
                                                  "in every row for QwenImageEditPipeline")
