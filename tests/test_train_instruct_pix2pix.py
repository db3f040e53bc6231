"""InstructPix2Pix (SD 1.x and SDXL): the shared pieces (training_utils.instruct_pix2pix) checked against the
pipeline, and the scripts end to end on the tiny fixtures, through ``accelerate launch``."""

import json

import numpy as np
import pytest
import torch
from diffusers import (StableDiffusionInstructPix2PixPipeline, StableDiffusionXLInstructPix2PixPipeline,
                       UNet2DConditionModel)
from PIL import Image
from safetensors.torch import load_file

from helpers import launch, launching, together, usage_error
from training_utils.instruct_pix2pix import conditioning_dropped, original_image_latents, widen_conv_in
from training_utils.testing import (assert_checkpoint_is_the_output, assert_resumes_exactly, assert_validated_at,
                                    checkpoint_names)

SCRIPT = "instruct_pix2pix/train_instruct_pix2pix.py"
SDXL_SCRIPT = "instruct_pix2pix/train_instruct_pix2pix_sdxl.py"
UNET = "unet/diffusion_pytorch_model.safetensors"
EMA_UNET = "ema/" + UNET
PROMPT = "make the circle red"


def original(tiny, index=0):
    return tiny["shapes_instruct_pix2pix"] / f"{index:04d}.png"


def common(tiny, output_dir, *extra, model=None):
    return ["--pretrained_model_name_or_path", model or tiny["sd"], "--train_data_dir",
            tiny["shapes_instruct_pix2pix"], "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", 2,
            "--learning_rate", 1e-3, "--random_flip", "--seed", 3, *extra]


def full_flags(tiny, output_dir):
    """4 steps with an EMA, a third of the samples' instructions, images or both dropped, validating every 2 steps
    (the original image given as upstream's --val_image_url, a local file), a checkpoint every 2."""
    return common(tiny, output_dir, "--max_train_steps", 4, "--use_ema", "--ema_decay", 0.9,
                  "--conditioning_dropout_prob", 0.1, "--validation_prompt", PROMPT, "--val_image_url",
                  original(tiny), "--num_validation_images", 1, "--validation_inference_steps", 2,
                  "--validation_steps", 2, "--checkpointing_steps", 2)


def instruct_pix2pix_folder(tiny, path):
    """The tiny SD as an InstructPix2Pix pipeline folder: its UNet widened to 8 input channels."""
    pipe = StableDiffusionInstructPix2PixPipeline.from_pretrained(tiny["sd"])
    widen_conv_in(pipe.unet)
    pipe.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
@launching
def runs(tiny, tmp_path_factory):
    """``{name: output_dir}``, launched together: ``full`` (`full_flags`) from the text-to-image tiny SD,
    ``from_ip2p``, 2 steps from an InstructPix2Pix folder (its UNet already 8 channels wide) with the edited images'
    latents cached, and ``sdxl``, the SDXL
    script's 2 steps from the text-to-image tiny SDXL with an EMA, validating at the end (its original image given as
    upstream's --val_image_url_or_path)."""
    root = tmp_path_factory.mktemp("runs")
    model = instruct_pix2pix_folder(tiny, root / "ip2p_model")
    launches = {"full": (SCRIPT, *full_flags(tiny, root / "full")),
                "from_ip2p": (SCRIPT, *common(tiny, root / "from_ip2p", "--max_train_steps", 2, "--cache_latents",
                                              "--conditioning_dropout_prob", 0.3, model=model)),
                "sdxl": (SDXL_SCRIPT, *common(tiny, root / "sdxl", "--max_train_steps", 2, "--use_ema",
                                              "--validation_prompt", PROMPT, "--val_image_url_or_path",
                                              original(tiny), "--num_validation_images", 1,
                                              "--validation_inference_steps", 2, model=tiny["sdxl"]))}
    together({name: lambda arguments=arguments: launch(*arguments) for name, arguments in launches.items()})
    return {"model": model, **{name: root / name for name in launches}}


