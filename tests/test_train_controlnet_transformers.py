"""Smoke tests: the transformer families' ControlNet scripts (SD3 and SD3.5, FLUX.1) end to end on the tiny fixtures,
through ``accelerate launch``, all their runs launched together."""

import json

import numpy as np
import pytest
import torch
from diffusers import (FluxControlNetModel, FluxControlNetPipeline, FluxPipeline, SD3ControlNetModel,
                       StableDiffusion3ControlNetPipeline, StableDiffusion3Pipeline)
from PIL import Image

from helpers import controlnet_flags, import_script, launch, launch_together, launching
from training_utils.errors import UsageError
from training_utils.testing import (assert_checkpoint_is_the_output, assert_model_folder_loads, assert_resumes_exactly,
                                    assert_same_files, assert_validated_at, differing_keys)

SD3_SCRIPT, FLUX_SCRIPT = "controlnet/train_controlnet_sd3.py", "controlnet/train_controlnet_flux.py"
WEIGHTS = "diffusion_pytorch_model.safetensors"
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]
# Each family's base pipeline, ControlNet pipeline and ControlNet class, by its tiny fixture.
CLASSES = {"sd3": (StableDiffusion3Pipeline, StableDiffusion3ControlNetPipeline, SD3ControlNetModel),
           "sd35": (StableDiffusion3Pipeline, StableDiffusion3ControlNetPipeline, SD3ControlNetModel),
           "flux": (FluxPipeline, FluxControlNetPipeline, FluxControlNetModel)}


def conditioning(tiny, index):
    return tiny["shapes_controlnet"] / "conditioning" / f"{index:04d}.png"


def validation_flags(tiny, steps, images=(0, 1)):
    return ["--validation_prompt", *PROMPTS, "--validation_image", *[conditioning(tiny, i) for i in images],
            "--num_validation_images", 1, "--validation_inference_steps", 2, "--validation_steps", steps]


STEPS = ["--max_train_steps", 4]


