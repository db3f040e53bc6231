"""The family protocol (training_utils.families): every family module offers the same functions with the same
signatures, is registered, and its functions agree with each other on its tiny pipeline.

What each family computes is its own test's (``test_<family>.py``: the pipeline's own encoding, and the sampling
loop's inputs at the training noise levels); here, what any family must satisfy."""

import argparse
import inspect
import pkgutil

import pytest
import torch
from diffusers import DiffusionPipeline

import training_utils.families
from training_utils.families import (chroma, cogvideox, cogview4, cosmos, flux, flux2, flux2_dev, flux_kontext,
                                     hidream, hunyuan_video15, ideogram4, krea2, ltx, ltx2, lumina2, qwen_image,
                                     qwen_image_edit, sana,
                                     sd, sd3, sdxl, wan, z_image)
from training_utils.data.buckets import size_multiple
from training_utils.families.base import VideoGeometry
from training_utils.families.protocol import OPTIONAL, EditFamily, ImageFamily, VideoFamily
from training_utils.families.registry import FAMILIES
from training_utils.pipeline import from_pretrained

# Each family module and the tiny fixture of one of its pipelines.
MODULES = {sd: "sd", sdxl: "sdxl", sd3: "sd3", flux: "flux", flux2: "flux2_klein", z_image: "z_image",
           qwen_image: "qwen_image", chroma: "chroma", flux2_dev: "flux2_dev", krea2: "krea2", sana: "sana",
           lumina2: "lumina2", hidream: "hidream", ideogram4: "ideogram4", wan: "wan21", flux_kontext: "flux_kontext",
           qwen_image_edit: "qwen_image_edit_plus", cogview4: "cogview4", cosmos: "cosmos_predict25",
           cogvideox: "cogvideox", ltx2: "ltx2", ltx: "ltx", hunyuan_video15: "hunyuan_video15"}
PROMPTS = ["a photo of sks triangle", "a purple triangle on a white background", ""]
# Families whose rows are encoded at a shorter prompt length than their default in the test of rows: Ideogram 4's
# default 2048 text positions through its encoder's 36 layers take most of a minute here.
SHORTER = {ideogram4}


def test_every_family_module_is_registered_and_tested_here():
    modules = {name for _, name, _ in pkgutil.iter_modules(training_utils.families.__path__)
               if name not in ("base", "layout", "protocol", "registry")}
    assert modules == {module.__name__.rsplit(".", 1)[1] for module in MODULES}
    assert [module.FAMILY for module in MODULES] == list(FAMILIES.values())


def functions_of(protocol):
    """``{name: parameters}`` of the protocol's functions."""
    return {name: inspect.signature(getattr(protocol, name)).parameters for name in dir(protocol)
            if not name.startswith("_")}


@pytest.mark.parametrize("module", MODULES, ids=lambda module: module.__name__.rsplit(".", 1)[1])
def test_every_family_follows_the_protocol_with_its_signatures(module):
    """The package's protocol (`protocol.ImageFamily`, `protocol.EditFamily`): each function with the protocol's
    parameters, and only those `protocol.OPTIONAL` allows besides; an edit family's reference functions may add
    parameters with defaults."""
    image, edit = functions_of(ImageFamily), functions_of(EditFamily)
    references = edit.keys() - image.keys()
    assert isinstance(module, ImageFamily) and module.FAMILY.pipelines, module.__name__
    offered = [name for name in sorted(references) if hasattr(module, name)]
    assert offered in ([], sorted(references)) and bool(offered) == isinstance(module, EditFamily), module.__name__
    for name, expected in (edit if offered else image).items():
        parameters = inspect.signature(getattr(module, name)).parameters
        assert [(key, parameter.default) for key, parameter in parameters.items()][:len(expected)] == \
            [(key, parameter.default) for key, parameter in expected.items()], (module.__name__, name)
        extra = {key: parameter.default for key, parameter in parameters.items() if key not in expected}
        if name in references:
            assert inspect.Parameter.empty not in extra.values(), (module.__name__, name, extra)
        else:
            assert extra in ({}, OPTIONAL.get(name)), (module.__name__, name, extra)
    assert hasattr(module, "add_args") == hasattr(module, "check_args")


@pytest.fixture(scope="module", params=MODULES, ids=lambda module: module.__name__.rsplit(".", 1)[1])
def family(request, tiny):
    path = tiny[MODULES[request.param]]
    # Qwen-Image-Edit's processor loads without torchvision only as the family loads it.
    components = {"processor": qwen_image_edit.load_processor(path)} if request.param is qwen_image_edit else {}
    if request.param is cosmos:  # the released folders name no safety checker: the script gives its own
        components = {"safety_checker": cosmos.PassThroughSafetyChecker()}
    pipe = from_pretrained(DiffusionPipeline, path, **components)
    assert type(pipe).__name__ in request.param.FAMILY.pipelines
    return request.param, pipe


@pytest.mark.parametrize("module", MODULES, ids=lambda module: module.__name__.rsplit(".", 1)[1])
def test_a_video_family_follows_the_video_protocol(module):
    """A family stating a video geometry offers the video protocol (`protocol.VideoFamily`) with its signatures, so
    that a video script's loop names no denoiser of its own; an image family offers none of it."""
    video_only = functions_of(VideoFamily).keys() - functions_of(ImageFamily).keys()
    assert isinstance(module, VideoFamily) == hasattr(module, "VIDEO") == hasattr(module, "DENOISERS")
    assert all(hasattr(module, name) == hasattr(module, "VIDEO") for name in video_only), module.__name__
    if hasattr(module, "VIDEO"):
        assert isinstance(module.VIDEO, VideoGeometry) and isinstance(module.DENOISERS, tuple)
        assert "frame_rate" in inspect.signature(module.model_inputs).parameters, module.__name__
        for name in video_only:
            assert inspect.signature(getattr(module, name)).parameters.keys() == \
                functions_of(VideoFamily)[name].keys(), (module.__name__, name)


