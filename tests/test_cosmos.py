"""training_utils.families.cosmos: Cosmos Predict 2.5's training inputs are those its pipeline's loop gives the
transformer; its conditioning frames, text dropout, flags, learning-rate schedule and validation starts."""

import argparse

import pytest
import torch
from PIL import Image

from training_utils.args import add_aliases, training_parser
from training_utils.data.video import Clip
from training_utils.errors import UsageError
from training_utils.families import base, cosmos
from training_utils.families.base import standardised_latents
from training_utils.flow_matching import velocity
from training_utils.testing.tiny.cosmos import cosmos_pipeline

SETTINGS = {"max_sequence_length": 48}


@pytest.fixture(scope="module")
def pipe():
    pipe = cosmos_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parse(*argv):
    parser = training_parser("test")
    parser.add_argument("--rank", type=int, default=4)
    cosmos.add_args(parser)
    add_aliases(parser, {"--rank": "--lora_rank"})
    args = parser.parse_args(["--pretrained_model_name_or_path", "cosmos", *map(str, argv)])
    cosmos.check_args(args)
    return args


def test_prompts_encode_as_the_pipeline_encodes_them_and_the_empty_prompt_as_zeros(pipe):
    prompts = ["a red circle on a white background", "", "a blue square on a black background"]
    with torch.no_grad():
        (rows,) = cosmos.encode_prompts(pipe, prompts, "cpu", SETTINGS)
        expected = pipe.encode_prompt(prompts[::2], do_classifier_free_guidance=False, **SETTINGS)[0]
    assert torch.equal(rows[::2], expected) and not torch.equal(expected[0], expected[1])
    assert torch.equal(rows[1], torch.zeros_like(rows[1]))


