"""training_utils.controlnet: flags, validation pairs, captions, the ControlNet pipeline built once, the residual
cast, the validator and the end of the run, for any base model and denoiser (tiny SD 1.x and SDXL's UNets, SD3's
transformer here)."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import (ControlNetModel, FluxControlNetPipeline, SD3ControlNetModel, StableDiffusion3ControlNetPipeline,
                       StableDiffusion3Pipeline, StableDiffusionControlNetPipeline, StableDiffusionPipeline,
                       StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline)
from diffusers.image_processor import VaeImageProcessor
from PIL import Image
from safetensors.torch import load_file

import training_utils.controlnet as controlnet_module
from training_utils.args import training_parser
from training_utils.controlnet import (add_controlnet_args, cast_residuals_to_denoiser_dtype, check_controlnet_args,
                                       conditioning_argument, conditioning_latents, controlnet_from_unet,
                                       controlnet_how_to_load, dataset_columns, denoiser_name, load_controlnet_pipeline,
                                       load_validation_pairs, make_controlnet_validator)
from training_utils.data.buckets import validation_size
from training_utils.data.datasets import drop_caption, pick_caption
from training_utils.errors import UsageError


def parse(tiny, output_dir, *flags, base="sd", controlnet_class=ControlNetModel):
    parser = training_parser("test", tracker_project_name="test_project")
    add_controlnet_args(parser)
    args = parser.parse_args(list(map(str, ["--pretrained_model_name_or_path", tiny[base], "--output_dir", output_dir,
                                            *flags])))
    check_controlnet_args(args, controlnet_class)
    return args


def conditioning(tiny, index):
    return tiny["shapes_controlnet"] / "conditioning" / f"{index:04d}.png"


def test_flags_follow_diffusers_and_name_the_dataset_columns(tiny, tmp_path):
    args = parse(tiny, tmp_path, "--conditioning_image_column", "hint")
    assert args.controlnet_model_name_or_path is None and args.validation_image is None
    assert args.caption_dropout == 0.0 and args.tracker_project_name == "test_project"
    # Upstream's --proportion_empty_prompts is the shared --caption_dropout (checked with the shared flags).
    assert parse(tiny, tmp_path, "--proportion_empty_prompts", 0.3).caption_dropout == 0.3
    assert dataset_columns(args) == {"--image_column": "image", "--caption_column": "text",
                                     "--conditioning_image_column": "hint"}
    assert parse(tiny, tmp_path, "--controlnet_model_name_or_path", "owner/controlnet").controlnet_model_name_or_path


def test_a_folder_that_is_not_a_controlnet_is_a_usage_error(tiny, tmp_path):
    with pytest.raises(UsageError) as error:
        parse(tiny, tmp_path, "--controlnet_model_name_or_path", tiny["sd"])
    assert "expected a ControlNetModel folder (with config.json)" in str(error.value)
    args = parse(tiny, tmp_path)
    args.controlnet_model_name_or_path = str(tiny["sd3"])
    with pytest.raises(UsageError) as error:
        check_controlnet_args(args, SD3ControlNetModel)
    assert "expected a SD3ControlNetModel folder (with config.json)" in str(error.value)
    # Another family's ControlNet, named by its config.
    args.controlnet_model_name_or_path = str(tiny["controlnet"])
    with pytest.raises(UsageError) as error:
        check_controlnet_args(args, SD3ControlNetModel)
    assert str(error.value).endswith("or a hub id; its config.json names 'ControlNetModel'")
    args.controlnet_model_name_or_path = str(tiny["sd3_controlnet"])
    check_controlnet_args(args, SD3ControlNetModel)


def test_the_denoiser_and_the_conditioning_argument_are_the_pipelines_own():
    assert denoiser_name(StableDiffusionXLPipeline) == denoiser_name(StableDiffusionControlNetPipeline) == "unet"
    assert denoiser_name(StableDiffusion3Pipeline) == denoiser_name(FluxControlNetPipeline) == "transformer"
    for pipeline_class, argument in ((StableDiffusionXLControlNetPipeline, "image"),
                                     (StableDiffusion3ControlNetPipeline, "control_image"),
                                     (FluxControlNetPipeline, "control_image")):
        assert conditioning_argument(pipeline_class.__new__(pipeline_class)) == argument


def test_validation_pairs_pair_one_to_one_or_share_one_side(tiny, tmp_path):
    first, second = conditioning(tiny, 0), conditioning(tiny, 1)
    sums = [np.asarray(Image.open(path).convert("RGB")).sum() for path in (first, second)]

    def pairs(prompts, images):
        args = parse(tiny, tmp_path, "--validation_prompt", *prompts, "--validation_image", *images)
        return [(prompt, np.asarray(image).sum(), image.mode) for prompt, image in load_validation_pairs(args)]

    assert pairs(["a", "b"], [first, second]) == [("a", sums[0], "RGB"), ("b", sums[1], "RGB")]
    assert pairs(["a", "b"], [first]) == [("a", sums[0], "RGB"), ("b", sums[0], "RGB")]
    assert pairs(["a"], [first, second]) == [("a", sums[0], "RGB"), ("a", sums[1], "RGB")]
    assert load_validation_pairs(parse(tiny, tmp_path)) == []
    # One image shared by all prompts is one PIL image, so the validator saves it once.
    args = parse(tiny, tmp_path, "--validation_prompt", "a", "b", "--validation_image", first)
    [(_, image_a), (_, image_b)] = load_validation_pairs(args)
    assert image_a is image_b


@pytest.mark.parametrize("prompts, images, message", [
    (["a", "b", "c"], ["IMAGE", "IMAGE"], "one conditioning image per --validation_prompt (3)"),
    (["a"], [], "one conditioning image per --validation_prompt (1)"),
    ([], ["IMAGE"], "one conditioning image per --validation_prompt (0)"),
    (["a"], ["missing.png"], "--validation_image='missing.png': expected an existing image file"),
    (["a"], ["TEXT"], "expected an existing image file"),
])
def test_unpaired_or_unreadable_validation_images_are_usage_errors(tiny, tmp_path, prompts, images, message):
    text = tmp_path / "not_an_image.png"
    text.write_text("hello")
    images = [{"IMAGE": conditioning(tiny, 0), "TEXT": text}.get(image, image) for image in images]
    flags = (["--validation_prompt", *prompts] if prompts else []) + (["--validation_image", *images] if images else [])
    with pytest.raises(UsageError) as error:
        load_validation_pairs(parse(tiny, tmp_path, *flags))
    assert message in str(error.value)


def test_training_captions_are_emptied_in_the_given_proportion_and_reproducibly():
    # What the ControlNet scripts draw for a sample's caption.
    def captions(proportion, seed):
        generator = torch.Generator().manual_seed(seed)
        return [drop_caption(pick_caption(["a", "b"], generator), proportion, generator) for _ in range(200)]

    assert "" not in captions(0.0, 0) and set(captions(0.0, 0)) == {"a", "b"}
    assert set(captions(1.0, 0)) == {""}
    emptied = captions(0.3, 0).count("")
    assert 40 <= emptied <= 80
    assert captions(0.3, 1) == captions(0.3, 1) and captions(0.3, 1) != captions(0.3, 2)
    # Without dropout nothing more is drawn: the captions are those that pick_caption alone draws.
    generator = torch.Generator().manual_seed(0)
    assert captions(0.0, 0) == [pick_caption(["a", "b"], generator) for _ in range(200)]


@pytest.fixture(scope="module")
def sd_pipe(tiny):
    return StableDiffusionPipeline.from_pretrained(tiny["sd"])


@pytest.mark.parametrize("vae_scale_factor, channels", [(2, [16, 32]), (8, [16, 32, 96, 256])])
def test_controlnet_from_unet_copies_the_encoder_and_shrinks_like_the_vae(sd_pipe, vae_scale_factor, channels):
    controlnet = controlnet_from_unet(sd_pipe.unet, SimpleNamespace(vae_scale_factor=vae_scale_factor))
    assert list(controlnet.config.conditioning_embedding_out_channels) == channels
    unet = sd_pipe.unet.state_dict()
    copied = {key: value for key, value in controlnet.state_dict().items() if key in unet}
    assert copied and all(torch.equal(value, unet[key]) for key, value in copied.items())
    assert not torch.any(controlnet.controlnet_mid_block.weight)  # the zero convolutions start at zero
    # Its residuals match the UNet's skip connections at the latent resolution.
    latents = torch.randn(1, 4, 8, 8)
    with torch.no_grad():
        down, mid = controlnet(latents, 10, torch.randn(1, 77, 32), return_dict=False,
                               controlnet_cond=torch.rand(1, 3, 8 * vae_scale_factor, 8 * vae_scale_factor))
        sd_pipe.unet(latents, 10, torch.randn(1, 77, 32), down_block_additional_residuals=down,
                     mid_block_additional_residual=mid)


@pytest.fixture
def counted_loads(monkeypatch):
    """Count the pipeline loads ``load_controlnet_pipeline`` makes."""
    loads = []
    load = controlnet_module.load_pipeline

    def counting(*args, **kwargs):
        loads.append(args[0].__name__)
        return load(*args, **kwargs)

    monkeypatch.setattr(controlnet_module, "load_pipeline", counting)
    return loads


@pytest.mark.parametrize("base, pipeline_class, base_class, option", [
    ("sd", StableDiffusionControlNetPipeline, StableDiffusionPipeline, "requires_safety_checker"),
    ("sdxl", StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline, "force_zeros_for_empty_prompt"),
])
def test_pipeline_without_a_controlnet_path_is_built_on_one_load(tiny, tmp_path, counted_loads, base, pipeline_class,
                                                                 base_class, option):
    # The base model's option set against the ControlNet pipeline's default (True), to see it carried over.
    model = tmp_path / "model"
    shutil.copytree(tiny[base], model)
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, option: False}))
    args = parse(tiny, tmp_path, base=base)
    args.pretrained_model_name_or_path = str(model)
    pipe = load_controlnet_pipeline(pipeline_class, base_class, args, torch.bfloat16)
    assert counted_loads == [base_class.__name__]
    assert isinstance(pipe, pipeline_class) and isinstance(pipe.controlnet, ControlNetModel)
    assert pipe.config[option] is False
    assert list(pipe.controlnet.config.conditioning_embedding_out_channels) == [16, 32]
    # The ControlNet copies the UNet's encoder in fp32 (prepare_components casts the UNet afterwards); the other
    # frozen components load in the weight dtype.
    assert pipe.controlnet.dtype == pipe.unet.dtype == torch.float32 and pipe.vae.dtype == torch.bfloat16
    assert pipe.text_encoder.dtype == torch.bfloat16
    assert torch.equal(pipe.controlnet.conv_in.weight, pipe.unet.conv_in.weight)
    assert pipe.controlnet.conv_in.weight is not pipe.unet.conv_in.weight
    assert pipe._progress_bar_config == {"disable": True}


def test_a_transformer_pipeline_gets_the_controlnet_its_from_denoiser_makes(tiny, tmp_path, counted_loads):
    made = []

    def from_transformer(transformer, base):
        made.append((transformer.dtype, base.vae_scale_factor))
        return SD3ControlNetModel.from_transformer(transformer, num_layers=1, num_extra_conditioning_channels=0)

    args = parse(tiny, tmp_path, base="sd3")
    pipe = load_controlnet_pipeline(StableDiffusion3ControlNetPipeline, StableDiffusion3Pipeline, args, torch.bfloat16,
                                    controlnet_class=SD3ControlNetModel, from_denoiser=from_transformer)
    assert counted_loads == ["StableDiffusion3Pipeline"] and made == [(torch.float32, pipe.vae_scale_factor)]
    assert isinstance(pipe, StableDiffusion3ControlNetPipeline) and isinstance(pipe.controlnet, SD3ControlNetModel)
    assert pipe.controlnet.dtype == pipe.transformer.dtype == torch.float32 and pipe.vae.dtype == torch.bfloat16
    block = pipe.transformer.transformer_blocks[0].state_dict()
    copied = pipe.controlnet.transformer_blocks[0].state_dict()
    assert block.keys() == copied.keys() and all(torch.equal(block[key], copied[key]) for key in block)
    saved = tmp_path / "saved"
    pipe.controlnet.save_pretrained(saved)
    args = parse(tiny, tmp_path, "--controlnet_model_name_or_path", saved, base="sd3",
                 controlnet_class=SD3ControlNetModel)
    loaded = load_controlnet_pipeline(StableDiffusion3ControlNetPipeline, StableDiffusion3Pipeline, args,
                                      torch.bfloat16, controlnet_class=SD3ControlNetModel, from_denoiser=None)
    assert counted_loads[1:] == ["StableDiffusion3ControlNetPipeline"]
    assert isinstance(loaded.controlnet, SD3ControlNetModel) and loaded.transformer.dtype == torch.bfloat16


def test_pipeline_with_a_controlnet_path_loads_it_as_a_component(tiny, tmp_path, counted_loads):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny["sdxl"] / "vae")
    args = parse(tiny, tmp_path, "--controlnet_model_name_or_path", tiny["sdxl_controlnet"], base="sdxl")
    pipe = load_controlnet_pipeline(StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline, args,
                                    torch.bfloat16, vae=vae)
    assert counted_loads == ["StableDiffusionXLControlNetPipeline"]
    assert pipe.vae is vae
    assert pipe.unet.dtype == pipe.text_encoder_2.dtype == torch.bfloat16 and pipe.controlnet.dtype == torch.float32
    saved = load_file(tiny["sdxl_controlnet"] / "diffusion_pytorch_model.safetensors")
    assert all(torch.equal(value, saved[key]) for key, value in pipe.controlnet.state_dict().items())


class ResidualRecorder(torch.nn.Module):
    """Stands in for a half-precision UNet: records the dtypes of the residuals it is given."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
        self.seen = None

    @property
    def dtype(self):
        return self.weight.dtype

    def forward(self, sample, down_block_additional_residuals=None, mid_block_additional_residual=None):
        if mid_block_additional_residual is not None:
            residuals = (*down_block_additional_residuals, mid_block_additional_residual)
            self.seen = [residual.dtype for residual in residuals]
        return sample


