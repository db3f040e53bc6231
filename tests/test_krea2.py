"""training_utils.families.krea2: Krea 2's prompt encoding (Qwen3-VL's stacked hidden states for the pipeline's
template, the system prefix dropped, with their mask), latent layout and transformer inputs are Krea2Pipeline's
own.

The central check: sampling with a transformer that predicts exactly the training target follows the training
path step by step and ends on the clean latents, and the training step's inputs, the rotary coordinates of the
text and image tokens included, are what the pipeline's sampling loop gives the transformer at each noise level."""

import functools

import pytest
import torch
from diffusers import Krea2Pipeline

from helpers import family_args
from training_utils.errors import UsageError
from training_utils.families import krea2
from training_utils.flow_matching import add_noise, velocity

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = Krea2Pipeline.from_pretrained(tiny["krea2"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def parse(tiny):
    return functools.partial(family_args, krea2, tiny["krea2"])


def test_prompts_encode_as_the_pipeline_does_with_the_mask_of_their_real_tokens(pipe, parse):
    assert krea2.prompt_settings(pipe, parse()) == {"max_sequence_length": 512}
    settings = krea2.prompt_settings(pipe, parse("--max_sequence_length", 16))
    with torch.no_grad():
        embeddings, mask = krea2.encode_prompts(pipe, PROMPTS, "cpu", settings)
        expected, expected_mask = pipe.encode_prompt(PROMPTS, max_sequence_length=16)
    assert torch.equal(embeddings, expected) and torch.equal(mask, expected_mask)
    text_encoder = pipe.text_encoder.config.text_config
    assert embeddings.shape == (2, 16, len(pipe.text_encoder_select_layers), text_encoder.hidden_size)
    assert not torch.allclose(embeddings[0], embeddings[1])
    # The system prefix is the 34 tokens the pipeline drops, as in Qwen's own vocabulary; each prompt's tokens are
    # real, then padding, then the 5 tokens of the assistant suffix.
    assert len(pipe.tokenizer(pipe.prompt_template_encode_prefix).input_ids) == pipe.prompt_template_encode_start_idx
    tokens = [len(ids) for ids in pipe.tokenizer(PROMPTS).input_ids]
    assert mask.sum(1).tolist() == [count + 5 for count in tokens] and tokens[0] != tokens[1] and mask[:, -5:].all()


@pytest.mark.parametrize("flags, message", [
    (["--max_sequence_length", 0], "--max_sequence_length=0: expected a positive integer"),
    (["--resolution", 34], "--resolution=34: expected a multiple of 4: the VAE divides the size by 2, and the latents "
                           "are packed in 2×2 patches"),
])
def test_bad_settings_fail_in_one_line(parse, flags, message):
    with pytest.raises(UsageError) as error:
        parse(*flags)
    assert str(error.value) == message


# A square, and a non-square aspect-ratio bucket (24 pixels high, 40 wide).
@pytest.mark.parametrize("height, width", [(32, 32), (24, 40)])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, parse, monkeypatch, height, width):
    settings = krea2.prompt_settings(pipe, parse("--max_sequence_length", 16))
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    vae_latents = torch.randn(1, 4, 1, height // scale, width // scale, generator=generator)
    latents = krea2.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)

    def packed(tensor):
        return pipe._pack_latents(tensor, tensor.shape[0], tensor.shape[1], *tensor.shape[-2:])

    target_tokens = packed(target)
    assert torch.equal(krea2.prediction(pipe, target_tokens, latents), target)
    calls = []

    def transformer_predicting_the_target(**inputs):
        calls.append(inputs)
        return (target_tokens,)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    # No classifier-free guidance (guidance_scale 0, Krea 2's convention): one transformer call per step.
    sampled = pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4, guidance_scale=0.0,
                   latents=packed(noise), output_type="latent", **krea2.call_kwargs(pipe, settings)).images
    torch.testing.assert_close(sampled, packed(latents), rtol=0, atol=1e-5)
    assert len(calls) == 4

    with torch.no_grad():
        text = krea2.text_inputs(list(zip(*krea2.encode_prompts(pipe, PROMPTS[:1], "cpu", settings))))
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step : step + 1]
        # What the training step passes, through the transformer's hook that puts the text's coordinates first.
        pipe.transformer(**krea2.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, text))
        trained = calls.pop()
        torch.testing.assert_close(trained["hidden_states"], call["hidden_states"], rtol=0, atol=1e-5)
        for name in ("timestep", "position_ids", "encoder_hidden_states", "encoder_attention_mask"):
            assert torch.equal(trained[name], call[name]), name
    # The text's 16 tokens at the origin, then the image's patches by (0, row, column).
    position_ids = calls[0]["position_ids"]
    rows, columns = height // scale // 2, width // scale // 2
    assert position_ids.shape == (16 + rows * columns, 3) and not position_ids[:16].any()
    assert position_ids[16:, 1:].tolist() == [[row, column] for row in range(rows) for column in range(columns)]
    assert pipe.scheduler.sigmas[0] == 1 and pipe.scheduler.config.use_dynamic_shifting
