"""training_utils.families.hidream: HiDream-I1's prompt settings, latent layout and transformer inputs are the
pipeline's own.

The central check: sampling with a transformer that predicts exactly the training target follows the training path
step by step and ends on the clean latents, so the training inputs, target and timestep conditioning are what the
pipeline's sampling loop gives the transformer at each noise level; and the transformer's training-mode output, read
by `prediction`, is what the pipeline reads from it in eval mode."""

from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline

from helpers import family_args
from training_utils.errors import UsageError
from training_utils.families import hidream
from training_utils.flow_matching import add_noise, velocity

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = HiDreamImagePipeline.from_pretrained(tiny["hidream"])
    pipe.set_progress_bar_config(disable=True)
    hidream.render_at_resolution(pipe, 32)
    return pipe


def parse(*argv):
    return family_args(hidream, "unused", *argv)


def encoded(pipe, prompts, settings):
    with torch.no_grad():
        rows = list(zip(*hidream.encode_prompts(pipe, prompts, "cpu", settings)))
    return hidream.text_inputs(rows)


def test_the_fixtures_tokenizers_keep_the_prompts_words_whole(pipe):
    for tokenizer in (pipe.tokenizer, pipe.tokenizer_3, pipe.tokenizer_4):
        ids = [tokenizer(prompt).input_ids for prompt in PROMPTS]
        assert ids[0] != ids[1][: len(ids[0])]
    # Llama 3's: <|begin_of_text|> first, a token per word; padded with its end-of-turn token, as the pipeline sets.
    assert [len(pipe.tokenizer_4(prompt).input_ids) for prompt in PROMPTS] == [1 + len(p.split()) for p in PROMPTS]
    assert pipe.tokenizer_4.pad_token == "<|eot_id|>"


def test_unset_prompt_settings_are_the_pipelines_and_encode_as_it_does(pipe):
    settings = hidream.prompt_settings(pipe, parse())
    assert settings == {"max_sequence_length": 128} and hidream.call_kwargs(pipe, settings) == settings
    text = encoded(pipe, PROMPTS, settings)
    with torch.no_grad():
        t5, _, llama, _, pooled, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False)
    # Every Llama layer, layer-first as the pipeline passes them (the transformer reads its llama_layers of them).
    assert llama.shape == (2, 2, 128, 16) and t5.shape == (2, 128, 64) and pooled.shape == (2, 64)
    assert torch.equal(text["encoder_hidden_states_llama3"], llama)
    assert torch.equal(text["encoder_hidden_states_t5"], t5) and torch.equal(text["pooled_embeds"], pooled)


def test_set_prompt_settings_reach_the_encoding_and_the_empty_prompt_is_the_pipelines(pipe):
    settings = hidream.prompt_settings(pipe, parse("--max_sequence_length", 16))
    assert settings == {"max_sequence_length": 16}
    text = encoded(pipe, [PROMPTS[0], ""], settings)
    with torch.no_grad():
        t5, negative_t5, llama, negative_llama, pooled, negative_pooled = pipe.encode_prompt(
            PROMPTS[0], max_sequence_length=16)  # with the unprompted (negative) encoding, of ""
    # Encoded in another batch: equal up to the kernels' rounding.
    for name, expected in (("encoder_hidden_states_t5", torch.cat([t5, negative_t5])),
                           ("encoder_hidden_states_llama3", torch.cat([llama, negative_llama], dim=1)),
                           ("pooled_embeds", torch.cat([pooled, negative_pooled]))):
        torch.testing.assert_close(text[name], expected, rtol=1e-5, atol=1e-6, msg=name)
    assert text["encoder_hidden_states_llama3"].shape == (2, 2, 16, 16)


def test_the_llama_flags_default_to_upstreams_and_a_bad_length_fails_in_one_line():
    args = parse()
    assert args.pretrained_text_encoder_4_name_or_path == args.pretrained_tokenizer_4_name_or_path == hidream.LLAMA
    with pytest.raises(UsageError) as error:
        parse("--max_sequence_length", 0)
    assert str(error.value) == "--max_sequence_length=0: expected a positive integer"


def test_the_pipeline_renders_at_the_training_resolutions_area(pipe):
    assert pipe.default_sample_size * pipe.vae_scale_factor == 32
    # HiDream-I1's VAE divides by 8: at --resolution 1024 the pipeline's own default_sample_size, 128.
    hidream_i1 = SimpleNamespace(vae_scale_factor=8, default_sample_size=128)
    hidream.render_at_resolution(hidream_i1, 1024)
    assert hidream_i1.default_sample_size == 128


