"""training_utils.families.ideogram4: Ideogram 4's prompt encoding (the chat template, Qwen3-VL's tapped layers
concatenated, the padding zeroed), its packed text-and-image sequence with the pipeline's ids, its latent layout and
its noise levels are Ideogram4Pipeline's own.

The central check: sampling with transformers that predict exactly the training target follows the training path
step by step and ends on the clean latents, and the training step's inputs are what the pipeline's sampling loop
gives the conditional transformer at each noise level, the text's positions and the ids included."""

import argparse
import functools

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline
from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas, _resolution_aware_mu

from helpers import family_args
from training_utils.errors import UsageError
from training_utils.families import ideogram4
from training_utils.flow_matching import add_flow_matching_args, add_noise, velocity
from training_utils.pipeline import training_noise_scheduler

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = Ideogram4Pipeline.from_pretrained(tiny["ideogram4"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def parse(tiny):
    return functools.partial(family_args, ideogram4, tiny["ideogram4"])


def rows_of(pipe, prompts, settings):
    with torch.no_grad():
        return list(zip(*ideogram4.encode_prompts(pipe, prompts, "cpu", settings)))


def test_prompts_encode_as_the_pipeline_does_for_any_image_grid(pipe, parse):
    assert ideogram4.prompt_settings(pipe, parse()) == {"max_sequence_length": 2048}
    settings = ideogram4.prompt_settings(pipe, parse("--max_sequence_length", 24))
    rows = rows_of(pipe, PROMPTS, settings)
    lengths = [int(row[1]) for row in rows]
    # Each prompt's features are kept at the longest prompt's length, not the sequence's; prompts differ.
    assert lengths[0] != lengths[1] and all(len(row[0]) == max(lengths) for row in rows)
    text = ideogram4.text_inputs(rows)
    # The same features and ids as the pipeline's own encoding gives for each latent grid, the image's included.
    for grid_h, grid_w in [(4, 4), (3, 5)]:
        latents = torch.zeros(2, 16, grid_h, grid_w)
        inputs = ideogram4.model_inputs(pipe, latents, torch.tensor([500.0, 500.0]), text)
        with torch.no_grad():
            expected = pipe.encode_prompt(PROMPTS, grid_h, grid_w, 24, "cpu")
        for name, tensor in zip(("encoder_hidden_states", "position_ids", "segment_ids", "indicator"), expected):
            assert torch.equal(inputs[name], tensor), name
    assert not torch.equal(text["encoder_hidden_states"][0], text["encoder_hidden_states"][1])
    # 13 tapped layers of the 16-wide text encoder.
    assert text["encoder_hidden_states"].shape == (2, 24, 13 * 16)


@pytest.mark.parametrize("flags, message", [
    (["--max_sequence_length", 0], "--max_sequence_length=0: expected a positive integer"),
    (["--resolution", 34], "--resolution=34: expected a multiple of 4: the VAE divides the size by 2, and the latents "
                           "are packed in 2×2 patches"),
])
def test_bad_settings_fail_in_one_line(parse, flags, message):
    with pytest.raises(UsageError) as error:
        parse(*flags)
    assert str(error.value) == message


def test_a_prompt_longer_than_the_text_positions_fails_in_one_line(pipe, parse):
    with pytest.raises(UsageError, match=r"--max_sequence_length=8: expected enough text positions \(prompt has 1\d "
                                         r"tokens, exceeds max_sequence_length=8\)"):
        rows_of(pipe, PROMPTS, ideogram4.prompt_settings(pipe, parse("--max_sequence_length", 8)))


# A square, and a non-square aspect-ratio bucket (24 pixels high, 40 wide).
@pytest.mark.parametrize("height, width", [(32, 32), (24, 40)])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, parse, monkeypatch, height, width):
    settings = ideogram4.prompt_settings(pipe, parse("--max_sequence_length", 24))
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    vae_latents = torch.randn(1, 4, height // scale, width // scale, generator=generator)
    latents = ideogram4.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)

    def packed(tensor):  # the pipeline's latents: a token per 2×2 patch
        return tensor.flatten(2).transpose(1, 2)

    # The transformers predict latents - noise; the conditional one over the text's 24 positions too.
    output = torch.cat([torch.full((1, 24, 16), 7.0), -packed(target)], dim=1)
    assert torch.equal(ideogram4.prediction(pipe, output, latents), target)
    calls = []

    def transformer_predicting_the_target(**inputs):
        calls.append(inputs)
        return (output,)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    monkeypatch.setattr(pipe.unconditional_transformer, "forward", lambda **inputs: (-packed(target),))
    # The pipeline's logit-normal schedule for this size starts just short of pure noise (its log-SNR clamp).
    schedule = _logit_normal_sigmas(4, _resolution_aware_mu(height, width, 0.0), std=1.5)
    start = packed(add_noise(latents, noise, schedule[0]))
    render = {**ideogram4.call_kwargs(pipe, settings), "guidance_scale": 1.0}
    sampled = pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4, latents=start,
                   output_type="latent", **render).images
    torch.testing.assert_close(sampled, packed(latents), rtol=0, atol=1e-5)

    text = ideogram4.text_inputs(rows_of(pipe, PROMPTS[:1], settings))
    assert len(calls) == 4
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step : step + 1]
        trained = ideogram4.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, text)
        assert trained.keys() == call.keys() - {"attention_kwargs", "return_dict"}
        torch.testing.assert_close(trained["hidden_states"], call["hidden_states"], rtol=0, atol=1e-5)
        for name in ("timestep", "encoder_hidden_states", "position_ids", "segment_ids", "indicator"):
            assert torch.equal(trained[name], call[name]), name
    # The text's positions carry no latents; the model's time runs from the noise (0) to the image (1), on the
    # pipeline's logit-normal schedule for this size.
    assert not calls[0]["hidden_states"][:, :24].any()
    assert torch.equal(pipe.scheduler.sigmas[:4], schedule) and 0.999 < schedule[0] < 1
    assert 0 < calls[0]["timestep"].item() < calls[-1]["timestep"].item() < 1

    # The pipeline's decoding undoes the patches and the standardisation: the VAE decodes the VAE latents.
    decoded = []
    monkeypatch.setattr(pipe.vae, "decode", lambda z, return_dict: decoded.append(z) or (torch.zeros(1, 3, 8, 8),))
    pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4, latents=start, output_type="pt",
         **render)
    torch.testing.assert_close(decoded[0], vae_latents, rtol=0, atol=1e-5)


