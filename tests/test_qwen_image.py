"""training_utils.families.qwen_image: Qwen-Image's prompt encoding, latent layout and transformer inputs are the
pipeline's own.

The central check: sampling with a transformer that predicts exactly the training target follows the training
path step by step and ends on the clean latents, so the training inputs, target and timestep conditioning are
what the pipeline's sampling loop gives the transformer at each noise level."""

import functools
import numpy as np
import pytest
import torch
from diffusers import (FlowMatchEulerDiscreteScheduler, QwenImageControlNetModel, QwenImageControlNetPipeline,
                       QwenImagePipeline)
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from PIL import Image

from helpers import family_args
from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.families import qwen_image
from training_utils.flow_matching import add_noise, velocity
from training_utils.testing.tiny.parts import vocabulary

# Two prompts of different lengths: batched, the shorter one is padded and masked.
PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def pipe(tiny):
    pipe = QwenImagePipeline.from_pretrained(tiny["qwen_image"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def parse(tiny):
    return functools.partial(family_args, qwen_image, tiny["qwen_image"])


def test_the_tiny_tokenizer_drops_the_templates_system_turn_as_qwens_does(pipe):
    # The pipeline drops a fixed number of tokens from each prompt's hidden states: Qwen's count for the template's
    # system turn. The tiny vocabulary makes it the same count of whole words, so what remains is the user's turn.
    system_turn = pipe.prompt_template_encode.split("{}")[0]
    tokens = pipe.tokenizer.tokenize(system_turn)
    assert len(tokens) == pipe.prompt_template_encode_start_idx
    assert tokens[:3] == ["<|im_start|>", "system", "Ċ"] and tokens[-3:] == ["<|im_start|>", "user", "Ċ"]
    assert all(len(pipe.tokenizer.tokenize(" " + word)) == 1 for word in vocabulary())
    first, second = (pipe.tokenizer(prompt).input_ids for prompt in PROMPTS)
    assert len(first) == 5 and len(second) == 7 and first != second


def test_unset_prompt_settings_are_the_pipelines_defaults_and_encode_as_it_does(pipe, parse):
    settings = qwen_image.prompt_settings(pipe, parse())
    assert settings == {"max_sequence_length": 512}
    with torch.no_grad():
        prompt_embeds, mask = qwen_image.encode_prompts(pipe, PROMPTS, "cpu", settings)
        expected_embeds, expected_mask = pipe.encode_prompt(PROMPTS, max_sequence_length=512)
    # The user's turn: the prompt's words, <|im_end|>, "\n", <|im_start|>, "assistant", "\n".
    assert prompt_embeds.shape == (2, 12, pipe.transformer.config.joint_attention_dim)
    assert torch.equal(prompt_embeds, expected_embeds) and torch.equal(mask, expected_mask)
    assert mask.sum(1).tolist() == [10, 12] and not prompt_embeds[0, 10:].any()
    # A prompt alone has no padding: the pipeline gives no mask, the rows one of ones.
    with torch.no_grad():
        alone, alone_mask = qwen_image.encode_prompts(pipe, PROMPTS[:1], "cpu", settings)
        expected_alone, no_mask = pipe.encode_prompt(PROMPTS[:1], max_sequence_length=512)
    assert no_mask is None and torch.equal(alone, expected_alone) and alone_mask.tolist() == [[1] * 10]


def test_set_prompt_settings_reach_the_encoding(pipe, parse):
    settings = qwen_image.prompt_settings(pipe, parse("--max_sequence_length", 8))
    assert settings == {"max_sequence_length": 8}
    with torch.no_grad():
        prompt_embeds, mask = qwen_image.encode_prompts(pipe, PROMPTS, "cpu", settings)
    assert prompt_embeds.shape[:2] == (2, 8) and mask.tolist() == [[1] * 8] * 2


def stacked(rows):
    """The transformer's text inputs for samples with these rows, as a tuple."""
    inputs = qwen_image.text_inputs(rows)
    return inputs["encoder_hidden_states"], inputs["encoder_hidden_states_mask"]


def test_rows_encoded_apart_stack_as_encode_prompt_batches_them(pipe, parse):
    settings = qwen_image.prompt_settings(pipe, parse())
    with torch.no_grad():
        together = qwen_image.encode_prompts(pipe, PROMPTS, "cpu", settings)
        apart = [qwen_image.encode_prompts(pipe, [prompt], "cpu", settings) for prompt in PROMPTS]
        expected_embeds, expected_mask = pipe.encode_prompt(PROMPTS, max_sequence_length=512)
    # Rows of one batch stack back into it bitwise; rows encoded apart (e.g. cached in other chunks) to float noise.
    stacked_embeds, stacked_mask = stacked(list(zip(*together)))
    assert torch.equal(stacked_embeds, expected_embeds) and torch.equal(stacked_mask, expected_mask)
    stacked_embeds, stacked_mask = stacked([(embeds[0], mask[0]) for embeds, mask in apart])
    torch.testing.assert_close(stacked_embeds, expected_embeds, rtol=1e-5, atol=1e-6)
    assert torch.equal(stacked_mask, expected_mask) and not stacked_embeds[0, 10:].any()
    # The longer prompt's row, padded in its batch, stacks alone unpadded and unmasked.
    alone_embeds, alone_mask = stacked([(together[0][0], together[1][0])] * 2)
    assert alone_mask is None and alone_embeds.shape[1] == 10


@pytest.mark.parametrize("value", [0, 1025])
def test_a_bad_sequence_length_fails_in_one_line(parse, value):
    with pytest.raises(UsageError) as error:
        parse("--max_sequence_length", value)
    assert str(error.value) == (f"--max_sequence_length={value}: expected a positive integer of at most 1024 "
                                "(QwenImagePipeline's limit)")


def test_a_size_the_latents_cannot_pack_fails_in_one_line_from_the_vae_configuration(parse, tiny):
    # The tiny VAE halves the size (Qwen-Image's divides it by 8: sizes must be multiples of 16).
    with pytest.raises(UsageError) as error:
        parse("--resolution", 34)
    assert str(error.value) == ("--resolution=34: expected a multiple of 4: the VAE divides the size by 2, and the "
                                "latents are packed in 2×2 patches")
    parser = training_parser("test")
    qwen_image.add_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", str(tiny["sd"])])
    with pytest.raises(UsageError) as error:
        qwen_image.check_args(args)
    assert str(error.value) == (f"--pretrained_model_name_or_path={str(tiny['sd'])!r}: expected a Qwen-Image "
                                "pipeline, whose vae configuration is Qwen-Image's VAE's")


def test_the_one_frame_vae_encodes_images_as_the_pipelines_video_vae(pipe):
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        parameters = qwen_image.OneFrameVAE(pipe.vae).encode(images).latent_dist.parameters
        expected = pipe.vae.encode(images[:, :, None]).latent_dist.parameters
    assert parameters.shape == (2, 2 * pipe.vae.config.z_dim, 1, 16, 16) and torch.equal(parameters, expected)


# A square, and a non-square aspect-ratio bucket (24 pixels high, 40 wide): each image's (frames, rows, columns) of
# patches, which place its tokens for the rotary embedding, are the pipeline's for that height and width.
@pytest.mark.parametrize("height, width", [(32, 32), (24, 40)])
def test_sampling_towards_the_training_target_follows_the_training_path(pipe, parse, monkeypatch, height, width):
    settings = qwen_image.prompt_settings(pipe, parse())
    generator = torch.Generator().manual_seed(0)
    latent_height, latent_width = height // pipe.vae_scale_factor, width // pipe.vae_scale_factor
    # What the VAE makes of two height x width images.
    vae_latents = torch.randn(2, 4, 1, latent_height, latent_width, generator=generator)
    latents = qwen_image.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    packed_noise, target_tokens = (pipe._pack_latents(tensor, 2, 4, latent_height, latent_width)
                                   for tensor in (noise, target))
    # The transformer's output tokens that the training step reads back as exactly the target.
    assert torch.equal(qwen_image.prediction(pipe, target_tokens, latents), target)
    calls, decoded = [], []

    def transformer_predicting_the_target(**inputs):
        calls.append(inputs)
        return (target_tokens,)

    def decode(latents, return_dict=True):
        decoded.append(latents)
        return (torch.zeros(2, 3, 1, height, width),)

    monkeypatch.setattr(pipe.transformer, "forward", transformer_predicting_the_target)
    monkeypatch.setattr(pipe.vae, "decode", decode)
    pipe(prompt=PROMPTS, height=height, width=width, num_inference_steps=4, true_cfg_scale=1.0, latents=packed_noise,
         output_type="np", **settings)
    # Straight from the noise to the latents the target points away from, given to the VAE in its own scale.
    torch.testing.assert_close(decoded[0], vae_latents, rtol=0, atol=1e-5)

    with torch.no_grad():
        rows = list(zip(*qwen_image.encode_prompts(pipe, PROMPTS, "cpu", settings)))
    prompt_embeds, mask = stacked(rows)
    assert mask is not None and len(calls) == 4
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step].expand(2)
        expected = qwen_image.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, {})
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        assert torch.equal(call["timestep"], expected["timestep"])
        assert call["img_shapes"] == expected["img_shapes"] == [[(1, latent_height // 2, latent_width // 2)]] * 2
        assert torch.equal(call["encoder_hidden_states"], prompt_embeds)
        assert torch.equal(call["encoder_hidden_states_mask"], mask) and call["guidance"] is None
    # The first step starts from pure noise; the pipeline shifts the steps' noise levels for the image size with the
    # scheduler configuration's dynamic shift, and training draws its levels from the same path.
    assert torch.equal(calls[0]["hidden_states"], packed_noise)
    config = pipe.scheduler.config
    mu = calculate_shift(packed_noise.shape[1], config.base_image_seq_len, config.max_image_seq_len,
                         config.base_shift, config.max_shift)
    expected_schedule = FlowMatchEulerDiscreteScheduler.from_config(config)
    expected_schedule.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=mu)
    assert torch.equal(pipe.scheduler.sigmas, expected_schedule.sigmas) and config.use_dynamic_shifting
    assert pipe.scheduler.sigmas[0] == 1 and pipe.scheduler.sigmas[-2] == pytest.approx(config.shift_terminal)


# The ControlNet (QwenImageControlNetPipeline's): made from the transformer, and fed what that pipeline feeds it.

def conditioning_image(seed=0, size=32):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (size, size, 3), dtype=np.uint8))