def test_the_training_inputs_are_those_the_pipeline_gives_its_transformer_from_an_image(pipe, monkeypatch):
    """Video2World from one image (the pipeline's Image2World, as validation starts it): the transformer's inputs at
    the first step are `conditioned_inputs` of the same latents, σ and conditioning frame."""
    image = Image.new("RGB", (32, 32), "red")
    calls = []
    monkeypatch.setattr(pipe.transformer, "forward",
                        lambda **inputs: calls.append(inputs) or (torch.zeros_like(inputs["hidden_states"]),))
    noise = torch.randn(1, 16, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    pipe(prompt="a red circle", video=[image], num_latent_conditional_frames=1, height=32, width=32, num_frames=9,
         num_inference_steps=2, guidance_scale=1.0, latents=noise, output_type="latent", **SETTINGS)
    with torch.no_grad():
        video = pipe.video_processor.preprocess_video([image] * 9, 32, 32)  # the image, then itself repeated
        clean = standardised_latents(pipe, pipe.vae.encode(video).latent_dist.mode())
        text = cosmos.text_inputs(list(zip(*cosmos.encode_prompts(pipe, ["a red circle"], "cpu", SETTINGS))))
    indicator = cosmos.frame_conditioning(noise, [1])
    sigma = pipe.scheduler.sigmas[:1]
    expected = cosmos.conditioned_inputs(pipe, cosmos.conditioned_latents(noise, clean, indicator), sigma, text,
                                         indicator, 0.0001)
    assert calls[0].keys() - {"return_dict"} == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(calls[0][name].float(), value.float(), rtol=0, atol=1e-5, msg=name)


def test_conditioning_frames_are_marked_given_clean_and_left_out_of_the_loss():
    latents, noise = torch.randn(2, 4, 3, 2, 2), torch.randn(2, 4, 3, 2, 2)
    indicator = cosmos.frame_conditioning(latents, [1, 2])
    assert indicator.flatten().tolist() == [1, 0, 0, 1, 1, 0]
    noisy = cosmos.conditioned_latents(noise, latents, indicator)
    assert torch.equal(noisy[0, :, 0], latents[0, :, 0]) and torch.equal(noisy[0, :, 1], noise[0, :, 1])
    output = torch.randn_like(latents)
    prediction = cosmos.generated_frames_prediction(output, latents, noise, indicator)
    assert torch.equal(prediction[1, :, :2], velocity(latents, noise)[1, :, :2])
    assert torch.equal(prediction[1, :, 2], output[1, :, 2])
    counts = [cosmos.draw_conditional_frames({1: 0.25, 2: 0.75}, torch.Generator().manual_seed(seed))
              for seed in range(400)]
    assert set(counts) == {1, 2} and 0.65 < counts.count(2) / 400 < 0.85
    assert cosmos.draw_conditional_frames({0: 1.0}, torch.Generator()) == 0


@pytest.mark.parametrize("flags, message", [
    (["--conditional_frames_probs", "[1, 2]"], "--conditional_frames_probs='[1, 2]': expected a JSON object of latent "
                                               "frame counts 0, 1 or 2 and their probabilities, such as "
                                               "{\"1\": 0.5, \"2\": 0.5}"),
    (["--conditional_frames_probs", '{"1": 0}'], None),
    (["--height", 40], "--height/--width='40/512': expected multiples of 16 (the VAE divides sides by 8, and the "
                       "pipeline takes whole patches)"),
    (["--checkpointing_epochs", 0], "--checkpointing_epochs=0: expected a positive integer"),
])
def test_bad_cosmos_flags_fail_in_one_line(flags, message):
    with pytest.raises(UsageError) as error:
        parse(*flags)
    assert message is None or str(error.value) == message


def test_upstream_flags_become_the_training_size_schedule_checkpoints_and_first_clip_render():
    args = parse("--height", 32, "--width", 48, "--conditional_frames_probs", '{"0": 0.2, "1": 0.8}', "--lora_rank", 8,
                 "--cfg_dropout_prob", 0.1, "--checkpointing_epochs", 3, "--do_final_eval")
    assert (args.aspect_ratio_buckets, args.conditional_frames_probs) == ([(32, 48)], {0: 0.2, 1: 0.8})
    assert (args.rank, args.caption_dropout) == (8, 0.1)
    cosmos.checkpoint_every_epochs(args, steps_per_epoch=5)
    assert args.checkpointing_steps == 15
    cosmos.validate_first_clip(args, [Clip("a.mp4", ["first caption", "second"], [0], (32, 32))])
    assert args.validation_prompt == ["first caption"]
    image = Image.new("RGB", (8, 8))
    assert cosmos.validation_starts([image], args) == [{"video": [image], "num_latent_conditional_frames": 1}]
    assert cosmos.validation_starts([image], parse("--conditional_frames_probs", '{"0": 1}')) == [{}]

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    schedule = cosmos.lr_scheduler(parse("--scheduler_warm_up_steps", 2, "--num_training_steps", 6), optimizer, 100, 1)
    rates = []
    for _ in range(8):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    # upstream's f_max 0.5 after 2 steps, then a straight line to f_min 0.2 at step 6
    assert rates == pytest.approx([0.0, 0.25, 0.5, 0.425, 0.35, 0.275, 0.2, 0.2])


def test_clips_with_no_latent_frame_past_their_conditioning_are_refused():
    args = parse()
    clips = [Clip("a.mp4", "a", list(range(9)), (32, 32)), Clip("b.mp4", "b", list(range(5)), (32, 32))]
    with pytest.raises(UsageError, match="expected clips of more than 2 latent frames \\(9 frames or more\\), the most "
                                         "that --conditional_frames_probs conditions on; the shortest has 5"):
        cosmos.check_conditional_frames(clips, args, cosmos.VIDEO, "--train_data_dir", "clips")
    cosmos.check_conditional_frames(clips, parse("--conditional_frames_probs", '{"1": 1}'), cosmos.VIDEO,
                                    "--train_data_dir", "clips")


def test_the_padding_mask_resizes_without_torchvision_as_torch_nearest_does():
    mask = torch.arange(16.0).reshape(1, 1, 4, 4)
    resized = cosmos.NearestResize.functional.resize(mask, [2, 2], cosmos.NearestResize.InterpolationMode.NEAREST)
    assert torch.equal(resized, mask[:, :, ::2, ::2])
    assert cosmos.video_geometry(argparse.Namespace()) == cosmos.VIDEO == base.fixed_geometry(cosmos.VIDEO)(None)
