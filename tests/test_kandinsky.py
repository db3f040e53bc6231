"""`training_utils.kandinsky`: the decoder's training inputs are those its pipeline's sampling loop passes, the MoVQ
wrapper gives the MoVQ's latents, and validation's combined pipeline holds the live modules."""

from types import SimpleNamespace

import pytest
import torch
from diffusers import KandinskyV22Pipeline
from PIL import Image

from training_utils import kandinsky


@pytest.fixture(scope="module")
def decoder(tiny):
    pipe = KandinskyV22Pipeline.from_pretrained(tiny["kandinsky22_decoder"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def prior(tiny):
    return kandinsky.load_prior(SimpleNamespace(pretrained_prior_model_name_or_path=tiny["kandinsky22_prior"],
                                                revision=None), torch.float32)


def test_the_movq_wrapper_gives_the_movq_latents_as_a_distribution_of_no_spread(decoder):
    images = torch.rand(2, 3, 64, 64) * 2 - 1
    distribution = kandinsky.MoVQLatents(decoder.movq).encode(images).latent_dist
    latents = decoder.movq.encode(images).latents
    assert latents.shape == (2, 4, 8, 8)  # the real MoVQ's 8x
    assert torch.equal(distribution.mean, latents)
    assert distribution.std.max() < 1e-6


def test_the_training_inputs_are_those_the_sampling_loop_passes(decoder):
    calls = []
    unet_forward = decoder.unet.forward

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return unet_forward(*args, **kwargs)

    embeds = torch.linspace(-1, 1, 32).unsqueeze(0)
    decoder.unet.forward = recording
    try:
        decoder(image_embeds=embeds, negative_image_embeds=-embeds, height=64, width=64, num_inference_steps=1,
                guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="latent")
    finally:
        del decoder.unet.forward
    (args, kwargs), = calls
    given = {"sample": kwargs["sample"], "timestep": kwargs["timestep"],
             "encoder_hidden_states": kwargs["encoder_hidden_states"], "added_cond_kwargs": kwargs["added_cond_kwargs"]}
    ours = kandinsky.model_inputs(given["sample"], given["timestep"], embeds)
    assert ours.keys() == given.keys() and ours["encoder_hidden_states"] is None
    assert torch.equal(ours["added_cond_kwargs"]["image_embeds"], given["added_cond_kwargs"]["image_embeds"])
    output = decoder.unet(**ours, return_dict=False)[0]
    assert output.shape[1] == 8 and torch.equal(kandinsky.prediction(output, given["sample"]), output[:, :4])


def test_the_conditioning_is_the_prior_pipelines_own_image_embedding(prior):
    image = Image.new("RGB", (80, 48), "red")
    pixels = torch.stack([kandinsky.clip_pixels(prior, image)])
    assert pixels.shape == (1, 3, 224, 224)
    expected = prior.image_encoder(prior.image_processor(image, return_tensors="pt").pixel_values).image_embeds
    assert torch.equal(kandinsky.image_embeddings(prior, pixels), expected)
    assert not any(parameter.requires_grad for parameter in prior.image_encoder.parameters())


def test_the_combined_pipeline_holds_the_live_modules_and_renders_prompts(decoder, prior):
    combined = kandinsky.combined_pipeline(decoder, prior)
    assert combined.unet is decoder.unet and combined.movq is decoder.movq
    assert combined.prior_image_encoder is prior.image_encoder and combined.prior_prior is prior.prior
    assert [kandinsky.prior_steps(steps) for steps in (1, 2, 30)] == [2, 2, 30]
    images = combined("a red circle", num_inference_steps=1, prior_num_inference_steps=kandinsky.prior_steps(1),
                      height=64, width=64,
                      generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert images.shape == (1, 3, 64, 64)


def test_buckets_are_sizes_the_decoder_renders_as_given(decoder):
    from training_utils.data.buckets import size_multiple

    # The pipeline renders latents of ceil(side / 64) * 8: only multiples of 64 come out at their own size.
    assert size_multiple(decoder) == 64
