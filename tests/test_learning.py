"""Training learns: on the pretrained tiny SD 1.x (`training_utils.testing.tiny.pretrain`), which draws the shape,
colour and background a prompt names ("a red circle on a white background": a red disc on white; "a red square ...": a
red square; `BASE_THRESHOLDS`), a DreamBooth LoRA trained with ``make demo``'s recipe (`star_lora_flags`: 200 steps,
half the pictures on the empty prompt) teaches the demo's orange star, called "sks", a shape its captions never named
in a colour it does not draw for the prompt: its validation images, raw and EMA, must show the star's colour and shape
(`STAR_THRESHOLDS`), and its denoising loss on held-out pictures of the star must fall below a fraction of the base
model's.

``python -m tests.benchmarks.learning`` trains the run over 5 seeds and three deliberately broken variants, and
prints every measure, raw and EMA (two shared cores, measured 2026-12-02; `tests/benchmarks/results/learning_cpu.json`):

| run (seeds 0-4, raw and EMA) | orange fraction | star overlap | held-out loss / base's |
|---|---|---|---|
| threshold | above 0.08 | above 0.45 | below 0.7 |
| correct | 0.131-0.321 | 0.507-0.659 | 0.532-0.588 |
| margin of the worst run | 0.051 | 0.057 | 0.112 |
| target's sign flipped | 0.000-0.605 | 0.00-0.33 | 6.0-6.9 |
| latents not scaled | 0.134-0.252 | 0.27-0.50 | 2.0-2.2 |
| LoRA on no layer: the base's pictures | 0.000 | 0.00 | 1.00 |

Each broken run fails at least the loss ratio; the base's own pictures of the prompt (a purple-blue blob) fail all
three, so the image thresholds, too, require that the LoRA taught something
(`test_pretrained_fixture_does_not_draw_the_star_before_training`); the loss ratio requires it on pictures it did not
train on.

The same test runs for flow matching (`LEARNING_RUNS`' rows, one launch each): on the pretrained tiny SD3
(`training_utils.testing.tiny.pretrain_sd3`), a DreamBooth LoRA of ``train_dreambooth_lora_sd3.py`` with the same
recipe and star; its loss on held-out stars is `flow_matching_held_out_loss` (the velocity, noise minus latents).
``python -m tests.benchmarks.learning --kind flow_matching`` (two shared cores, 2026-12-02;
`tests/benchmarks/results/learning_sd3_cpu.json`):

| run (seeds 0-4, raw and EMA) | orange fraction | star overlap | held-out loss / base's |
|---|---|---|---|
| threshold | above 0.04 | above 0.35 | below 0.9 |
| correct | 0.066-0.218 | 0.405-0.613 | 0.683-0.801 |
| margin of the worst run | 0.026 | 0.055 | 0.099 |
| target's sign flipped | 0.000 | 0.00 | 8.8-10.5 |
| latents not normalized | 0.008-0.163 | 0.17-0.65 | 2.7-2.8 |
| LoRA on no layer: the base's pictures | 0.006-0.014 | 0.24-0.35 | 1.00 |

Here the star overlap does not tell the base's speckled blob from the star; its colour and the loss ratio do.
"""

import os

import numpy as np
import pytest
import torch
from diffusers import StableDiffusion3Pipeline, StableDiffusionPipeline
from PIL import Image

from helpers import launch, launching
from training_utils.testing.learning import (LEARNING_RUNS, base_images, color_fraction, color_mask, drawing_measures,
                                             failed_thresholds, final_images, flow_matching_held_out_loss,
                                             held_out_loss, held_out_stars, shape_overlap)
from training_utils.testing.tiny.data import COLORS, DEMO_STAR, STAR_PROMPT, draw_shape


@pytest.fixture(scope="module", params=list(LEARNING_RUNS))
@launching
def star_run(request, tiny, tmp_path_factory):
    """The learning run of a family kind (`LEARNING_RUNS`): its `LearningRun` and output folder."""
    run = LEARNING_RUNS[request.param]
    output_dir = tmp_path_factory.mktemp("learning") / "out"
    launch(run.script, *run.flags(tiny[run.base], tiny[run.instance], output_dir))
    return run, output_dir


@pytest.mark.parametrize("variant", ["raw", "ema"])
def test_lora_learns_the_star(tiny, star_run, tmp_path, variant):
    run, output_dir = star_run
    lora_dir = output_dir if variant == "raw" else output_dir / "ema"
    measures = run.measures(tiny[run.base], lora_dir, final_images(output_dir, variant),
                            run.held_out(tmp_path / "held_out"), STAR_PROMPT)
    assert not failed_thresholds(measures, run.thresholds), f"{measures} against {run.thresholds}"


