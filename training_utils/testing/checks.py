"""Checks of what a training run wrote: its LoRA files and model folders, validation log and images, checkpoints,
and the comparisons between two runs (bitwise, or within float tolerance).

They read the output directory's documented layout. Nothing here needs pytest: a failed check raises
`AssertionError`.
"""

import re
import shutil
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from ..grids import BASE, read_log
from .launch import launch_script


def assert_validated_at(output_dir, steps, variants=("raw",), prompts=None, num_images=None, sweep=()):
    """The run in ``output_dir`` drew the base model's pictures (step 0, variant "base", one record per prompt), then
    validated at ``steps`` (in order; the final step once) and nowhere else: each
    step's records are one per variant (``variants``: "raw", and "ema" with ``--use_ema``; at the last step, then
    the post-hoc EMA's ``sweep``, e.g. "ema_sigma_rel-0.08") and prompt (``prompts``;
    by default those of the first step), and name images that exist (``num_images`` each, if given), the step's
    grid and the prompt's progress grid. Returns the records."""
    log = read_log(output_dir)
    if prompts is None:
        prompts = [record["prompt"] for record in log if record["step"] == log[0]["step"]
                   and record["variant"] == log[0]["variant"]] if log else []
    validated = [(record["step"], record["variant"], record["prompt"]) for record in log]
    expected = [(0, BASE, prompt) for prompt in prompts]
    expected += [(step, variant, prompt) for step in steps
                 for variant in (*variants, *(sweep if step == steps[-1] else ())) for prompt in prompts]
    assert validated == expected, f"validated (step, variant, prompt): {validated}; expected {expected}"
    for record in log:
        assert record["images"] and all((Path(output_dir) / path).is_file() for path in record["images"]), record
        assert num_images is None or len(record["images"]) == num_images, record
        assert all((Path(output_dir) / record[grid]).is_file() for grid in ("grid", "progress")), record
    return log


def reported_buckets(stderr):
    """``{(height, width): images}`` of the aspect-ratio buckets a run reported, one line each
    (`buckets.BucketBatchSampler.report`)."""
    lines = re.findall(r"bucket (\d+)x(\d+) \(height x width\): (\d+) images?", stderr)
    return {(int(height), int(width)): int(images) for height, width, images in lines}


def assert_latents_cached_per_bucket(features_dir, stderr, vae_scale_factor, repeats=2):
    """A run's ``--feature_cache_dir`` holds one latent store per aspect-ratio bucket it reported: each image once,
    unflipped and flipped (though it trains ``repeats`` times an epoch), at the bucket's latent size. Returns
    ``{latent (height, width): [images, flips, ...] tensor}``."""
    stores = (load_file(shard)["0/parameters"] for shard in Path(features_dir).glob("latents-*/shard-*"))
    latents = {tuple(parameters.shape[-2:]): parameters for parameters in stores}
    assert {(height * vae_scale_factor, width * vae_scale_factor): repeats * len(parameters)
            for (height, width), parameters in latents.items()} == reported_buckets(stderr)
    assert all(parameters.shape[1] == 2 for parameters in latents.values())
    return latents


def most_common_bucket(buckets):
    """The bucket of ``{(height, width): images}`` that validation renders at by default: the one with the most
    images, the largest of equally common ones (`buckets.validation_size`)."""
    return max(buckets, key=lambda shape: (buckets[shape], shape))


def rendered_images(output_dir):
    """The validation images a run rendered at its validated steps (not the base model's at step 0, not its grids,
    nor a ControlNet's conditioning images)."""
    return sorted(path for path in (Path(output_dir) / "validation").glob("step-*/*.png")
                  if not path.name.startswith("grid-") and path.parent.name != "step-000000")


