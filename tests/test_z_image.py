"""training_utils.families.z_image: Z-Image's prompt settings, latent layout and transformer inputs are the
pipeline's own.

The central check: sampling with a transformer that predicts exactly the training target follows the training
path step by step and ends on the clean latents, so the training inputs, target and timestep conditioning are
what the pipeline's sampling loop gives the transformer at each noise level."""

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, ZImageControlNetModel, ZImageControlNetPipeline, ZImagePipeline
from PIL import Image

from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.families import z_image
from training_utils.flow_matching import add_noise, velocity
from training_utils.pipeline import training_noise_scheduler

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = ZImagePipeline.from_pretrained(tiny["z_image"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parse(*argv):
    parser = training_parser("test")
    z_image.add_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "unused", *map(str, argv)])
    z_image.check_args(args)
    return args


def encoded_as_the_pipeline_does(pipe, prompts, settings):
    """Our encoding, padded and cut back to each prompt's own embedding."""
    with torch.no_grad():
        padded, lengths = z_image.encode_prompts(pipe, prompts, "cpu", settings)
    return z_image.text_inputs(list(zip(padded, lengths)))["cap_feats"]


def test_the_fixtures_tokenizer_keeps_the_prompts_words_whole(pipe):
    ids = [pipe.tokenizer(prompt).input_ids for prompt in PROMPTS]
    assert [len(prompt_ids) for prompt_ids in ids] == [len(prompt.split()) for prompt in PROMPTS]
    assert ids[0] != ids[1][: len(ids[0])]


def test_unset_prompt_settings_are_the_pipelines_defaults_and_encode_as_it_does(pipe):
    settings = z_image.prompt_settings(pipe, parse())
    assert settings == {"max_sequence_length": 512}
    prompts = list(PROMPTS)
    embeddings = encoded_as_the_pipeline_does(pipe, prompts, settings)
    assert prompts == PROMPTS  # untouched: the pipeline writes the chat-templated prompts into the list it gets
    with torch.no_grad():
        expected, negative = pipe.encode_prompt(list(PROMPTS))
    # Each prompt's own tokens (its chat template included), no padding: lengths differ, and so do the embeddings.
    assert [embedding.shape for embedding in embeddings] == [(23, 16), (25, 16)]
    assert all(torch.equal(embedding, want) for embedding, want in zip(embeddings, expected, strict=True))
    assert not torch.allclose(embeddings[0][-5:], embeddings[1][-5:])
    assert len(negative) == 2  # the pipeline's default guidance also embeds the empty prompt; training does not


def test_set_prompt_settings_reach_the_encoding(pipe):
    settings = z_image.prompt_settings(pipe, parse("--max_sequence_length", 16))
    assert settings == {"max_sequence_length": 16}
    embeddings = encoded_as_the_pipeline_does(pipe, PROMPTS, settings)
    with torch.no_grad():
        expected, _ = pipe.encode_prompt(list(PROMPTS), max_sequence_length=16, do_classifier_free_guidance=False)
    assert [embedding.shape for embedding in embeddings] == [(16, 16), (16, 16)]
    assert all(torch.equal(embedding, want) for embedding, want in zip(embeddings, expected, strict=True))


def test_a_bad_prompt_setting_fails_in_one_line():
    with pytest.raises(UsageError) as error:
        parse("--max_sequence_length", 0)
    assert str(error.value) == "--max_sequence_length=0: expected a positive integer"


