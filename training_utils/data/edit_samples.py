"""Edit samples: a target, its references and its instruction, laid out, cached and batched for training.

The target is laid out as every training image is (buckets, crops, flips: the run's `ImageTransform`), and its
latents cached as theirs are (`frozen_encoders.FrozenEncoders`). Each reference is laid out by the family's own function
(``lay_out(image)``: CHW pixels in [-1, 1], resized as the pipeline resizes references; passed in by the script),
mirrored when its target is, and encoded by the VAE to its latent distribution's parameters, cached with
``--cache_latents`` (in memory, or on disk with ``--feature_cache_dir``) and otherwise encoded in each step
(`References`). A batch holds samples whose target and references have one shape each (`SampleShape`), so that
they stack. The rows come from `edit.edit_rows_from_args`. A sample carries its row's position, so that a family whose
prompt embedding depends on the references (Qwen-Image-Edit's) looks it up by row and instruction.
"""

import contextlib

import torch
from PIL import Image, ImageOps

from .cache_keys import describe
from .captions import distinct_captions
from .datasets import TrainDataset, drop_caption, pick_caption, stack_collate
from .feature_store import Block, block_bytes, encode_once, encoders_on
from .frozen_encoders import UnreadableImage, image_source, many
from .images import READING, image_sizes, read_image
from .prompts import embeddings_by_caption, text_chunk_encoder


class SampleShape(tuple):
    """A sample's shapes, its target's (height, width) first, then each reference's pixels': samples of one
    `SampleShape` stack into a batch (`buckets.BucketBatchSampler` batches them together)."""

    @property
    def target(self):
        return self[0]

    @property
    def label(self):
        references = ", ".join("x".join(map(str, shape)) for shape in self[1:]) or "none"
        return f"target {'x'.join(map(str, self.target))}, references {references}"


class References:
    """Reference images as a pipeline conditions on them: laid out by ``lay_out`` (the family's function: a PIL
    image to CHW pixels in [-1, 1]), mirrored with their target, and encoded by ``encoders``' VAE to the latent
    distribution's parameters, which the family turns into latents as its pipeline does (the mode, or a sample).

    With ``encoders.cache_latents`` each distinct reference is encoded once (both mirrorings) by `cache`, in memory
    or under ``encoders.cache_dir``; a sample then carries the parameters, else the pixels. The disk cache is keyed
    by ``lay_out``'s code (a ``functools.partial``'s function's) and ``depends_on``, what else the layout depends on
    (e.g. the pipeline's image processor settings)."""

    def __init__(self, lay_out, encoders, depends_on=()):
        self.lay_out = lay_out
        self.encoders = encoders
        self.depends_on = list(depends_on)
        self.cached = None
        self._shapes = {}

    def shape_of(self, width, height):
        """The (height, width) of the pixels ``lay_out`` makes of a ``width``×``height`` image (only the size
        matters to its resize and crop, so a blank image of that size tells)."""
        if (width, height) not in self._shapes:
            self._shapes[width, height] = tuple(self.lay_out(Image.new("RGB", (width, height))).shape[-2:])
        return self._shapes[width, height]

    def shapes(self, references):
        """Each reference's laid-out (height, width), from its header."""
        return [self.shape_of(*size) for size in image_sizes(references)]

    def pixels(self, reference, flip=False):
        pixels = self.lay_out(read_image(reference))
        return pixels.flip(-1) if flip else pixels

    def cache(self, references):
        """With cached latents, encode each distinct reference of ``references`` once (unflipped and flipped)."""
        if not self.encoders.cache_latents:
            return
        keys = list(dict.fromkeys(references))
        encoders = self.encoders
        store = encoders.store("reference_latents", {
            "vae": describe(encoders.vae), "images": many([image_source(key) for key in keys], "images"),
            "reading": READING, "layout": describe(getattr(self.lay_out, "func", self.lay_out)),
            "depends_on": [describe(thing) for thing in self.depends_on]})

        def encode_chunk(indices):
            pixels = [self.pixels(keys[index], flip) for index in indices for flip in (False, True)]
            parameters = encoders.vae.encode(torch.stack(pixels).to(encoders.device, encoders.dtype))
            return Block(torch.tensor(indices), {"parameters": parameters.latent_dist.parameters.cpu().unflatten(
                0, (len(indices), 2))}, {})

        def bytes_per_item():
            return encode_chunk([0]).tensors["parameters"].nbytes

        # One reference a chunk: references differ in size, and a chunk's tensors stack.
        blocks = encode_once("reference latents", len(keys), encode_chunk, bytes_per_item,
                             lambda: encoders_on(encoders.device, [encoders.vae]), 1, store)
        found = {}
        for block in blocks:
            found.update({index: block.tensors["parameters"][row] for row, index in enumerate(block.indices.tolist())})
        self.cached = {key: found[index] for index, key in enumerate(keys)}

    def sample(self, reference, flip):
        """What a sample carries for ``reference``: its cached parameters (of the mirrored image if ``flip``), or
        its pixels."""
        if self.cached is None:
            return self.pixels(reference, flip)
        cached = self.cached[reference]
        if isinstance(cached, UnreadableImage):
            raise cached
        return cached[int(flip)]

    def parameters(self, batch):
        """The latent parameters of a batch's references (a list, one tensor of shape (B, 3, H, W) or of cached
        parameters per reference), encoded now when not cached."""
        if self.cached is not None:
            return list(batch)
        encoders = self.encoders
        offloaded = encoders.vae in encoders.off_device
        with encoders_on(encoders.device, [encoders.vae]) if offloaded else contextlib.nullcontext():
            return [encoders.vae.encode(pixels.to(encoders.device, encoders.dtype)).latent_dist.parameters
                    for pixels in batch]