def test_residuals_reach_the_unet_in_its_dtype():
    unet = ResidualRecorder()
    unet.register_forward_pre_hook(cast_residuals_to_denoiser_dtype, with_kwargs=True)
    unet(torch.ones(2))
    assert unet.seen is None
    down = [torch.full((2,), 0.5), torch.ones(2)]
    unet(torch.ones(2), down_block_additional_residuals=down, mid_block_additional_residual=torch.ones(3))
    assert unet.seen == [torch.bfloat16] * 3
    assert [residual.dtype for residual in down] == [torch.float32] * 2  # the caller's tensors are untouched


class BlockSampleRecorder(ResidualRecorder):
    """Stands in for a half-precision transformer: records the dtypes of the block samples it is given."""

    def forward(self, hidden_states, block_controlnet_hidden_states=None, controlnet_block_samples=None,
                controlnet_single_block_samples=None):
        self.seen = (block_controlnet_hidden_states, controlnet_block_samples, controlnet_single_block_samples)
        return hidden_states


def test_block_samples_reach_the_transformer_in_its_dtype():
    transformer = BlockSampleRecorder()
    transformer.register_forward_pre_hook(cast_residuals_to_denoiser_dtype, with_kwargs=True)
    samples = [torch.ones(2), torch.ones(2)]
    transformer(torch.ones(2), block_controlnet_hidden_states=samples)  # SD3's
    assert [sample.dtype for sample in transformer.seen[0]] == [torch.bfloat16] * 2
    assert transformer.seen[1:] == (None, None)
    transformer(torch.ones(2), controlnet_block_samples=samples, controlnet_single_block_samples=samples)  # FLUX.1's
    assert transformer.seen[0] is None
    assert [sample.dtype for sample in transformer.seen[1] + transformer.seen[2]] == [torch.bfloat16] * 4
    transformer(torch.ones(2), controlnet_block_samples={0: torch.ones(2), 2: torch.ones(2)})  # Z-Image's, by block
    assert {index: sample.dtype for index, sample in transformer.seen[1].items()} == {0: torch.bfloat16,
                                                                                      2: torch.bfloat16}
    assert [sample.dtype for sample in samples] == [torch.float32] * 2