def test_training_noise_levels_follow_the_pipelines_sampling_schedule_for_the_image_size(pipe):
    """Drawn as upstream draws them, sigma from the logit-normal itself: its quantiles are the pipeline's sampling
    sigmas, whose mean the image's size shifts (towards the noise for larger images)."""
    parser = argparse.ArgumentParser()
    add_flow_matching_args(parser, weighting_scheme="logit_normal", logit_std=1.5)  # the script's defaults
    args = parser.parse_args([])
    noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
    for grid in (32, 128):  # 128² and 512² pixels: the tiny VAE halves the size, and the patches are 2×2
        mu = _resolution_aware_mu(grid * 4, grid * 4, 0.0)
        torch.manual_seed(0)
        timesteps, sigmas = ideogram4.sample_timesteps(pipe, noise_scheduler, args,
                                                       torch.zeros(1).expand(20000, 16, grid, grid))
        assert sigmas.shape == (20000, 1, 1, 1) and torch.equal(timesteps, sigmas.flatten() * 1000)
        # Sampling's steps sit at the quantiles 1 - k/10 of the training density (the first, 1, clamped).
        schedule = _logit_normal_sigmas(10, mu, std=1.5)
        below = torch.stack([(sigmas <= sigma).float().mean() for sigma in schedule[1:]])
        torch.testing.assert_close(below, torch.arange(9, 0, -1) / 10, rtol=0, atol=0.015)
        assert abs(sigmas.median().item() - torch.sigmoid(torch.tensor(mu)).item()) < 0.01
