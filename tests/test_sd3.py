"""training_utils.sd3: SD3's prompt encoding equals StableDiffusion3Pipeline's; its flags."""

import pytest
import torch
from diffusers import StableDiffusion3Pipeline

from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.lora import CLIP_ATTENTION_PROJECTIONS, add_lora
from training_utils.sd3 import add_sd3_args, check_sd3_args, encode_prompt, tokenize_prompt

PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background"]


@pytest.fixture(scope="module")
def sd3_pipe(tiny):
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny["sd3"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tokenizers(pipe):
    return [pipe.tokenizer, pipe.tokenizer_2, pipe.tokenizer_3]


def text_encoders(pipe):
    return [pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]


def parse(*argv):
    parser = training_parser("test")
    add_sd3_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "x", *map(str, argv)])
    check_sd3_args(args)
    return args


@pytest.mark.parametrize("prompts, max_sequence_length", [(PROMPTS[:1], 77), (PROMPTS, 12)])
def test_prompt_embeddings_equal_the_pipelines_encode_prompt(sd3_pipe, prompts, max_sequence_length):
    input_ids = tokenize_prompt(tokenizers(sd3_pipe), prompts, max_sequence_length)
    with torch.no_grad():
        prompt_embeds, pooled = encode_prompt(text_encoders(sd3_pipe), input_ids)
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
    ids = tokenize_prompt(tokenizers(sd3_pipe), PROMPTS, 16)
    with torch.no_grad():
        prompt_embeds, pooled = encode_prompt(text_encoders(sd3_pipe), ids)
        first = sd3_pipe.text_encoder(ids[0], output_hidden_states=True)
        second = sd3_pipe.text_encoder_2(ids[1], output_hidden_states=True)
        t5 = sd3_pipe.text_encoder_3(ids[2])[0]
    width_1, width_2 = first.hidden_states[-2].shape[-1], second.hidden_states[-2].shape[-1]
    clip_length = ids[0].shape[1]
    assert torch.equal(prompt_embeds[:, :clip_length, :width_1], first.hidden_states[-2])
    assert torch.equal(prompt_embeds[:, :clip_length, width_1:width_1 + width_2], second.hidden_states[-2])
    assert torch.equal(prompt_embeds[:, :clip_length, width_1 + width_2:],
                       torch.zeros_like(prompt_embeds[:, :clip_length, width_1 + width_2:]))
    assert torch.equal(prompt_embeds[:, clip_length:], t5)
    assert torch.equal(pooled, torch.cat([first.text_embeds, second.text_embeds], dim=-1))


def test_each_images_prompt_indexed_from_the_distinct_prompts_embeds_as_that_prompt_alone(sd3_pipe):
    # What the DreamBooth script does: the instance, class and empty prompts are embedded once (in every step when
    # the encoders train) and each image of a batch takes its own by `prompt_index`; upstream embeds every image's
    # prompt. The two agree: no prompt's embedding depends on the others in its batch.
    prompts = [PROMPTS[0], PROMPTS[1], ""]
    prompt_index = torch.tensor([0, 2, 0, 1, 1, 1])

    def embed(texts):
        with torch.no_grad():
            return encode_prompt(text_encoders(sd3_pipe), tokenize_prompt(tokenizers(sd3_pipe), texts, 16))

    prompt_embeds, pooled = embed(prompts)
    expected, expected_pooled = embed([prompts[index] for index in prompt_index])
    torch.testing.assert_close(prompt_embeds[prompt_index], expected)
    torch.testing.assert_close(pooled[prompt_index], expected_pooled)
    assert not torch.allclose(prompt_embeds[2], prompt_embeds[0])  # the empty prompt is a prompt of its own


def test_gradients_reach_the_clip_encoders_adapters(tiny):
    pipe = StableDiffusion3Pipeline.from_pretrained(tiny["sd3"])  # its own copy: adapters are added
    for text_encoder in (pipe.text_encoder, pipe.text_encoder_2):
        add_lora(text_encoder, 4, CLIP_ATTENTION_PROJECTIONS)
    pipe.text_encoder_3.requires_grad_(False)
    prompt_embeds, pooled = encode_prompt(text_encoders(pipe), tokenize_prompt(tokenizers(pipe), PROMPTS, 8))
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
    args = parse()
    assert (args.max_sequence_length, args.precondition_outputs) == (77, 1)
