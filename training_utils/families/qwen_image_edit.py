"""Qwen-Image-Edit (`QwenImageEditPlusPipeline`, 2509/2511, one to three references; `QwenImageEditPipeline`, the
first Edit model, one): Qwen-Image's transformer, VAE and latent layout (`qwen_image`), conditioned on reference
images twice, each as the pipeline does it:

- in the prompt: the Qwen2.5-VL text encoder sees each reference (its vision tower, through the pipeline's
  ``processor``) inside the pipeline's edit template, Edit Plus numbering them ("Picture 1: <image>..."), so the
  prompt's embeddings depend on the references (`encode_prompts` takes ``(instruction, references)``). Edit Plus
  gives the encoder each reference resized to about 384×384 pixels (``CONDITION_IMAGE_SIZE``) at its aspect ratio;
  the first Edit gives it the reference at the VAE's size;
- in the image stream: each reference resized to about 1024×1024 pixels (Edit Plus' ``VAE_IMAGE_SIZE``, the first
  Edit's literal), encoded by the VAE (the mode, standardised like the target), packed into tokens after the
  target's, with its own (frames, rows, columns) in ``img_shapes`` (`with_references`). The transformer's output
  is cut back to the target's tokens (`prediction`), as the sampling loop cuts it.

``--reference_area`` trains on references of another area (memory, speed), and validation renders at that area:
the pipelines fix theirs in code, so a script runs at that area inside `references_at_area`. The pipeline's
``Qwen2VLProcessor`` needs torchvision in transformers 5 only for its video processor, which editing never uses:
`load_processor` loads it without (`QwenVLImageProcessor`).
"""

import contextlib
import functools
import sys

import diffusers
import torch
from diffusers import DiffusionPipeline
from PIL import Image
from transformers import Qwen2VLProcessor

from . import base, qwen_image
from ..data.cache_keys import describe
from ..errors import require
from .layout import Family

# Qwen-Image's own: the renders without true classifier-free guidance, a batch's text inputs from its samples' rows,
# the VAE and the latents' standardisation.
call_kwargs = qwen_image.call_kwargs
text_inputs = qwen_image.text_inputs
image_vae = qwen_image.image_vae
normalized_latents = qwen_image.normalized_latents
# ComfyUI loads Qwen-Image-Edit's transformer as Qwen-Image's: the same module names.
FAMILY = Family("qwen_image_edit", "Qwen-Image-Edit", ("QwenImageEditPipeline", "QwenImageEditPlusPipeline"),
                "transformer", {}, qwen_image.COMFYUI_LAYOUT)
# The references each pipeline conditions on: the first Edit's template holds one image; Edit Plus numbers up to
# three (the count its model was trained with).
REFERENCES = {"QwenImageEditPipeline": (1, 1), "QwenImageEditPlusPipeline": (0, 3)}
# The area that QwenImageEditPipeline.__call__ resizes its reference to, a literal there.
EDIT_IMAGE_AREA = 1024 * 1024


class QwenVLImageProcessor(Qwen2VLProcessor):
    """The pipeline's ``Qwen2VLProcessor`` without a video processor: its tokenizer and image processor, loaded from
    the same files, do all that the edit pipelines ask of it (text and images), and transformers 5's video processor
    needs torchvision."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def load_processor(path, revision=None, cache_dir=None):
    """The processor (``processor/``) of the pipeline at ``path`` as a `QwenVLImageProcessor`, to pass to the
    pipeline's ``from_pretrained``."""
    return QwenVLImageProcessor.from_pretrained(path, subfolder="processor", revision=revision, cache_dir=cache_dir)


def add_args(parser):
    """The references' area for the VAE. (No ``--max_sequence_length``: the edit pipelines never cut a prompt.)"""
    group = parser.add_argument_group("Qwen-Image-Edit")
    group.add_argument("--reference_area", type=int, default=None,
                       help="pixels of each reference image for the VAE, resized at its aspect ratio (default: the "
                            "pipeline's, 1024*1024); validation renders at the same")


