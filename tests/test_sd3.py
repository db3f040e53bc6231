"""training_utils.families.sd3: SD3's prompt encoding equals StableDiffusion3Pipeline's; its flags."""

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from training_utils.adapters.injection import CLIP_ATTENTION_PROJECTIONS, add_lora
from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.families import sd3
from training_utils.families.base import tokenize

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def sd3_pipe(tiny):
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny["sd3"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def encode(pipe, prompts, max_sequence_length, text_encoders=None):
    return sd3.encode_prompts(pipe, prompts, "cpu", {"max_sequence_length": max_sequence_length}, text_encoders)


def parse(*argv):
    parser = training_parser("test")
    sd3.add_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "x", *map(str, argv)])
    sd3.check_args(args)
    return args


@pytest.mark.parametrize("prompts, max_sequence_length", [(PROMPTS[:1], 77), (PROMPTS, 12)])
def test_prompt_embeddings_equal_the_pipelines_encode_prompt(sd3_pipe, prompts, max_sequence_length):
    with torch.no_grad():
        prompt_embeds, pooled = encode(sd3_pipe, prompts, max_sequence_length)
        expected, _, expected_pooled, _ = sd3_pipe.encode_prompt(
            prompts, None, None, device="cpu", do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length)
    clip_length = sd3_pipe.tokenizer.model_max_length
    assert prompt_embeds.shape == (len(prompts), clip_length + max_sequence_length,
                                   sd3_pipe.text_encoder_3.config.d_model)
    assert pooled.shape == (len(prompts), sd3_pipe.text_encoder.config.projection_dim
                            + sd3_pipe.text_encoder_2.config.projection_dim)
    assert torch.equal(prompt_embeds, expected)
    assert torch.equal(pooled, expected_pooled)


def test_prompt_embeddings_are_both_clips_padded_then_t5_and_pooled_is_both_projections(sd3_pipe):
    t5_ids = sd3_pipe.tokenizer_3(PROMPTS, padding="max_length", max_length=16, truncation=True,
                                  return_tensors="pt").input_ids
    with torch.no_grad():
        prompt_embeds, pooled = encode(sd3_pipe, PROMPTS, 16)
        first = sd3_pipe.text_encoder(tokenize(sd3_pipe.tokenizer, PROMPTS), output_hidden_states=True)
        second = sd3_pipe.text_encoder_2(tokenize(sd3_pipe.tokenizer_2, PROMPTS), output_hidden_states=True)
        t5 = sd3_pipe.text_encoder_3(t5_ids)[0]
    width_1, width_2 = first.hidden_states[-2].shape[-1], second.hidden_states[-2].shape[-1]
    clip_length = sd3_pipe.tokenizer.model_max_length
    assert torch.equal(prompt_embeds[:, :clip_length, :width_1], first.hidden_states[-2])
    assert torch.equal(prompt_embeds[:, :clip_length, width_1:width_1 + width_2], second.hidden_states[-2])
    assert torch.equal(prompt_embeds[:, :clip_length, width_1 + width_2:],
                       torch.zeros_like(prompt_embeds[:, :clip_length, width_1 + width_2:]))
    assert torch.equal(prompt_embeds[:, clip_length:], t5)
    assert torch.equal(pooled, torch.cat([first.text_embeds, second.text_embeds], dim=-1))


def test_each_images_row_from_the_distinct_prompts_embeds_as_that_prompt_alone(sd3_pipe):
    # What the DreamBooth script does: the instance, class and empty prompts are embedded once (in every step when
    # the encoders train) and each image of a batch takes its prompt's row; upstream embeds every image's prompt.
    # The two agree: no prompt's embedding depends on the others in its batch.
    prompts = [PROMPTS[0], PROMPTS[1], ""]
    batch = [prompts[index] for index in (0, 2, 0, 1, 1, 1)]
    with torch.no_grad():
        rows = dict(zip(prompts, zip(*encode(sd3_pipe, prompts, 16))))
        expected, expected_pooled = encode(sd3_pipe, batch, 16)
    inputs = sd3.text_inputs([rows[prompt] for prompt in batch])
    torch.testing.assert_close(inputs["encoder_hidden_states"], expected)
    torch.testing.assert_close(inputs["pooled_projections"], expected_pooled)
    assert not torch.allclose(rows[""][0], rows[prompts[0]][0])  # the empty prompt is a prompt of its own


def test_gradients_reach_the_clip_encoders_adapters(tiny):
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny["sd3"])  # its own copy: adapters are added
    for text_encoder in (pipe.text_encoder, pipe.text_encoder_2):
        add_lora(text_encoder, 4, CLIP_ATTENTION_PROJECTIONS)
    pipe.text_encoder_3.requires_grad_(False)
    prompt_embeds, pooled = encode(pipe, PROMPTS, 8)
    (prompt_embeds.square().sum() + pooled.square().sum()).backward()
    for text_encoder in (pipe.text_encoder, pipe.text_encoder_2):
        # lora_B starts at zero (so the adapter starts as a no-op); its gradient is the one that is non-zero.
        grads = [p.grad for name, p in text_encoder.named_parameters() if "lora_B" in name]
        assert grads and all(grad is not None and grad.abs().sum() > 0 for grad in grads)


@pytest.mark.parametrize("flags, message", [
    (["--max_sequence_length", 0], "--max_sequence_length=0: expected a positive integer"),
])
def test_bad_flags_raise_one_line(flags, message):
    with pytest.raises(UsageError) as error:
        parse(*flags)
    assert str(error.value) == message


def test_defaults_follow_the_diffusers_sd3_scripts():
    assert parse().max_sequence_length == 77
