"""FSDP2 through accelerate on two CPU processes (gloo): sharded training, shard-local EMA, sharded checkpoints that
resume exactly, whole outputs equal to a DDP run's, validation while sharded.

The launches, in one module-scoped set (two at a time on CI's two cores):

- klein (the thorough family): 4 steps sharded, with an EMA and a post-hoc EMA, checkpointing every 2 steps and
  validating at the end (the post-hoc sweep too); each EMA update runs with every collective made to raise; its text
  encoder sharded too (``--fsdp_text_encoder``), while it embeds the prompts and renders validation;
- klein DDP: the same job unsharded, for the outputs to match;
- klein resumed: the sharded run resumed from its checkpoint-2 (as after a kill), to end bitwise equal (its text
  encoder whole: the flag leaves the trajectory alone);
- z_image: a minimal sharded run (2 steps, EMA, validation at the end) of another family's script, its text
  encoder sharded too (a Qwen3Model: the pipeline reads one of its hidden states);
- text_encoder: two trained modules (SD's UNet LoRA and text-encoder LoRA, dreambooth), 2 steps with an EMA, a
  checkpoint at each, validating at the end; text_encoder DDP: the same job unsharded (without checkpoints or
  validation), for the outputs to match;
- sd3_full: a transformer family's full fine-tune (SD3's transformer and both CLIP encoders), 2 steps with an EMA, a
  checkpoint at each: the trained models written whole, with the buffer saved beside their weights (SD3's positional
  embedding, which FSDP2 leaves unsharded).

A full fine-tune is launched sharded by the ControlNet's tests (beside a DDP run, and resumed) and text_to_image's.

Turning FSDP on is what ``accelerate launch --use_fsdp --fsdp_version 2`` does: the variables it sets.
"""

import json
import re
import shutil
import time

import pytest
import torch
import torch.distributed.checkpoint
from diffusers import (Flux2KleinPipeline, SD3Transformer2DModel, StableDiffusion3Pipeline, StableDiffusionPipeline,
                       ZImagePipeline)
from safetensors.torch import load_file

from helpers import FSDP2, launch, launching, together
from training_utils.names import MANIFEST_FILE
from training_utils.testing import assert_validated_at

LORA = "pytorch_lora_weights.safetensors"
PROMPT = "a photo of sks triangle"
STEPS = 4
# Raises inside every EMA update that makes a collective call (c10d's ops, DTensor's functional collectives), and
# counts the updates made so, one file per process.
NO_COLLECTIVES_WRAPPER = """\
import os, runpy, sys
from pathlib import Path
from torch.utils._python_dispatch import TorchDispatchMode
from training_utils import ema

class NoCollectives(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
            raise AssertionError(f"collective {func} in an EMA update")
        return func(*args, **(kwargs or {}))

update = ema.EMA.update
def update_without_collectives(self, step):
    with NoCollectives():
        update(self, step)
    counts = Path(os.environ["EMA_UPDATES_DIR"]) / f"process-{os.environ['RANK']}"
    counts.write_text(str(int(counts.read_text()) + 1 if counts.exists() else 1))
ema.EMA.update = update_without_collectives
sys.argv[0] = SCRIPT
runpy.run_path(SCRIPT, run_name="__main__")
"""


def klein_flags(tiny, output_dir, *extra):
    return ["--pretrained_model_name_or_path", tiny["flux2_klein"], "--instance_data_dir", tiny["instance"],
            "--instance_prompt", PROMPT, "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 1,
            "--learning_rate", 1e-3, "--rank", 4, "--seed", 3, "--max_train_steps", STEPS, "--checkpointing_steps", 2,
            "--use_ema", "--ema_decay", 0.9, "--ema_posthoc_sigma_rels", 0.05, 0.1, "--report_to", "none",
            "--validation_prompt", "a sks triangle", "--num_validation_images", 1, "--validation_inference_steps", 2,
            "--validation_steps", STEPS, "--max_sequence_length", 32, *extra]


def checked_along(sharded, prompt):
    """A sharded run checkpoints at each step and validates at the end (step 2); its unsharded partner, there for the
    weights to match, does neither (neither changes the weights)."""
    if not sharded:
        return ["--checkpointing_steps", 1000]
    return ["--checkpointing_steps", 1, "--validation_prompt", prompt, "--num_validation_images", 1,
            "--validation_inference_steps", 2, "--validation_steps", 2]


