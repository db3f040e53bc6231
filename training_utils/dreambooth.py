"""DreamBooth data: one subject's images, optionally its class's, and class images made on demand.

Prior preservation (Ruiz et al., 2023) trains on the subject and, in the same batch, on images that the
model itself generated for the subject's class, so that fine-tuning on a few pictures does not make it
forget what the class looks like. Nothing here names a model: the prompts' token ids or embeddings are
the script's business, and class images come from whichever pipeline the script has already loaded.
"""

import contextlib
import itertools
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .data import TrainDataset, drop_caption
from .errors import require
from .images import IMAGE_EXTENSIONS, image_sizes
from .pipeline import modules_of
from .validation import preserved_state

PARTIAL_SUFFIX = ".partial"  # a class image being written

# The dataset flags of upstream's DreamBooth scripts for captioned data, which the scripts here do not carry.
CAPTIONED_DATASET_NOT_CARRIED = dict.fromkeys(
    ["--dataset_name", "--dataset_config_name", "--image_column", "--caption_column", "--train_data_dir",
     "--max_train_samples"],
    "the images come from --instance_data_dir, captioned by --instance_prompt; a dataset with captions of its own "
    "is not carried yet")


def transformer_dreambooth_refusals(text_encoder_trains):
    """The flags of upstream's DreamBooth scripts for the flow-matching transformers that a script here does not
    carry, besides those no script here carries (`args.NOT_CARRIED`), with reasons true of it: whether its text
    encoder trains (``text_encoder_trains``: then it takes upstream's text-encoder optimizer flags) or not."""
    refused = {
        "--do_fp8_training": "torchao's float8 training is not carried; --quantize_base fp8 loads the frozen "
                             "transformer in float8 instead",
        "--fsdp_text_encoder": "FSDP is not supported; the text encoder runs once, before training, and then leaves "
                               "the accelerator",
        **CAPTIONED_DATASET_NOT_CARRIED,
    }
    if not text_encoder_trains:
        refused.update(dict.fromkeys(["--text_encoder_lr", "--adam_weight_decay_text_encoder"],
                                     "the text encoder does not train in this script"))
    return refused


def add_dreambooth_args(parser):
    """The DreamBooth flags of the diffusers scripts, with their names and meanings."""
    group = parser.add_argument_group("DreamBooth")
    group.add_argument("--instance_data_dir", required=True, help="a folder of images of the subject")
    group.add_argument("--instance_prompt", required=True,
                       help='the prompt naming the subject, e.g. "a photo of sks dog"')
    group.add_argument("--class_data_dir", default=None,
                       help="a folder of class images; with --with_prior_preservation, missing ones are generated")
    group.add_argument("--class_prompt", default=None, help='the prompt naming the class, e.g. "a photo of a dog"')
    group.add_argument("--with_prior_preservation", action="store_true", help="add the class images' loss")
    group.add_argument("--prior_loss_weight", type=float, default=1.0, help="weight of the class images' loss")
    group.add_argument("--num_class_images", type=int, default=100,
                       help="class images to train with; the missing ones are generated")
    group.add_argument("--sample_batch_size", type=int, default=4, help="batch size when generating class images")
    group.add_argument("--class_inference_steps", type=int, default=None,
                       help="denoising steps per generated class image (default: the pipeline's own)")
    group.add_argument("--pre_compute_text_embeddings", action="store_true",
                       help="accepted for upstream's commands: the frozen text encoders always embed the prompts "
                            "once, before training")


