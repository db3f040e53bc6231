"""DreamBooth data: one subject's images, optionally its class's, and class images made on demand.

Prior preservation (Ruiz et al., 2023) trains on the subject and, in the same batch, on images that the
model itself generated for the subject's class, so that fine-tuning on a few pictures does not make it
forget what the class looks like. Nothing here names a model: the prompts' token ids or embeddings are
the script's business, and class images come from whichever pipeline the script has already loaded.

Each instance image trains on its own caption (`InstanceImages`): from a dataset's ``--caption_column``
(``--dataset_name``, a hub name or a local folder, as upstream's scripts take it), from a sidecar file beside it
in ``--instance_data_dir`` (``--caption_extension .txt``: ``a.png`` beside ``a.txt``, as kohya's datasets are
laid out), or, without one, ``--instance_prompt``. Class images keep ``--class_prompt``.
"""

import contextlib
import itertools
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm.auto import tqdm

from ..errors import require
from ..parser import add_refused_args
from ..pipeline import modules_of, preserved_state
from ..sharding.text_encoders import is_sharded
from .captions import distinct_captions, read_caption_file
from .datasets import TrainDataset, drop_caption, load_train_dataset, pick_caption
from .images import IMAGE_EXTENSIONS, image_sizes

logger = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"  # a class image being written
CAPTIONS_ON_THE_CARD = 5  # the model card shows this many of the training captions

# The data flags of the text-to-image scripts that DreamBooth's do not take, as upstream's do not.
NOT_DREAMBOOTH_DATA = dict.fromkeys(
    ["--train_data_dir", "--max_train_samples"],
    "DreamBooth's images come from --instance_data_dir (captions beside them with --caption_extension) or "
    "--dataset_name (captions in --caption_column)")


def transformer_dreambooth_refusals(text_encoder_trains):
    """The flags of upstream's DreamBooth scripts for the flow-matching transformers that a script here does not
    carry, besides those no script here carries (`parser.NOT_CARRIED`), with reasons true of it: whether its text
    encoder trains (``text_encoder_trains``: then it takes upstream's text-encoder optimizer flags) or not."""
    refused = {
        "--do_fp8_training": "torchao's float8 training is not carried; --quantize_base fp8 loads the frozen "
                             "transformer in float8 instead",
    }
    if not text_encoder_trains:
        refused.update(dict.fromkeys(["--text_encoder_lr", "--adam_weight_decay_text_encoder"],
                                     "the text encoder does not train in this script"))
    return refused


def add_instance_args(parser, group, prompt_required):
    """The flags of training images given as a folder (or as ``--dataset_name``), shared by the DreamBooth and edit
    scripts, into their ``group``: ``--instance_data_dir``, ``--caption_extension``, ``--instance_prompt`` (with
    ``prompt_required``, as DreamBooth's). Such data takes no ``--caption_column`` unless given, and refuses the
    text-to-image data flags (`NOT_DREAMBOOTH_DATA`), as upstream's scripts do."""
    group.add_argument("--instance_data_dir", default=None,
                       help="a folder of the training images (DreamBooth: the subject's; edit: targets without "
                            "references), or --dataset_name")
    group.add_argument("--caption_extension", default=None,
                       help="read each image's caption (an edit's instruction) from the file beside it with this "
                            "extension (e.g. .txt: a.png's caption is a.txt); an image without one takes "
                            "--instance_prompt")
    group.add_argument("--instance_prompt", default=None, required=prompt_required,
                       help='the caption of every image that has none of its own (DreamBooth: the prompt naming the '
                            'subject, e.g. "a photo of sks dog"; edit: the instruction)')
    parser.set_defaults(caption_column=None)
    add_refused_args(parser, NOT_DREAMBOOTH_DATA)


def add_dreambooth_args(parser):
    """The DreamBooth flags of the diffusers scripts, with their names and meanings, beside the shared data flags."""
    group = parser.add_argument_group("DreamBooth")
    add_instance_args(parser, group, prompt_required=True)
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


class InstanceImages(NamedTuple):
    """The subject's images (paths, or a dataset's `EmbeddedImage`) and each one's caption: a string, or a list of
    strings of which a sample draws one."""

    images: list
    captions: list

    @classmethod
    def captioned_by(cls, images, prompt):
        """``images``, every one captioned by ``prompt``."""
        return cls(list(images), [prompt] * len(images))