def as_pixels(image):
    """An image as a conditioning image's pixels from `ImageWithConditioningTransform`: (1, 3, H, W) in [0, 1]."""
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float() / 255


def render(pipe, **kwargs):
    return pipe(prompt=PROMPTS[0], height=32, width=32, num_inference_steps=2, true_cfg_scale=1.0, output_type="pt",
                generator=torch.Generator().manual_seed(0), max_sequence_length=32, **kwargs).images


def test_a_controlnet_from_the_transformer_copies_its_blocks_and_changes_nothing_until_it_trains(pipe):
    controlnet = qwen_image.controlnet_from_transformer(pipe.transformer, 3)
    # The transformer's width, not the class's defaults (the released model's); a block past its two starts random.
    assert (controlnet.config.num_layers, controlnet.inner_dim) == (3, 32)
    for index in range(2):
        for name, tensor in pipe.transformer.transformer_blocks[index].state_dict().items():
            assert torch.equal(controlnet.transformer_blocks[index].state_dict()[name], tensor), name
    assert not controlnet.controlnet_x_embedder.weight.any()
    assert not any(block.weight.any() for block in controlnet.controlnet_blocks)
    controlnet_pipe = QwenImageControlNetPipeline(**pipe.components, controlnet=controlnet)
    controlnet_pipe.set_progress_bar_config(disable=True)
    # The same starting noise (the ControlNet pipeline draws the control image's latents from the generator first).
    noise = torch.randn(1, 64, 16, generator=torch.Generator().manual_seed(1))
    assert torch.equal(render(controlnet_pipe, control_image=conditioning_image(), latents=noise),
                       render(pipe, latents=noise))