def list_images(folder):
    """The image files directly in ``folder``, sorted by name; none if it does not exist."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(path for path in folder.iterdir() if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS)


def check_dreambooth_args(args):
    """Fail on bad DreamBooth inputs before any weights load; returns the instance images."""
    instance_images = list_images(args.instance_data_dir)
    require(not (args.pre_compute_text_embeddings and getattr(args, "train_text_encoder", False)),
            "--pre_compute_text_embeddings", True, "no --train_text_encoder with it (a text encoder that trains "
            "embeds the prompts in every step)")
    require(Path(args.instance_data_dir).is_dir(), "--instance_data_dir", args.instance_data_dir, "an existing folder")
    require(instance_images, "--instance_data_dir", args.instance_data_dir, "a folder holding images")
    require(args.instance_prompt.strip(), "--instance_prompt", args.instance_prompt, "a non-empty prompt")
    require(args.num_class_images > 0, "--num_class_images", args.num_class_images, "a positive integer")
    require(args.sample_batch_size > 0, "--sample_batch_size", args.sample_batch_size, "a positive integer")
    require(args.class_inference_steps is None or args.class_inference_steps > 0, "--class_inference_steps",
            args.class_inference_steps, "a positive integer")
    require(args.prior_loss_weight >= 0, "--prior_loss_weight", args.prior_loss_weight, "a non-negative number")
    if args.with_prior_preservation:
        require(args.class_data_dir is not None, "--class_data_dir", None,
                "a folder for the class images with --with_prior_preservation")
        require(not Path(args.class_data_dir).exists() or Path(args.class_data_dir).is_dir(), "--class_data_dir",
                args.class_data_dir, "a folder (it is created if missing)")
        require(args.class_prompt is not None and args.class_prompt.strip(), "--class_prompt", args.class_prompt,
                "a non-empty prompt with --with_prior_preservation")
    return instance_images


def dreambooth_prompts(args):
    """The prompts a DreamBooth run trains on, which the frozen text encoders embed once: the instance prompt, with
    prior preservation the class prompt, and with ``--caption_dropout`` the empty prompt."""
    return [args.instance_prompt, *([args.class_prompt] if args.with_prior_preservation else []),
            *([""] if args.caption_dropout > 0 else [])]


def dreambooth_dataset(instance_images, class_images, encoders, seed, repeats=1, caption_dropout=0.0,
                       instance_prompt="", class_prompt=None):
    """A `TrainDataset` of ``instance`` images, each ``repeats`` times, and, with ``class_images``, ``class``
    images: what ``encoders.image_file`` gives for each (pixels, or the cached latent parameters, which it
    encodes here when caching latents), with each one's prompt. Its length is that of the longer list; the shorter
    one cycles.

    With aspect-ratio buckets (in ``encoders.transform``) a sample trains at its instance image's bucket, and its
    class image is resized to cover that shape and cropped to it (the two halves of a batch are one tensor).
    With ``caption_dropout``, an instance sample trains on the empty prompt instead of ``instance_prompt`` with
    that probability; a class sample never does (it trains on ``class_prompt``).
    """
    transform = encoders.transform
    shapes = None if transform.buckets is None else transform.shapes(image_sizes(instance_images)) * repeats
    instance_images = list(instance_images) * repeats
    length = max(len(instance_images), len(class_images or ()))
    examples = [{"instance": instance_images[index % len(instance_images)]} for index in range(length)]
    if class_images:
        for index, example in enumerate(examples):
            example["class"] = class_images[index % len(class_images)]
    example_shapes = None if shapes is None else [shapes[index % len(shapes)] for index in range(length)]
    encoders.cache_image_files((path, None if example_shapes is None else example_shapes[index])
                               for index, example in enumerate(examples) for path in example.values())
    for index, example in enumerate(examples):
        example["shape"] = None if example_shapes is None else example_shapes[index]

    def preprocess(example, generator):
        sample = {kind: encoders.image_file(example[kind], generator, example["shape"]).pixels
                  for kind in ("instance", "class") if kind in example}
        sample["prompt"] = drop_caption(instance_prompt, caption_dropout, generator)
        if "class" in sample:
            sample["class_prompt"] = class_prompt
        return sample

    return TrainDataset(examples, preprocess, seed, shapes=example_shapes)


def instance_then_class_collate(examples):
    """``{"images": the instance images, then the class images, "prompts": each image's prompt}``: the two halves
    line up, so ``chunk(2)`` splits predictions into the instance and the class part."""
    kinds = [kind for kind in ("instance", "class") if kind in examples[0]]
    return {"images": torch.cat([torch.stack([example[kind] for example in examples]) for kind in kinds]),
            "prompts": [example["prompt"] for example in examples]
                       + [example["class_prompt"] for example in examples if "class" in example]}


def generate_class_images(pipe, prompt, class_dir, num_images, accelerator, seed, batch_size=4, schedulers=(),
                          weight_dtype=torch.float32, num_inference_steps=None, call_kwargs=None,
                          encoders_on_device=contextlib.nullcontext):
    """Render ``pipe(prompt)`` into ``class_dir`` until it holds ``num_images`` images; returns how many it made.

    Only the main process renders; the others wait. The image that becomes the folder's i-th is drawn
    from a generator seeded ``seed + i``, so the same folder state gives the same images. Rendering has
    validation's protections: the global RNG is untouched, and ``pipe.scheduler``, ``schedulers`` (e.g.
    the training noise scheduler) and every module's train/eval mode are restored afterwards.
    ``encoders_on_device`` (e.g. `cache.FrozenEncoders.on_device`) holds the encoders kept off the
    accelerator on it while rendering.
    """
    class_dir = Path(class_dir)
    accelerator.wait_for_everyone()  # every process counts before the main one starts writing
    existing = len(list_images(class_dir))
    missing = max(0, num_images - existing)
    if missing == 0:
        accelerator.print(f"{class_dir} holds {existing} class images; none generated")
        return 0
    if accelerator.is_main_process:
        class_dir.mkdir(parents=True, exist_ok=True)
        for partial in class_dir.glob(f".*{PARTIAL_SUFFIX}"):  # what a killed generation left half written
            partial.unlink()
        device_type = accelerator.device.type
        autocast = (torch.autocast(device_type, dtype=weight_dtype) if weight_dtype != torch.float32
                    else contextlib.nullcontext())
        modules = modules_of(pipe).values()
        steps = {} if num_inference_steps is None else {"num_inference_steps": num_inference_steps}
        indices = list(range(existing, existing + missing))
        batches = [indices[start:start + batch_size] for start in range(0, missing, batch_size)]
        free_names = (name for name in (f"class-{n:05d}.png" for n in itertools.count())
                      if not (class_dir / name).exists())
        with (preserved_state([pipe.scheduler, *schedulers], modules),
              torch.random.fork_rng(devices=[accelerator.device] if device_type == "cuda" else []),
              autocast, torch.no_grad(), encoders_on_device()):
            for module in modules:
                module.eval()
            for batch in tqdm(batches, desc="class images", disable=not accelerator.is_local_main_process):
                images = pipe(prompt=prompt, num_images_per_prompt=len(batch),
                              generator=[torch.Generator().manual_seed(seed + index) for index in batch],
                              **steps, **(call_kwargs or {})).images
                for image in images:
                    _save_atomically(image, class_dir / next(free_names))
        accelerator.print(f"generated {missing} class images into {class_dir} ({existing} were there)")
    accelerator.wait_for_everyone()
    return missing


def _save_atomically(image, path):
    # Written under a name that list_images skips, then renamed: a crash never leaves a truncated image.
    partial = path.with_name(f".{path.name}{PARTIAL_SUFFIX}")
    image.save(partial, format="PNG")
    os.replace(partial, path)


def class_images_from_args(args, pipe, accelerator, schedulers=(), weight_dtype=torch.float32,
                           encoders_on_device=contextlib.nullcontext, call_kwargs=None):
    """With ``--with_prior_preservation``: the ``--num_class_images`` class images, generated first by
    ``pipe`` (the one that trains) where ``--class_data_dir`` lacks some; without it, None. ``call_kwargs`` go
    to every pipeline call besides the size (e.g. how the pipeline is to encode the prompt)."""
    if not args.with_prior_preservation:
        return None
    generate_class_images(
        pipe, args.class_prompt, args.class_data_dir, args.num_class_images, accelerator, args.seed,
        args.sample_batch_size, schedulers=schedulers, weight_dtype=weight_dtype,
        num_inference_steps=args.class_inference_steps,
        call_kwargs={"height": args.resolution, "width": args.resolution, **(call_kwargs or {})},
        encoders_on_device=encoders_on_device,
    )
    return list_images(args.class_data_dir)[: args.num_class_images]