def check_args(args):
    """Fail in one line on a bad area or image size, or a model that is no edit pipeline, before any weights load
    (the size against the VAE's configuration, as Qwen-Image checks it)."""
    require(args.reference_area is None or args.reference_area >= 32 * 32, "--reference_area", args.reference_area,
            "a number of pixels of at least 32*32 (the pipeline rounds sides to multiples of 32)")
    pipeline_class(args)
    qwen_image.check_resolution(args)


def pipeline_class(args):
    """The edit pipeline class that ``--pretrained_model_name_or_path``'s ``model_index.json`` names (read without
    loading weights): the first Edit's or Edit Plus'."""
    path = args.pretrained_model_name_or_path
    try:
        name = DiffusionPipeline.load_config(path, revision=args.revision, cache_dir=args.cache_dir)["_class_name"]
    except (OSError, ValueError, KeyError):
        name = None
    require(name in REFERENCES, "--pretrained_model_name_or_path", path,
            f"a Qwen-Image-Edit pipeline ({' or '.join(REFERENCES)}), not {name}")
    return getattr(diffusers, name)


def prompt_settings(pipe, args):
    """None: the references' area, on which the first Edit's prompt depends too, is the pipeline's rule in force
    (`references_at_area`)."""
    return {}


def _pipeline_module(pipe):
    """The module of the pipeline (or pipeline class) ``pipe``, which holds its rules."""
    return sys.modules[(pipe if isinstance(pipe, type) else type(pipe)).__module__]


def _edit_plus(pipe):
    """Whether ``pipe`` is Edit Plus: references in a list, its areas the constants of its module."""
    return hasattr(_pipeline_module(pipe), "VAE_IMAGE_SIZE")


@contextlib.contextmanager
def references_at_area(pipe, area):
    """``--reference_area``: inside, the pipeline (``pipe``, or its class) resizes references for the VAE to ``area``
    pixels (the first Edit: for the text encoder too), in training as in validation, where it is the pipeline itself
    that resizes them; ``None`` keeps the pipeline's own. The pipelines fix their areas in code, a module constant
    (Edit Plus) or a literal given to the module's ``calculate_dimensions`` (the first Edit): their module's name is
    rebound while inside, and restored on leaving."""
    if area is None:
        yield
        return
    module = _pipeline_module(pipe)
    name, original = (("VAE_IMAGE_SIZE", module.VAE_IMAGE_SIZE) if _edit_plus(pipe)
                      else ("calculate_dimensions", module.calculate_dimensions))
    setattr(module, name, area if _edit_plus(pipe) else lambda target_area, ratio: original(area, ratio))
    try:
        yield
    finally:
        setattr(module, name, original)


def reference_sizes(pipe, reference):
    """``((width, height) for the text encoder, (width, height) for the VAE)`` of a PIL reference, by the
    pipeline's rules in force: its aspect ratio at each area, sides rounded to multiples of 32."""
    module = _pipeline_module(pipe)
    ratio = reference.width / reference.height
    if _edit_plus(pipe):
        return module.calculate_dimensions(module.CONDITION_IMAGE_SIZE, ratio)[:2], \
            module.calculate_dimensions(module.VAE_IMAGE_SIZE, ratio)[:2]
    size = module.calculate_dimensions(EDIT_IMAGE_AREA, ratio)[:2]
    return size, size


def _rules(pipe):
    """What describes the rules in force: the pipeline class, and the sizes they give a square."""
    return [type(pipe).__name__, reference_sizes(pipe, Image.new("RGB", (1, 1)))]


def condition_images(pipe, references):
    """What the pipeline's ``encode_prompt`` gets as ``image`` for these PIL references: each resized to the text
    encoder's size, a list for Edit Plus, the image itself for the first Edit; None without references."""
    if not references:
        return None
    resized = []
    for reference in references:
        (width, height), _ = reference_sizes(pipe, reference)
        resized.append(pipe.image_processor.resize(reference, height, width))
    return resized if _edit_plus(pipe) else resized[0]


