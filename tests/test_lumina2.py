"""training_utils.families.lumina2: Lumina 2's prompt settings, latent layout and transformer inputs are the
pipeline's own.

The central check: sampling with a transformer that predicts exactly the training target follows the training path
step by step and ends on the clean latents, so the training inputs, target and timestep conditioning are what the
pipeline's sampling loop gives the transformer at each noise level."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline

from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.families import lumina2
from training_utils.flow_matching import add_noise, velocity
from training_utils.pipeline import training_noise_scheduler

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = Lumina2Pipeline.from_pretrained(tiny["lumina2"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parse(*argv):
    parser = training_parser("test")
    lumina2.add_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "unused", *map(str, argv)])
    lumina2.check_args(args)
    return args


def encoded(pipe, prompts, settings):
    with torch.no_grad():
        rows = list(zip(*lumina2.encode_prompts(pipe, prompts, "cpu", settings)))
    return lumina2.text_inputs(rows)


def test_the_fixtures_tokenizer_keeps_the_prompts_and_the_system_prompts_words_whole(pipe):
    ids = [pipe.tokenizer(prompt).input_ids for prompt in PROMPTS]
    assert [len(prompt_ids) for prompt_ids in ids] == [1 + len(prompt.split()) for prompt in PROMPTS]  # <bos> first
    assert ids[0] != ids[1][: len(ids[0])]
    assert len(pipe.tokenizer(pipe.system_prompt).input_ids) == 1 + len(pipe.system_prompt.split())


def test_unset_prompt_settings_are_the_pipelines_and_encode_as_it_does(pipe):
    settings = lumina2.prompt_settings(pipe, parse())
    assert settings == {"max_sequence_length": 256, "system_prompt": pipe.system_prompt}
    text = encoded(pipe, PROMPTS, settings)
    with torch.no_grad():
        expected, mask, _, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False)
        bare, _, _, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, system_prompt="")
    assert text["encoder_hidden_states"].shape == (2, 256, 16)
    assert torch.equal(text["encoder_hidden_states"], expected) and torch.equal(text["encoder_attention_mask"], mask)
    # The system prompt is read: its 23 words and "<Prompt Start>" come first, each a token.
    assert mask.sum(1).tolist() == [1 + 23 + 2 + len(prompt.split()) for prompt in PROMPTS]
    assert not torch.allclose(expected, bare)


def test_set_prompt_settings_reach_the_encoding(pipe):
    settings = lumina2.prompt_settings(pipe, parse("--max_sequence_length", 16, "--system_prompt", "Draw:"))
    assert settings == {"max_sequence_length": 16, "system_prompt": "Draw:"}
    assert lumina2.call_kwargs(pipe, settings) == settings
    text = encoded(pipe, PROMPTS, settings)
    with torch.no_grad():
        expected, mask, _, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=16,
                                                  system_prompt="Draw:")
    assert text["encoder_hidden_states"].shape == (2, 16, 16)
    assert torch.equal(text["encoder_hidden_states"], expected) and torch.equal(text["encoder_attention_mask"], mask)


def test_a_bad_prompt_setting_fails_in_one_line():
    with pytest.raises(UsageError) as error:
        parse("--max_sequence_length", 513)
    assert str(error.value) == ("--max_sequence_length=513: expected a positive integer of at most 512 "
                                "(Lumina2Pipeline's limit)")


# A square, and a non-square aspect-ratio bucket (16 pixels high, 48 wide): the latents keep their rows and columns.
@pytest.mark.parametrize("height, width", [(32, 32), (16, 48)])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, monkeypatch, height, width):
    settings = lumina2.prompt_settings(pipe, parse("--max_sequence_length", 40))
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    vae_latents = torch.randn(1, 16, height // scale, width // scale, generator=generator)
    latents = lumina2.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    # The transformer's output that the training step reads back as exactly the target.
    assert torch.equal(lumina2.prediction(pipe, -target, latents), target)
    calls, decoded = [], []

    def transformer_predicting_the_target(hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                                          **options):
        calls.append({"hidden_states": hidden_states, "timestep": timestep,
                      "encoder_hidden_states": encoder_hidden_states, "encoder_attention_mask": encoder_attention_mask})
        return (-target.clone(),)

    def vae_decode(latents, return_dict=True):
        decoded.append(latents)
        return (torch.zeros(1, 3, height, width),)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    monkeypatch.setattr(pipe.vae, "decode", vae_decode)
    pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4, guidance_scale=1.0, latents=noise,
         output_type="pt", **lumina2.call_kwargs(pipe, settings))
    # Straight from the noise to the latents the target points away from, handed to the VAE in its own scale.
    torch.testing.assert_close(decoded[0], vae_latents, rtol=0, atol=1e-5)

    # At each of the pipeline's noise levels, the training step's inputs at the same level of the training schedule
    # (the same shift) are what the pipeline gives the transformer.
    noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
    text = encoded(pipe, PROMPTS[:1], settings)
    assert len(calls) == 4
    for step, call in enumerate(calls):
        index = (noise_scheduler.sigmas - pipe.scheduler.sigmas[step]).abs().argmin()
        sigma, timestep = noise_scheduler.sigmas[index], noise_scheduler.timesteps[index : index + 1]
        torch.testing.assert_close(sigma, pipe.scheduler.sigmas[step], rtol=0, atol=1e-6)
        expected = lumina2.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, text)
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        torch.testing.assert_close(call["timestep"], expected["timestep"], rtol=0, atol=1e-6)
        assert torch.equal(call["encoder_hidden_states"], text["encoder_hidden_states"])
        assert torch.equal(call["encoder_attention_mask"], text["encoder_attention_mask"])
    # The first step starts from pure noise at time 0; the schedule is shifted (statically) by the config's shift.
    assert torch.equal(calls[0]["hidden_states"], noise) and calls[0]["timestep"].tolist() == [0.0]
    assert pipe.scheduler.config.shift == 6 and not pipe.scheduler.config.use_dynamic_shifting
    assert pipe.scheduler.sigmas[1] > 0.75  # unshifted, the second of 4 steps would be at 0.75