def run_args(tiny, output_dir, *flags):
    args = parse(tiny, output_dir, "--seed", 0, "--num_validation_images", 1, "--validation_inference_steps", 2,
                 *flags, base="sdxl")
    args.validation_sigma_rels = None
    return args


def test_validator_renders_each_prompt_with_its_conditioning_image(tiny, tmp_path):
    pipe = StableDiffusionXLControlNetPipeline.from_pretrained(
        tiny["sdxl"], controlnet=ControlNetModel.from_pretrained(tiny["sdxl_controlnet"]))
    pipe.set_progress_bar_config(disable=True)
    args = run_args(tiny, tmp_path, "--validation_prompt", "a", "b", "--validation_image", conditioning(tiny, 0),
                    conditioning(tiny, 1))
    accelerator = SimpleNamespace(is_main_process=True, process_index=0, num_processes=1, device=torch.device("cpu"),
                                  trackers=[], wait_for_everyone=lambda: None, is_fsdp2=False)
    assert make_controlnet_validator(run_args(tiny, tmp_path), pipe, accelerator, []) is None
    pairs = load_validation_pairs(args)
    # Trained mostly in a 16x32 bucket: the square conditioning images are rendered at that size.
    size = validation_size(args, [(16, 32), (32, 32), (16, 32)])
    assert size == {"height": 16, "width": 32} and all(image.size == (64, 64) for _, image in pairs)
    validator = make_controlnet_validator(args, pipe, accelerator, pairs, call_kwargs={**size, "output_type": "pil"})
    assert validator.prompts == ["a", "b"]
    assert [kwargs["image"] for kwargs in validator.prompt_kwargs] == [image for _, image in pairs]
    assert validator.conditioning_paths == ["validation/conditioning-p00.png", "validation/conditioning-p01.png"]
    records = validator(1, final=True)
    assert [(record["variant"], record["prompt"]) for record in records] == [("raw", "a"), ("raw", "b")]
    first, second = (Image.open(tmp_path / record["images"][0]) for record in records)
    assert first.size == second.size == (32, 16)
    assert not np.array_equal(np.asarray(first), np.asarray(second))  # the same seed, another conditioning image