def text_encoder_flags(tiny, output_dir, sharded):
    """2 steps of a UNet LoRA and a text-encoder LoRA (two trained modules) with an EMA."""
    return ["--pretrained_model_name_or_path", tiny["sd"], "--instance_data_dir", tiny["instance"],
            "--instance_prompt", PROMPT, "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 1,
            "--learning_rate", 1e-3, "--rank", 4, "--seed", 3, "--max_train_steps", 2, "--train_text_encoder",
            "--use_ema", "--ema_decay", 0.9, "--report_to", "none", *checked_along(sharded, "a sks triangle")]


# Runs made sharded and unsharded alike, for their outputs to match: ``{name: (script, flags, sharded)}``.
PAIRED = {"text_encoder": ("dreambooth/train_dreambooth_lora.py", text_encoder_flags, True),
          "text_encoder_ddp": ("dreambooth/train_dreambooth_lora.py", text_encoder_flags, False)}


def without_collectives_in_ema(script, directory):
    wrapper = directory / "train_without_collectives_in_ema.py"
    wrapper.write_text(f"SCRIPT = {str(script)!r}\n" + NO_COLLECTIVES_WRAPPER)
    return wrapper


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, CompletedProcess)}`` of the launches the module docstring lists."""
    from helpers import EXAMPLES
    klein = EXAMPLES / "dreambooth/train_dreambooth_lora_flux2_klein.py"
    folders = {name: tmp_path_factory.mktemp(name)
               for name in ("klein", "klein_ddp", "z_image", "resumed", "sd3_full", *PAIRED)}
    wrapper = without_collectives_in_ema(klein, tmp_path_factory.mktemp("wrapper"))
    updates = tmp_path_factory.mktemp("ema_updates")
    z_image = ["--pretrained_model_name_or_path", tiny["z_image"], "--instance_data_dir", tiny["instance"],
               "--instance_prompt", PROMPT, "--output_dir", folders["z_image"], "--resolution", 32,
               "--train_batch_size", 1, "--learning_rate", 1e-3, "--rank", 4, "--seed", 3, "--max_train_steps", 2,
               "--use_ema", "--ema_decay", 0.9, "--report_to", "none", "--validation_prompt", "a sks triangle",
               "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", 2,
               "--max_sequence_length", 32, "--fsdp_text_encoder"]
    sd3_full = ["--pretrained_model_name_or_path", tiny["sd3"], "--instance_data_dir", tiny["instance"],
                "--instance_prompt", PROMPT, "--output_dir", folders["sd3_full"], "--resolution", 32,
                "--train_batch_size", 1, "--learning_rate", 1e-3, "--seed", 3, "--max_train_steps", 2,
                "--checkpointing_steps", 1, "--train_text_encoder", "--use_ema", "--ema_decay", 0.9,
                "--report_to", "none", "--max_sequence_length", 32]

    def two(script, args, env):
        return lambda: launch(script, *args, processes=2, env=env)

    def klein_then_resumed():
        sharded = launch(wrapper, *klein_flags(tiny, folders["klein"], "--fsdp_text_encoder"), processes=2,
                         env={**FSDP2, "EMA_UPDATES_DIR": str(updates)})
        shutil.copytree(folders["klein"] / "checkpoint-2", folders["resumed"] / "checkpoint-2")
        return sharded, launch(klein, *klein_flags(tiny, folders["resumed"], "--resume_from_checkpoint", "latest"),
                               processes=2, env=FSDP2)

    started = time.monotonic()
    results = together({
        "klein": klein_then_resumed,
        "klein_ddp": two(klein, klein_flags(tiny, folders["klein_ddp"]), {}),
        "z_image": two("dreambooth/train_dreambooth_lora_z_image.py", z_image, FSDP2),
        "sd3_full": two("dreambooth/train_dreambooth_sd3.py", sd3_full, FSDP2),
        **{name: two(script, flags(tiny, folders[name], sharded), FSDP2 if sharded else {})
           for name, (script, flags, sharded) in PAIRED.items()}})
    print(f"FSDP2 launches: {time.monotonic() - started:.1f} s")
    results["klein"], results["resumed"] = results["klein"]
    return {**{name: (folders[name], result) for name, result in results.items()}, "ema_updates": (updates, None)}


def held(result):
    """``([{kind: bytes} per process], {kind: bytes} whole)`` from the run's line on what each process holds."""
    line = re.search(r"sharded over 2 processes with FSDP2: (.*) \(whole: (.*)\)", result.stderr)
    assert line, result.stderr[-3000:]

    def counts(text):
        return {kind: int(count) for kind, count in re.findall(r"(\w+) (\d+) B", text)}

    return [counts(part) for part in line.group(1).split("; ")], counts(line.group(2))