@pytest.mark.parametrize("kind", list(LEARNING_RUNS))
@pytest.mark.parametrize("pretrained", [True, False], ids=["pretrained", "random"])
def test_pretrained_fixture_draws_its_prompts_and_the_random_one_does_not(tiny, kind, pretrained):
    """The committed weights still load and draw each of the family's base prompts (SD 1.x: a red circle and a red
    square, each its own shape more than the other; SD3: a red circle); the random fixture's noise fails."""
    run = LEARNING_RUNS[kind]
    failed = {}
    for prompt, images in zip(run.base_prompts, base_images(tiny[run.base if pretrained else run.random_base],
                                                            tuple(run.base_prompts))):
        measures = drawing_measures(images, *run.base_prompts[prompt])
        failed[prompt] = (measures, failed_thresholds(measures, run.base_thresholds))
    assert all(not fails for _, fails in failed.values()) == pretrained, f"{failed} against {run.base_thresholds}"


@pytest.mark.parametrize("kind", list(LEARNING_RUNS))
def test_pretrained_fixture_does_not_draw_the_star_before_training(tiny, kind):
    """The base's own pictures of the star's prompt fail the colour threshold, so that passing it is evidence of what
    the LoRA taught (a base that drew the star's colour for the unknown "sks" would pass it untaught)."""
    run = LEARNING_RUNS[kind]
    shape, color, _ = DEMO_STAR
    measures = drawing_measures(base_images(tiny[run.base], (STAR_PROMPT,))[0], shape, color)
    assert "color_fraction" in failed_thresholds(measures, {name: run.thresholds[name] for name in measures}), measures


def drawn(shape, color="orange", background="white", seed=1):
    return draw_shape(shape, color, background, rng=__import__("random").Random(seed))[0].resize((32, 32),
                                                                                                Image.LANCZOS)


def test_drawing_measures_average_the_colour_and_shape_of_the_images():
    measures = drawing_measures([drawn("star"), drawn("circle")], "star", "orange")
    assert measures == {"color_fraction": pytest.approx(np.mean([color_fraction(drawn(shape), COLORS["orange"])
                                                                 for shape in ("star", "circle")])),
                        "shape_overlap": pytest.approx(np.mean([shape_overlap(drawn(shape), COLORS["orange"], "star")
                                                                for shape in ("star", "circle")]))}
    assert drawing_measures([drawn("star")], "star", "blue") == {"color_fraction": 0, "shape_overlap": 0}


@pytest.mark.parametrize("shape, other", [("circle", "square"), ("square", "circle")])
def test_shape_contrast_is_positive_for_the_shape_drawn_and_negative_for_the_other(shape, other):
    images = [drawn(shape, seed=seed) for seed in range(2)]
    assert drawing_measures(images, shape, "orange", other)["shape_contrast"] > 0.05
    assert drawing_measures(images, other, "orange", shape)["shape_contrast"] < -0.05


def test_color_fraction_counts_the_pixels_near_the_color():
    image = np.zeros((4, 4, 3), dtype="uint8")
    image[:2, :1] = COLORS["orange"]
    image[2, 0] = (200, 140, 40)  # within the tolerance of orange
    assert color_fraction(image, COLORS["orange"]) == 3 / 16
    assert color_fraction(image, COLORS["blue"]) == 0


@pytest.mark.parametrize("shape", ["circle", "square", "triangle", "star"])
def test_shape_overlap_is_highest_for_the_shape_drawn(shape):
    overlaps = {other: shape_overlap(drawn(shape), COLORS["orange"], other)
                for other in ["circle", "square", "triangle", "star"]}
    assert max(overlaps, key=overlaps.get) == shape and overlaps[shape] > 0.75
    assert shape_overlap(drawn(shape), COLORS["blue"], shape) == 0


@pytest.mark.parametrize("pipeline, fixture, loss_of", [
    (StableDiffusionPipeline, "sd_pretrained", held_out_loss),
    (StableDiffusion3Pipeline, "sd3_pretrained", flow_matching_held_out_loss)])
def test_held_out_loss_is_reproducible_and_depends_on_the_prompt(tiny, tmp_path, pipeline, fixture, loss_of):
    pipe = pipeline.from_pretrained(tiny[fixture])
    stars = held_out_stars(tmp_path / "stars", count=4)
    loss = loss_of(pipe, stars, STAR_PROMPT, repeats=2)
    assert loss == loss_of(pipe, stars, STAR_PROMPT, repeats=2)
    assert loss != loss_of(pipe, stars, "a blue square on a black background", repeats=2)


