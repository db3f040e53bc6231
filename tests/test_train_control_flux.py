"""Smoke tests: the FLUX.1 Control scripts (full fine-tune and LoRA) end to end on the tiny FLUX.1 fixture."""

import json

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, FluxControlPipeline, FluxTransformer2DModel
from PIL import Image
from safetensors.torch import load_file

from helpers import controlnet_flags, launch, launch_together, launching, together, usage_error
from training_utils.control import widen_input_layer
from training_utils.posthoc_ema.__main__ import main as synthesize
from training_utils.testing import (assert_checkpoint_is_the_output, assert_model_folder_loads, assert_resumes_exactly,
                                    assert_same_files, assert_same_tensors, assert_validated_at,
                                    checkpoint_weight_files, differing_keys, read_log)

FULL, LORA = "flux-control/train_control_flux.py", "flux-control/train_control_lora_flux.py"
LORA_WEIGHTS, WEIGHTS = "pytorch_lora_weights.safetensors", "diffusion_pytorch_model.safetensors"
TRANSFORMER, EMA_TRANSFORMER = f"transformer/{WEIGHTS}", f"ema/transformer/{WEIGHTS}"
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


def conditioning(tiny, index):
    return tiny["shapes_controlnet"] / "conditioning" / f"{index:04d}.png"


def validation_flags(tiny, prompts, steps):
    return ["--validation_prompt", *prompts, "--validation_image", *[conditioning(tiny, i) for i in range(len(prompts))],
            "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", steps]


def lora_flags(tiny, output_dir, *extra):
    """4 steps of a rank-2 Control LoRA with biases and the norm layers, on 32px crops with flips and 30% empty
    prompts, checkpointing every 2 steps."""
    return controlnet_flags(tiny, "flux", output_dir, "--max_train_steps", 4, "--rank", 2, "--use_lora_bias",
                            "--train_norm_layers", "--checkpointing_steps", 2, *extra)