def test_how_to_load_names_the_pipeline_and_the_first_conditioning_image(tiny, tmp_path):
    args = run_args(tiny, tmp_path, "--validation_prompt", "a red circle", "--validation_image", "hint.png", "b.png")
    pipe = StableDiffusionXLControlNetPipeline.__new__(StableDiffusionXLControlNetPipeline)
    pipe.__dict__["controlnet"] = ControlNetModel.__new__(ControlNetModel)
    text = controlnet_how_to_load(args, pipe, load_options=", vae=vae")
    assert "from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline\n" in text
    assert 'ControlNetModel.from_pretrained("' + str(tmp_path) + '")' in text
    assert (f'StableDiffusionXLControlNetPipeline.from_pretrained("{tiny["sdxl"]}", controlnet=controlnet, vae=vae)'
            in text)
    assert 'pipe("a red circle", image=load_image("hint.png"))' in text
    without_images = controlnet_how_to_load(run_args(tiny, tmp_path), pipe)
    assert 'pipe("a photo", image=load_image("conditioning.png"))' in without_images
    # A transformer family's pipeline takes the conditioning image as control_image.
    pipe = StableDiffusion3ControlNetPipeline.__new__(StableDiffusion3ControlNetPipeline)
    pipe.__dict__["controlnet"] = SD3ControlNetModel.__new__(SD3ControlNetModel)
    text = controlnet_how_to_load(args, pipe)
    assert "from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline\n" in text
    assert "controlnet = SD3ControlNetModel.from_pretrained(" in text
    assert 'pipe("a red circle", control_image=load_image("hint.png"))' in text


