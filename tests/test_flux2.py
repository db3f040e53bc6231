"""training_utils.families.flux2: FLUX.2 [klein]'s prompt settings, latent layout and transformer inputs are the
pipeline's own.

The central check: sampling with a transformer that predicts exactly the training target follows the training
path step by step and ends on the clean latents, so the training inputs, target and timestep conditioning are
what the pipeline's sampling loop gives the transformer at each noise level."""

import functools

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline
from PIL import Image

from helpers import family_args
from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.families import flux2
from training_utils.flow_matching import add_noise, velocity

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = Flux2KleinPipeline.from_pretrained(tiny["flux2_klein"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def parse(tiny):
    return functools.partial(family_args, flux2, tiny["flux2_klein"])


def test_unset_prompt_settings_are_the_pipelines_defaults_and_encode_as_it_does(pipe, parse):
    settings = flux2.prompt_settings(pipe, parse())
    assert settings == {"max_sequence_length": 512, "text_encoder_out_layers": (9, 18, 27)}
    with torch.no_grad():
        embeddings, text_ids = pipe.encode_prompt(PROMPTS, device="cpu", **settings)
        expected_embeddings, expected_text_ids = pipe.encode_prompt(PROMPTS)
    assert embeddings.shape == (2, 512, pipe.transformer.config.joint_attention_dim)
    assert torch.equal(embeddings, expected_embeddings) and torch.equal(text_ids, expected_text_ids)
    assert not torch.allclose(embeddings[0], embeddings[1])


def test_set_prompt_settings_reach_the_encoding(pipe, parse):
    settings = flux2.prompt_settings(pipe, parse("--max_sequence_length", 16, "--text_encoder_out_layers", 1, 2, -1))
    assert settings == {"max_sequence_length": 16, "text_encoder_out_layers": (1, 2, -1)}
    with torch.no_grad():
        embeddings, text_ids = pipe.encode_prompt(PROMPTS, device="cpu", **settings)
        default_layers, _ = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=16)
    assert embeddings.shape == default_layers.shape == (2, 16, 48) and text_ids.shape == (2, 16, 4)
    assert not torch.allclose(embeddings, default_layers)


@pytest.mark.parametrize("flags, message", [
    (["--max_sequence_length", 0], "--max_sequence_length=0: expected a positive integer"),
    (["--text_encoder_out_layers", 9, 18, 29],
     "--text_encoder_out_layers=[9, 18, 29]: expected indices of the text encoder's hidden states, from -29 to 28 "
     "(it has 28 layers)"),
    (["--text_encoder_out_layers", 9, 18],
     "--text_encoder_out_layers=[9, 18]: expected 3 indices: the transformer reads 48 text features, 16 from each "
     "layer"),
])
def test_bad_prompt_settings_fail_in_one_line_from_the_configurations(parse, flags, message):
    with pytest.raises(UsageError) as error:
        parse(*flags)
    assert str(error.value) == message


def test_a_folder_without_the_configurations_fails_in_one_line(tiny):
    parser = training_parser("test")
    flux2.add_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", str(tiny["sd"]), "--text_encoder_out_layers", "1"])
    with pytest.raises(UsageError) as error:
        flux2.check_args(args)
    assert str(error.value) == (f"--pretrained_model_name_or_path={str(tiny['sd'])!r}: expected a FLUX.2 pipeline "
                                "whose text_encoder and transformer configurations load")


# A square, and a non-square aspect-ratio bucket (24 pixels high, 40 wide): the tokens' position ids, which place
# them for the rotary embedding, are the pipeline's for that height and width.
@pytest.mark.parametrize("height, width", [(32, 32), (24, 40)])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, parse, monkeypatch, height, width):
    settings = flux2.prompt_settings(pipe, parse("--max_sequence_length", 16))
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    # What the VAE makes of a height x width image.
    vae_latents = torch.randn(1, 4, height // scale, width // scale, generator=generator)
    latents = flux2.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    # The transformer's output tokens that the training step reads back as exactly the target.
    target_tokens = pipe._pack_latents(target)
    assert torch.equal(flux2.prediction(pipe, target_tokens, latents), target)
    calls = []

    def transformer_predicting_the_target(**inputs):
        calls.append(inputs)
        return (target_tokens,)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    sampled = pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4, guidance_scale=1.0,
                   latents=noise, output_type="latent", **settings).images
    # Straight from the noise to the latents the target points away from, in the VAE's own layout and scale.
    torch.testing.assert_close(sampled, vae_latents, rtol=0, atol=1e-5)

    with torch.no_grad():
        prompt_embeds, text_ids = pipe.encode_prompt(PROMPTS[0], device="cpu", **settings)
    assert len(calls) == 4
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step : step + 1]
        expected = flux2.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, {})
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        assert torch.equal(call["timestep"], expected["timestep"]) and torch.equal(call["img_ids"], expected["img_ids"])
        assert torch.equal(call["encoder_hidden_states"], prompt_embeds) and torch.equal(call["txt_ids"], text_ids)
        assert call["guidance"] is None
    # Each token's (time, row, column, layer) ids: the image's rows and columns of 2×2 patches, row by row.
    rows, columns = height // scale // 2, width // scale // 2
    assert calls[0]["img_ids"][0, :, 1:3].tolist() == [[row, column] for row in range(rows)
                                                       for column in range(columns)]
    # The first step starts from pure noise; the steps' noise levels are shifted for the image size by the pipeline.
    assert torch.equal(calls[0]["hidden_states"], pipe._pack_latents(noise))
    assert pipe.scheduler.sigmas[0] == 1 and pipe.scheduler.config.use_dynamic_shifting