@pytest.mark.parametrize("name", ["klein", "z_image", "text_encoder"])
def test_each_process_holds_about_half_of_the_frozen_trained_and_ema_bytes(runs, name):
    per_process, whole = held(runs[name][1])
    assert len(per_process) == 2 and whole["frozen"] > 0 and whole["trained"] > 0 and whole["ema"] > 0
    for process in per_process:
        for kind in ("frozen", "trained", "ema"):
            assert 0 < process[kind] <= 0.55 * whole[kind], (name, kind, process, whole)


@pytest.mark.parametrize("name, blocks", [
    # The tiny klein's 1 double-stream and 2 single-stream blocks (its _no_split_modules), and accelerate's own unit
    # for the final norm; Z-Image's 2 layers and its noise and context refiners' 1 each, all ZImageTransformerBlock.
    ("klein", {"Flux2Transformer2DModel": 1, "Flux2TransformerBlock": 1, "Flux2SingleTransformerBlock": 2,
               "AdaLayerNormContinuous": 1}),
    ("z_image", {"ZImageTransformer2DModel": 1, "ZImageTransformerBlock": 4}),
    # The tiny SD UNet's blocks; with its text encoder's LoRA, that encoder is a unit too, and its 2 layers.
    ("text_encoder", {"UNet2DConditionModel": 1, "BasicTransformerBlock": 4, "CLIPTextModel": 1,
                      "CLIPEncoderLayer": 2}),
    # The tiny SD3's 2 joint blocks, and its two CLIP encoders (trained whole) with their 2 layers each.
    ("sd3_full", {"SD3Transformer2DModel": 1, "JointTransformerBlock": 2, "CLIPTextModelWithProjection": 2,
                  "CLIPEncoderLayer": 4})])
def test_each_repeated_block_of_the_model_is_a_unit_of_its_own(runs, name, blocks):
    line = re.search(r"FSDP2 units: (.*)", runs[name][1].stderr)
    assert line, runs[name][1].stderr[-3000:]
    units = {unit: int(count) for count, unit in re.findall(r"(\d+) (\w+)", line.group(1))}
    assert {unit: count for unit, count in units.items() if unit in blocks} == blocks, units


@pytest.mark.parametrize("name, encoder, units", [
    ("klein", "Qwen3ForCausalLM", "1 Qwen3ForCausalLM, 1 Embedding, 28 Qwen3DecoderLayer"),  # the tiny encoders' layers
    ("z_image", "Qwen3Model", "1 Qwen3Model, 1 Embedding, 2 Qwen3DecoderLayer")])
def test_the_text_encoder_is_sharded_per_layer_and_each_process_holds_about_half(runs, name, encoder, units):
    line = re.search(rf"{encoder} sharded while it encodes \(--fsdp_text_encoder\), units: (.*); held per process: "
                     r"process 0: (\d+) B; process 1: (\d+) B \(whole: (\d+) B\)", runs[name][1].stderr)
    assert line, runs[name][1].stderr[-3000:]
    assert line.group(1) == units
    held, whole = [int(line.group(2)), int(line.group(3))], int(line.group(4))
    assert sum(held) == whole and all(0 < part <= 0.55 * whole for part in held), line.group(0)


def test_no_collective_runs_in_an_ema_update(runs):
    updates, _ = runs["ema_updates"]
    # The run's EMA and its post-hoc EMA's two profiles, updated at each of the 4 steps, on both processes.
    assert sorted(path.read_text() for path in updates.iterdir()) == [str(3 * STEPS)] * 2


def test_a_checkpoint_holds_each_processs_optimizer_shard_what_trains_only_and_its_manifest_every_file(runs):
    checkpoint = runs["klein"][0] / "checkpoint-2"
    assert {path.name for path in (checkpoint / "optimizer_0").glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    files = {str(path.relative_to(checkpoint)) for path in checkpoint.rglob("*") if path.is_file()}
    # No model state of accelerate's: the frozen base is not in it. The LoRA, its EMA and the post-hoc EMA are the
    # weights; the optimizer's shards hold the state of the LoRA's parameters only.
    assert not any(name.startswith("pytorch_model_fsdp") for name in files), files
    optimizer_keys = torch.distributed.checkpoint.FileSystemReader(checkpoint / "optimizer_0").read_metadata()
    states = {key.rpartition(".")[0] for key in optimizer_keys.state_dict_metadata
              if key.startswith("optimizer.state.")}
    assert states and all(".lora_" in name for name in states), sorted(states)[:5]
    listed = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]
    assert set(listed) == files - {MANIFEST_FILE}
    assert json.loads((checkpoint / "training_state.json").read_text())["sharded"] is True
    # Whole, loadable as the final output is.
    assert load_file(checkpoint / LORA).keys() == load_file(runs["klein"][0] / LORA).keys()