def unet_output(unet, seed=0):
    generator = torch.Generator().manual_seed(seed)
    sample = torch.randn(1, unet.config.in_channels, 8, 8, generator=generator)
    text = torch.randn(1, 5, unet.config.cross_attention_dim, generator=generator)
    with torch.no_grad():
        return unet(sample, 10, text, return_dict=False)[0]


def test_the_output_is_an_instruct_pix2pix_pipeline_whose_trained_unet_edits_differently(tiny, runs):
    output_dir = runs["full"]
    assert json.loads((output_dir / "model_index.json").read_text())["_class_name"] == \
        "StableDiffusionInstructPix2PixPipeline"
    pipe = StableDiffusionInstructPix2PixPipeline.from_pretrained(output_dir)
    assert (pipe.unet.config.in_channels, pipe.unet.conv_in.in_channels, pipe.unet.config.out_channels) == (8, 8, 4)
    base = StableDiffusionInstructPix2PixPipeline.from_pretrained(tiny["sd"]).unet
    widen_conv_in(base)
    assert not torch.equal(unet_output(pipe.unet), unet_output(base))
    # The original image's channels, zero at first, have learnt.
    assert pipe.unet.conv_in.weight[:, 4:].abs().sum() > 0
    ema = UNet2DConditionModel.from_pretrained(output_dir / "ema" / "unet")
    assert ema.config.in_channels == 8 and not torch.equal(unet_output(ema), unet_output(pipe.unet))
    # The frozen components are the base model's files, linked.
    assert (output_dir / "vae" / "diffusion_pytorch_model.safetensors").stat().st_nlink > 1
    image = pipe(PROMPT, image=Image.open(original(tiny)), num_inference_steps=2,
                 generator=torch.Generator().manual_seed(0)).images[0]
    assert image.size == (64, 64)
    assert checkpoint_names(output_dir) == ["checkpoint-2", "checkpoint-4"]
    assert_checkpoint_is_the_output(output_dir / "checkpoint-4", output_dir, [UNET, EMA_UNET])
    assert "image=load_image(" in (output_dir / "README.md").read_text()


def test_validation_edits_the_original_image_shown_beside_the_raw_and_ema_edits(tiny, runs):
    output_dir = runs["full"]
    records = assert_validated_at(output_dir, [2, 4], variants=("raw", "ema"), prompts=[PROMPT], num_images=1)
    shown = np.asarray(Image.open(output_dir / "validation" / "conditioning-p00.png"))
    assert np.array_equal(shown, np.asarray(Image.open(original(tiny)).convert("RGB").resize((32, 32))))
    for record in records:
        assert Image.open(output_dir / record["images"][0]).size == (32, 32)


def test_an_instruct_pix2pix_unet_trains_as_it_is(runs):
    unet = UNet2DConditionModel.from_pretrained(runs["from_ip2p"] / "unet")
    base = UNet2DConditionModel.from_pretrained(runs["model"] / "unet")
    assert unet.conv_in.weight.shape == base.conv_in.weight.shape == (32, 8, 3, 3)
    assert not torch.equal(unet.conv_in.weight, base.conv_in.weight)


def test_the_sdxl_output_is_an_instruct_pix2pix_pipeline_validated_beside_its_original(tiny, runs):
    output_dir = runs["sdxl"]
    pipe = StableDiffusionXLInstructPix2PixPipeline.from_pretrained(output_dir)
    assert (pipe.unet.config.in_channels, pipe.unet.config.out_channels) == (8, 4)
    base = StableDiffusionXLInstructPix2PixPipeline.from_pretrained(tiny["sdxl"]).unet
    widen_conv_in(base)
    assert pipe.unet.conv_in.weight[:, 4:].abs().sum() > 0
    assert not torch.equal(pipe.unet.conv_in.weight, base.conv_in.weight)
    assert UNet2DConditionModel.from_pretrained(output_dir / "ema" / "unet").config.in_channels == 8
    assert_validated_at(output_dir, [2], variants=("raw", "ema"), prompts=[PROMPT], num_images=1)
    assert (output_dir / "validation" / "conditioning-p00.png").is_file()
    assert "StableDiffusionXLInstructPix2PixPipeline" in (output_dir / "README.md").read_text()