def test_a_video_familys_stated_geometry_is_its_pipelines(family):
    """A video family's geometry (``video_geometry``, read from the fixture's folder) is what its fixture's VAE and
    pipeline do: the shortest clip that is still a video gives two latent frames, sides of ``size_multiple`` shrink
    by ``spatial`` into whole patches (as the buckets find), and the pipeline's frames come as ``output_type``
    unless asked otherwise."""
    module, pipe = family
    if not hasattr(module, "VIDEO"):
        pytest.skip("not a video family")
    video = module.video_geometry(argparse.Namespace(pretrained_model_name_or_path=pipe.name_or_path, revision=None))
    assert isinstance(video, VideoGeometry) and size_multiple(pipe) == video.size_multiple
    side = 2 * video.size_multiple
    with torch.no_grad():
        latents = module.image_vae(pipe).encode(torch.zeros(1, 3, video.min_frames, side, side)).latent_dist.mode()
    assert latents.shape[2:] == (2, side // video.spatial, side // video.spatial)
    assert inspect.signature(pipe.__call__).parameters["output_type"].default == video.output_type


def test_rows_encoded_apart_batch_as_rows_encoded_together(family):
    """A prompt's row does not depend on the prompts it was encoded with (the cache encodes in chunks; a batch
    gathers rows from any of them)."""
    module, pipe = family
    settings = module.prompt_settings(pipe, default_args(module, shorter=module in SHORTER))
    with torch.no_grad():
        together = list(zip(*module.encode_prompts(pipe, PROMPTS, "cpu", settings)))
        apart = [next(zip(*module.encode_prompts(pipe, [prompt], "cpu", settings))) for prompt in PROMPTS]
    batch = [2, 0, 1, 0]
    expected, actual = (module.text_inputs([rows[index] for index in batch]) for rows in (together, apart))
    for name, value in flattened(expected).items():
        torch.testing.assert_close(flattened(actual)[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_prediction_of_the_inputs_layout_is_read_in_the_latents_layout(family):
    """`prediction` reads an output in the model's layout (here: the model's inputs, which it returns in the same
    layout) back into the latents', whatever the latents' size. `model_inputs` returns the model's keyword
    arguments, the text's among them."""
    module, pipe = family
    images = torch.zeros(2, 3, 64, 96)  # two non-square images (sides SANA takes: multiples of 32)
    if hasattr(module, "VIDEO"):  # a video family's VAE takes clips: a frame axis after the channels
        images = images[:, :, None]
    settings = module.prompt_settings(pipe, default_args(module, shorter=True))  # any text serves here
    with torch.no_grad():
        vae_latents = module.image_vae(pipe).encode(images).latent_dist.mode()
        text = module.text_inputs(list(zip(*module.encode_prompts(pipe, PROMPTS[:2], "cpu", settings))))
    latents = module.normalized_latents(pipe, vae_latents)
    inputs = module.model_inputs(pipe, latents, torch.tensor([500.0, 500.0]), text)
    forward = inspect.signature((getattr(pipe, "transformer", None) or pipe.unet).forward).parameters
    assert inputs.keys() <= forward.keys() and {name for name in text if name in forward} <= inputs.keys()
    model_input = next(value for key, value in inputs.items() if key in ("sample", "hidden_states", "x"))
    if module is z_image:  # its output is the negated velocity, one tensor per image
        model_input = [-tensor for tensor in model_input]
    if module in (lumina2, ideogram4):  # its output is the negated velocity (Ideogram 4's after the text's positions)
        model_input = -model_input
    if module is hidream:  # its training-mode output is the negated velocity's patches, unfolded
        batch, channels, height, width = model_input.shape
        model_input = -model_input.reshape(batch, channels, height // 2, 2, width // 2, 2).permute(
            0, 1, 2, 4, 3, 5).reshape(batch, channels, height * width // 4, 4)
    if module is hunyuan_video15:  # its input carries a condition and its mask after the latents' channels
        model_input = model_input[:, :latents.shape[1]]
    assert torch.equal(module.prediction(pipe, model_input, latents), latents)


def default_args(module, shorter=False):
    """The family's flags at their defaults; ``shorter``, with a prompt length of 64 tokens where it has the flag."""
    from training_utils.args import training_parser

    parser = training_parser("test")
    if hasattr(module, "add_args"):
        module.add_args(parser)
    length = ["--max_sequence_length", "64"] if shorter and "--max_sequence_length" in parser._option_string_actions \
        else []
    return parser.parse_args(["--pretrained_model_name_or_path", "unused", *length])


def flattened(inputs):
    """``inputs`` (the model's keyword arguments) as ``{name: tensor}``, nested dicts and lists spelled out."""
    flat = {}
    for name, value in inputs.items():
        if isinstance(value, dict):
            flat.update({f"{name}.{key}": item for key, item in flattened(value).items()})
        elif isinstance(value, list):
            flat.update({f"{name}[{index}]": item for index, item in enumerate(value)})
        elif value is not None:
            flat[name] = value
    return flat
