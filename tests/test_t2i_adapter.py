"""training_utils.t2i_adapter, and the T2I-Adapter script's flags: the adapter's features in training are those the
SDXL adapter pipeline feeds its UNet, a new adapter is upstream's for SDXL and fits the tiny UNet, the timesteps are
drawn as upstream draws them, and bad flags stop in one line. The script's runs are in test_train_controlnet_sdxl."""

from types import SimpleNamespace

import pytest
import torch
from diffusers import StableDiffusionXLAdapterPipeline, StableDiffusionXLPipeline, T2IAdapter
from PIL import Image

from helpers import import_script, usage_error
from training_utils.data.images import ImageWithConditioningTransform
from training_utils.pipeline import training_noise_scheduler
from training_utils.t2i_adapter import (adapter_features, cast_features_to_unet_dtype, cubic_timesteps,
                                        load_adapter_pipeline, new_adapter)

SCRIPT = "t2i_adapter/train_t2i_adapter_sdxl.py"


def flags(tiny, output_dir, *extra):
    return list(map(str, ["--pretrained_model_name_or_path", tiny["sdxl_adapter_base"], "--train_data_dir",
                          tiny["shapes_controlnet"], "--output_dir", output_dir, "--resolution", 32, *extra]))


def test_training_feeds_the_unet_the_features_the_pipeline_feeds_it(tiny, tmp_path):
    """The conditioning image as the training data lays it out (resized to 32 px from its 64, in [0, 1]) is bitwise
    the adapter's input in StableDiffusionXLAdapterPipeline, and the features of an input, scaled, are bitwise what
    the pipeline gives the UNet for it."""
    args = import_script(SCRIPT).parse_args(flags(tiny, tmp_path, "--adapter_model_name_or_path",
                                                  tiny["sdxl_t2i_adapter"], "--center_crop"))
    pipe = load_adapter_pipeline(StableDiffusionXLAdapterPipeline, args, torch.float32)
    path = tiny["shapes_controlnet"] / "conditioning" / "0000.png"
    adapter_input, fed = [], []
    pipe.adapter.register_forward_pre_hook(lambda module, inputs: adapter_input.append(inputs[0].clone()))
    pipe.unet.register_forward_pre_hook(
        lambda module, inputs, kwargs: fed.append([f.clone() for f in kwargs["down_intrablock_additional_residuals"]]),
        with_kwargs=True)
    pipe("a red circle", image=Image.open(path), height=32, width=32, num_inference_steps=1, guidance_scale=1.0,
         adapter_conditioning_scale=0.7, output_type="latent")
    laid_out = ImageWithConditioningTransform.from_args(args, pipe)(path, path, torch.Generator().manual_seed(0))
    assert torch.equal(adapter_input[0], laid_out.conditioning_pixels[None])
    with torch.no_grad():
        trained = adapter_features(pipe.adapter, adapter_input[0], 0.7)
    assert len(fed) == 1 and len(fed[0]) == len(trained) == 2
    for pipeline_feature, training_feature in zip(fed[0], trained):
        assert torch.equal(pipeline_feature, training_feature)


def test_a_new_adapter_is_upstreams_for_sdxl_and_fits_the_tiny_unet(tiny, tmp_path):
    with torch.device("meta"):
        sdxl = new_adapter({"block_out_channels": [320, 640, 1280]}, 8)
    assert sdxl.config.adapter_type == "full_adapter_xl" and list(sdxl.config.channels) == [320, 640, 1280, 1280]
    assert sdxl.config.downscale_factor == 16 and sdxl.config.num_res_blocks == 2 and sdxl.config.in_channels == 3

    # Without --adapter_model_name_or_path the script's pipeline gets one sized from the configs, made from --seed
    # without touching the global random state.
    args = import_script(SCRIPT).parse_args(flags(tiny, tmp_path, "--seed", 5))
    state = torch.random.get_rng_state()
    pipe = load_adapter_pipeline(StableDiffusionXLAdapterPipeline, args, torch.float32)
    assert torch.equal(torch.random.get_rng_state(), state)
    adapter = pipe.adapter
    assert list(adapter.config.channels) == [32, 64] and adapter.config.downscale_factor == 4
    fixture = T2IAdapter.from_pretrained(tiny["sdxl_t2i_adapter"]).config
    assert {key: value for key, value in fixture.items() if not key.startswith("_")} == dict(adapter.config)
    again = new_adapter(pipe.unet.config, pipe.vae_scale_factor, seed=5).state_dict()
    assert all(torch.equal(tensor, again[name]) for name, tensor in adapter.state_dict().items())
    assert not torch.equal(new_adapter(pipe.unet.config, 2, seed=6).state_dict()["adapter.conv_in.weight"],
                           again["adapter.conv_in.weight"])

    # Its features reach every block of the UNet, and change what it predicts.
    latents, text = torch.randn(1, 4, 16, 16), torch.randn(1, 77, 64)
    added = {"text_embeds": torch.randn(1, 32), "time_ids": torch.tensor([[32.0, 32, 0, 0, 32, 32]])}
    with torch.no_grad():
        features = adapter_features(adapter, torch.rand(1, 3, 32, 32), 1.0)
        plain = pipe.unet(latents, 10, text, added_cond_kwargs=added).sample
        guided = pipe.unet(latents, 10, text, added_cond_kwargs=added,
                           down_intrablock_additional_residuals=list(features)).sample
    assert [tuple(feature.shape[1:]) for feature in features] == [(32, 8, 8), (64, 8, 8)]
    assert not torch.allclose(plain, guided)


