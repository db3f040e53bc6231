"""training_utils.families.wan: Wan's prompt encoding, latent layout, noise levels, experts and transformer inputs
are the pipeline's own.

The central check: sampling with transformers that predict exactly the training target follows the training path
step by step and ends on the clean latents, each step in the expert that training gives that noise level. The
image-to-video script refuses a model or data it cannot train before any weights load."""

import argparse
import shutil

import numpy as np
import pytest
import torch
from peft.tuners.lora import LoraLayer
from PIL import Image
from safetensors.torch import load_file

from helpers import usage_error
from training_utils.adapters.export import LoraExport
from training_utils.adapters.injection import add_lora, linear_layers_named
from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.families import wan
from training_utils.flow_matching import add_flow_matching_args, add_noise, velocity
from training_utils.pipeline import trainable_parameters
from training_utils.testing.tiny.video import build_moving_shapes
from training_utils.testing.tiny.wan import wan_i2v_pipeline, wan_pipeline

I2V_SCRIPT = "video/train_image_to_video_lora_wan.py"
PROMPTS = ["a red circle on a white background", "a blue square"]


@pytest.fixture(scope="module")
def pipes():
    pipes = {"wan21": wan_pipeline(), "wan22": wan_pipeline(two_experts=True),
             "ti2v": wan_pipeline(expand_timesteps=True)}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    return pipes


def parse(*argv, model="unused"):
    parser = training_parser("test")
    wan.add_args(parser)
    add_flow_matching_args(parser, weighting_scheme="none")
    args = parser.parse_args(["--pretrained_model_name_or_path", str(model), *map(str, argv)])
    wan.check_args(args)
    return args


def test_prompts_encode_as_the_pipeline_encodes_them_when_it_samples(pipes):
    pipe = pipes["wan21"]
    settings = wan.prompt_settings(pipe, parse())
    assert settings == {"max_sequence_length": 512}  # what __call__ passes, not encode_prompt's own default (226)
    with torch.no_grad():
        rows, = wan.encode_prompts(pipe, PROMPTS, "cpu", settings)
        expected, negative = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=512)
    assert rows.shape == (2, 512, 32) and torch.equal(rows, expected)
    assert not torch.allclose(rows[0], rows[1])
    assert wan.text_inputs(list(zip(rows)))["encoder_hidden_states"].shape == (2, 512, 32)
    short = wan.prompt_settings(pipe, parse("--max_sequence_length", 16))
    assert wan.encode_prompts(pipe, PROMPTS, "cpu", short)[0].shape == (2, 16, 32)


def test_the_training_noise_levels_are_the_samplers_shifted_ones(pipes):
    pipe = pipes["wan21"]
    noise_scheduler = wan.training_noise_scheduler(pipe)
    assert noise_scheduler.config.shift == pipe.scheduler.config.flow_shift == 3.0
    pipe.scheduler.set_timesteps(10)
    for timestep, sigma in zip(pipe.scheduler.timesteps, pipe.scheduler.sigmas):
        # The sampler's integer timesteps: the training schedule's sigma there is the sampler's, to their rounding.
        index = int((noise_scheduler.timesteps - timestep).abs().argmin())
        assert abs(float(noise_scheduler.sigmas[index]) - float(sigma)) < 2e-3