def test_failed_thresholds_names_the_measures_on_the_wrong_side():
    thresholds = {"color_fraction": 0.1, "held_out_loss_ratio": 0.5}
    assert failed_thresholds({"color_fraction": 0.2, "held_out_loss_ratio": 0.4}, thresholds) == []
    assert failed_thresholds({"color_fraction": 0.1, "held_out_loss_ratio": 0.5}, thresholds) == list(thresholds)


def test_demo_star_pictures_are_one_centred_orange_star(tiny):
    pictures = sorted(tiny["instance_star_demo"].glob("*.png"))
    assert len(pictures) == 8
    first = np.asarray(Image.open(pictures[0]))
    assert all(np.array_equal(np.asarray(Image.open(path)), first) for path in pictures)
    image = Image.open(pictures[0]).resize((32, 32), Image.LANCZOS)
    assert shape_overlap(image, COLORS["orange"], "star") > 0.8
    mask = color_mask(first, COLORS["orange"])
    rows, columns = np.nonzero(mask)
    assert abs(rows.mean() - 31.5) < 3 and abs(columns.mean() - 31.5) < 1


def test_shape_pictures_cover_every_combination_in_range():
    from training_utils.testing.tiny.pretrain import shape_pictures

    pictures = shape_pictures(count=54, resolution=16)
    assert pictures.shape == (54, 3, 16, 16) and pictures.min() >= -1 and pictures.max() <= 1
    assert torch.equal(pictures, shape_pictures(count=54, resolution=16))


def test_train_vae_is_deterministic_and_scales_latents_to_unit_variance():
    from training_utils.testing.tiny.parts import tiny_vae
    from training_utils.testing.tiny.pretrain import shape_pictures, train_vae

    pictures = shape_pictures(count=8, resolution=16)
    first, second = tiny_vae(), tiny_vae()
    errors = [train_vae(vae, pictures, steps=2, batch_size=2) for vae in (first, second)]
    assert errors[0] == errors[1]
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    with torch.no_grad():
        latents = first.encode(pictures).latent_dist.mean * first.config.scaling_factor
    assert latents.std().item() == pytest.approx(1.0, rel=1e-4)


def test_pretraining_scripts_run_this_repository_on_the_pretraining_threads(monkeypatch):
    from training_utils.testing.tiny.pretrain import REPOSITORY, THREADS, script_environment

    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    environment = script_environment()
    assert environment["PYTHONPATH"].split(os.pathsep) == [str(REPOSITORY), "elsewhere"]
    assert environment["OMP_NUM_THREADS"] == str(THREADS) == "1"


def test_distinct_token_embeddings_set_unit_variance_and_separate_prompts():
    from training_utils.testing.tiny.parts import sd_components
    from training_utils.testing.tiny.pretrain import distinct_token_embeddings

    components = sd_components()
    encoder, tokenizer = components["text_encoder"], components["tokenizer"]
    ids = tokenizer(["a red circle", "a blue circle"], return_tensors="pt").input_ids

    def word_distance():
        with torch.no_grad():
            states = encoder(ids).last_hidden_state
        return (states[0, 2] - states[1, 2]).norm().item()  # the colour word's output

    before = word_distance()
    distinct_token_embeddings(encoder)
    assert encoder.get_input_embeddings().weight.std().item() == pytest.approx(1.0, abs=0.05)
    assert word_distance() > 3 * before


def test_sd3_base_has_normalized_latents_and_a_full_rank_adapter_on_every_linear_layer():
    from training_utils.testing.tiny.pretrain import shape_pictures
    from training_utils.testing.tiny.pretrain_sd3 import RANK, adapted_layers, sd3_base

    pipe = sd3_base()
    with torch.no_grad():
        latents = pipe.vae.encode(shape_pictures(count=54)).latent_dist.mean
    normalized = (latents - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
    assert abs(normalized.mean().item()) < 0.1 and normalized.std().item() == pytest.approx(1.0, abs=0.1)
    layers = dict(pipe.transformer.named_modules())
    linear = [name for name, module in layers.items() if isinstance(module, torch.nn.Linear)]
    assert set(linear) < set(adapted_layers(pipe.transformer))
    assert all(min(layers[name].weight.shape[:2]) <= RANK for name in adapted_layers(pipe.transformer))
