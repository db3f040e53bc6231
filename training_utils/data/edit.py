"""Edit data: a target image, the reference images it is rendered from (none, one or several) and an instruction.

An edit model (FLUX.2 with reference images, FLUX.1 Kontext, Qwen-Image-Edit) renders a target from references and
an instruction. The data flags are upstream's (`add_edit_args`): ``--dataset_name`` (a datasets name, or a folder,
e.g. an imagefolder whose ``metadata.jsonl`` names the target in ``file_name`` and the references in
``reference_file_name`` or, for several, ``reference_file_names``) with ``--image_column`` (the target),
``--cond_image_column`` (the references: one image, a list of images, or none for a row) and ``--caption_column``
(the instruction); or ``--instance_data_dir`` (targets only, captioned by ``--instance_prompt`` or sidecar files).
A row without a reference trains as text-to-image; the run logs how many do.

Each reference is laid out by the family's function, encoded and cached by `edit_samples`, which makes the
samples. An unreadable reference stops the run before any weights load, in one line naming it (with
``--skip_corrupt_images`` its row is left out, named in a warning). ``--validation_image`` gives the validation
prompts' references (`validation_inputs`).
"""

import logging
from pathlib import Path
from typing import NamedTuple

from PIL import Image

from ..errors import UsageError, require
from .captions import without_bom
from .datasets import load_train_dataset
from .dreambooth import EmbeddedImage, add_instance_args, folder_images
from .images import UNREADABLE_IMAGE_ERRORS, image_sizes, openable, read_image

logger = logging.getLogger(__name__)


# The DreamBooth flags of upstream's edit scripts that no edit script here carries.
EDIT_REFUSALS = {
    "--class_data_dir": "an edit trains on its rows alone, without prior preservation (upstream's image-to-image "
                        "scripts take the flag and never read it)",
    "--sample_batch_size": "an edit generates no class images (upstream's image-to-image scripts take the flag and "
                           "never read it)",
}


def add_edit_args(parser):
    """Upstream's data flags of its edit scripts (``--cond_image_column``, ``--validation_image``), beside the shared
    data flags and those of training images in a folder (`dreambooth.add_instance_args`: here the targets)."""
    group = parser.add_argument_group("edit data")
    add_instance_args(parser, group, prompt_required=False)
    group.add_argument("--cond_image_column", default=None,
                       help="--dataset_name's column of reference images: an image, a list of images, or nothing "
                            "for a row (which then trains as text-to-image)")
    group.add_argument("--validation_image", nargs="+", action="append", default=None,
                       help="reference images for the validation prompts: given once, every prompt's; given once "
                            "per --validation_prompt, that prompt's (several images each are allowed)")


class EditRows(NamedTuple):
    """The rows to train on: each one's target (a path, or a dataset's `EmbeddedImage`), its references (a tuple of
    those, maybe empty) and its instruction (a string, or a list of strings to draw one from)."""

    targets: list
    references: list
    captions: list

    def select(self, keep):
        """The rows whose positions are in ``keep``."""
        return EditRows(*([values[index] for index in keep] for values in self))


def check_edit_args(args):
    """Fail on bad edit data flags before any weights load (the rows are checked as they are read,
    `edit_rows_from_args`)."""
    require((args.instance_data_dir is None) != (args.dataset_name is None), "--instance_data_dir",
            args.instance_data_dir, "a folder of target images, or --dataset_name, not both")
    require(args.instance_prompt is None or args.instance_prompt.strip(), "--instance_prompt", args.instance_prompt,
            "a non-empty instruction")
    if args.dataset_name is not None:
        require(args.caption_extension is None, "--caption_extension", args.caption_extension,
                "no caption files with --dataset_name (its instructions are in --caption_column)")
        require(args.caption_column is not None or args.instance_prompt is not None, "--caption_column", None,
                "a column of instructions, or --instance_prompt for every row")
    else:
        for flag in ("--cond_image_column", "--caption_column"):
            value = getattr(args, flag[2:])
            require(value is None, flag, value, "--dataset_name with it (--instance_data_dir holds targets only)")
        require(args.instance_prompt is not None or args.caption_extension is not None, "--instance_prompt", None,
                "an instruction for the targets of --instance_data_dir (or --caption_extension files)")