@pytest.mark.parametrize("name", ["wan21", "wan22", "ti2v"])
def test_sampling_towards_the_training_target_follows_the_training_path_in_each_expert(pipes, monkeypatch, name):
    pipe = pipes[name]
    settings = wan.prompt_settings(pipe, parse("--max_sequence_length", 16))
    generator = torch.Generator().manual_seed(0)
    side = 32 // pipe.vae_scale_factor_spatial  # 4, or TI2V's 2
    vae_latents = torch.randn(1, pipe.vae.config.z_dim, 3, side, side, generator=generator)  # 9 frames of 32x32
    latents = wan.normalized_latents(pipe, vae_latents)
    noise = torch.randn(latents.shape, generator=generator)
    target = velocity(latents, noise)
    calls = []
    for component in ("transformer", "transformer_2"):
        if getattr(pipe, component) is not None:
            monkeypatch.setattr(getattr(pipe, component), "forward",
                                lambda component=component, **inputs: calls.append((component, inputs)) or (target,))
    decoded, blank_video = [], torch.zeros(1, 3, 9, 32, 32)
    monkeypatch.setattr(pipe.vae, "decode", lambda latents, **_: decoded.append(latents) or (blank_video,))
    pipe(prompt=PROMPTS[0], height=32, width=32, num_frames=9, num_inference_steps=6, guidance_scale=1.0,
         latents=noise, **settings)
    # Straight to the clean latents, which the pipeline un-standardises back into the VAE's own.
    torch.testing.assert_close(decoded[0], vae_latents, rtol=0, atol=1e-4)

    noise_scheduler = wan.training_noise_scheduler(pipe)
    ranges = wan.expert_ranges(pipe, noise_scheduler)
    with torch.no_grad():
        prompt_embeds = pipe.encode_prompt(PROMPTS[0], device="cpu", do_classifier_free_guidance=False,
                                           **settings)[0]
    assert len(calls) == 6
    for step, (component, call) in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step:step + 1]
        expected = wan.model_inputs(pipe, add_noise(latents, noise, sigma), timestep, {})
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        assert torch.equal(call["timestep"], expected["timestep"])
        assert torch.equal(call["encoder_hidden_states"], prompt_embeds)
        # The expert that training gives this noise level is the one the pipeline called.
        index = int((noise_scheduler.timesteps - timestep).abs().argmin())
        first, end = ranges[component]
        assert first <= index < end, (component, float(timestep))
    if name == "wan22":
        assert {component for component, _ in calls} == {"transformer", "transformer_2"}
    if name == "ti2v":  # one timestep per token of 1x2x2 patches: 3 frames of 1x1 (a 16x VAE's 2x2 latents)
        assert calls[0][1]["timestep"].shape == (1, 3)


def test_each_expert_trains_only_on_its_own_timesteps(pipes):
    pipe = pipes["wan22"]
    noise_scheduler = wan.training_noise_scheduler(pipe)
    args = parse("--weighting_scheme", "logit_normal")
    latents = torch.zeros(4096, 16, 1, 2, 2)
    boundary = pipe.config.boundary_ratio * 1000
    high, high_sigmas = wan.sample_denoiser_timesteps(pipe, noise_scheduler, args, latents, "transformer")
    low, low_sigmas = wan.sample_denoiser_timesteps(pipe, noise_scheduler, args, latents, "transformer_2")
    assert bool((high >= boundary).all()) and bool((low < boundary).all())
    assert high.unique().numel() > 10 and low.unique().numel() > 100  # spread over each range
    torch.testing.assert_close(high_sigmas.flatten(), high / 1000)
    assert wan.trained_denoisers(pipe, argparse.Namespace(train_expert="low")).keys() == {"transformer_2"}
    assert wan.trained_denoisers(pipe, argparse.Namespace(train_expert=None)).keys() == {"transformer", "transformer_2"}
    both = {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}
    chosen = [wan.step_denoiser(pipe, noise_scheduler, both, 0, step) for step in range(400)]
    share = chosen.count("transformer") / len(chosen)
    expected = ranges_share = wan.expert_ranges(pipe, noise_scheduler)["transformer"][1] / 1000
    assert abs(share - expected) < 0.1 and ranges_share > 0
    assert chosen == [wan.step_denoiser(pipe, noise_scheduler, both, 0, step) for step in range(400)]


def test_a_low_noise_expert_asked_of_a_one_transformer_pipeline_fails_in_one_line(tmp_path):
    pipes_dir = tmp_path / "wan21"
    wan_pipeline().save_pretrained(pipes_dir)
    with pytest.raises(UsageError) as error:
        parse("--train_expert", "low", model=pipes_dir)
    assert str(error.value) == ("--train_expert='low': expected high or nothing: the pipeline has one transformer, "
                                "no low-noise expert (transformer_2)")


