"""training_utils.families.sana: SANA's prompt settings, latent layout and transformer inputs are the pipeline's own.

The central check: sampling with a transformer that predicts exactly the training target follows the training path
step by step and ends on the clean latents, so the training inputs, target and timestep conditioning are what the
pipeline's sampling loop gives the transformer at each noise level."""

import inspect

import pytest
import torch
from diffusers import SanaPipeline

from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.families import sana
from training_utils.flow_matching import add_noise, velocity

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]
INSTRUCTION = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = SanaPipeline.from_pretrained(tiny["sana"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parse(*argv):
    parser = training_parser("test")
    sana.add_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "unused", *map(str, argv)])
    sana.check_args(args)
    return args


def encoded(pipe, prompts, settings):
    with torch.no_grad():
        rows = list(zip(*sana.encode_prompts(pipe, prompts, "cpu", settings)))
    return sana.text_inputs(rows)


def test_the_fixtures_tokenizer_keeps_the_prompts_words_whole(pipe):
    ids = [pipe.tokenizer(prompt).input_ids for prompt in PROMPTS]
    assert [len(prompt_ids) for prompt_ids in ids] == [1 + len(prompt.split()) for prompt in PROMPTS]  # <bos> first
    assert ids[0][0] == ids[1][0] == pipe.tokenizer.bos_token_id and ids[0] != ids[1][: len(ids[0])]
    # The instruction's words are whole tokens too: its lines cost a token a word, not a letter.
    assert len(pipe.tokenizer.encode("\n".join(INSTRUCTION))) < 200


def test_unset_prompt_settings_are_the_pipelines_call_defaults_and_encode_as_it_does(pipe):
    settings = sana.prompt_settings(pipe, parse())
    assert settings == {"max_sequence_length": 300, "complex_human_instruction": tuple(INSTRUCTION)}
    text = encoded(pipe, PROMPTS, settings)
    with torch.no_grad():
        expected, mask, _, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False,
                                                  complex_human_instruction=INSTRUCTION)
        bare, _, _, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False)
    assert text["encoder_hidden_states"].shape == (2, 300, 16)
    assert torch.equal(text["encoder_hidden_states"], expected) and torch.equal(text["encoder_attention_mask"], mask)
    # The instruction is read: the prompt's tokens attend to it (what is kept is <bos> and what follows it).
    assert not torch.allclose(expected[:, 1:], bare[:, 1:], atol=1e-3)
    assert not torch.allclose(expected[0], expected[1])


@pytest.mark.parametrize("flag, instruction", [("", []), ("Describe the picture:", ["Describe the picture:"])])
def test_set_prompt_settings_reach_the_encoding(pipe, flag, instruction):
    settings = sana.prompt_settings(pipe, parse("--max_sequence_length", 16, "--complex_human_instruction", flag))
    assert settings == {"max_sequence_length": 16, "complex_human_instruction": tuple(instruction)}
    text = encoded(pipe, PROMPTS, settings)
    with torch.no_grad():
        expected, mask, _, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=16,
                                                  complex_human_instruction=instruction)
    assert text["encoder_hidden_states"].shape == (2, 16, 16)
    assert torch.equal(text["encoder_hidden_states"], expected) and torch.equal(text["encoder_attention_mask"], mask)
    assert sana.call_kwargs(pipe, settings) == {"max_sequence_length": 16, "complex_human_instruction": instruction,
                                                "use_resolution_binning": False}


def test_a_bad_prompt_setting_fails_in_one_line():
    with pytest.raises(UsageError) as error:
        parse("--max_sequence_length", 1)
    assert str(error.value) == ("--max_sequence_length=1: expected an integer above 1 (the first token and the last "
                                "ones are kept)")


def test_the_dc_ae_latents_are_a_distribution_of_no_spread(pipe):
    images = torch.rand(2, 3, 32, 64) * 2 - 1
    with torch.no_grad():
        latents = pipe.vae.encode(images).latent
        distribution = sana.image_vae(pipe).encode(images).latent_dist
    assert torch.equal(distribution.mode(), latents)
    torch.testing.assert_close(distribution.sample(), latents, rtol=0, atol=3e-6)


def test_learned_sigmas_are_dropped_from_the_prediction(pipe):
    latents, output = torch.randn(1, 4, 2, 3), torch.randn(1, 8, 2, 3)
    assert torch.equal(sana.prediction(pipe, output, latents), output[:, :4])
    assert sana.prediction(pipe, output[:, :4], latents) is not None


# A square, and a non-square aspect-ratio bucket (32 pixels high, 96 wide): the latents keep their rows and columns.
@pytest.mark.parametrize("height, width", [(64, 64), (32, 96)])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, monkeypatch, height, width):
    settings = sana.prompt_settings(pipe, parse("--max_sequence_length", 24))
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    vae_latents = torch.randn(1, 4, height // scale, width // scale, generator=generator)
    latents = sana.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    calls, decoded = [], []

    def transformer_predicting_the_target(hidden_states, encoder_hidden_states, timestep, encoder_attention_mask,
                                          **options):
        calls.append({"hidden_states": hidden_states, "timestep": timestep,
                      "encoder_hidden_states": encoder_hidden_states, "encoder_attention_mask": encoder_attention_mask})
        return (target.clone(),)

    def vae_decode(latents, return_dict=True):
        decoded.append(latents)
        return (torch.zeros(1, 3, height, width),)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    monkeypatch.setattr(pipe.vae, "decode", vae_decode)
    # SANA's DPM-Solver starts just short of pure noise (at the shifted 0.999): there, on the training path.
    pipe.scheduler.set_timesteps(4)
    start = add_noise(latents, noise, pipe.scheduler.sigmas[0])
    assert 0.999 < pipe.scheduler.sigmas[0] < 1
    pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4, guidance_scale=1.0, latents=start,
         output_type="pt", **sana.call_kwargs(pipe, settings))
    # Straight from the noise to the latents the target points away from, handed to the VAE in its own scale.
    torch.testing.assert_close(decoded[0], vae_latents, rtol=0, atol=1e-5)

    # At each of the sampler's noise levels, the training step's inputs at that level are what the pipeline gives the
    # transformer: the noisy latents, the timestep (sigma times 1000, times the transformer's timestep scale), and
    # the prompt's embedding and mask as the family encodes them.
    text = encoded(pipe, PROMPTS[:1], settings)
    assert len(calls) == 4
    for step, call in enumerate(calls):
        sigma = pipe.scheduler.sigmas[step]
        expected = sana.model_inputs(pipe, add_noise(latents, noise, sigma), (sigma * 1000).reshape(1), text)
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        # The DPM-Solver hands the transformer its timesteps as integers: sigma x 1000 rounded down, as training's
        # (which keeps the fraction) to within one of a thousand steps.
        assert call["timestep"].tolist() == [int(sigma * 1000) * pipe.transformer.config.timestep_scale]
        torch.testing.assert_close(call["timestep"].float(), expected["timestep"], rtol=0, atol=1)
        assert torch.equal(call["encoder_hidden_states"], text["encoder_hidden_states"])
        assert torch.equal(call["encoder_attention_mask"], text["encoder_attention_mask"])
    assert torch.equal(calls[0]["hidden_states"], start)
    # Training draws its levels shifted as the sampler shifts them (its flow_shift), not unshifted.
    training = sana.training_noise_scheduler(pipe)
    assert pipe.scheduler.config.flow_shift == training.config.shift == 3
    assert training.sigmas[500] == pytest.approx(3 * 0.5 / (1 + 2 * 0.5), abs=2e-3)