# A square, and a non-square aspect-ratio bucket (16 pixels high, 64 wide: the area of 32²): the transformer pads a
# non-square image's tokens, and its output keeps rows and columns apart.
@pytest.mark.parametrize("height, width", [(32, 32), (16, 64)])
def test_the_training_mode_output_read_by_prediction_is_what_sampling_reads_in_eval_mode(pipe, height, width):
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    latents = torch.randn(2, 4, height // scale, width // scale, generator=generator)
    text = encoded(pipe, PROMPTS, hidream.prompt_settings(pipe, parse("--max_sequence_length", 16)))
    inputs = hidream.model_inputs(pipe, latents, torch.tensor([900.0, 250.0]), text)
    transformer = pipe.transformer
    try:
        with torch.no_grad():
            transformer.train()
            trained = transformer(**inputs, return_dict=False)[0]
            transformer.eval()
            sampled = transformer(**inputs, return_dict=False)[0]
    finally:
        transformer.eval()
    assert trained.shape != sampled.shape == latents.shape
    # The pipeline steps with the negated output; the experts' weighted sum is added up in another order.
    torch.testing.assert_close(hidream.prediction(pipe, trained, latents), -sampled, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scheduler", ["unipc", "euler"])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, monkeypatch, scheduler):
    """HiDream-I1 [full]'s flow-prediction UniPC scheduler (the fixture's, shift 3), and [dev]'s flow-matching Euler
    scheduler (shift 6)."""
    if scheduler == "euler":
        monkeypatch.setattr(pipe, "scheduler", FlowMatchEulerDiscreteScheduler(shift=6.0))
    height, width = 16, 64
    settings = hidream.prompt_settings(pipe, parse("--max_sequence_length", 16))
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    vae_latents = torch.randn(1, 4, height // scale, width // scale, generator=generator)
    latents = hidream.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    calls, decoded = [], []

    def transformer_predicting_the_target(hidden_states, timesteps, encoder_hidden_states_t5,
                                          encoder_hidden_states_llama3, pooled_embeds, **options):
        calls.append({"hidden_states": hidden_states, "timesteps": timesteps, "encoder_hidden_states_t5":
                      encoder_hidden_states_t5, "encoder_hidden_states_llama3": encoder_hidden_states_llama3,
                      "pooled_embeds": pooled_embeds})
        return (-target.clone(),)  # eval mode's layout; the pipeline negates it

    def vae_decode(latents, return_dict=True):
        decoded.append(latents)
        return (torch.zeros(1, 3, height, width),)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    monkeypatch.setattr(pipe.vae, "decode", vae_decode)
    pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4, guidance_scale=1.0, latents=noise,
         output_type="pt", **hidream.call_kwargs(pipe, settings))
    # Straight from the noise to the latents the target points away from, handed to the VAE in its own scale (UniPC's
    # multistep update adds a little more rounding).
    torch.testing.assert_close(decoded[0], vae_latents, rtol=0, atol=5e-5 if scheduler == "unipc" else 1e-5)

    # At each of the pipeline's noise levels, the training step's inputs at that level are what the pipeline gives
    # the transformer: the timestep is the level times 1000 (UniPC's are rounded down to whole numbers).
    noise_scheduler = hidream.training_noise_scheduler(pipe)
    text = encoded(pipe, PROMPTS[:1], settings)
    assert len(calls) == 4
    for step, call in enumerate(calls):
        sigma = pipe.scheduler.sigmas[step]
        expected = hidream.model_inputs(pipe, add_noise(latents, noise, sigma), sigma.reshape(1) * 1000, text)
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        rounding = 1.0 if scheduler == "unipc" else 1e-3
        torch.testing.assert_close(call["timesteps"].float(), expected["timesteps"], rtol=0, atol=rounding)
        for name, value in text.items():
            assert torch.equal(call[name], value), name
        # The training schedule is shifted as the sampling one: it holds each sampled level.
        assert (noise_scheduler.sigmas - sigma).abs().min() < 2e-3
    shift = pipe.scheduler.config.flow_shift if scheduler == "unipc" else pipe.scheduler.config.shift
    assert noise_scheduler.config.shift == shift and not noise_scheduler.config.use_dynamic_shifting
    assert torch.equal(calls[0]["hidden_states"], noise)