def test_image_to_video_training_inputs_are_the_pipelines_conditioning_on_its_image(monkeypatch):
    pipe = wan_i2v_pipeline()
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    image = Image.fromarray(torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8).numpy())
    first_frame = pipe.video_processor.preprocess(image, height=32, width=32)  # what training lays out: [-1, 1]
    latents = wan.normalized_latents(pipe, torch.randn(1, 16, 3, 4, 4, generator=generator))
    noise = torch.randn(latents.shape, generator=generator)
    conditioning = wan.image_to_video_conditioning(pipe, first_frame, latents)
    assert conditioning["condition"].shape == (1, 4 + 16, 3, 4, 4)  # the first frame's mask, then its latents
    calls = []
    monkeypatch.setattr(pipe.transformer, "forward",
                        lambda **inputs: calls.append(inputs) or (velocity(latents, noise),))
    pipe(image=image, prompt=PROMPTS[0], height=32, width=32, num_frames=9, num_inference_steps=3, guidance_scale=1.0,
         latents=noise, output_type="latent", max_sequence_length=16)
    for step, call in enumerate(calls):
        sigma, timestep = pipe.scheduler.sigmas[step], pipe.scheduler.timesteps[step:step + 1]
        expected = wan.image_to_video_inputs(pipe, add_noise(latents, noise, sigma), timestep, {}, conditioning)
        torch.testing.assert_close(call["hidden_states"], expected["hidden_states"], rtol=0, atol=1e-5)
        assert torch.equal(call["timestep"], expected["timestep"])
        assert torch.equal(call["encoder_hidden_states_image"], expected["encoder_hidden_states_image"])
    assert len(calls) == 3 and conditioning["encoder_hidden_states_image"].shape[-1] == 4


def test_the_comfyui_file_is_wans_original_layout_at_the_trained_strength(tmp_path):
    # Every adapted layer of a Wan 2.1 I2V transformer, with lora_alpha != rank: diffusers reads the original layout
    # (its converter for Wan LoRAs of other trainers, as ComfyUI's model names them) into the same weight changes.
    pipe = wan_i2v_pipeline()
    layers = ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj", "ffn.net.0.proj", "ffn.net.2"]
    add_lora(pipe.transformer, 4, linear_layers_named(pipe.transformer, layers), alpha=6.0)
    generator = torch.Generator().manual_seed(0)
    for name, parameter in pipe.transformer.named_parameters():
        if "lora_B" in name:
            parameter.data = torch.randn(parameter.shape, generator=generator)
    LoraExport.of(type(pipe), {"transformer": pipe.transformer}, ["diffusers", "comfyui"]).save(tmp_path)
    converted = load_file(tmp_path / "pytorch_lora_weights_comfyui.safetensors")
    for name in ("blocks.0.self_attn.q", "blocks.1.self_attn.o", "blocks.0.cross_attn.k_img", "blocks.1.ffn.2"):
        assert f"diffusion_model.{name}.lora_A.weight" in converted and converted[f"diffusion_model.{name}.alpha"] == 6
    fresh = wan_i2v_pipeline()
    fresh.load_lora_weights(str(tmp_path / "pytorch_lora_weights.safetensors"), adapter_name="ours")
    fresh.load_lora_weights(str(tmp_path / "pytorch_lora_weights_comfyui.safetensors"), adapter_name="comfyui")
    adapted = [module for module in fresh.transformer.modules() if isinstance(module, LoraLayer)]
    assert len(adapted) == 2 * 12  # two blocks: self-attention 4, cross-attention 6 (the image's k and v), MLP 2
    for module in adapted:
        torch.testing.assert_close(module.get_delta_weight("comfyui"), module.get_delta_weight("ours"))