class Captured(Exception):
    """Stops a pipeline call once it has shown what the test needs."""


@pytest.mark.parametrize("size", [(102, 70), (1100, 1000)])
def test_references_are_laid_out_as_the_pipeline_lays_them_out(pipe, monkeypatch, size):
    # One to cut down to multiples of the patch size, one above 1024² pixels (scaled down first).
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    captured = []

    def capture(images, **kwargs):
        captured.extend(images)
        raise Captured

    monkeypatch.setattr(pipe, "prepare_image_latents", capture)
    with pytest.raises(Captured):
        pipe(prompt=PROMPTS[0], image=[image], height=32, width=32, num_inference_steps=1, max_sequence_length=16)
    laid_out = flux2.reference_pixels(pipe, image)
    assert torch.equal(laid_out[None], captured[0])
    patch = pipe.vae_scale_factor * 2
    assert laid_out.shape[-2] % patch == 0 and laid_out.shape[-1] % patch == 0 and laid_out.shape[-1] < size[0]
    assert laid_out.shape[-2] * laid_out.shape[-1] <= flux2.REFERENCE_AREA


def test_a_reference_the_pipeline_refuses_is_refused():
    flux2.check_reference_size(64, 64)
    for size in ((63, 64), (600, 64)):
        with pytest.raises(ValueError):
            flux2.check_reference_size(*size)


def test_sampling_with_references_feeds_the_transformer_the_training_inputs(pipe, parse, monkeypatch):
    # Two references of other sizes than the 32x32 target: their tokens follow the target's, told apart by the
    # time coordinate of their ids; the transformer's output for them is dropped.
    settings = flux2.prompt_settings(pipe, parse("--max_sequence_length", 16))
    generator = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(1)
    references = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
                  for width, height in ((96, 64), (64, 80))]
    scale = pipe.vae_scale_factor
    vae_latents = torch.randn(1, 4, 32 // scale, 32 // scale, generator=generator)
    latents = flux2.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target_tokens = pipe._pack_latents(velocity(latents, noise))
    with torch.no_grad():
        parameters = [pipe.vae.encode(flux2.reference_pixels(pipe, image)[None]).latent_dist.parameters
                      for image in references]
    reference_latents = flux2.reference_latents(pipe, parameters)
    calls = []

    def transformer_predicting_the_target(hidden_states, **inputs):
        calls.append({"hidden_states": hidden_states, **inputs})
        # Something else for the references' tokens: the pipeline drops them, as `prediction` does.
        return (torch.cat([target_tokens, torch.ones(1, hidden_states.shape[1] - target_tokens.shape[1],
                                                     target_tokens.shape[2])], dim=1),)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    sampled = pipe(prompt=PROMPTS[0], image=references, height=32, width=32, num_inference_steps=3, guidance_scale=1.0,
                   latents=noise, output_type="latent", **settings).images
    torch.testing.assert_close(sampled, vae_latents, rtol=0, atol=1e-5)
    assert len(calls) == 3
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step : step + 1]
        expected = flux2.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, {}, reference_latents)
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        assert torch.equal(call["timestep"], expected["timestep"]) and torch.equal(call["img_ids"], expected["img_ids"])
    # The target's tokens, then each reference's (a token a patch of 2x2 latent cells), at times 0, 10 and 20.
    counts = [(32 // scale // 2) ** 2, (64 // scale // 2) * (96 // scale // 2), (80 // scale // 2) * (64 // scale // 2)]
    assert calls[0]["img_ids"][0, :, 0].tolist() == [0] * counts[0] + [10] * counts[1] + [20] * counts[2]
    output = torch.cat([target_tokens, torch.ones(1, sum(counts[1:]), target_tokens.shape[2])], dim=1)
    assert torch.equal(flux2.prediction(pipe, output, latents), velocity(latents, noise))