# A square, and a non-square aspect-ratio bucket (24 pixels high, 40 wide): the latents keep their rows and columns.
@pytest.mark.parametrize("height, width", [(32, 32), (24, 40)])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, monkeypatch, height, width):
    settings = z_image.prompt_settings(pipe, parse("--max_sequence_length", 32))
    generator = torch.Generator().manual_seed(0)
    scale = pipe.vae_scale_factor
    # What the VAE makes of a height x width image.
    vae_latents = torch.randn(1, 16, height // scale, width // scale, generator=generator)
    latents = z_image.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    # The transformer's outputs that the training step reads back as exactly the target.
    target_outputs = [-target[0].unsqueeze(1)]
    assert torch.equal(z_image.prediction(pipe, target_outputs, latents), target)
    calls, decoded = [], []

    def transformer_predicting_the_target(x, t, cap_feats, **options):
        calls.append({"x": x, "t": t, "cap_feats": cap_feats})
        return ([output.clone() for output in target_outputs],)

    def vae_decode(latents, return_dict=True):
        decoded.append(latents)
        return (torch.zeros(1, 3, height, width),)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    monkeypatch.setattr(pipe.vae, "decode", vae_decode)
    pipe(prompt=PROMPTS[0], height=height, width=width, num_inference_steps=4, guidance_scale=0.0, latents=noise,
         output_type="pt", **settings)
    # Straight from the noise to the latents the target points away from, handed to the VAE in its own scale.
    torch.testing.assert_close(decoded[0], vae_latents, rtol=0, atol=1e-5)

    # At each of the pipeline's noise levels, the training step's inputs at the same level of the training schedule
    # (the same shift) are what the pipeline gives the transformer.
    noise_scheduler = training_noise_scheduler(pipe, FlowMatchEulerDiscreteScheduler)
    expected_prompt = encoded_as_the_pipeline_does(pipe, PROMPTS[:1], settings)
    assert len(calls) == 4
    for step, call in enumerate(calls):
        index = (noise_scheduler.sigmas - pipe.scheduler.sigmas[step]).abs().argmin()
        sigma, timestep = noise_scheduler.sigmas[index], noise_scheduler.timesteps[index : index + 1]
        torch.testing.assert_close(sigma, pipe.scheduler.sigmas[step], rtol=0, atol=1e-6)
        expected = z_image.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, {})
        assert len(call["x"]) == 1 and call["x"][0].shape == (16, 1, height // scale, width // scale)
        torch.testing.assert_close(call["x"][0], expected["x"][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(call["t"], expected["t"], rtol=0, atol=1e-6)
        assert all(torch.equal(got, want) for got, want in zip(call["cap_feats"], expected_prompt, strict=True))
    # The first step starts from pure noise at time 0; the schedule is shifted (statically) by the config's shift.
    assert torch.equal(calls[0]["x"][0], noise[0].unsqueeze(1)) and calls[0]["t"].tolist() == [0.0]
    assert pipe.scheduler.config.shift == 3 and not pipe.scheduler.config.use_dynamic_shifting
    assert pipe.scheduler.sigmas[1] > 0.75  # unshifted, the second of 4 steps would be at 0.75


# The ControlNet (ZImageControlNetPipeline's): made from the transformer, and fed what that pipeline feeds it.

@pytest.fixture(scope="module")
def controlnet_pipe(tiny, pipe):
    controlnet = ZImageControlNetModel.from_pretrained(tiny["z_image_controlnet"])
    controlnet_pipe = ZImageControlNetPipeline(**pipe.components, controlnet=controlnet)
    controlnet_pipe.set_progress_bar_config(disable=True)
    return controlnet_pipe


def conditioning_image(seed=0, size=32):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (size, size, 3), dtype=np.uint8))


def as_pixels(image):
    """An image as a conditioning image's pixels from `ImageWithConditioningTransform`: (1, 3, H, W) in [0, 1]."""
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float() / 255


def render(pipe, **kwargs):
    return pipe(prompt=PROMPTS[0], height=32, width=32, num_inference_steps=2, guidance_scale=0.0, output_type="pt",
                generator=torch.Generator().manual_seed(0), max_sequence_length=32, **kwargs).images


def test_a_controlnet_from_the_transformer_copies_its_layers_and_changes_nothing_until_it_trains(pipe):
    controlnet = z_image.controlnet_from_transformer(pipe.transformer, [0, 1])
    assert controlnet.config.control_layers_places == [0, 1] and controlnet.config.control_in_dim == 16
    for layer, place in zip(controlnet.control_layers, [0, 1]):
        for name, tensor in pipe.transformer.layers[place].state_dict().items():
            assert torch.equal(layer.state_dict()[name], tensor), name
        assert not layer.after_proj.weight.any() and not layer.after_proj.bias.any()
    assert not controlnet.control_layers[0].before_proj.weight.any()
    assert all(torch.equal(controlnet.control_noise_refiner.state_dict()[name], tensor)
               for name, tensor in pipe.transformer.noise_refiner.state_dict().items())
    controlnet_pipe = ZImageControlNetPipeline(**pipe.components, controlnet=controlnet)
    controlnet_pipe.set_progress_bar_config(disable=True)
    assert torch.equal(render(controlnet_pipe, control_image=conditioning_image()), render(pipe))


def test_the_unshared_controlnet_holds_and_saves_only_its_own_modules(tiny, pipe, tmp_path):
    controlnet = ZImageControlNetModel.from_pretrained(tiny["z_image_controlnet"])
    controlnet_pipe = ZImageControlNetPipeline(**pipe.components, controlnet=controlnet)
    shared = {name for name in controlnet.state_dict() if not name.startswith("control_")}
    assert shared  # the pipeline made the transformer's modules the ControlNet's own
    z_image.unshare_transformer_modules(controlnet)
    assert {name.split(".")[0] for name in controlnet.state_dict()} == {
        "control_layers", "control_noise_refiner", "control_all_x_embedder"}
    assert controlnet.t_embedder is pipe.transformer.t_embedder and controlnet.x_pad_token is pipe.transformer.x_pad_token
    # It still renders as before, and what it saves loads back into the pipeline to render the same.
    image = render(controlnet_pipe, control_image=conditioning_image())
    with torch.no_grad():
        for layer in controlnet.control_layers:
            layer.after_proj.bias.fill_(0.1)
    changed = render(controlnet_pipe, control_image=conditioning_image())
    assert not torch.equal(changed, image)
    controlnet.save_pretrained(tmp_path)
    loaded = ZImageControlNetPipeline(**pipe.components, controlnet=ZImageControlNetModel.from_pretrained(tmp_path))
    loaded.set_progress_bar_config(disable=True)
    assert torch.equal(render(loaded, control_image=conditioning_image()), changed)


def test_the_control_context_and_inputs_are_what_the_pipeline_feeds_the_controlnet(controlnet_pipe, monkeypatch):
    calls = []
    forward = controlnet_pipe.controlnet.forward

    def recording(x, t, cap_feats, control_context, conditioning_scale=1.0, **options):
        calls.append({"x": x, "t": t, "cap_feats": cap_feats, "control_context": control_context})
        return forward(x, t, cap_feats, control_context, conditioning_scale, **options)

    monkeypatch.setattr(controlnet_pipe.controlnet, "forward", recording)
    image = conditioning_image(seed=1)
    noise = torch.randn(1, 16, 16, 16, generator=torch.Generator().manual_seed(0))
    render(controlnet_pipe, control_image=image, latents=noise)
    context = z_image.control_context(controlnet_pipe, controlnet_pipe.controlnet, as_pixels(image))
    assert context.shape == (1, 16, 1, 16, 16)
    assert all(torch.equal(call["control_context"], context) for call in calls)
    # The first step's other inputs are the transformer's training inputs at the first noise level (pure noise).
    settings = {"max_sequence_length": 32}
    expected = z_image.model_inputs(controlnet_pipe, noise, torch.tensor([1000.0]),
                                    {"cap_feats": encoded_as_the_pipeline_does(controlnet_pipe, PROMPTS[:1], settings)})
    assert torch.equal(calls[0]["x"][0], expected["x"][0]) and torch.equal(calls[0]["t"], expected["t"])
    assert torch.equal(calls[0]["cap_feats"][0], expected["cap_feats"][0])


def test_inpainting_channels_of_the_control_context_are_zero(controlnet_pipe):
    wider = ZImageControlNetModel.from_config({**controlnet_pipe.controlnet.config, "control_in_dim": 20})
    context = z_image.control_context(controlnet_pipe, wider, as_pixels(conditioning_image()))
    narrow = z_image.control_context(controlnet_pipe, controlnet_pipe.controlnet, as_pixels(conditioning_image()))
    assert context.shape == (1, 20, 1, 16, 16) and not context[:, 16:].any()
    assert torch.equal(context[:, :16], narrow)