def test_two_experts_loras_are_written_apart_and_read_back_by_parameter(tmp_path):
    pipe = wan_pipeline(two_experts=True)
    trained = wan.trained_denoisers(pipe, argparse.Namespace(train_expert="both"))
    for seed, transformer in enumerate(trained.values()):
        add_lora(transformer, 4, linear_layers_named(transformer, ["to_q"]))
        for name, parameter in transformer.named_parameters():
            if "lora_B" in name:
                parameter.data = torch.randn(parameter.shape, generator=torch.Generator().manual_seed(seed))
    export = LoraExport.of(type(pipe), trained)
    assert export.save_checkpoint(tmp_path) == tmp_path / "pytorch_lora_weights.safetensors"
    high, low = load_file(tmp_path / "pytorch_lora_weights.safetensors"), load_file(
        tmp_path / "transformer_2" / "pytorch_lora_weights.safetensors")
    assert high.keys() == low.keys() and not torch.equal(*(lora[next(key for key in lora if "lora_B" in key)]
                                                          for lora in (high, low)))
    read = export.read_checkpoint(tmp_path)
    parameters = trainable_parameters(trained)
    assert read.keys() == parameters.keys()
    assert all(torch.equal(read[name], parameter) for name, parameter in parameters.items())
    assert wan.load_adapter_lines(export, "out").splitlines()[1] == \
        'pipe.load_lora_weights("out/transformer_2", load_into_transformer_2=True)'


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``{name: folder}``: the tiny text-to-video, TI2V and image-to-video pipelines saved, and a folder of stills."""
    root = tmp_path_factory.mktemp("saved")
    for name, pipe in (("wan21", wan_pipeline()), ("ti2v", wan_pipeline(expand_timesteps=True)),
                       ("wan_i2v", wan_i2v_pipeline())):
        pipe.save_pretrained(root / name)
    build_moving_shapes(root / "clips")
    (root / "stills").mkdir()
    for name in ("still.png", "still.txt"):
        shutil.copy(root / "clips" / name, root / "stills" / name)
    return {name: root / name for name in ("wan21", "ti2v", "wan_i2v", "clips", "stills")}


def image_to_video_error(saved, tmp_path, model, data):
    return usage_error(I2V_SCRIPT, "--pretrained_model_name_or_path", saved[model], "--train_data_dir", saved[data],
                       "--output_dir", tmp_path / "out", "--resolution", 32, "--num_frames", 9)


def test_image_to_video_refuses_a_text_to_video_model_before_its_weights_load(saved, tmp_path):
    assert image_to_video_error(saved, tmp_path, "wan21", "clips") == (
        f"error: --pretrained_model_name_or_path={str(saved['wan21'])!r}: expected {wan.IMAGE_TO_VIDEO} (it is a "
        "WanPipeline whose transformer takes 16 channels; a text-to-video model trains with "
        "train_text_to_video_lora_wan.py)")
    assert image_to_video_error(saved, tmp_path, "ti2v", "clips").endswith(wan.NOT_TI2V)
    with pytest.raises(UsageError, match="its transformer takes 16 channels"):
        wan.check_image_to_video(wan_pipeline())  # a hub name's, found once loaded
    wan.check_image_to_video(wan_i2v_pipeline())


def test_image_to_video_refuses_a_folder_of_still_images_before_anything_loads(saved, tmp_path):
    assert image_to_video_error(saved, tmp_path, "wan_i2v", "stills").endswith(
        "expected clips of more than one frame for image-to-video: all 1 train at 1 frame (still images), so each "
        "sample's conditioning first frame would be its whole target and the model would learn to copy it")
    assert not (tmp_path / "out").exists()


def test_validation_reads_the_same_frames_whatever_output_type_the_pipeline_renders(pipes):
    """A Wan render as PIL frames, NumPy and tensors becomes one and the same video, not one value throughout."""
    from training_utils.data.rendered_video import RenderedVideo

    videos = {}
    for output_type in ("np", "pil", "pt"):
        frames = pipes["wan21"](PROMPTS[0], num_frames=5, height=16, width=16, num_inference_steps=2,
                                generator=torch.Generator().manual_seed(0), output_type=output_type).frames[0]
        videos[output_type] = RenderedVideo(frames, fps=16).frames
    assert videos["np"].shape == (5, 16, 16, 3) and len(np.unique(videos["np"])) > 1
    assert all(np.array_equal(video, videos["np"]) for video in videos.values())


def test_the_geometry_is_the_pipelines_own_so_ti2v_sides_are_multiples_of_32_before_its_weights_load(saved, tmp_path):
    """TI2V-5B's VAE is 16× in space: its config says so, and `video_geometry` reads it before anything loads; a
    hub id that cannot be read yet keeps `VIDEO` until loading says why."""
    def geometry(path):
        return wan.video_geometry(argparse.Namespace(pretrained_model_name_or_path=str(path), revision=None))

    assert geometry(saved["wan21"]) == wan.VIDEO
    assert geometry(saved["ti2v"]) == wan.VIDEO._replace(spatial=16, size_multiple=32)
    assert geometry(tmp_path / "missing") == wan.VIDEO
    assert usage_error("video/train_text_to_video_lora_wan.py", "--pretrained_model_name_or_path", saved["ti2v"],
                       "--train_data_dir", saved["clips"], "--output_dir", tmp_path / "out", "--resolution", 48,
                       "--num_frames", 9) == ("error: --resolution=48: expected a multiple of 32 (the VAE divides "
                                              "sides by 16, and the pipeline takes whole patches)")