def test_the_features_reach_a_half_precision_unet_in_its_dtype_in_a_list_of_their_own():
    unet = SimpleNamespace(dtype=torch.bfloat16)
    features = [torch.randn(1, 2, 4, 4), torch.randn(1, 3, 2, 2)]
    _, kwargs = cast_features_to_unet_dtype(unet, (), {"down_intrablock_additional_residuals": features, "other": 1})
    cast = kwargs["down_intrablock_additional_residuals"]
    assert cast is not features and [feature.dtype for feature in cast] == [torch.bfloat16] * 2
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(features, cast)) and kwargs["other"] == 1
    assert cast_features_to_unet_dtype(unet, (), {"sample": 0}) == ((), {"sample": 0})


def test_timesteps_are_drawn_cubic_as_upstream_draws_them(tiny):
    scheduler = training_noise_scheduler(StableDiffusionXLPipeline.from_pretrained(tiny["sdxl_adapter_base"]))
    torch.manual_seed(0)
    timesteps = cubic_timesteps(scheduler, 4000, "cpu")
    torch.manual_seed(0)
    uniform = torch.rand(4000)
    assert timesteps.dtype == torch.long
    assert torch.equal(timesteps, ((1 - uniform ** 3) * 1000).long().clamp(0, 999))
    assert timesteps.min() >= 0 and timesteps.max() <= 999
    # Three in four above the middle (1 - u³ > 1/2 for u < 0.79), where uniform timesteps put half.
    assert 0.77 < (timesteps >= 500).float().mean() < 0.82


def test_flags_default_as_upstreams(tiny):
    args = import_script(SCRIPT).parse_args(["--pretrained_model_name_or_path", str(tiny["sdxl_adapter_base"])])
    assert args.resolution == 1024 and args.tracker_project_name == "sd_xl_train_t2iadapter"
    assert args.adapter_model_name_or_path is None and args.adapter_conditioning_scale == 1.0
    assert args.conditioning_image_column == "conditioning_image" and args.validation_image is None


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--adapter_model_name_or_path", "SDXL"],
         "sdxl_adapter_base': expected a T2IAdapter folder (with config.json) or a hub id"),
        (["--adapter_conditioning_scale", 0], "--adapter_conditioning_scale=0.0: expected a positive number"),
        (["--resolution", 40, "--adapter_model_name_or_path", "XL"],
         "--resolution=40: expected a multiple of 16, the T2I-Adapter's downscale factor"),
        (["--validation_height", 40, "--adapter_model_name_or_path", "XL"],
         "--validation_height=40: expected a multiple of 16, the T2I-Adapter's downscale factor"),
        (["--detection_resolution", 512], "--detection_resolution is not supported here: upstream's script never "
                                          "reads it"),
        (["--crops_coords_top_left_h", 4], "--crops_coords_top_left_h is not supported here"),
    ],
)
def test_bad_flags_stop_in_one_line_before_anything_loads(tiny, tmp_path, extra, message):
    # XL: an adapter folder whose config (all that is read before weights load) unshuffles by 16, as SDXL's.
    (tmp_path / "xl").mkdir()
    (tmp_path / "xl" / "config.json").write_text('{"_class_name": "T2IAdapter", "downscale_factor": 16}')
    replacements = {"SDXL": tiny["sdxl_adapter_base"], "XL": tmp_path / "xl"}
    extra = [str(replacements.get(flag, flag)) for flag in extra]
    error = usage_error(SCRIPT, *flags(tiny, tmp_path / "out", *extra))
    assert message in error, error
    assert not (tmp_path / "out").exists()