class EmbeddedImage(dict):
    """A dataset's image held in the dataset, not in a file: datasets' undecoded ``{"path", "bytes"}``, which
    `images.read_image` reads, hashable so that it keys the latent cache as a path does."""

    def __hash__(self):
        return hash((self["path"], self["bytes"]))


def list_images(folder):
    """The image files directly in ``folder``, sorted by name; none if it does not exist."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(path for path in folder.iterdir() if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS)


def check_dreambooth_args(args):
    """Fail on bad DreamBooth flags before any weights load (the images are checked as they are listed,
    `instance_images_from_args`)."""
    require(not (args.pre_compute_text_embeddings and getattr(args, "train_text_encoder", False)),
            "--pre_compute_text_embeddings", True, "no --train_text_encoder with it (a text encoder that trains "
            "embeds the prompts in every step)")
    require((args.instance_data_dir is None) != (args.dataset_name is None), "--instance_data_dir",
            args.instance_data_dir, "a folder of images, or --dataset_name, not both")
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
    if args.dataset_name is not None:
        require(args.caption_extension is None, "--caption_extension", args.caption_extension,
                "no caption files with --dataset_name (its captions are in --caption_column)")
    else:
        require(args.caption_column is None, "--caption_column", args.caption_column,
                "--dataset_name with it (--instance_data_dir's captions are in --caption_extension files)")


def instance_images_from_args(args):
    """The `InstanceImages` of ``--instance_data_dir`` or ``--dataset_name`` (checked flags), each with its caption;
    a folder without images, or a dataset without the columns, stops the run before any weights load."""
    instance_images = dataset_instance_images(args) if args.dataset_name is not None else folder_images(args)
    if not args.instance_prompt.strip() and args.instance_prompt in instance_images.captions:
        # Accepted, as upstream's scripts accept it: those images train on the pipeline's encoding of that prompt.
        logger.warning(f"--instance_prompt={args.instance_prompt!r} is empty: the adapter learns the subject without "
                       "a trigger word, as what the model draws unprompted")
    return instance_images


def folder_images(args):
    """The `InstanceImages` of ``--instance_data_dir``, each captioned by its ``--caption_extension`` file or by
    ``--instance_prompt``; a missing folder, or one without images, stops the run."""
    require(Path(args.instance_data_dir).is_dir(), "--instance_data_dir", args.instance_data_dir, "an existing folder")
    images = list_images(args.instance_data_dir)
    require(images, "--instance_data_dir", args.instance_data_dir, "a folder holding images")
    if args.caption_extension is None:
        return InstanceImages.captioned_by(images, args.instance_prompt)
    return sidecar_captioned_images(images, args.caption_extension, args.instance_prompt)


def sidecar_captioned_images(images, extension, instance_prompt):
    """`InstanceImages` of ``images`` each captioned by the text of its file with ``extension`` beside it (stripped;
    an empty file is the empty caption), or by ``instance_prompt`` where it has none; logs how many have none."""
    require(extension.startswith(".") and len(extension) > 1, "--caption_extension", extension,
            "a file extension, e.g. .txt")
    captions = [read_caption_file(image.with_suffix(extension), "--caption_extension", extension) for image in images]
    missing, empty = captions.count(None), captions.count("")
    if missing:
        logger.warning(f"{missing} of {len(images)} instance images have no {extension} caption file beside them; "
                       f"they train on --instance_prompt")
    if empty:
        logger.warning(f"{empty} of {len(images)} {extension} caption files are empty: those images train on the "
                       "empty caption, without the trigger word")
    return InstanceImages(images, [instance_prompt if caption is None else caption for caption in captions])


def dataset_instance_images(args):
    """`InstanceImages` of ``--dataset_name``'s ``--image_column``, captioned by its ``--caption_column`` or, without
    one, by ``--instance_prompt``; checked (columns, captions) reading no image. Images in files stay paths."""
    import datasets

    columns = {"--image_column": args.image_column,
               **({} if args.caption_column is None else {"--caption_column": args.caption_column})}
    dataset = load_train_dataset(args, columns)
    undecoded = dataset.cast_column(args.image_column, datasets.Image(decode=False))[args.image_column]
    images = [EmbeddedImage(value) if value["bytes"] is not None else Path(value["path"]) for value in undecoded]
    if args.caption_column is None:
        return InstanceImages.captioned_by(images, args.instance_prompt)
    return InstanceImages(images, list(dataset[args.caption_column]))


def dreambooth_prompts(args, instance):
    """The prompts a DreamBooth run trains on, which the frozen text encoders embed once: each distinct caption of
    the `InstanceImages` ``instance``, with prior preservation the class prompt, and with ``--caption_dropout`` the
    empty prompt."""
    return [*distinct_captions(instance.captions), *([args.class_prompt] if args.with_prior_preservation else []),
            *([""] if args.caption_dropout > 0 else [])]


def training_captions(instance, count=CAPTIONS_ON_THE_CARD):
    """The first ``count`` distinct captions of the `InstanceImages` ``instance``, for the model card."""
    return distinct_captions(instance.captions)[:count]


def dreambooth_dataset(instance, class_images, encoders, seed, repeats=1, caption_dropout=0.0, class_prompt=None):
    """A `TrainDataset` of the `InstanceImages` ``instance``, each ``repeats`` times, and, with ``class_images``,
    ``class`` images: what ``encoders.image_file`` gives for each (pixels, or the cached latent parameters, which
    it encodes here when caching latents), with each one's prompt. Its length is that of the longer list; the
    shorter one cycles.

    With aspect-ratio buckets (in ``encoders.transform``) a sample trains at its instance image's bucket, and its
    class image is resized to cover that shape and cropped to it (the two halves of a batch are one tensor).
    An instance sample trains on its image's caption (one drawn from a list), or, with ``caption_dropout``, on the
    empty prompt with that probability; a class sample never does (it trains on ``class_prompt``).
    """
    transform = encoders.transform
    shapes = None if transform.buckets is None else transform.shapes(image_sizes(instance.images)) * repeats
    instance_images, captions = list(instance.images) * repeats, list(instance.captions) * repeats
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
        example["caption"] = captions[index % len(captions)]

    def preprocess(example, generator):
        sample = {}
        for kind in ("instance", "class"):
            if kind in example:
                laid_out = encoders.image_file(example[kind], generator, example["shape"])
                sample[kind] = laid_out.pixels
                sample[f"{kind}_layout"] = torch.tensor([*laid_out.original_size, *laid_out.crop_top_left,
                                                         *laid_out.size])
        sample["prompt"] = drop_caption(pick_caption(example["caption"], generator), caption_dropout, generator)
        if "class" in sample:
            sample["class_prompt"] = class_prompt
        return sample

    return TrainDataset(examples, preprocess, seed, shapes=example_shapes)


def instance_then_class_collate(examples):
    """``{"images": the instance images, then the class images, "layouts": how each was laid out, "prompts": each
    image's prompt}``: the two halves line up, so ``chunk(2)`` splits predictions into the instance and the class
    part. An image's layout is its original (height, width), its crop's (top, left) and the (height, width) it
    trains at, six integers (SDXL's micro-conditioning)."""
    kinds = [kind for kind in ("instance", "class") if kind in examples[0]]
    return {"images": torch.cat([torch.stack([example[kind] for example in examples]) for kind in kinds]),
            "layouts": torch.cat([torch.stack([example[f"{kind}_layout"] for example in examples]) for kind in kinds]),
            "prompts": [example["prompt"] for example in examples]
                       + [example["class_prompt"] for example in examples if "class" in example]}


def generate_class_images(pipe, prompt, class_dir, num_images, accelerator, seed, batch_size=4, schedulers=(),
                          weight_dtype=torch.float32, num_inference_steps=None, call_kwargs=None,
                          encoders_on_device=contextlib.nullcontext):
    """Render ``pipe(prompt)`` into ``class_dir`` until it holds ``num_images`` images; returns how many it made.

    Only the main process renders; the others wait. With a module of ``pipe`` sharded (``--fsdp_text_encoder``),
    whose forward needs every process, every process renders every image and the main one writes them. The image
    that becomes the folder's i-th is drawn from a generator seeded ``seed + i``, so the same folder state gives the
    same images. Rendering has validation's protections: the global RNG is untouched, and ``pipe.scheduler``,
    ``schedulers`` (e.g. the training noise scheduler) and every module's train/eval mode are restored afterwards.
    ``encoders_on_device`` (e.g. `frozen_encoders.FrozenEncoders.on_device`) holds the encoders kept off the accelerator on it
    while rendering.
    """
    class_dir = Path(class_dir)
    accelerator.wait_for_everyone()  # every process counts before the main one starts writing
    existing = len(list_images(class_dir))
    missing = max(0, num_images - existing)
    if missing == 0:
        accelerator.print(f"{class_dir} holds {existing} class images; none generated")
        return 0
    if accelerator.is_main_process or any(map(is_sharded, modules_of(pipe).values())):
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
                for image in images if accelerator.is_main_process else ():
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