def assert_lora_changes_pipeline_output(base_model, *lora_dirs, prompt="a photo", resolution=32,
                                        num_inference_steps=2, atol=1e-4, load_kwargs=None, components=None,
                                        prepare=None, **call_kwargs):
    """Render ``prompt`` with the pipeline saved in ``base_model`` (``components`` replacing loaded ones, e.g. a
    processor that loads without torchvision), then with the adapter of each of ``lora_dirs`` loaded in turn as a
    user loads it, all with one seed: each adapter must load and change the images (a video
    pipeline's frames; ``call_kwargs`` go to every call, e.g. ``num_frames``) by more than ``atol``. A LoRA or DoRA
    loads with ``pipe.load_lora_weights(lora_dir, **load_kwargs)``; a LoKr, LoHa or OFT (a folder per component in
    peft's format) with ``PeftModel.from_pretrained(getattr(pipe, component), lora_dir/component)``, into a freshly
    loaded pipeline. ``prepare(pipe)``, if given, runs on each pipeline once loaded (what a script does to the
    pipeline it renders with, e.g. `families.hidream.render_at_resolution`). Returns the images (numpy), the base
    model's first."""
    from diffusers import DiffusionPipeline
    from peft import PeftModel

    from ..pipeline import from_pretrained

    def load():
        pipe = from_pretrained(DiffusionPipeline, base_model, **(components or {}))
        pipe.set_progress_bar_config(disable=True)
        if prepare is not None:
            prepare(pipe)
        return pipe

    def render(pipe):
        output = pipe(prompt=prompt, num_inference_steps=num_inference_steps, height=resolution, width=resolution,
                      output_type="np", generator=torch.Generator().manual_seed(0), **call_kwargs)
        return output.frames if hasattr(output, "frames") else output.images

    pipe = load()
    images = [render(pipe)]
    for lora_dir in lora_dirs:
        peft_folders = sorted(path.parent for path in Path(lora_dir).glob("*/adapter_config.json"))
        if peft_folders:
            adapted = load()
            for folder in peft_folders:
                PeftModel.from_pretrained(getattr(adapted, folder.name), folder)
            images.append(render(adapted))
        else:
            pipe.load_lora_weights(lora_dir, **(load_kwargs or {}))
            images.append(render(pipe))
            pipe.unload_lora_weights()
        assert not np.allclose(images[0], images[-1], atol=atol), f"the adapter in {lora_dir} changes no image"
    return images


def assert_model_folder_loads(model_class, folder, initial=None):
    """``model_class.from_pretrained(folder)`` loads (e.g. ``ControlNetModel`` and a ControlNet script's output_dir,
    ``UNet2DConditionModel`` and ``output_dir/unet``), and the folder's safetensors files hold fp32 weights. Given
    ``initial`` (the folder of the model training started from), also: the same tensor names as it, and some
    tensors changed. Returns the model."""
    saved = [load_file(path) for path in sorted(Path(folder).glob("*.safetensors"))]
    assert saved and all(tensor.dtype == torch.float32 for tensors in saved for tensor in tensors.values()), \
        f"{folder}: expected fp32 safetensors"
    model = model_class.from_pretrained(folder)
    if initial is not None:
        weights, initial_weights = model.state_dict(), model_class.from_pretrained(initial).state_dict()
        assert weights.keys() == initial_weights.keys(), f"{folder} holds other tensors than {initial}"
        assert differing_keys(weights, initial_weights), f"{folder} holds the weights of {initial}, untrained"
    return model


def checkpoint_names(output_dir):
    """The names of the checkpoints in ``output_dir``, oldest first (``checkpoint-<step>``)."""
    return sorted((path.name for path in Path(output_dir).glob("checkpoint-*")), key=lambda name: int(name[11:]))


def checkpoint_weight_files(checkpoint):
    """The safetensors files of a checkpoint folder that hold weights, as a set of paths relative to it (each
    process's random state left out): a test compares them with the final output's layout, to show that the
    checkpoint holds each trained tensor once, where the stock loaders find it."""
    checkpoint = Path(checkpoint)
    return {path.relative_to(checkpoint).as_posix() for path in checkpoint.rglob("*.safetensors")
            if not path.name.startswith("random_state_")}


