"""training_utils.families.chroma: Chroma's prompt encoding (T5 with its attention mask), latent layout and
transformer inputs are ChromaPipeline's own.

The central check: sampling with a transformer that predicts exactly the training target follows the training
path step by step and ends on the clean latents, and the training step's inputs, its attention mask over text and
image included, are what the pipeline's sampling loop gives the transformer at each noise level."""

import pytest
import torch
from diffusers import ChromaPipeline

from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.families import chroma
from training_utils.flow_matching import add_noise, velocity

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = ChromaPipeline.from_pretrained(tiny["chroma"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parse(*argv):
    parser = training_parser("test")
    chroma.add_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "unused", *map(str, argv)])
    chroma.check_args(args)
    return args


def test_prompts_encode_as_the_pipeline_does_with_the_mask_of_their_tokens_and_first_padding(pipe):
    assert chroma.prompt_settings(pipe, parse()) == {"max_sequence_length": 512}
    settings = chroma.prompt_settings(pipe, parse("--max_sequence_length", 16))
    with torch.no_grad():
        embeddings, mask = chroma.encode_prompts(pipe, PROMPTS, "cpu", settings)
        expected, text_ids, expected_mask, *negative = pipe.encode_prompt(PROMPTS, device="cpu",
                                                                          max_sequence_length=16)
    assert torch.equal(embeddings, expected) and torch.equal(mask, expected_mask)
    assert embeddings.shape == (2, 16, pipe.transformer.config.joint_attention_dim)
    assert not torch.allclose(embeddings[0], embeddings[1])
    # Each prompt's tokens (its end-of-text one included) and one padding token.
    tokens = [len(ids) for ids in pipe.tokenizer(PROMPTS).input_ids]
    assert mask.sum(1).tolist() == [count + 1 for count in tokens] and tokens[0] != tokens[1]
    text = chroma.text_inputs(list(zip(embeddings, mask)))
    assert torch.equal(text["txt_ids"], text_ids) and torch.equal(text["attention_mask"], mask)


def test_a_bad_prompt_length_fails_in_one_line():
    with pytest.raises(UsageError) as error:
        parse("--max_sequence_length", 0)
    assert str(error.value) == "--max_sequence_length=0: expected a positive integer"


# A square, and a non-square aspect-ratio bucket (24 pixels high, 40 wide).
@pytest.mark.parametrize("height, width", [(32, 32), (24, 40)])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, monkeypatch, height, width):
    settings = chroma.prompt_settings(pipe, parse("--max_sequence_length", 16))
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    vae_latents = torch.randn(1, 4, height // scale, width // scale, generator=generator)
    latents = chroma.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    target_tokens = pipe._pack_latents(target, *target.shape)
    assert torch.equal(chroma.prediction(pipe, target_tokens, latents), target)
    calls = []

    def transformer_predicting_the_target(**inputs):
        calls.append(inputs)
        return (target_tokens,)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    # No classifier-free guidance (guidance_scale 1): one transformer call per step, on the prompt.
    sampled = pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4, guidance_scale=1.0,
                   latents=pipe._pack_latents(noise, *noise.shape), output_type="latent", **settings).images
    torch.testing.assert_close(sampled, pipe._pack_latents(latents, *latents.shape), rtol=0, atol=1e-5)
    assert len(calls) == 4

    with torch.no_grad():
        text = chroma.text_inputs(list(zip(*chroma.encode_prompts(pipe, PROMPTS[:1], "cpu", settings))))
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step : step + 1]
        training_call = len(calls)
        # What the training step passes, through the transformer's hook that extends the text's mask.
        pipe.transformer(**chroma.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, text))
        trained = calls.pop()
        assert len(calls) == training_call
        torch.testing.assert_close(trained["hidden_states"], call["hidden_states"], rtol=0, atol=1e-5)
        for name in ("timestep", "img_ids", "txt_ids", "encoder_hidden_states", "attention_mask"):
            assert torch.equal(trained[name], call[name].to(trained[name].dtype)), name
    # The mask covers the text and the image's tokens: the prompt's tokens and one padding token, then every patch.
    mask = calls[0]["attention_mask"][0]
    assert mask.shape == (16 + height * width // (2 * scale) ** 2,) and mask[16:].all() and not mask[:16].all()
    assert pipe.scheduler.sigmas[0] == 1 and pipe.scheduler.config.use_dynamic_shifting