def edit_rows_from_args(args, max_references=None, check_size=None):
    """The `EditRows` of ``--dataset_name`` or ``--instance_data_dir`` (checked flags), their references read
    (`readable_references`), before any weights load. ``max_references`` is the most references the model takes in
    one sample (None: no limit); ``check_size(width, height)`` raises ValueError for a reference size the model's
    pipeline refuses."""
    if args.dataset_name is not None:
        rows = dataset_edit_rows(args)
    else:
        targets = folder_images(args)
        rows = EditRows(targets.images, [()] * len(targets.images), targets.captions)
    most = max(map(len, rows.references))
    require(max_references is None or most <= max_references, "--cond_image_column", args.cond_image_column,
            f"at most {max_references} reference images a row for this model (a row has {most})")
    rows = readable_references(rows, args.cond_image_column, args.skip_corrupt_images, check_size)
    without = sum(not references for references in rows.references)
    if without:
        logger.warning(f"{without} of {len(rows.targets)} rows have no reference image: they train as text-to-image")
    return rows


def dataset_edit_rows(args):
    """`EditRows` of ``--dataset_name``: its ``--image_column``, ``--cond_image_column`` and ``--caption_column``
    (a row without a caption takes ``--instance_prompt``), checked reading no image."""
    import datasets

    columns = {"--image_column": args.image_column}
    for flag, column in (("--cond_image_column", args.cond_image_column), ("--caption_column", args.caption_column)):
        if column is not None:
            columns[flag] = column
    # Without --instance_prompt to fall back on, every row needs its caption (checked there).
    dataset = load_train_dataset(args, {flag: column for flag, column in columns.items()
                                        if flag != "--caption_column" or args.instance_prompt is None})
    require(args.caption_column is None or args.caption_column in dataset.column_names, "--caption_column",
            args.caption_column, f"a column of the dataset: {', '.join(dataset.column_names)}")
    targets = [undecoded_image(value, "--image_column", args.image_column, index) for index, value in
               enumerate(dataset.cast_column(args.image_column, datasets.Image(decode=False))[args.image_column])]
    references = [()] * len(targets)
    if args.cond_image_column is not None:
        column = args.cond_image_column
        feature = undecoded_feature(dataset.features[column], column)
        references = [tuple(undecoded_image(image, "--cond_image_column", column, index)
                            for image in ([] if value is None else value if isinstance(value, list) else [value]))
                      for index, value in enumerate(dataset.cast_column(column, feature)[column])]
    captions = [args.instance_prompt] * len(targets)
    if args.caption_column is not None:
        captions = [without_bom(caption) if caption not in (None, "") or args.instance_prompt is None
                    else args.instance_prompt for caption in dataset[args.caption_column]]
    return EditRows(targets, references, captions)


def undecoded_feature(feature, column):
    """``feature`` (an image, or a list of images) with decoding off, so that rows give ``{"path", "bytes"}``."""
    import datasets

    if isinstance(feature, datasets.Image):
        return datasets.Image(decode=False)
    inner = getattr(feature, "feature", None)
    if isinstance(feature, (datasets.List, datasets.Sequence, list)) and isinstance(
            feature[0] if isinstance(feature, list) else inner, datasets.Image):
        return datasets.List(datasets.Image(decode=False))
    raise UsageError("--cond_image_column", column, f"a column of images or lists of images, not {feature}")


def undecoded_image(value, flag, column, index):
    """A dataset's undecoded image as a path (an image in a file) or an `EmbeddedImage` (one held in the dataset)."""
    if not isinstance(value, dict) or (value.get("bytes") is None and value.get("path") is None):
        raise UsageError(flag, column, f"an image in every place of the column: row {index} has {value!r}")
    return EmbeddedImage(value) if value["bytes"] is not None else Path(value["path"])


def image_name(image):
    """How a message names an image: its path, or a dataset's embedded image by its original file name."""
    return str(image["path"] or "an embedded image") if isinstance(image, dict) else str(image)