def assert_checkpoint_is_the_output(checkpoint, output_dir, files):
    """``checkpoint`` (taken at the final step) holds exactly the weight ``files`` of ``output_dir``, bitwise
    equal: it loads as the final output does. ``files`` are paths relative to both folders, or a dict of
    ``{path in the checkpoint: path in output_dir}`` where they differ (a ControlNet's ``controlnet/…``)."""
    files = files if isinstance(files, dict) else {name: name for name in files}
    assert checkpoint_weight_files(checkpoint) == set(files), checkpoint_weight_files(checkpoint)
    for in_checkpoint, in_output in files.items():
        assert_same_files(Path(checkpoint) / in_checkpoint, Path(output_dir) / in_output)


def assert_resumes_exactly(script, args_for, straight_dir, resumed_dir, step, weight_files, launch=launch_script):
    """The run in ``straight_dir``, resumed from its ``checkpoint-<step>``, ends with bitwise the same
    ``weight_files`` (paths relative to the output directory) as the run that went straight on.

    The checkpoint is copied into ``resumed_dir``, and ``script`` is launched with ``args_for(resumed_dir)`` and
    ``--resume_from_checkpoint latest``: ``args_for(output_dir)`` gives the flags of the straight run, and may drop
    its validation or change its checkpointing, which leave the weights alone. ``launch(script, *args)`` is
    `launch_script` by default. Returns the resumed run's `subprocess.CompletedProcess`."""
    checkpoint = Path(resumed_dir) / f"checkpoint-{step}"
    shutil.copytree(Path(straight_dir) / checkpoint.name, checkpoint)
    result = launch(script, *args_for(resumed_dir), "--resume_from_checkpoint", "latest")
    assert f"resumed from {checkpoint} at step {step}" in result.stdout, result.stdout[-3000:]
    for name in weight_files:
        assert_same_files(Path(resumed_dir) / name, Path(straight_dir) / name)
    return result


def differing_keys(a, b):
    """The keys whose tensors are not bitwise equal in two state dicts with the same keys."""
    return [key for key in a if not torch.equal(a[key], b[key])]


def assert_same_tensors(a, b, where=""):
    """Two state dicts hold the same keys and bitwise-equal tensors."""
    assert a.keys() == b.keys() and len(a) > 0, (where, sorted(a.keys() ^ b.keys())[:3])
    different = differing_keys(a, b)
    assert not different, f"{len(different)} of {len(a)} tensors differ in {where}, e.g. {different[0]}"


def assert_same_files(a, b):
    """Two safetensors files hold the same keys and bitwise-equal tensors."""
    assert_same_tensors(load_file(a), load_file(b), f"{a} and {b}")


def assert_close_files(a, b, atol=1e-5):
    """Two safetensors files hold the same keys and tensors within ``atol`` (e.g. the weights of an uncached
    and a cached run, equal up to float noise); returns ``b``'s tensors for further checks."""
    a_tensors, b_tensors = load_file(a), load_file(b)
    assert a_tensors.keys() == b_tensors.keys() and len(b_tensors) > 0, (str(a), str(b))
    for key in b_tensors:
        assert torch.allclose(b_tensors[key], a_tensors[key], atol=atol), (str(b), key)
    return b_tensors


def assert_close_validations(a, b, expected, max_difference=2):
    """The runs in ``a`` and ``b`` both logged the base model's pictures (step 0), then the validations ``expected``
    (``[(step, variant)]``), with images at most ``max_difference`` levels apart: e.g. cached against uncached
    encoders, equal up to float noise."""
    a, b = Path(a), Path(b)
    logs = read_log(a), read_log(b)
    for log in logs:
        base = [record for record in log if record["step"] == 0]
        assert base and all(record["variant"] == BASE for record in base), log
        assert [(record["step"], record["variant"]) for record in log[len(base):]] == expected
    for record_a, record_b in zip(*logs):
        for path_a, path_b in zip(record_a["images"], record_b["images"], strict=True):
            image_a, image_b = (np.asarray(Image.open(path), dtype=np.int16) for path in (a / path_a, b / path_b))
            assert np.abs(image_a - image_b).max() <= max_difference, path_b
