"""training_utils.families.ltx: LTX-Video's prompt encoding, latent layout, noise levels, frame-rate positions and
image-to-video conditioning are the pipelines' own.

The central check: sampling with a transformer that predicts exactly the training target follows the training path
step by step and ends on the clean latents, text-to-video and image-to-video alike (the first frame held at the
image's latents, its tokens at timestep 0)."""

import numpy as np
import pytest
import torch
from diffusers import LTXImageToVideoPipeline
from peft.tuners.lora import LoraLayer
from PIL import Image
from safetensors.torch import load_file

from training_utils.adapters.export import LoraExport
from training_utils.adapters.injection import add_lora, linear_layers_named
from training_utils.args import training_parser
from training_utils.families import ltx
from training_utils.flow_matching import add_flow_matching_args, add_noise, velocity
from training_utils.testing.tiny.ltx import LATENT_CHANNELS, ltx_pipeline

PROMPTS = ["a red circle on a white background", "a blue square"]


@pytest.fixture(scope="module")
def pipe():
    pipe = ltx_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parse(*argv):
    parser = training_parser("test")
    ltx.add_args(parser)
    add_flow_matching_args(parser, weighting_scheme="none")
    args = parser.parse_args(["--pretrained_model_name_or_path", "unused", *map(str, argv)])
    ltx.check_args(args)
    return args


def test_the_vae_compresses_as_ltx_videos_and_the_geometry_says_so(pipe):
    assert (pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio) == (32, 8)
    with torch.no_grad():
        latents = pipe.vae.encode(torch.zeros(1, 3, 17, 64, 96)).latent_dist.mode()
    assert latents.shape == (1, LATENT_CHANNELS, 3, 2, 3)
    assert ltx.VIDEO.min_frames == 9 and ltx.VIDEO.counts_up_to(16) == [9] and not ltx.VIDEO.takes(6)


def test_prompts_encode_as_the_pipeline_encodes_them_when_it_samples(pipe):
    settings = ltx.prompt_settings(pipe, parse())
    assert settings == {"max_sequence_length": 128}
    with torch.no_grad():
        embeds, mask = ltx.encode_prompts(pipe, PROMPTS, "cpu", settings)
        expected, expected_mask, _, _ = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=128)
    assert torch.equal(embeds, expected) and torch.equal(mask, expected_mask) and embeds.shape == (2, 128, 32)
    assert not torch.allclose(embeds[0], embeds[1]) and mask[0].sum() != mask[1].sum()
    text = ltx.text_inputs(list(zip(embeds, mask)))
    assert text.keys() == {"encoder_hidden_states", "encoder_attention_mask"}


def test_the_training_levels_are_the_samplers_for_the_clips_tokens(pipe, monkeypatch):
    # The pipeline sampling 1000 steps visits exactly the levels training draws from for its latents' tokens.
    monkeypatch.setattr(pipe.transformer, "forward", lambda hidden_states, **_: (torch.zeros_like(hidden_states),))
    pipe(prompt=PROMPTS[0], height=64, width=64, num_frames=17, num_inference_steps=1000, guidance_scale=1.0,
         output_type="latent", max_sequence_length=16)
    noise_scheduler = ltx.training_noise_scheduler(pipe)
    schedule = ltx.sampler_schedule(noise_scheduler, 3 * 2 * 2)
    assert torch.equal(schedule.timesteps, pipe.scheduler.timesteps)
    assert torch.equal(schedule.sigmas, pipe.scheduler.sigmas)
    assert abs(float(schedule.sigmas[-2]) - 0.1) < 1e-6  # stretched to end at the configuration's shift_terminal
    latents = torch.zeros(4096, LATENT_CHANNELS, 3, 2, 2)
    timesteps, sigmas = ltx.sample_denoiser_timesteps(pipe, noise_scheduler, parse(), latents, "transformer")
    assert set(timesteps.tolist()) <= set(schedule.timesteps.tolist()) and timesteps.unique().numel() > 900
    torch.testing.assert_close(sigmas.flatten(), timesteps / 1000)  # the transformer reads the shifted level
    larger, _ = ltx.sample_denoiser_timesteps(pipe, noise_scheduler, parse(), torch.zeros(4096, 8, 9, 16, 16), None)
    assert larger.mean() > timesteps.mean() + 50  # more tokens, shifted towards noise, as the sampler shifts them