def edit_prompts(rows, caption_dropout):
    """The instructions a run trains on, each once, and with ``caption_dropout`` the empty one."""
    return [*distinct_captions(rows.captions), *([""] if caption_dropout > 0 else [])]


def edit_dataset(rows, encoders, references, seed, repeats=1, caption_dropout=0.0):
    """A `datasets.TrainDataset` of the `EditRows` ``rows``, each ``repeats`` times. A sample is ``{"image"``: the
    target as ``encoders.image_file`` gives it (pixels or cached latent parameters), ``"references"``: a list of
    what `References.sample` gives for each, mirrored with the target, ``"prompt"``: its instruction (one drawn
    from a list; the empty one with probability ``caption_dropout``), ``"row"``: its row's position, ``"flip"``:
    whether it is mirrored (for a family whose prompt embedding sees the references)}. Samples are batched by
    `SampleShape`; the dataset's ``target_shapes`` are the targets' (for the validation size)."""
    transform = encoders.transform
    target_shapes = transform.shapes(image_sizes(rows.targets))
    shapes = [SampleShape([target, *references.shapes(refs)]) for target, refs in zip(target_shapes, rows.references)]
    encoders.cache_image_files(zip(rows.targets, target_shapes))
    references.cache([reference for refs in rows.references for reference in refs])
    examples = [{"target": target, "references": list(refs), "caption": caption, "row": index}
                for index, (target, refs, caption) in enumerate(zip(*rows))]

    def preprocess(example, generator):
        shape = shapes[example["row"]]
        laid_out, flip = encoders.image_file_with_flip(example["target"], generator, shape.target)
        return {"image": laid_out.pixels,
                "references": [references.sample(reference, flip) for reference in example["references"]],
                "prompt": drop_caption(pick_caption(example["caption"], generator), caption_dropout, generator),
                "row": example["row"], "flip": flip}

    dataset = TrainDataset(examples, preprocess, seed, repeats, shapes)
    dataset.target_shapes = target_shapes
    return dataset


def edit_collate(examples):
    """``{"images", "references": a list with one stacked tensor per reference place, "prompts", "rows",
    "flips"}``."""
    batch = stack_collate([{key: example[key] for key in ("image", "prompt", "row", "flip")} for example in examples])
    return {"images": batch["image"], "prompts": batch["prompt"], "rows": batch["row"], "flips": batch["flip"],
            "references": [torch.stack(place) for place in zip(*(example["references"] for example in examples))]}


def embeddings_with_references(encoders, rows, caption_dropout, encode, depends_on=(), mirrored=False):
    """``{(row, instruction, flip): embedding row}`` for a family whose prompt embedding depends on the references
    (Qwen-Image-Edit's text encoder sees them): each row's instructions (and with ``caption_dropout`` the empty
    one), each encoded once with the row's references (and with ``mirrored``, random flips, once more with them
    mirrored, as its samples' are) by ``encode(list of (instruction, PIL references))`` before training, held in
    memory, or on disk under ``encoders.cache_dir`` keyed by the instructions, the references' sources, the text
    encoders, ``encode``'s code and ``depends_on``. A batch's samples look theirs up by their ``"rows"``,
    ``"prompts"`` and ``"flips"``."""
    keys = list(dict.fromkeys(
        (row, instruction, flip) for row, caption in enumerate(rows.captions)
        for instruction in [*distinct_captions([caption]), *([""] if caption_dropout else [])]
        for flip in ((False, True) if mirrored else (False,))))
    store = encoders.store("text_embeddings_with_references", {
        "encoders": [describe(encoder) for encoder in encoders.text_encoders],
        "depends_on": [describe(thing) for thing in depends_on], "encode": describe(encode),
        "samples": many([[instruction, flip, *map(image_source, rows.references[row])]
                         for row, instruction, flip in keys], "samples")})

    def encode_keys(chosen):
        return encode([(instruction, [ImageOps.mirror(image) if flip else image
                                      for image in map(read_image, rows.references[row])])
                       for row, instruction, flip in chosen])

    encode_chunk = text_chunk_encoder(keys, encode_keys)
    blocks = encode_once("text embeddings with references", len(keys), encode_chunk,
                         lambda: block_bytes(encode_chunk([0])),  # one item's
                         lambda: encoders_on(encoders.device, encoders.text_encoders), encoders.batch_size, store)
    return embeddings_by_caption(keys, blocks)
