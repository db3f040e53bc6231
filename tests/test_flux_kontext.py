"""training_utils.families.flux_kontext: FLUX.1 Kontext's prompts, reference layout and transformer inputs are the
pipeline's own.

The central check: sampling with a transformer that predicts exactly the training target follows the training
path step by step and ends on the clean latents, so the training inputs (the reference's tokens and ids among them),
target, timestep and guidance are what the pipeline's sampling loop gives the transformer at each noise level."""

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from training_utils.args import training_parser
from training_utils.families import flux, flux_kontext
from training_utils.flow_matching import add_noise, velocity

PROMPTS = ["make the triangle purple", "turn the square into a circle"]


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = FluxKontextPipeline.from_pretrained(tiny["flux_kontext"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def settings_for(pipe, *argv):
    parser = training_parser("test")
    flux_kontext.add_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "unused", *map(str, argv)])
    flux_kontext.check_args(args)
    return flux_kontext.prompt_settings(pipe, args)


def test_prompts_encode_as_the_pipeline_does(pipe):
    settings = settings_for(pipe, "--max_sequence_length", 16, "--guidance_scale", 2.0)
    with torch.no_grad():
        embeds, pooled, text_ids, guidance = flux_kontext.encode_prompts(pipe, PROMPTS, "cpu", settings)
        expected = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=16)
    assert [torch.equal(part, other) for part, other in zip((embeds, pooled, text_ids[0]), expected)] == [True] * 3
    assert not torch.allclose(embeds[0], embeds[1]) and guidance.tolist() == [2.0, 2.0]


class SizeChosen(Exception):
    pass


@pytest.mark.parametrize("width, height", [(64, 64), (40, 24), (24, 40), (1000, 999), (300, 100), (100, 300)])
def test_a_reference_takes_the_size_the_pipeline_gives_it(pipe, monkeypatch, width, height):
    def resize(image, height, width, **kwargs):  # where the pipeline resizes the reference: stop, and say to what
        raise SizeChosen(width, height)

    monkeypatch.setattr(pipe.image_processor, "resize", resize)
    with pytest.raises(SizeChosen) as chosen:
        pipe(image=Image.new("RGB", (width, height)), prompt=PROMPTS[0], height=32, width=32, num_inference_steps=1)
    assert flux_kontext.reference_size(pipe, width, height) == chosen.value.args
    # At a smaller area, the same aspect ratio, on the 2×2 patches' pixels (4 here: the tiny VAE halves the size).
    small_width, small_height = flux_kontext.reference_size(pipe, width, height, area=32 * 32)
    assert small_width % 4 == small_height % 4 == 0 and abs(small_width * small_height - 32 * 32) < 32 * 12
    assert (small_width > small_height) == (chosen.value.args[0] > chosen.value.args[1])


def test_a_batch_without_references_takes_flux_inputs(pipe):
    noisy, timesteps = torch.randn(2, 4, 8, 8), torch.tensor([500.0, 250.0])
    inputs = flux_kontext.model_inputs(pipe, noisy, timesteps, {})
    expected = flux.model_inputs(pipe, noisy, timesteps, {})
    assert inputs.keys() == expected.keys() and all(torch.equal(inputs[name], expected[name]) for name in inputs)


# A square target with a wider reference, and a non-square bucket (24 pixels high, 40 wide) with a tall one: the
# reference's tokens follow the target's, with their own position ids, whatever the two sizes.
@pytest.mark.parametrize("height, width, reference_size", [(32, 32, (50, 30)), (24, 40, (20, 44))])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, monkeypatch, height, width,
                                                                        reference_size):
    settings = settings_for(pipe, "--max_sequence_length", 16, "--guidance_scale", 2.5)
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    latents = flux_kontext.normalized_latents(pipe, torch.randn(1, 4, height // scale, width // scale,
                                                                generator=generator))
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    target_tokens = pipe._pack_latents(target, 1, 4, *target.shape[-2:])
    reference = Image.fromarray(np.random.default_rng(0).integers(0, 256, (*reference_size[::-1], 3), np.uint8))
    # The reference as training lays it out and encodes it, at the target's area; validation passes it resized.
    layout, _ = flux_kontext.reference_layout(pipe, area=height * width)
    with torch.no_grad():
        parameters = pipe.vae.encode(layout(reference)[None]).latent_dist.parameters
    reference_latents = flux_kontext.reference_latents(pipe, [parameters])
    calls = []

    def transformer_predicting_the_target(**inputs):
        calls.append(inputs)  # the reference's tokens come back too; the pipeline cuts them off, as training does
        return (torch.cat([target_tokens, torch.zeros_like(inputs["hidden_states"][:, target_tokens.shape[1]:])], 1),)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    sampled = pipe(image=layout.resized(reference), prompt=PROMPTS[0], num_inference_steps=4,
                   latents=pipe._pack_latents(noise, 1, 4, *noise.shape[-2:]), output_type="latent",
                   **flux_kontext.render_kwargs({"height": height, "width": width}),
                   **flux_kontext.call_kwargs(pipe, settings)).images
    torch.testing.assert_close(pipe._unpack_latents(sampled, height, width, scale), latents, rtol=0, atol=1e-5)

    with torch.no_grad():
        embeds, pooled, text_ids, guidance = flux_kontext.encode_prompts(pipe, PROMPTS[:1], "cpu", settings)
    text = flux_kontext.text_inputs([(embeds[0], pooled[0], text_ids[0], guidance[0])])
    assert len(calls) == 4
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step : step + 1]
        expected = flux_kontext.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, text, reference_latents)
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        assert torch.equal(call["timestep"], expected["timestep"]) and torch.equal(call["img_ids"], expected["img_ids"])
        for name, value in text.items():
            assert torch.equal(call[name], value), name
    # The target's tokens, then the reference's: (0, row, column) ids, then (1, row, column) over the reference.
    target_count = (height // scale // 2) * (width // scale // 2)
    reference_width, reference_height = layout.resized(reference).size
    assert (reference_width > reference_height) == (reference_size[0] > reference_size[1])
    reference_rows, reference_columns = reference_height // scale // 2, reference_width // scale // 2
    ids = calls[0]["img_ids"]
    assert ids.shape[0] == target_count + reference_rows * reference_columns
    assert ids[:target_count, 0].eq(0).all() and ids[target_count:, 0].eq(1).all()
    assert ids[target_count:, 1:].tolist() == [[row, column] for row in range(reference_rows)
                                               for column in range(reference_columns)]
    assert torch.equal(flux_kontext.prediction(pipe, calls[0]["hidden_states"], latents),
                       flux_kontext.prediction(pipe, calls[0]["hidden_states"][:, :target_count], latents))