def test_sampling_towards_the_training_target_follows_the_training_path(pipe, monkeypatch):
    settings = ltx.prompt_settings(pipe, parse("--max_sequence_length", 16))
    generator = torch.Generator().manual_seed(0)
    vae_latents = torch.randn(1, LATENT_CHANNELS, 3, 2, 2, generator=generator)  # 17 frames of 64x64 pixels
    latents = ltx.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    inputs = ltx.model_inputs(pipe, latents, torch.tensor([0.0]), {})
    assert torch.equal(ltx.prediction(pipe, inputs["hidden_states"], latents), latents)
    target = inputs["hidden_states"] * 0 + ltx.model_inputs(pipe, velocity(latents, noise), None, {})["hidden_states"]
    calls = []
    monkeypatch.setattr(pipe.transformer, "forward", lambda **inputs: calls.append(inputs) or (target,))
    decoded = []
    monkeypatch.setattr(pipe.vae, "decode", lambda latents, *_, **__: decoded.append(latents)
                        or (torch.zeros(1, 3, 17, 64, 64),))
    pipe(prompt=PROMPTS[0], height=64, width=64, num_frames=17, frame_rate=12, num_inference_steps=6,
         guidance_scale=1.0, latents=pipe._pack_latents(noise), **settings)
    # Straight to the clean latents, which the pipeline denormalises back into the VAE's own.
    torch.testing.assert_close(decoded[0], vae_latents, rtol=0, atol=1e-5)
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(PROMPTS[0], device="cpu", do_classifier_free_guidance=False, **settings)[:2]
    assert len(calls) == 6
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step:step + 1]
        expected = ltx.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, {}, frame_rate=[12.0])
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-6)
        assert torch.equal(call["timestep"], expected["timestep"])
        assert (call["num_frames"], call["height"], call["width"]) == (3, 2, 2) == \
            (expected["num_frames"], expected["height"], expected["width"])
        assert call["rope_interpolation_scale"] == (8 / 12, 32, 32)
        assert torch.equal(expected["rope_interpolation_scale"][0], torch.full((1, 1, 1, 1, 1), 8 / 12))
        assert torch.equal(call["encoder_hidden_states"], embeds) and torch.equal(call["encoder_attention_mask"], mask)


def test_each_sample_is_placed_in_time_at_its_own_frame_rate(pipe):
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, LATENT_CHANNELS, 3, 2, 2, generator=generator)
    text = {"encoder_hidden_states": torch.randn(2, 16, 32, generator=generator),
            "encoder_attention_mask": torch.ones(2, 16)}
    timesteps = torch.tensor([300.0, 700.0])
    with torch.no_grad():
        together = pipe.transformer(**ltx.model_inputs(pipe, latents, timesteps, text, [8.0, None]))[0]
        for index, rate in enumerate([8.0, 25.0]):  # None: the native rate
            alone = pipe.transformer(
                hidden_states=pipe._pack_latents(latents[index:index + 1]), timestep=timesteps[index:index + 1],
                encoder_hidden_states=text["encoder_hidden_states"][index:index + 1],
                encoder_attention_mask=text["encoder_attention_mask"][index:index + 1], num_frames=3, height=2,
                width=2, rope_interpolation_scale=(8 / rate, 32, 32))[0]
            torch.testing.assert_close(together[index:index + 1], alone, rtol=0, atol=1e-6)
        other_rate = pipe.transformer(**ltx.model_inputs(pipe, latents, timesteps, text, [25.0, 25.0]))[0]
    assert not torch.allclose(other_rate[0], together[0]) and torch.equal(other_rate[1], together[1])