def test_a_resumed_run_ends_as_the_straight_run(tiny, runs, tmp_path):
    # From checkpoint-2, with random flips and dropped conditioning drawn per sample, and the EMA: bit for bit. The
    # straight run validated, the resumed one never: validation leaves the weights, the EMA and the RNG untouched.
    def resumed_flags(output_dir):
        return common(tiny, output_dir, "--max_train_steps", 4, "--use_ema", "--ema_decay", 0.9,
                      "--conditioning_dropout_prob", 0.1, "--checkpointing_steps", 2)

    assert_resumes_exactly(SCRIPT, resumed_flags, runs["full"], tmp_path, 2, [UNET, EMA_UNET], launch=launch)


def test_the_original_latents_are_the_pipelines_and_the_widened_unet_starts_as_the_base(tiny):
    pipe = StableDiffusionInstructPix2PixPipeline.from_pretrained(tiny["sd"])
    image = Image.open(original(tiny)).convert("RGB")
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float() / 255  # in [0, 1], as trained on
    processed = pipe.image_processor.preprocess(image)
    assert torch.equal(pixels * 2 - 1, processed)
    expected = pipe.prepare_image_latents(processed, 1, 1, torch.float32, "cpu", False)
    # In the processor's memory layout (channels-last), on which the CPU convolutions' rounding depends.
    pixels = torch.empty_like(processed).copy_(pixels)
    assert torch.equal(original_image_latents(pipe.vae, pixels, torch.float32), expected)
    assert widen_conv_in(pipe.unet) and not widen_conv_in(pipe.unet)  # widened once, then left
    assert pipe.unet.config.in_channels == 8


def test_conditioning_dropout_drops_each_alone_and_both_with_the_probability_from_the_sample_generator():
    def draws(seed):
        return conditioning_dropped(0.2, torch.Generator().manual_seed(seed))

    counts = {}
    for seed in range(4000):
        counts[draws(seed)] = counts.get(draws(seed), 0) + 1
    for outcome in [(True, False), (True, True), (False, True)]:
        assert abs(counts[outcome] / 4000 - 0.2) < 0.03, counts
    assert [draws(seed) for seed in range(20)] == [draws(seed) for seed in range(20)]
    generator = torch.Generator().manual_seed(0)
    assert conditioning_dropped(None, generator) == (False, False)
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(0).get_state())  # nothing drawn


def test_a_url_and_a_bad_probability_stop_in_one_line(tiny, tmp_path):
    output_dir = tmp_path / "out"
    error = usage_error(SCRIPT, *common(tiny, output_dir, "--val_image_url", "https://example.com/mountain.png"))
    assert error.startswith("error: --val_image_url='https://example.com/mountain.png': expected a local image file")
    error = usage_error(SCRIPT, *common(tiny, output_dir, "--conditioning_dropout_prob", 1.5))
    assert error == "error: --conditioning_dropout_prob=1.5: expected a probability in [0, 1]"
    error = usage_error(SCRIPT, *common(tiny, output_dir, "--original_image_column", "before"))
    assert error.startswith("error: --original_image_column='before': expected a column of the dataset")
    error = usage_error(SCRIPT, *common(tiny, output_dir, "--validation_prompt", PROMPT))
    assert error.startswith("error: --validation_image=[]: expected one conditioning image per --validation_prompt")
    error = usage_error(SDXL_SCRIPT, *common(tiny, output_dir, "--val_image_url_or_path", "http://example.com/a.png",
                                             model=tiny["sdxl"]))
    assert error.startswith("error: --val_image_url_or_path='http://example.com/a.png': expected a local image file")
    assert usage_error(SDXL_SCRIPT, *common(tiny, output_dir, "--vae_precision", "fp32", model=tiny["sdxl"])) \
        .startswith("error: --vae_precision")
    assert not output_dir.exists()
