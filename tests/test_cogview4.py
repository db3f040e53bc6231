"""training_utils.families.cogview4: CogView4's prompt settings, latent layout, noise levels and transformer inputs
are the pipeline's own.

The central check: sampling with a transformer that predicts exactly the training target follows the training
path step by step and ends on the clean latents, so the training inputs, target, timestep and shift are what the
pipeline's sampling loop gives the transformer at each noise level."""

import pytest
import torch
from diffusers import CogView4ControlPipeline, CogView4Pipeline, FlowMatchEulerDiscreteScheduler
from PIL import Image

from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.families import cogview4
from training_utils.flow_matching import add_flow_matching_args, add_noise, velocity
from training_utils.pipeline import training_noise_scheduler

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]
# Seventeen words and [gMASK]<sop>: 19 tokens, padded at the front to 32 (the others to 16).
LONG = "a big red circle on a white background a small blue square on a black background of the shape"


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = CogView4Pipeline.from_pretrained(tiny["cogview4"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parse(*argv):
    parser = training_parser("test")
    cogview4.add_args(parser)
    add_flow_matching_args(parser, weighting_scheme="none")
    return parser.parse_args(["--pretrained_model_name_or_path", "unused", *map(str, argv)])


def encoded(pipe, prompts, settings):
    with torch.no_grad():
        padded, lengths = cogview4.encode_prompts(pipe, prompts, "cpu", settings)
    return cogview4.text_inputs(list(zip(padded, lengths)))


def test_the_fixtures_tokenizer_keeps_the_prompts_words_whole_after_glms_prefix(pipe):
    ids = [pipe.tokenizer(prompt).input_ids for prompt in PROMPTS]
    prefix = pipe.tokenizer.convert_tokens_to_ids(["[gMASK]", "<sop>"])
    assert all(prompt_ids[:2] == prefix for prompt_ids in ids)
    assert [len(prompt_ids) for prompt_ids in ids] == [2 + len(prompt.split()) for prompt in PROMPTS]
    assert ids[0][2:] != ids[1][2: len(ids[0])]
    assert pipe.tokenizer.padding_side == "left"


def test_unset_prompt_settings_are_the_pipelines_defaults_and_encode_as_it_does(pipe):
    settings = cogview4.prompt_settings(pipe, parse())
    assert settings == {"max_sequence_length": 1024}
    inputs = encoded(pipe, PROMPTS, settings)
    with torch.no_grad():
        expected, negative = pipe.encode_prompt(list(PROMPTS))
    # Prompts of one length (16 positions) batch as the pipeline batches them: no mask, the same embeddings.
    assert expected.shape == (2, 16, 16) and inputs["attention_mask"] is None
    assert torch.equal(inputs["encoder_hidden_states"], expected)
    assert not torch.allclose(expected[0, -3:], expected[1, -3:])
    assert negative is not None  # the pipeline's default guidance also embeds the empty prompt; training does not


def test_prompts_of_different_lengths_keep_each_its_own_rendered_embedding(pipe):
    settings = cogview4.prompt_settings(pipe, parse())
    inputs = encoded(pipe, [PROMPTS[0], LONG], settings)
    with torch.no_grad():
        alone = [pipe.encode_prompt(prompt, do_classifier_free_guidance=False)[0][0] for prompt in (PROMPTS[0], LONG)]
    assert [len(embedding) for embedding in alone] == [16, 32]
    embeddings, mask = inputs["encoder_hidden_states"], inputs["attention_mask"]
    assert embeddings.shape == (2, 32, 16)
    assert torch.equal(embeddings[0, 16:], alone[0]) and torch.equal(embeddings[1], alone[1])
    assert not embeddings[0, :16].any()
    assert mask.tolist() == [[0.0] * 16 + [1.0] * 16, [1.0] * 32]


def test_set_prompt_settings_reach_the_encoding(pipe):
    settings = cogview4.prompt_settings(pipe, parse("--max_sequence_length", 6))
    assert settings == {"max_sequence_length": 6}
    inputs = encoded(pipe, [LONG], settings)
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(LONG, max_sequence_length=6, do_classifier_free_guidance=False)
    assert expected.shape == (1, 16, 16) and torch.equal(inputs["encoder_hidden_states"], expected)


def test_bad_settings_fail_in_one_line(tiny):
    with pytest.raises(UsageError) as error:
        cogview4.check_args(parse("--max_sequence_length", 0))
    assert str(error.value) == "--max_sequence_length=0: expected a positive integer"
    cogview4.check_args(parse("--pretrained_model_name_or_path", tiny["cogview4"], "--resolution", 32))
    with pytest.raises(UsageError) as error:
        cogview4.check_args(parse("--pretrained_model_name_or_path", tiny["cogview4"], "--resolution", 24))
    assert str(error.value).startswith("--resolution=24: expected a multiple of 16")


# A square, and a non-square size (32 pixels high, 64 wide): the latents keep their rows and columns, and the shift
# follows the number of patches.
@pytest.mark.parametrize("height, width", [(32, 32), (32, 64)])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, monkeypatch, height, width):
    settings = cogview4.prompt_settings(pipe, parse())
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    vae_latents = torch.randn(1, 16, height // scale, width // scale, generator=generator) * 2  # what the VAE makes
    latents = cogview4.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    assert torch.equal(cogview4.prediction(pipe, target, latents), target)
    calls, decoded = [], []

    def transformer_predicting_the_target(**inputs):
        calls.append(inputs)
        return (target.clone(),)

    def vae_decode(latents, return_dict=True, generator=None):
        decoded.append(latents)
        return (torch.zeros(1, 3, height, width),)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    monkeypatch.setattr(pipe.vae, "decode", vae_decode)
    pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4, guidance_scale=1.0, latents=noise,
         output_type="pt", **settings)
    # Straight from the noise to the latents the target points away from, handed to the VAE in its own scale.
    torch.testing.assert_close(decoded[0], vae_latents, rtol=0, atol=1e-5)

    # At each of the pipeline's steps, the training step that draws the same timestep of the training schedule
    # gives the transformer what the pipeline gives it: the shifted noise level, the unshifted timestep.
    noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
    text = encoded(pipe, PROMPTS[:1], settings)
    args = parse()
    assert len(calls) == 4
    for step, call in enumerate(calls):
        index = int((noise_scheduler.timesteps == call["timestep"][0]).nonzero())
        drawn = noise_scheduler.timesteps[index: index + 1], noise_scheduler.sigmas[index].reshape(1, 1, 1, 1)
        monkeypatch.setattr(cogview4, "sample_flow_matching_timesteps", lambda *_: drawn)
        timesteps, sigmas = cogview4.sample_timesteps(pipe, noise_scheduler, args, latents)
        torch.testing.assert_close(sigmas.flatten(), pipe.scheduler.sigmas[step: step + 1], rtol=0, atol=1e-6)
        expected = cogview4.model_inputs(pipe, add_noise(latents, noise, sigmas), timesteps, text)
        assert expected.keys() == call.keys() - {"attention_kwargs", "return_dict"} | {"attention_mask"}
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        for name in ("timestep", "encoder_hidden_states", "original_size", "target_size", "crop_coords"):
            assert torch.equal(call[name], expected[name]), name
    assert calls[0]["original_size"].tolist() == [[height, width]] and calls[0]["crop_coords"].tolist() == [[0, 0]]
    # The first step starts from pure noise at timestep 1000; the later ones are shifted up for the image's size
    # (mu = 0.25 + 0.75 * sqrt(patches / 256) < 1 here: the tiny images shift towards the image, not the noise).
    assert torch.equal(calls[0]["hidden_states"], noise) and calls[0]["timestep"].tolist() == [1000.0]
    assert calls[1]["timestep"].tolist() == [667.0] and pipe.scheduler.sigmas[1] < 0.667


def test_the_control_pipeline_reads_the_conditioning_latents_after_the_noisy_ones(tiny, monkeypatch):
    """CogView4ControlPipeline gives its transformer the noisy latents, then the conditioning image's VAE latents
    (sampled, from [-1, 1]) as `normalized_latents` lays them out: what the Control script concatenates."""
    pipe = CogView4ControlPipeline.from_pretrained(tiny["cogview4_control"])
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8)
    image = Image.fromarray(levels.numpy())
    pixels = levels.permute(2, 0, 1)[None].float() / 255  # the image in [0, 1], channels first
    noise = torch.randn(1, 16, 4, 4, generator=generator)
    calls = []

    def transformer(**inputs):
        calls.append(inputs)
        return (torch.zeros_like(noise),)

    monkeypatch.setattr(pipe.transformer, "forward", transformer)
    torch.manual_seed(1)
    pipe(prompt=PROMPTS[0], control_image=image, height=32, width=32, num_inference_steps=2, guidance_scale=1.0,
         latents=noise, output_type="latent")
    torch.manual_seed(1)
    with torch.no_grad():
        expected = cogview4.normalized_latents(pipe, pipe.vae.encode(pixels * 2 - 1).latent_dist.sample())
    assert calls[0]["hidden_states"].shape == (1, 32, 4, 4)
    assert torch.equal(calls[0]["hidden_states"][:, :16], noise)
    torch.testing.assert_close(calls[0]["hidden_states"][:, 16:], expected, rtol=0, atol=1e-5)
    assert torch.equal(calls[1]["hidden_states"][:, 16:], calls[0]["hidden_states"][:, 16:])