class Recorder:
    """A forward pre-hook keeping the keyword arguments of every call."""

    def __init__(self, module):
        self.calls = []
        module.register_forward_pre_hook(lambda _, args, kwargs: self.calls.append(dict(kwargs)), with_kwargs=True)


def assert_same_inputs(ours, recorded):
    """The same tensors, exactly; the conditioning latents to the VAE's float noise (its CPU kernels' result varies
    in the last bits between calls), far below the VAE's shift (0.06 or more) that would tell another layout."""
    assert ours.keys() <= recorded.keys()
    torch.testing.assert_close(ours["controlnet_cond"], recorded["controlnet_cond"], rtol=0, atol=1e-5)
    for key, value in ours.items():
        if key == "controlnet_cond":
            continue
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, recorded[key]), key
        else:
            assert value is recorded[key] is None, key


@pytest.fixture
def vae_mean(monkeypatch):
    """The VAE's latent mean for its sample, so that the pipeline's conditioning latents can be computed again."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    monkeypatch.setattr(DiagonalGaussianDistribution, "sample", lambda self, generator=None: self.mean)


def test_conditioning_latents_encode_the_image_the_transformer_pipelines_hand_their_vae(tiny):
    """The training data's conditioning pixels are in [0, 1] (`ImageWithConditioningTransform`, the ControlNet
    convention); the SD3 and FLUX.1 ControlNet pipelines, and the Control pipelines, hand their VAE the image in
    [-1, 1] (their `VaeImageProcessor` normalises)."""
    image = Image.open(conditioning(tiny, 0)).convert("RGB")
    ours = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)[None]
    encoded = conditioning_latents(SimpleNamespace(encode=lambda pixels: pixels), ours)
    theirs = VaeImageProcessor().preprocess(image, height=image.height, width=image.width)
    assert torch.allclose(encoded, theirs, atol=1e-6)


def test_sd3_controlnet_is_fed_what_its_pipeline_feeds_it(tiny, vae_mean):
    from training_utils.families import sd3

    pipe = StableDiffusion3ControlNetPipeline.from_pretrained(
        tiny["sd3"], controlnet=SD3ControlNetModel.from_pretrained(tiny["sd3_controlnet"]))
    pipe.set_progress_bar_config(disable=True)
    controlnet = Recorder(pipe.controlnet)
    image = Image.open(conditioning(tiny, 0)).convert("RGB")
    settings = {"max_sequence_length": 77}
    pipe("a red circle", control_image=image, height=32, width=32, num_inference_steps=1, guidance_scale=1.0,
         generator=torch.Generator().manual_seed(0), **settings)
    [recorded] = controlnet.calls
    with torch.no_grad():
        text = sd3.text_inputs([[part[0] for part in sd3.encode_prompts(pipe, ["a red circle"], "cpu", settings)]])
        pixels = pipe.image_processor.preprocess(image, height=32, width=32)
        latents = pipe.vae.encode(pixels).latent_dist.sample()
    inputs = sd3.model_inputs(pipe, recorded["hidden_states"], recorded["timestep"], text)
    ours = sd3.controlnet_inputs(pipe, inputs, latents)
    assert_same_inputs(ours, recorded)
    # A ControlNet made from the transformer takes zero pooled projections and unshifted latents (InstantX's).
    assert pipe.controlnet.config.force_zeros_for_pooled_projection and not torch.any(ours["pooled_projections"])
    assert torch.equal(ours["controlnet_cond"], latents * pipe.vae.config.scaling_factor)
    # One that takes the pooled projections gets them, and shifted latents.
    pipe.controlnet.register_to_config(force_zeros_for_pooled_projection=False)
    ours = sd3.controlnet_inputs(pipe, inputs, latents)
    assert torch.equal(ours["pooled_projections"], inputs["pooled_projections"])
    shift, scale = pipe.vae.config.shift_factor, pipe.vae.config.scaling_factor
    assert torch.equal(ours["controlnet_cond"], (latents - shift) * scale)


def test_flux_controlnet_is_fed_what_its_pipeline_feeds_it(tiny, vae_mean):
    from diffusers import FluxControlNetModel

    from training_utils.families import flux

    pipe = FluxControlNetPipeline.from_pretrained(
        tiny["flux"], controlnet=FluxControlNetModel.from_pretrained(tiny["flux_controlnet"]))
    pipe.set_progress_bar_config(disable=True)
    controlnet = Recorder(pipe.controlnet)
    image = Image.open(conditioning(tiny, 0)).convert("RGB")
    settings = {"max_sequence_length": 32, "guidance_scale": 2.5}
    pipe("a red circle", control_image=image, height=32, width=32, num_inference_steps=1,
         generator=torch.Generator().manual_seed(0), **settings)
    [recorded] = controlnet.calls
    with torch.no_grad():
        rows = [[part[0] for part in flux.encode_prompts(pipe, ["a red circle"], "cpu", settings)]]
        pixels = pipe.image_processor.preprocess(image, height=32, width=32)
        latents = pipe.vae.encode(pixels).latent_dist.sample()
    inputs = {**flux.text_inputs(rows), "hidden_states": recorded["hidden_states"], "img_ids": recorded["img_ids"],
              "timestep": recorded["timestep"]}
    ours = flux.controlnet_inputs(pipe, inputs, latents, settings)
    assert_same_inputs(ours, recorded)
    assert ours["guidance"].tolist() == [2.5]
    # The transformer's text ids and guidance come with the prompt's row, as the transformer's inputs have them.
    assert torch.equal(ours["txt_ids"], recorded["txt_ids"])
    pipe.controlnet.register_to_config(guidance_embeds=False)
    assert flux.controlnet_inputs(pipe, inputs, latents, settings)["guidance"] is None