def test_resuming_the_latest_checkpoint_ends_bitwise_equal_to_the_uninterrupted_run(runs):
    uninterrupted, resumed = runs["klein"][0], runs["resumed"][0]
    assert "resumed from" in runs["resumed"][1].stdout + runs["resumed"][1].stderr
    snapshots = sorted(path.relative_to(resumed) for path in (resumed / "posthoc_ema").glob("snapshot-00000004-*"))
    assert len(snapshots) == 2
    names = [LORA, f"ema/{LORA}", *snapshots]
    for name in names:
        expected, got = load_file(uninterrupted / name), load_file(resumed / name)
        assert expected.keys() == got.keys() and all(torch.equal(expected[key], got[key]) for key in expected), name


@pytest.mark.parametrize("name", ["klein", "text_encoder"])
def test_the_outputs_match_a_ddp_run(runs, name):
    sharded, ddp = runs[name][0], runs[f"{name}_ddp"][0]
    assert "sharded over" not in runs[f"{name}_ddp"][1].stderr
    for file in (LORA, f"ema/{LORA}"):
        expected, got = load_file(ddp / file), load_file(sharded / file)
        assert expected.keys() == got.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-5)
    if name == "text_encoder":
        assert any(key.startswith("text_encoder.") for key in load_file(sharded / LORA))


def test_the_outputs_load_in_the_stock_pipeline(tiny, runs):
    # What renders these files is the same writer every unsharded run's tests render with; here, that they load.
    for pipeline, fixture, output_dir in ((Flux2KleinPipeline, "flux2_klein", runs["klein"][0]),
                                          (ZImagePipeline, "z_image", runs["z_image"][0])):
        pipe = pipeline.from_pretrained(tiny[fixture])
        for folder in (output_dir, output_dir / "ema"):
            pipe.load_lora_weights(folder, adapter_name=folder.name)
        assert set(pipe.get_list_adapters()["transformer"]) == {output_dir.name, "ema"}
    pipe = StableDiffusionPipeline.from_pretrained(tiny["sd"])
    output_dir = runs["text_encoder"][0]
    pipe.load_lora_weights(output_dir)
    assert set(pipe.get_list_adapters()) == {"unet", "text_encoder"}


def test_validation_renders_while_sharded_the_post_hoc_sweep_too(runs):
    assert_validated_at(runs["klein"][0], [STEPS], ("raw", "ema", "ema_sigma_rel-0.05", "ema_sigma_rel-0.1"),
                        ["a sks triangle"], num_images=1)
    for name in ("z_image", "text_encoder"):
        assert_validated_at(runs[name][0], [2], ("raw", "ema"), ["a sks triangle"], num_images=1)


def test_a_sharded_full_fine_tune_writes_its_checkpoints_and_pipeline_whole_with_their_buffers(tiny, runs):
    output_dir = runs["sd3_full"][0]
    base = SD3Transformer2DModel.from_pretrained(tiny["sd3"] / "transformer").state_dict()
    weights = {folder: SD3Transformer2DModel.from_pretrained(output_dir / folder / "transformer").state_dict()
               for folder in ("checkpoint-1", "checkpoint-2", "checkpoint-2/ema", ".")}
    for folder, state in weights.items():
        assert state.keys() == base.keys(), folder
        assert torch.equal(state["pos_embed.pos_embed"], base["pos_embed.pos_embed"]), folder
    for folder in ("checkpoint-1", "checkpoint-2/ema"):
        assert any(not torch.equal(weights["."][key], weights[folder][key]) for key in base), folder
    assert all(torch.equal(weights["."][key], weights["checkpoint-2"][key]) for key in base)
    pipe = StableDiffusion3Pipeline.from_pretrained(output_dir)
    assert all(torch.equal(tensor, weights["."][key]) for key, tensor in pipe.transformer.state_dict().items())