def test_the_controlnet_cond_is_what_the_pipeline_feeds_the_controlnet(tiny, pipe, monkeypatch):
    controlnet = QwenImageControlNetModel.from_pretrained(tiny["qwen_image_controlnet"])
    controlnet_pipe = QwenImageControlNetPipeline(**pipe.components, controlnet=controlnet)
    controlnet_pipe.set_progress_bar_config(disable=True)
    calls = []
    forward = controlnet.forward

    def recording(**inputs):
        calls.append(inputs)
        return forward(**inputs)

    monkeypatch.setattr(controlnet, "forward", recording)
    image = conditioning_image(seed=1)
    # The pipeline samples the control image's latents from its generator before it draws the initial noise.
    render(controlnet_pipe, control_image=image)
    expected = qwen_image.controlnet_cond(controlnet_pipe, as_pixels(image), torch.Generator().manual_seed(0))
    assert expected.shape == (1, 64, 16)
    assert all(torch.equal(call["controlnet_cond"], expected) for call in calls) and len(calls) == 2
    # Its other inputs are the transformer's: the latents packed as `model_inputs` packs them, the timestep over 1000.
    latents = controlnet_pipe._unpack_latents(calls[0]["hidden_states"], 32, 32, controlnet_pipe.vae_scale_factor)
    inputs = qwen_image.model_inputs(controlnet_pipe, latents, torch.tensor([1000.0]), {})
    assert torch.equal(calls[0]["hidden_states"], inputs["hidden_states"])
    assert torch.equal(calls[0]["timestep"], inputs["timestep"])
    # The ControlNet pipeline gives each image its shape, QwenImagePipeline (and training) a list of one shape: the
    # rotary embedding reads each image's first shape either way.
    assert calls[0]["img_shapes"] == [shapes[0] for shapes in inputs["img_shapes"]]
