"""training_utils.families.sdxl: SDXL's conditioning equals what StableDiffusionXLPipeline computes; the VAE
flag's check."""

import json

import pytest
import torch
from PIL import Image

from training_utils.args import training_parser
from training_utils.data.buckets import AspectRatioBuckets, on_the_fly_buckets
from training_utils.data.images import ImageTransform
from training_utils.errors import UsageError
from training_utils.families.base import tokenize
from training_utils.families.sdxl import (add_args, batch_time_ids, check_vae_path, encode_prompts, time_ids,
                                          vae_components)

PROMPTS = ["a red circle on a white background", "a blue square"]


@pytest.fixture(scope="module")
def sdxl_pipe(tiny):
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def encode(pipe, prompts):
    with torch.no_grad():
        return encode_prompts(pipe, prompts, "cpu", {})


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS])
def test_prompt_embeddings_equal_the_pipelines_encode_prompt(sdxl_pipe, prompts):
    prompt_embeds, pooled = encode(sdxl_pipe, prompts)
    with torch.no_grad():
        expected, _, expected_pooled, _ = sdxl_pipe.encode_prompt(prompts, device="cpu", num_images_per_prompt=1,
                                                                  do_classifier_free_guidance=False)
    hidden_1 = sdxl_pipe.text_encoder.config.hidden_size
    hidden_2 = sdxl_pipe.text_encoder_2.config.hidden_size
    assert prompt_embeds.shape == (len(prompts), sdxl_pipe.tokenizer.model_max_length, hidden_1 + hidden_2)
    assert pooled.shape == (len(prompts), sdxl_pipe.text_encoder_2.config.projection_dim)
    assert torch.equal(prompt_embeds, expected)
    assert torch.equal(pooled, expected_pooled)


def test_prompt_embeddings_are_the_penultimate_layers_of_both_encoders_and_the_projection(sdxl_pipe):
    prompt_embeds, pooled = encode(sdxl_pipe, PROMPTS)
    ids_1, ids_2 = tokenize(sdxl_pipe.tokenizer, PROMPTS), tokenize(sdxl_pipe.tokenizer_2, PROMPTS)
    with torch.no_grad():
        first = sdxl_pipe.text_encoder(ids_1, output_hidden_states=True)
        second = sdxl_pipe.text_encoder_2(ids_2, output_hidden_states=True)
    hidden_1 = sdxl_pipe.text_encoder.config.hidden_size
    assert torch.equal(prompt_embeds[..., :hidden_1], first.hidden_states[-2])
    assert torch.equal(prompt_embeds[..., hidden_1:], second.hidden_states[-2])
    assert not torch.equal(prompt_embeds[..., :hidden_1], first.last_hidden_state)
    assert torch.equal(pooled, second.text_embeds)
    assert not torch.equal(pooled, second.text_embeds.new_zeros(pooled.shape))


def test_time_ids_of_a_known_crop_equal_the_pipelines():
    # A 64 x 48 (w x h) image resized to 43 x 32 and centre-cropped to 32: top 0, left (43 - 32) // 2 = 5.
    transform = ImageTransform(32, center_crop=True)
    laid_out = transform(Image.new("RGB", (64, 48)), torch.Generator().manual_seed(0))
    ids = time_ids(laid_out.original_size, laid_out.crop_top_left, laid_out.size)
    assert torch.equal(ids, torch.tensor([48.0, 64.0, 0.0, 5.0, 32.0, 32.0]))
    assert ids.dtype == torch.float32


def test_a_batchs_time_ids_from_its_layouts_are_each_images_time_ids_in_fp32():
    layouts = torch.tensor([[48, 64, 0, 5, 32, 32], [1023, 700, 3, 0, 24, 40]])
    ids = batch_time_ids(layouts)
    assert ids.dtype == torch.float32
    expected = [time_ids((48, 64), (0, 5), (32, 32)), time_ids((1023, 700), (3, 0), (24, 40))]
    assert torch.equal(ids, torch.stack(expected))


def test_time_ids_of_a_bucketed_image_hold_its_bucket_as_the_target_size(sdxl_pipe):
    # A 70 x 50 (w x h) image goes to the 24 x 40 (h x w) bucket of resolution 32: resized to 40 x 29 and
    # centre-cropped to it, top (29 - 24) // 2 = 2. It trains at 24 x 40, as the pipeline renders at height 24,
    # width 40, and its time ids say so, not the 32 x 32 of --resolution.
    buckets = AspectRatioBuckets(on_the_fly_buckets(32, 8), 8)
    laid_out = ImageTransform(32, center_crop=True, buckets=buckets)(Image.new("RGB", (70, 50)),
                                                                     torch.Generator().manual_seed(0))
    assert laid_out.pixels.shape == (3, 24, 40) and laid_out.size == (24, 40)
    ids = time_ids(laid_out.original_size, laid_out.crop_top_left, laid_out.size)
    assert torch.equal(ids, torch.tensor([50.0, 70.0, 2.0, 0.0, 24.0, 40.0]))
    expected = sdxl_pipe._get_add_time_ids((50, 70), (2, 0), (24, 40), torch.float32,
                                           text_encoder_projection_dim=sdxl_pipe.text_encoder_2.config.projection_dim)
    assert torch.equal(ids.unsqueeze(0), expected)


