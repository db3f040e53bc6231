"""training_utils.families.flux: FLUX.1's prompt settings, guidance, latent layout and transformer inputs are the
pipeline's own.

The central check: sampling with a transformer that predicts exactly the training target follows the training
path step by step and ends on the clean latents, so the training inputs, target, timestep and guidance are what the
pipeline's sampling loop gives the transformer at each noise level."""

import copy
from types import SimpleNamespace

import pytest
import torch
from diffusers import FluxPipeline

from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.families import flux
from training_utils.flow_matching import add_noise, velocity

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = FluxPipeline.from_pretrained(tiny["flux"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parse(*argv):
    parser = training_parser("test")
    flux.add_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "unused", *map(str, argv)])
    flux.check_args(args)
    return args


def test_prompts_encode_as_the_pipeline_does_with_the_guidance_beside_them(pipe):
    settings = flux.prompt_settings(pipe, parse())
    assert settings == {"max_sequence_length": 512, "guidance_scale": 3.5}  # the pipeline's and upstream's defaults
    settings = flux.prompt_settings(pipe, parse("--max_sequence_length", 16, "--guidance_scale", 2.0))
    with torch.no_grad():
        embeds, pooled, text_ids, guidance = flux.encode_prompts(pipe, PROMPTS, "cpu", settings)
        expected = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=16)
    # The text ids, one set for all prompts there, are each prompt's here: every part has a row per prompt.
    assert [torch.equal(part, other) for part, other in zip((embeds, pooled, text_ids[0]), expected)] == [True] * 3
    assert embeds.shape == (2, 16, 64) and pooled.shape == (2, 32) and text_ids.shape == (2, 16, 3)
    assert not torch.allclose(embeds[0], embeds[1]) and not torch.allclose(pooled[0], pooled[1])
    assert guidance.tolist() == [2.0, 2.0] and guidance.dtype == torch.float32
    inputs = flux.text_inputs(list(zip(embeds, pooled, text_ids, guidance)))
    assert torch.equal(inputs["txt_ids"], expected[2]) and inputs["guidance"].tolist() == [2.0, 2.0]


def test_a_clip_encoder_given_encodes_the_pooled_prompt(pipe):
    """A CLIP encoder that trains is given (the wrapped module): its pooled output is the prompt's, T5's stays."""
    settings = flux.prompt_settings(pipe, parse("--max_sequence_length", 16))
    other_clip = copy.deepcopy(pipe.text_encoder)
    torch.nn.init.normal_(other_clip.get_input_embeddings().weight)
    with torch.no_grad():
        embeds, pooled, *_ = flux.encode_prompts(pipe, PROMPTS, "cpu", settings)
        other_embeds, other_pooled, *_ = flux.encode_prompts(pipe, PROMPTS, "cpu", settings,
                                                             text_encoders={"text_encoder": other_clip})
    assert torch.equal(other_embeds, embeds) and not torch.allclose(other_pooled, pooled)


def test_schnell_embeds_no_guidance(pipe):
    pipe = SimpleNamespace(encode_prompt=pipe.encode_prompt, _get_t5_prompt_embeds=pipe._get_t5_prompt_embeds,
                           text_encoder=pipe.text_encoder, tokenizer=pipe.tokenizer,  # a [schnell]: no guidance
                           transformer=SimpleNamespace(config=SimpleNamespace(guidance_embeds=False)))
    settings = flux.prompt_settings(pipe, parse("--max_sequence_length", 16))
    with torch.no_grad():
        rows = list(zip(*flux.encode_prompts(pipe, PROMPTS, "cpu", settings)))
    assert len(rows[0]) == 3 and flux.text_inputs(rows)["guidance"] is None


def test_a_prompt_longer_than_the_pipeline_takes_fails_in_one_line():
    for value in (0, 513):
        with pytest.raises(UsageError) as error:
            parse("--max_sequence_length", value)
        assert str(error.value) == (f"--max_sequence_length={value}: expected a positive integer of at most 512 "
                                    "(FluxPipeline's limit)")


# A square, and a non-square aspect-ratio bucket (24 pixels high, 40 wide): the tokens' position ids, which place
# them for the rotary embedding, are the pipeline's for that height and width.
@pytest.mark.parametrize("height, width", [(32, 32), (24, 40)])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, monkeypatch, height, width):
    settings = flux.prompt_settings(pipe, parse("--max_sequence_length", 16, "--guidance_scale", 2.5))
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    vae_latents = torch.randn(1, 4, height // scale, width // scale, generator=generator)  # a height x width image's
    latents = flux.normalized_latents(pipe, vae_latents)
    assert not torch.allclose(latents, vae_latents)  # the VAE's shift and scale are applied
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    # The transformer's output tokens that the training step reads back as exactly the target.
    target_tokens = pipe._pack_latents(target, 1, 4, *target.shape[-2:])
    assert torch.equal(flux.prediction(pipe, target_tokens, latents), target)
    calls = []

    def transformer_predicting_the_target(**inputs):
        calls.append(inputs)
        return (target_tokens,)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    sampled = pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4,
                   latents=pipe._pack_latents(noise, 1, 4, *noise.shape[-2:]), output_type="latent",
                   **flux.call_kwargs(pipe, settings)).images
    # Straight from the noise to the latents the target points away from.
    torch.testing.assert_close(pipe._unpack_latents(sampled, height, width, scale), latents, rtol=0, atol=1e-5)

    with torch.no_grad():
        embeds, pooled, text_ids, guidance = flux.encode_prompts(pipe, PROMPTS[:1], "cpu", settings)
    text = flux.text_inputs([(embeds[0], pooled[0], text_ids[0], guidance[0])])  # the row the cache holds
    assert len(calls) == 4
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step : step + 1]
        expected = flux.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, text)
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        assert torch.equal(call["timestep"], expected["timestep"]) and torch.equal(call["img_ids"], expected["img_ids"])
        for name, value in text.items():
            assert torch.equal(call[name], value), name
    assert calls[0]["guidance"].tolist() == [2.5]
    # Each token's (0, row, column) ids: the image's rows and columns of 2×2 patches, row by row.
    rows_, columns = height // scale // 2, width // scale // 2
    assert calls[0]["img_ids"][:, 1:3].tolist() == [[row, column] for row in range(rows_) for column in range(columns)]
    assert pipe.scheduler.sigmas[0] == 1 and pipe.scheduler.config.use_dynamic_shifting