def full_flags(tiny, output_dir, *extra):
    """3 steps of the whole transformer, latents cached (the conditioning images still encoded in every step), the EMA
    on the CPU and updated every 2 steps (and at the final step), post-hoc EMA snapshots, checkpointing every step,
    the newest 2 kept."""
    return controlnet_flags(tiny, "flux", output_dir, "--max_train_steps", 3, "--cache_latents", "--ema_device", "cpu",
                            "--ema_update_every", 2, "--ema_posthoc_sigma_rels", 0.05, 0.1, "--checkpointing_steps", 1,
                            "--checkpoints_total_limit", 2, *extra)


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: output_dir}`` of the runs here, launched together:

    - lora: `lora_flags`, validating both prompts, each with its conditioning image, every 2 steps (2 and 4);
    - full: `full_flags`, validating one prompt every 2 steps (2 and the final 3, there also the post-hoc EMA of
      sigma_rel 0.08).
    """
    root = tmp_path_factory.mktemp("runs")
    launch_together({
        "lora": (LORA, *lora_flags(tiny, root / "lora", *validation_flags(tiny, PROMPTS, 2))),
        "full": (FULL, *full_flags(tiny, root / "full", *validation_flags(tiny, PROMPTS[:1], 2),
                                   "--validation_sigma_rels", 0.08)),
    })
    return {name: root / name for name in ("lora", "full")}


def render(pipe, tiny):
    pipe.set_progress_bar_config(disable=True)
    return pipe(PROMPTS[0], control_image=Image.open(conditioning(tiny, 0)).convert("RGB"), num_inference_steps=2,
                height=32, width=32, output_type="np", generator=torch.Generator().manual_seed(0)).images


def widened_base(tiny):
    """The base model in FluxControlPipeline with its input widened by zeros: the untrained Control model."""
    pipe = FluxControlPipeline.from_pretrained(tiny["flux"])
    widen_input_layer(pipe.transformer, "x_embedder")
    return pipe


def test_the_lora_holds_the_widened_input_layer_the_norm_layers_and_biases_raw_and_ema(runs):
    raw, ema = (load_file(runs["lora"] / folder / LORA_WEIGHTS) for folder in ("", "ema"))
    assert raw.keys() == ema.keys() and differing_keys(raw, ema)
    assert raw["transformer.x_embedder.lora_A.weight"].shape == (2, 32)  # the tiny latents' 16 features, twice
    assert "transformer.x_embedder.lora_B.bias" in raw and "transformer.transformer_blocks.0.ff.net.2.lora_B.bias" in raw
    norms = [key for key in raw if ".norm_" in key]
    assert {key.split(".")[-2] for key in norms} == {"norm_q", "norm_k", "norm_added_q", "norm_added_k"}
    assert all(raw[key].dtype == torch.float32 for key in raw)


def test_load_lora_weights_widens_a_fresh_pipeline_and_the_lora_changes_its_output(tiny, runs):
    untrained = render(widened_base(tiny), tiny)
    outputs = []
    for folder in (runs["lora"], runs["lora"] / "ema"):
        pipe = FluxControlPipeline.from_pretrained(tiny["flux"])
        pipe.load_lora_weights(folder)
        assert pipe.transformer.config.in_channels == 32 and pipe.transformer.x_embedder.in_features == 32
        outputs.append(render(pipe, tiny))
        assert not np.allclose(outputs[-1], untrained, atol=1e-4)
    assert not np.array_equal(*outputs)
    checkpoint = runs["lora"] / "checkpoint-4"
    assert_checkpoint_is_the_output(checkpoint, runs["lora"], [LORA_WEIGHTS, f"ema/{LORA_WEIGHTS}"])


def test_the_full_fine_tune_saves_a_control_pipeline_with_the_widened_transformer_raw_and_ema(tiny, runs):
    output_dir = runs["full"]
    # From a FLUX.1 text-to-image base, a FluxControlPipeline folder: whatever loads it gets the Control pipeline.
    assert json.loads((output_dir / "model_index.json").read_text())["_class_name"] == "FluxControlPipeline"
    pipe = DiffusionPipeline.from_pretrained(output_dir)
    assert type(pipe) is FluxControlPipeline
    raw = assert_model_folder_loads(FluxTransformer2DModel, output_dir / "transformer")
    ema = assert_model_folder_loads(FluxTransformer2DModel, output_dir / "ema" / "transformer")
    assert raw.config.in_channels == 32 and raw.config.out_channels == 16 and raw.x_embedder.in_features == 32
    assert_same_tensors(raw.state_dict(), pipe.transformer.state_dict(), "transformer")
    assert differing_keys(raw.state_dict(), ema.state_dict())
    assert sorted(path.name for path in (output_dir / "ema").iterdir()) == ["transformer"]
    # Only the transformer is written anew; the other models' files are the base's, linked.
    assert (output_dir / TRANSFORMER).stat().st_nlink == 1
    for name in ("vae", "text_encoder", "text_encoder_2"):
        files = sorted((tiny["flux"] / name).glob("*.safetensors")) + [tiny["flux"] / name / "config.json"]
        assert all((output_dir / name / path.name).samefile(path) for path in files), name
    base = widened_base(tiny)
    untrained = base.transformer.state_dict()
    assert len(differing_keys(raw.state_dict(), untrained)) == len(untrained)  # every tensor trained
    trained = render(pipe, tiny)
    pipe.transformer = ema
    assert not np.allclose(trained, render(base, tiny), atol=1e-4) and not np.array_equal(trained, render(pipe, tiny))
    # The final checkpoint holds the same transformers (and the post-hoc EMA's profiles, to resume them).
    checkpoint = output_dir / "checkpoint-3"
    assert checkpoint_weight_files(checkpoint) == {TRANSFORMER, EMA_TRANSFORMER, "posthoc_ema.safetensors"}
    for name in (TRANSFORMER, EMA_TRANSFORMER):
        assert_same_files(checkpoint / name, output_dir / name)


def test_a_posthoc_ema_synthesized_after_the_full_fine_tune_is_a_widened_transformer(runs):
    output_dir = runs["full"]
    synthesize(["--output_dir", str(output_dir), "--sigma_rel", "0.08"])
    synthesized = assert_model_folder_loads(FluxTransformer2DModel, output_dir / "posthoc_ema" / "sigma_rel-0.08")
    assert synthesized.config.in_channels == 32 and synthesized.x_embedder.in_features == 32
    for folder in ("transformer", "ema/transformer"):
        trained = FluxTransformer2DModel.from_pretrained(output_dir / folder).state_dict()
        assert differing_keys(synthesized.state_dict(), trained), folder


@pytest.mark.parametrize("name, prompts, steps, sweep", [("lora", PROMPTS, [2, 4], ()),
                                                          ("full", PROMPTS[:1], [2, 3], ["ema_sigma_rel-0.08"])])
def test_validation_renders_each_prompt_with_its_conditioning_beside_raw_and_ema(tiny, runs, name, prompts, steps,
                                                                                 sweep):
    output_dir = runs[name]
    log = assert_validated_at(output_dir, steps, ("raw", "ema"), prompts, num_images=1, sweep=sweep)
    assert {Image.open(output_dir / record["images"][0]).size for record in log} == {(32, 32)}
    assert {record["guidance_scale"] for record in log} == {30.0}  # upstream's default for Control
    for index in range(len(prompts)):
        saved = output_dir / "validation" / f"conditioning-p{index:02d}.png"
        given = Image.open(conditioning(tiny, index)).convert("RGB")
        assert np.array_equal(np.asarray(Image.open(saved)), np.asarray(given))
    card = (output_dir / "README.md").read_text()
    assert "FluxControlPipeline.from_pretrained" in card and f'control_image=load_image("{conditioning(tiny, 0)}")' in card
    assert ("load_lora_weights" in card) == (name == "lora")
    assert (f'pipe = FluxControlPipeline.from_pretrained("{output_dir}")' in card) == (name == "full")
    assert (f'FluxTransformer2DModel.from_pretrained("{output_dir}/ema/transformer")' in card) == (name == "full")
    assert "validation/conditioning-p00.png" in card and read_log(output_dir)[-1]["progress"] in card


def test_both_resume_to_the_uninterrupted_weights(tiny, tmp_path, runs):
    # The uninterrupted runs validated (the LoRA at steps 2 and 4, the full fine-tune at 2 and 3), the resumed ones
    # never; the full fine-tune's CPU EMA resumes between its updates (at 2 and the final step).
    together({
        "lora": lambda: assert_resumes_exactly(LORA, lambda output_dir: lora_flags(tiny, output_dir), runs["lora"],
                                               tmp_path / "lora", 2, [LORA_WEIGHTS, f"ema/{LORA_WEIGHTS}"],
                                               launch=launch),
        "full": lambda: assert_resumes_exactly(FULL, lambda output_dir: full_flags(tiny, output_dir), runs["full"],
                                               tmp_path / "full", 2, [TRANSFORMER, EMA_TRANSFORMER], launch=launch),
    })


@pytest.mark.parametrize("script, flags, expected", [
    (LORA, ["--use_lora_bias", "--gaussian_init_lora"], "error: --gaussian_init_lora=True: expected not with"),
    (LORA, ["--adapter", "lokr"], "error: --adapter='lokr': expected lora"),
    (LORA, ["--jsonl_for_train", "train.jsonl"], "error: --jsonl_for_train='train.jsonl': expected no --dataset_name"),
    (FULL, ["--upcast_before_saving"], "error: --upcast_before_saving is not supported here: the transformer"),
    (FULL, ["--only_target_transformer_blocks", "--ema_posthoc_sigma_rels", 0.05, 0.1],
     "error: --ema_posthoc_sigma_rels=[0.05, 0.1]: expected none with --only_target_transformer_blocks"),
    (FULL, ["--conditioning_image_column", "hint"], "error: --conditioning_image_column='hint': expected a column"),
])
def test_bad_input_fails_with_one_line_before_anything_loads(tiny, tmp_path, script, flags, expected):
    error = usage_error(script, *controlnet_flags(tiny, "flux", tmp_path / "out", *flags))
    assert error.startswith(expected), error
    assert not (tmp_path / "out").exists()