def flux_flags(tiny, output_dir, *extra):
    """4 steps of the tiny FLUX.1 [dev] with a ControlNet made from its first blocks, checkpoints every 2 steps."""
    return controlnet_flags(tiny, "flux", output_dir, *STEPS, "--num_double_layers", 1, "--num_single_layers", 1,
                            "--checkpointing_steps", 2, *extra)


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: (output_dir, result)}`` of the runs here, launched together, each 4 steps validating every 2:

    - sd3: from tiny/sd3_controlnet, two prompts with their conditioning images, checkpoints every 2 steps;
    - sd35: the tiny SD3.5, its ControlNet made from the transformer, EMA decay 0, one image for both prompts,
      --cache_latents (the conditioning images still go through the VAE in every step);
    - flux: the tiny FLUX.1 [dev], its ControlNet made from the transformer's first double- and single-stream
      blocks (upstream's --num_double_layers/--num_single_layers), checkpoints every 2 steps.
    """
    root = tmp_path_factory.mktemp("runs")
    results = launch_together({
        "sd3": (SD3_SCRIPT, *controlnet_flags(tiny, "sd3", root / "sd3", *STEPS, *validation_flags(tiny, 2),
                                              "--controlnet_model_name_or_path", tiny["sd3_controlnet"],
                                              "--checkpointing_steps", 2)),
        "sd35": (SD3_SCRIPT, *controlnet_flags(tiny, "sd35", root / "sd35", *STEPS,
                                               *validation_flags(tiny, 2, images=(5,)), "--ema_decay", 0,
                                               "--cache_latents", "--checkpointing_steps", 1000)),
        "flux": (FLUX_SCRIPT, *flux_flags(tiny, root / "flux", *validation_flags(tiny, 2))),
    })
    return {name: (root / name, result) for name, result in results.items()}


@pytest.mark.parametrize("name, initial", [("sd3", "sd3_controlnet"), ("flux", None)])
def test_writes_raw_and_ema_controlnets_that_load_and_differ(tiny, runs, name, initial):
    output_dir, result = runs[name]
    controlnet_class = CLASSES[name][2]
    raw, ema = (assert_model_folder_loads(controlnet_class, folder, initial=initial and tiny[initial])
                for folder in (output_dir, output_dir / "ema"))
    raw, ema = raw.state_dict(), ema.state_dict()
    # The zero-initialised output blocks, where a new ControlNet starts learning, trained.
    assert any(key.startswith("controlnet_blocks") for key in differing_keys(raw, ema))
    assert torch.any(raw["controlnet_blocks.0.weight"] != 0)
    assert f"raw ControlNet: {output_dir}" in result.stdout
    assert f"ema ControlNet: {output_dir / 'ema'}" in result.stdout


@pytest.mark.parametrize("name", ["sd3", "sd35", "flux"])
def test_validates_at_the_due_steps_with_the_conditioning_beside_the_samples(tiny, runs, name):
    output_dir, _ = runs[name]
    log = assert_validated_at(output_dir, [2, 4], ("raw", "ema"), PROMPTS, num_images=1)
    assert {Image.open(output_dir / record["images"][0]).size for record in log} == {(32, 32)}
    saved = sorted(path.name for path in (output_dir / "validation").glob("conditioning-*.png"))
    assert saved == (["conditioning-p00.png"] if name == "sd35" else ["conditioning-p00.png", "conditioning-p01.png"])
    with Image.open(output_dir / "validation" / saved[0]) as image:
        given = Image.open(conditioning(tiny, 5 if name == "sd35" else 0)).convert("RGB")
        assert np.array_equal(np.asarray(image), np.asarray(given))
    _, pipeline_class, controlnet_class = CLASSES[name]
    card = (output_dir / "README.md").read_text()
    assert f"from diffusers import {controlnet_class.__name__}, {pipeline_class.__name__}\n" in card
    assert f'control_image=load_image("{conditioning(tiny, 5 if name == "sd35" else 0)}")' in card


def render(tiny, name, controlnet):
    base_class, pipeline_class, _ = CLASSES[name]
    pipe = pipeline_class(**base_class.from_pretrained(tiny[name]).components, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    image = Image.open(conditioning(tiny, 0)).convert("RGB")
    torch.manual_seed(0)  # SD3's pipeline samples the conditioning image's latents from the global RNG
    return pipe(PROMPTS[0], control_image=image, num_inference_steps=2, height=32, width=32, output_type="np",
                generator=torch.Generator().manual_seed(0)).images


@pytest.mark.parametrize("name, initial", [("sd3", "sd3_controlnet"), ("flux", "flux_controlnet")])
def test_saved_controlnet_changes_a_fresh_pipelines_output(tiny, runs, name, initial):
    output_dir, _ = runs[name]
    controlnet_class = CLASSES[name][2]
    trained = render(tiny, name, controlnet_class.from_pretrained(output_dir))
    # Against a ControlNet whose outputs are still zero (flux: the same shape, made from the same transformer).
    assert not np.allclose(render(tiny, name, controlnet_class.from_pretrained(tiny[initial])), trained, atol=1e-4)
    # The final step's checkpoint holds the same ControlNets, raw and EMA, each a folder that loads.
    checkpoint = output_dir / "checkpoint-4"
    assert_checkpoint_is_the_output(checkpoint, output_dir, {f"controlnet/{WEIGHTS}": WEIGHTS,
                                                             f"ema/controlnet/{WEIGHTS}": f"ema/{WEIGHTS}"})
    assert np.array_equal(render(tiny, name, controlnet_class.from_pretrained(checkpoint / "controlnet")), trained)


def test_resumes_to_the_uninterrupted_weights_without_validating(tiny, tmp_path, runs):
    # The uninterrupted run validated at steps 2 and 4; the one resumed from its checkpoint-2 does not validate. Both
    # sample the conditioning image's latents in every step, from the restored random state.
    flux_dir, _ = runs["flux"]
    assert_resumes_exactly(FLUX_SCRIPT, lambda output_dir: flux_flags(tiny, output_dir), flux_dir, tmp_path, 2,
                           [WEIGHTS, f"ema/{WEIGHTS}"], launch=launch)
    assert not (tmp_path / "validation").exists()


def test_controlnets_made_from_the_transformer_copy_its_first_blocks(tiny, runs):
    sd35_dir, _ = runs["sd35"]
    transformer = StableDiffusion3Pipeline.from_pretrained(tiny["sd35"]).transformer
    controlnet = SD3ControlNetModel.from_pretrained(sd35_dir)
    # SD3.5's normalised attention and dual-attention block, the first block of the two-block tiny transformer
    # (upstream copies the first 12; the last reads the prompt without passing it on), no extra channels; the pooled
    # projections zeroed as the pipeline zeroes them.
    assert controlnet.config.qk_norm == "rms_norm" and list(controlnet.config.dual_attention_layers) == [0]
    assert controlnet.config.num_layers == 1 and controlnet.config.extra_conditioning_channels == 0
    assert controlnet.config.force_zeros_for_pooled_projection
    block, copied = transformer.transformer_blocks[0].state_dict(), controlnet.transformer_blocks[0].state_dict()
    assert block.keys() == copied.keys() and differing_keys(copied, block)  # the same layers, trained
    assert_same_files(sd35_dir / WEIGHTS, sd35_dir / "ema" / WEIGHTS)  # EMA decay 0: the raw weights

    flux_dir, _ = runs["flux"]
    flux_transformer = FluxPipeline.from_pretrained(tiny["flux"]).transformer
    controlnet = FluxControlNetModel.from_pretrained(flux_dir)
    assert (controlnet.config.num_layers, controlnet.config.num_single_layers) == (1, 1)
    assert controlnet.config.guidance_embeds and controlnet.input_hint_block is None  # [dev]'s guidance; InstantX's
    guidance = controlnet.time_text_embed.guidance_embedder.state_dict()
    assert guidance.keys() == flux_transformer.time_text_embed.guidance_embedder.state_dict().keys()


@pytest.mark.parametrize("script, model, flags, message", [
    (SD3_SCRIPT, "sd3", ["--num_extra_conditioning_channels", 1],
     "--num_extra_conditioning_channels=1: expected 0: StableDiffusion3ControlNetPipeline gives the ControlNet"),
    (SD3_SCRIPT, "sd3", ["--upcast_vae"], "--upcast_vae is not supported here: the VAE runs in"),
    (SD3_SCRIPT, "sd3", ["--controlnet_model_name_or_path", "MODEL"], "expected a SD3ControlNetModel folder"),
    (FLUX_SCRIPT, "flux", ["--controlnet_model_name_or_path", "MODEL"], "expected a FluxControlNetModel folder"),
    (FLUX_SCRIPT, "flux", ["--controlnet_model_name_or_path", "SD3_CONTROLNET"],
     "or a hub id; its config.json names 'SD3ControlNetModel'"),
    (FLUX_SCRIPT, "flux", ["--controlnet_model_name_or_path", "XLABS"],
     "expected an InstantX-style FluxControlNetModel, which reads the conditioning image's latents"),
    (FLUX_SCRIPT, "flux", ["--num_single_layers", -1], "--num_single_layers=-1: expected a count, 0 or more"),
    (FLUX_SCRIPT, "flux", ["--jsonl_for_train", "x.jsonl"], "--jsonl_for_train is not supported here: give the"),
])
def test_bad_flags_are_usage_errors(tiny, tmp_path, script, model, flags, message):
    # XLabs' layout: FLUX.1's ControlNet with a hint block (conditioning_embedding_channels) reading pixels.
    xlabs = tmp_path / "xlabs"
    xlabs.mkdir()
    config = json.loads((tiny["flux_controlnet"] / "config.json").read_text())
    (xlabs / "config.json").write_text(json.dumps({**config, "conditioning_embedding_channels": 16}))
    replacements = {"MODEL": tiny[model], "SD3_CONTROLNET": tiny["sd3_controlnet"], "XLABS": xlabs}
    flags = [str(replacements.get(flag, flag)) for flag in flags]
    with pytest.raises(UsageError) as error:
        import_script(script).parse_args(list(map(str, controlnet_flags(tiny, model, tmp_path / "out", *flags))))
    assert message in str(error.value)


def test_flags_follow_the_upstream_scripts(tiny):
    sd3 = import_script(SD3_SCRIPT).parse_args(["--pretrained_model_name_or_path", str(tiny["sd3"])])
    assert (sd3.resolution, sd3.tracker_project_name, sd3.precondition_outputs) == (512, "train_controlnet", 1)
    assert sd3.weighting_scheme == "logit_normal" and sd3.max_sequence_length == 77
    flux = import_script(FLUX_SCRIPT).parse_args(["--pretrained_model_name_or_path", str(tiny["flux"])])
    assert (flux.num_double_layers, flux.num_single_layers, flux.guidance_scale) == (4, 4, 3.5)
    assert (flux.tracker_project_name, flux.image_interpolation_mode) == ("flux_train_controlnet", "lanczos")