def test_image_to_video_training_inputs_are_the_pipelines_conditioning_on_its_image(pipe, monkeypatch):
    i2v = LTXImageToVideoPipeline(**pipe.components)
    i2v.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    image = Image.fromarray(torch.randint(0, 256, (64, 64, 3), generator=generator, dtype=torch.uint8).numpy())
    first_frame = i2v.video_processor.preprocess(image, height=64, width=64)  # what training lays out: [-1, 1]
    latents = ltx.normalized_latents(i2v, torch.randn(1, LATENT_CHANNELS, 3, 2, 2, generator=generator))
    torch.manual_seed(5)  # the pipeline's generator draws the image's latents, then the noise
    first_latents = ltx.image_to_video_conditioning(i2v, first_frame)
    noise = torch.randn(latents.shape)
    assert first_latents.shape == (1, LATENT_CHANNELS, 1, 2, 2)
    calls = []
    monkeypatch.setattr(i2v.transformer, "forward", lambda **inputs: calls.append(inputs) or (
        ltx.model_inputs(i2v, velocity(latents, noise), None, {})["hidden_states"],))
    i2v(image=image, prompt=PROMPTS[0], height=64, width=64, num_frames=17, num_inference_steps=3, guidance_scale=1.0,
        output_type="latent", max_sequence_length=16, generator=torch.Generator().manual_seed(5))
    for step, call in enumerate(calls):
        sigma, timestep = i2v.scheduler.sigmas[step], i2v.scheduler.timesteps[step:step + 1]
        expected = ltx.image_to_video_inputs(i2v, add_noise(latents, noise, sigma), timestep, {}, first_latents, [25])
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        assert torch.equal(call["timestep"], expected["timestep"])
        assert call["timestep"].shape == (1, 12) and torch.equal(call["timestep"][0, :4], torch.zeros(4))
        assert bool((call["timestep"][0, 4:] == timestep).all())
    assert len(calls) == 3


def test_a_still_has_no_frame_to_learn_in_image_to_video(caplog):
    from training_utils.data.video import Clip

    clips = [Clip("a.mp4", "a", list(range(9)), (32, 32)), Clip("b.png", "b", [0], (32, 32))]
    assert ltx.clips_with_frames_to_learn(clips) == clips[:1]
    assert "left out 1 one-frame clips (still images)" in caplog.text


def test_the_comfyui_file_is_ltx_videos_original_layout_at_the_trained_strength(tmp_path):
    # Every block layer, with lora_alpha != rank: diffusers reads ComfyUI's LTX-Video layout (its loader strips the
    # prefix) into the same weight changes; the embedders are named as the original model names them.
    pipe = ltx_pipeline()
    layers = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "time_embed.linear"]
    add_lora(pipe.transformer, 4, linear_layers_named(pipe.transformer, layers), alpha=6.0)
    generator = torch.Generator().manual_seed(0)
    for name, parameter in pipe.transformer.named_parameters():
        if "lora_B" in name:
            parameter.data = torch.randn(parameter.shape, generator=generator)
    LoraExport.of(type(pipe), {"transformer": pipe.transformer}, ["diffusers", "comfyui"]).save(tmp_path)
    converted = load_file(tmp_path / "pytorch_lora_weights_comfyui.safetensors")
    for name in ("transformer_blocks.0.attn1.to_q", "transformer_blocks.1.attn2.to_out.0",
                 "transformer_blocks.1.ff.net.2", "patchify_proj", "adaln_single.linear"):
        assert f"diffusion_model.{name}.lora_A.weight" in converted and converted[f"diffusion_model.{name}.alpha"] == 6
    # diffusers' LTX-Video loader reads neither alphas nor the embedders' original names: the blocks' layers, each
    # down projection scaled by alpha / rank, as ComfyUI applies them.
    blocks_only = {key: value * converted[key.replace(".lora_A.weight", ".alpha")] / 4 if ".lora_A." in key else value
                   for key, value in converted.items() if ".transformer_blocks." in key and ".alpha" not in key}
    fresh = ltx_pipeline()
    fresh.load_lora_weights(str(tmp_path / "pytorch_lora_weights.safetensors"), adapter_name="ours")
    fresh.load_lora_weights(blocks_only, adapter_name="comfyui")
    adapted = [module for module in fresh.transformer.modules()
               if isinstance(module, LoraLayer) and "comfyui" in module.lora_A]
    assert len(adapted) == 2 * 10  # two blocks: self- and cross-attention 4 each, MLP 2
    for module in adapted:
        torch.testing.assert_close(module.get_delta_weight("comfyui"), module.get_delta_weight("ours"))


def test_validation_reads_the_pipelines_pil_frames(pipe):
    from training_utils.data.rendered_video import RenderedVideo

    frames = pipe(prompt=PROMPTS[0], height=32, width=32, num_frames=9, num_inference_steps=2,
                  max_sequence_length=16, generator=torch.Generator().manual_seed(0)).frames[0]
    assert isinstance(frames[0], Image.Image)  # the pipeline's default output_type, the geometry's
    video = RenderedVideo(frames, ltx.VIDEO.fps)
    assert video.frames.shape == (9, 32, 32, 3) and np.array_equal(video.frames[3], np.asarray(frames[3]))