def check_reference_size(width, height):
    """Nothing to refuse: the pipelines resize a reference of any size to their areas."""


def reference_pixels(pipe, reference):
    """A PIL reference as the pipeline gives it to the VAE: at the VAE's size (`reference_sizes`), CHW in
    [-1, 1]."""
    _, (width, height) = reference_sizes(pipe, reference)
    return pipe.image_processor.preprocess(reference, height, width)[0]


def reference_layout(pipe):
    """``(lay_out, depends_on)`` for `edit_samples.References`: `reference_pixels` with ``pipe``, and what it depends
    on besides its code (the rules in force, the image processor's settings, the sizing code)."""
    return (functools.partial(reference_pixels, pipe),
            [*_rules(pipe), dict(pipe.image_processor.config), describe(reference_sizes)])


def reference_latents(pipe, parameters):
    """The references of a batch as the pipeline encodes them, from their VAE latent distributions' ``parameters``
    (a list, one ``(B, 2C, 1, h, w)`` tensor per reference): the mode (``sample_mode="argmax"``), standardised
    as the target is (`normalized_latents`), as the pipeline standardises them."""
    return base.normalized_modes(pipe, parameters, normalized_latents)


def prompt_dependencies(pipe, settings):
    """What the embeddings depend on besides the text encoder's weights and the prompts with their references: the
    encoding code, the tokenizer, the image processor's configuration, the template and its dropped prefix, and the
    rules in force."""
    return [encode_prompts, condition_images, reference_sizes, pipe.tokenizer, pipe.processor.image_processor.to_dict(),
            pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx, *_rules(pipe), settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(prompt_embeds, mask)`` for ``prompts``, each an instruction (no reference: text to image) or a pair
    ``(instruction, PIL references)``: each one's row is ``pipe.encode_prompt(instruction, image=...)``'s, as the
    pipeline encodes it for its call with those references, padded with zeros to the longest row; the mask marks the
    real tokens. Each is encoded alone (the pipeline gives one set of references to the whole batch)."""
    rows = []
    for prompt in prompts:
        instruction, references = (prompt, ()) if isinstance(prompt, str) else prompt
        prompt_embeds, _ = pipe.encode_prompt(instruction, image=condition_images(pipe, references), device=device)
        rows.append(prompt_embeds[0])
    length = max(len(row) for row in rows)
    prompt_embeds = torch.stack([torch.cat([row, row.new_zeros(length - len(row), row.shape[1])]) for row in rows])
    mask = torch.stack([torch.arange(length, device=prompt_embeds.device) < len(row) for row in rows]).long()
    return prompt_embeds, mask


def model_inputs(pipe, noisy_latents, timesteps, text, references=()):
    """Qwen-Image's inputs for the target, with the references' tokens after the target's, as the sampling loop
    concatenates them: ``references`` holds a batch ``(B, C, 1, h, w)`` of `reference_latents` per reference, in
    order (the batch's samples share their references' count and sizes); each adds its (frames, rows, columns) of
    patches to every sample's ``img_shapes``."""
    inputs = qwen_image.model_inputs(pipe, noisy_latents, timesteps, text)
    if not references:
        return inputs
    tokens = [pipe._pack_latents(latents.to(noisy_latents), *latents.shape[:2], *latents.shape[-2:])
              for latents in references]
    shapes = [(1, latents.shape[-2] // 2, latents.shape[-1] // 2) for latents in references]
    return {**inputs, "hidden_states": torch.cat([inputs["hidden_states"], *tokens], dim=1),
            "img_shapes": [[*sample, *shapes] for sample in inputs["img_shapes"]]}


def prediction(pipe, output, latents):
    """The transformer's output tokens for the target (the first ones; the references' follow) in the layout of
    the `normalized_latents` ``latents``: the velocity it predicts."""
    height, width = latents.shape[-2:]
    return qwen_image.prediction(pipe, output[:, : (height // 2) * (width // 2)], latents)