def test_time_ids_match_the_pipelines_layout_and_fit_the_unet(sdxl_pipe):
    ids = time_ids((48, 64), (0, 6), (32, 32))
    expected = sdxl_pipe._get_add_time_ids((48, 64), (0, 6), (32, 32), torch.float32,
                                           text_encoder_projection_dim=sdxl_pipe.text_encoder_2.config.projection_dim)
    assert torch.equal(ids.unsqueeze(0), expected)


def test_the_unet_accepts_the_conditioning(sdxl_pipe):
    prompt_embeds, pooled = encode(sdxl_pipe, PROMPTS)
    ids = torch.stack([time_ids((64, 64), (0, 0), (32, 32)), time_ids((48, 64), (0, 5), (32, 32))])
    latents = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([10, 500])
    with torch.no_grad():
        prediction = sdxl_pipe.unet(latents, timesteps, prompt_embeds, return_dict=False,
                                    added_cond_kwargs={"text_embeds": pooled, "time_ids": ids})[0]
        same_size = sdxl_pipe.unet(latents, timesteps, prompt_embeds, return_dict=False,
                                   added_cond_kwargs={"text_embeds": pooled, "time_ids": ids[[0, 0]]})[0]
    assert prediction.shape == latents.shape
    # The micro-conditioning reaches the UNet: the second sample's crop and size change its prediction.
    assert torch.equal(prediction[0], same_size[0]) and not torch.equal(prediction[1], same_size[1])


def test_vae_flag_defaults_to_the_pipelines_vae():
    parser = training_parser("test")
    add_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "x"])
    assert args.pretrained_vae_model_name_or_path is None
    assert vae_components(None, torch.float32) == {}
    check_vae_path(None)


def test_vae_components_load_the_vae_folder(tiny):
    from diffusers import AutoencoderKL

    components = vae_components(str(tiny["sdxl"] / "vae"), torch.bfloat16)
    assert set(components) == {"vae"} and isinstance(components["vae"], AutoencoderKL)
    assert components["vae"].dtype == torch.bfloat16


def test_accepts_a_vae_folder_and_a_hub_id(tiny):
    check_vae_path(str(tiny["sdxl"] / "vae"))
    check_vae_path("madebyollin/sdxl-vae-fp16-fix")


@pytest.mark.parametrize("case", ["pipeline", "unet", "missing", "file", "bad_json"])
def test_rejects_what_is_not_a_vae(tiny, tmp_path, case):
    paths = {
        "pipeline": tiny["sdxl"],
        "unet": tiny["sdxl"] / "unet",
        "missing": tmp_path / "nowhere",
        "file": tiny["sdxl"] / "model_index.json",
        "bad_json": tmp_path / "bad",
    }
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(UsageError) as error:
        check_vae_path(str(paths[case]))
    message = str(error.value)
    assert message.startswith(f"--pretrained_vae_model_name_or_path={str(paths[case])!r}: expected an AutoencoderKL")
    if case == "unet":
        assert json.loads((paths[case] / "config.json").read_text())["_class_name"] in message


def test_every_text_encoder_adapter_gets_a_gradient_from_the_prompt_embeddings(tiny):
    """DDP stops a run in which a trained parameter gets no gradient: the adapters go only on layers that the
    embeddings read (not the first encoder's last layer), and every one of them gets a gradient."""
    from diffusers import StableDiffusionXLPipeline

    from training_utils.adapters.injection import add_lora
    from training_utils.families.sdxl import TEXT_ENCODERS, text_encoder_adapter_layers

    pipe = StableDiffusionXLPipeline.from_pretrained(tiny["sdxl"])
    for name in TEXT_ENCODERS:
        add_lora(getattr(pipe, name), 4, text_encoder_adapter_layers(pipe, name))
    embeddings, pooled = encode_prompts(pipe, PROMPTS, "cpu", {})
    (embeddings.sum() + pooled.sum()).backward()
    trained = {f"{name}.{key}": parameter for name in TEXT_ENCODERS
               for key, parameter in getattr(pipe, name).named_parameters() if parameter.requires_grad}
    layers = pipe.text_encoder.config.num_hidden_layers
    assert not any(f"layers.{layers - 1}." in key for key in trained if key.startswith("text_encoder."))
    assert [key for key, parameter in trained.items() if parameter.grad is None] == []
    assert any(f"layers.{layers - 1}." in key for key in trained if key.startswith("text_encoder_2."))