def readable_references(rows, column, skip_unreadable, check_size=None):
    """``rows`` whose references all read (decoded, so that a truncated file is found here, not as a size of 1×1); a
    row with one that does not stops the run in one line naming it and why, or with ``skip_unreadable`` is left out,
    counted and named in one warning. ``check_size(width, height)`` (the family's) raises ValueError for a size its
    pipeline refuses: that stops the run, naming the image."""
    unreadable = {}
    for index, references in enumerate(rows.references):
        for reference in references:
            try:
                with Image.open(openable(reference)) as image:
                    image.load()
            except UNREADABLE_IMAGE_ERRORS as error:
                unreadable[index] = f"{image_name(reference)} ({type(error).__name__}: {error})"
                break
            check_reference_size(reference, check_size, "--cond_image_column", column, f"row {index}'s ")
    if not unreadable:
        return rows
    first = next(iter(unreadable.items()))
    if not skip_unreadable:
        raise UsageError("--cond_image_column", column, f"readable reference images: row {first[0]}'s "
                         f"{first[1]} is not (--skip_corrupt_images leaves such rows out)")
    logger.warning(f"{len(unreadable)} rows left out for an unreadable reference image: "
                   + "; ".join(f"row {index}: {name}" for index, name in unreadable.items()))
    return rows.select([index for index in range(len(rows.targets)) if index not in unreadable])


def check_reference_size(image, check_size, flag, value, whose=""):
    """Stop in one line naming ``image`` if ``check_size`` (a family's: ValueError for a size its pipeline refuses)
    refuses its upright size."""
    if check_size is not None:
        try:
            check_size(*image_sizes([image])[0] if not isinstance(image, Image.Image) else image.size)
        except ValueError as error:
            raise UsageError(flag, value, f"reference images the pipeline takes: {whose}{image_name(image)} is not "
                                          f"({error})") from None


def validation_references(args, check_size=None):
    """Each validation prompt's reference images (a list of PIL images, maybe empty), from ``--validation_image``:
    given once, every prompt's; given once per prompt, that prompt's. Read, and their sizes checked
    (``check_size``, as `readable_references`), before any weights load."""
    prompts = args.validation_prompt or []
    given = args.validation_image or []
    if not given:
        return [[] for _ in prompts]
    require(prompts, "--validation_image", given, "a --validation_prompt to render with it")
    require(len(given) in (1, len(prompts)), "--validation_image", given,
            f"one set of reference images for every prompt, or one per prompt ({len(prompts)})")
    read = {}
    for path in (path for paths in given for path in paths):
        try:
            read[path] = read_image(path)
        except UNREADABLE_IMAGE_ERRORS as error:
            raise UsageError("--validation_image", path, f"a readable image ({type(error).__name__})") from None
        check_reference_size(path, check_size, "--validation_image", path)
    sets = [[read[path] for path in paths] for paths in given]
    return sets * len(prompts) if len(sets) == 1 else sets


def validation_inputs(args, single_reference=False, check_size=None):
    """`validation.make_validator`'s keyword arguments for ``--validation_image``: each prompt's references as the
    pipeline's ``image`` (a list, or with ``single_reference`` the image itself, for a pipeline that takes one) and
    as the conditioning images that each step's grid shows first, labelled "references"."""
    references = validation_references(args, check_size)
    if single_reference:
        require(all(len(images) <= 1 for images in references), "--validation_image", args.validation_image,
                "one reference image a prompt for this model")
    return {"prompt_kwargs": [{"image": images[0] if single_reference else images} if images else {}
                              for images in references],
            "conditioning_images": references, "conditioning_label": "references"}


def how_to_edit(template, args, single_reference=False):
    """``(template, fields)`` for `hub.how_to_load`: a loading code ``template`` (e.g. `hub.LORA_HOW_TO_LOAD`) whose
    call passes references as the pipeline's ``image`` (a list, or with ``single_reference`` one image): the first
    validation prompt's, or a placeholder file name."""
    paths = (args.validation_image or [["reference.png"]])[0]
    images = [f'load_image("{path}")' for path in paths]
    image = images[0] if single_reference else f"[{', '.join(images)}]"
    imports = "from diffusers import {imports}\n"
    template = template.replace('pipe("{prompt}")', 'pipe("{prompt}", image={image})').replace(
        imports, imports + "from diffusers.utils import load_image\n")
    return template, {"image": image}
