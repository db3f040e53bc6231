"""training_utils.families.flux2_dev: FLUX.2 [dev]'s prompt encoding (Mistral 3, the pipeline's system message and
chat template, its hidden layers), guidance, latent layout and transformer inputs are Flux2Pipeline's own.

The central check: sampling with a transformer that predicts exactly the training target follows the training
path step by step and ends on the clean latents, and the training step's inputs, the guidance included, are what
the pipeline's sampling loop gives the transformer at each noise level."""

import functools

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline
from PIL import Image

from helpers import family_args
from training_utils.errors import UsageError
from training_utils.families import flux2_dev
from training_utils.flow_matching import add_noise, velocity
from training_utils.pipeline import from_pretrained

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = from_pretrained(Flux2Pipeline, tiny["flux2_dev"])  # its tokenizer, a PixtralProcessor as released
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def parse(tiny):
    return functools.partial(family_args, flux2_dev, tiny["flux2_dev"])


def test_prompts_encode_as_the_pipeline_does_after_its_system_message(pipe, parse):
    assert flux2_dev.prompt_settings(pipe, parse()) == {
        "max_sequence_length": 512, "text_encoder_out_layers": (10, 20, 30), "guidance_scale": 3.5}
    settings = flux2_dev.prompt_settings(pipe, parse("--max_sequence_length", 48, "--guidance_scale", 4))
    with torch.no_grad():
        embeddings, text_ids, guidance = flux2_dev.encode_prompts(pipe, PROMPTS, "cpu", settings)
        expected, expected_ids = pipe.encode_prompt(PROMPTS, max_sequence_length=48)
    assert torch.equal(embeddings, expected) and torch.equal(text_ids, expected_ids)
    assert embeddings.shape == (2, 48, pipe.transformer.config.joint_attention_dim)
    assert not torch.allclose(embeddings[0], embeddings[1]) and guidance.tolist() == [4.0, 4.0]
    # The conversation the text encoder reads: the system message, then the prompt, in Mistral's control tokens.
    text = pipe.tokenizer.apply_chat_template([[{"role": "system", "content": pipe.system_message},
                                                {"role": "user", "content": PROMPTS[0]}]], tokenize=False)[0]
    assert text == f"<s>[SYSTEM_PROMPT]{pipe.system_message}[/SYSTEM_PROMPT][INST]{PROMPTS[0]}[/INST]"


def test_set_layers_reach_the_encoding(pipe, parse):
    settings = flux2_dev.prompt_settings(pipe, parse("--max_sequence_length", 48, "--text_encoder_out_layers", 1, 2,
                                                     -1))
    with torch.no_grad():
        embeddings, _, _ = flux2_dev.encode_prompts(pipe, PROMPTS, "cpu", settings)
        default_layers, _ = pipe.encode_prompt(PROMPTS, max_sequence_length=48)
    assert embeddings.shape == default_layers.shape and not torch.allclose(embeddings, default_layers)


@pytest.mark.parametrize("flags, message", [
    (["--guidance_scale", 0], "--guidance_scale=0.0: expected a positive number"),
    (["--text_encoder_out_layers", 10, 20, 31],
     "--text_encoder_out_layers=[10, 20, 31]: expected indices of the text encoder's hidden states, from -31 to 30 "
     "(it has 30 layers)"),
])
def test_bad_settings_fail_in_one_line_from_the_configurations(parse, flags, message):
    with pytest.raises(UsageError) as error:
        parse(*flags)
    assert str(error.value) == message


# A square, and a non-square aspect-ratio bucket (24 pixels high, 40 wide).
@pytest.mark.parametrize("height, width", [(32, 32), (24, 40)])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, parse, monkeypatch, height, width):
    settings = flux2_dev.prompt_settings(pipe, parse("--max_sequence_length", 48, "--guidance_scale", 2.5))
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    vae_latents = torch.randn(1, 4, height // scale, width // scale, generator=generator)
    latents = flux2_dev.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    target_tokens = pipe._pack_latents(target)
    assert torch.equal(flux2_dev.prediction(pipe, target_tokens, latents), target)
    calls = []

    def transformer_predicting_the_target(**inputs):
        calls.append(inputs)
        return (target_tokens,)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    sampled = pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4, latents=noise,
                   output_type="latent", **flux2_dev.call_kwargs(pipe, settings)).images
    # Straight from the noise to the latents the target points away from (as tokens: the pipeline's latent output).
    torch.testing.assert_close(sampled, pipe._pack_latents(latents), rtol=0, atol=1e-5)

    with torch.no_grad():
        text = flux2_dev.text_inputs(list(zip(*flux2_dev.encode_prompts(pipe, PROMPTS[:1], "cpu", settings))))
    assert len(calls) == 4
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step : step + 1]
        expected = flux2_dev.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, text)
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        assert torch.equal(call["timestep"], expected["timestep"]) and torch.equal(call["img_ids"], expected["img_ids"])
        for name, value in text.items():
            assert torch.equal(call[name], value), name
    assert calls[0]["guidance"].tolist() == [2.5]
    assert torch.equal(calls[0]["hidden_states"], pipe._pack_latents(noise))
    assert pipe.scheduler.sigmas[0] == 1 and pipe.scheduler.config.use_dynamic_shifting


def test_sampling_with_references_feeds_the_transformer_the_training_inputs(pipe, parse, monkeypatch):
    # [klein]'s layout of references (its own test checks it against its pipeline) is Flux2Pipeline's too: two
    # references' clean tokens follow the target's, with their ids, beside the prompt and the guidance.
    settings = flux2_dev.prompt_settings(pipe, parse("--max_sequence_length", 48, "--guidance_scale", 2.5))
    generator = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(1)
    references = [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
                  for width, height in ((64, 64), (80, 64))]
    scale = pipe.vae_scale_factor
    latents = flux2_dev.normalized_latents(pipe, torch.randn(1, 4, 32 // scale, 32 // scale, generator=generator))
    noise = torch.randn(latents.shape, generator=generator)
    target_tokens = pipe._pack_latents(velocity(latents, noise))
    lay_out, _ = flux2_dev.reference_layout(pipe)
    with torch.no_grad():
        reference_latents = flux2_dev.reference_latents(pipe, [
            pipe.vae.encode(lay_out(image)[None]).latent_dist.parameters for image in references])
    calls = []

    def transformer_predicting_the_target(hidden_states, **inputs):
        calls.append({"hidden_states": hidden_states, **inputs})
        return (torch.cat([target_tokens, torch.ones(1, hidden_states.shape[1] - target_tokens.shape[1],
                                                     target_tokens.shape[2])], dim=1),)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    sampled = pipe(prompt=PROMPTS[0], image=references, height=32, width=32, num_inference_steps=3, latents=noise,
                   output_type="latent", **flux2_dev.call_kwargs(pipe, settings)).images
    torch.testing.assert_close(sampled, pipe._pack_latents(latents), rtol=0, atol=1e-5)
    assert len(calls) == 3
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step : step + 1]
        expected = flux2_dev.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, {}, reference_latents)
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        assert torch.equal(call["img_ids"], expected["img_ids"]) and call["guidance"].tolist() == [2.5]
    assert sorted(set(calls[0]["img_ids"][0, :, 0].tolist())) == [0, 10, 20]
    output = torch.cat([target_tokens, torch.ones(1, len(calls[0]["img_ids"][0]) - target_tokens.shape[1],
                                                  target_tokens.shape[2])], dim=1)
    assert torch.equal(flux2_dev.prediction(pipe, output, latents), velocity(latents, noise))
