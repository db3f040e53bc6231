"""Aspect-ratio buckets: images of every shape train at about the same pixel count, uncropped but for the margin
their bucket's aspect ratio leaves, instead of as center squares (which cut heads and feet off portraits).

A bucket is a (height, width) that the model can take: both sides a multiple of `size_multiple` (the VAE's
downsampling times the UNet's, or times the transformer's patch). Each image goes to the bucket nearest its aspect
ratio, is resized to cover it and cropped to it (`images.ImageTransform`), and every batch holds images of one
bucket (`BucketBatchSampler`).

Without a list (``--use_aspect_ratio_buckets``) the buckets are made from ``--resolution`` (`on_the_fly_buckets`:
about ``resolution²`` pixels, from 1:4 to 4:1), and an image smaller than its bucket goes to the largest bucket of
that shape that it fills, rather than being upscaled. With a list (``--aspect_ratio_buckets "h,w;h,w"``) the
buckets are those, and every image is resized to cover its bucket.
"""

import collections
import math

import torch

from ..errors import UsageError, require

# The most elongated bucket made on the fly, as height / width and width / height.
MAX_ASPECT_RATIO = 4


def add_bucket_args(group):
    """Upstream's bucket flags."""
    group.add_argument("--use_aspect_ratio_buckets", action="store_true",
                       help="train each image at the aspect ratio nearest its own, about --resolution² pixels, "
                            "instead of a --resolution square; every batch holds one bucket")
    group.add_argument("--aspect_ratio_buckets", type=parse_buckets, default=None,
                       help='the buckets, as "height,width;height,width;…" (implies --use_aspect_ratio_buckets; '
                            "--resolution is then ignored); default: made from --resolution")


def parse_buckets(value):
    """``"h,w;h,w"`` as a list of (height, width), for ``--aspect_ratio_buckets``."""
    buckets = []
    for pair in filter(None, (part.strip() for part in value.split(";"))):
        sides = pair.split(",")
        if len(sides) != 2 or not all(side.strip().isdigit() and int(side) > 0 for side in sides):
            raise UsageError("--aspect_ratio_buckets", value,
                             f'"height,width" pairs of positive integers separated by ";" ({pair!r} is not one)')
        buckets.append((int(sides[0]), int(sides[1])))
    if not buckets:
        raise UsageError("--aspect_ratio_buckets", value, 'at least one "height,width" pair')
    return sorted(set(buckets))


def size_multiple(pipe):
    """The multiple of which both sides of a training image must be for ``pipe``'s model: the VAE's downsampling
    times the UNet's (which halves at every down block but the last) or times the transformer's patch (a pipeline
    that packs 2×2 latents into one token, as FLUX.2, Qwen-Image and Z-Image do, says so in its image processor's
    factor; Kandinsky's MoVQ factor squared); and of 8, which the pipelines ask of a size they render, so that
    validation can render any bucket."""
    model = pipe.unet if hasattr(pipe, "unet") else pipe.transformer
    config = model.config
    if "down_block_types" in config:
        model_factor = 2 ** (len(config.down_block_types) - 1)
    else:
        # A transformer without a patch size of its own (Krea 2's: its pipeline packs the patches) leaves it to the
        # image processor's factor; a video model's is (time, height, width).
        patch = config.get("patch_size") or config.get("all_patch_size") or 1
        model_factor = patch[-1] if isinstance(patch, (list, tuple)) else patch
    if hasattr(pipe, "movq_scale_factor"):
        # Kandinsky's pipelines render latents of ceil(side / factor²) * factor: a side it renders as given is a
        # multiple of the MoVQ's factor squared.
        return math.lcm(pipe.movq_scale_factor ** 2, pipe.movq_scale_factor * model_factor, 8)
    processor = getattr(pipe, "image_processor", None) or pipe.video_processor
    # A video pipeline's processor holds its VAE's spatial factor, whatever the pipeline calls it.
    vae_factor = getattr(pipe, "vae_scale_factor", None) or processor.config.vae_scale_factor
    needed = max(processor.config.vae_scale_factor, vae_factor * model_factor)
    return math.lcm(needed, 8)


def on_the_fly_buckets(resolution, multiple):
    """The (height, width) buckets of about ``resolution²`` pixels, each side a multiple of ``multiple``, from
    1:`MAX_ASPECT_RATIO` to `MAX_ASPECT_RATIO`:1: for every width up to ``resolution``, the height that comes
    nearest the area (a portrait or square bucket), and the same turned landscape."""
    area = resolution * resolution
    buckets = set()
    for width in range(multiple, resolution + 1, multiple):
        height = round(area / width / multiple) * multiple
        if width <= height <= MAX_ASPECT_RATIO * width:
            buckets.update([(height, width), (width, height)])
    return sorted(buckets)


class AspectRatioBuckets:
    """Which bucket an image of a given size trains in.

    Args:
        buckets: the (height, width) buckets.
        cap_to_image: an image smaller than its bucket goes to the largest bucket of the same shape that it
            fills (each side still a multiple of ``multiple``), instead of being upscaled.
        multiple: what each side of a bucket is a multiple of.
    """

    def __init__(self, buckets, multiple, cap_to_image=True):
        self.buckets = sorted(buckets)
        self.multiple = multiple
        self.cap_to_image = cap_to_image

    @classmethod
    def from_args(cls, args, pipe):
        """The buckets ``--use_aspect_ratio_buckets``/``--aspect_ratio_buckets`` ask for, for ``pipe``'s model;
        None without either."""
        if not (args.use_aspect_ratio_buckets or args.aspect_ratio_buckets):
            return None
        multiple = size_multiple(pipe)
        if args.aspect_ratio_buckets is None:
            return cls(on_the_fly_buckets(args.resolution, multiple), multiple)
        for height, width in args.aspect_ratio_buckets:
            require(height % multiple == 0 and width % multiple == 0, "--aspect_ratio_buckets",
                    f"{height},{width}", f"sides that are multiples of {multiple} for this model")
        return cls(args.aspect_ratio_buckets, multiple, cap_to_image=False)

    def nearest(self, width, height):
        """The bucket whose aspect ratio is nearest ``width``×``height``'s (by log ratio; ties: the first)."""
        ratio = math.log(height / width)
        return min(self.buckets, key=lambda bucket: abs(math.log(bucket[0] / bucket[1]) - ratio))

    def shape_of(self, width, height):
        """The (height, width) an image of ``width``×``height`` trains at."""
        bucket_height, bucket_width = self.nearest(width, height)
        if not self.cap_to_image or (width >= bucket_width and height >= bucket_height):
            return bucket_height, bucket_width
        scale = min(width / bucket_width, height / bucket_height)
        return (max(self.multiple, int(bucket_height * scale) // self.multiple * self.multiple),
                max(self.multiple, int(bucket_width * scale) // self.multiple * self.multiple))


def validation_size(args, shapes=None):
    """``{"height", "width"}`` to render validation images at: ``--validation_height``/``--validation_width``,
    else the shape most training images have (``shapes``, with buckets; the largest among equally common ones),
    else the ``--resolution`` square."""
    height = width = args.resolution
    if shapes:
        counts = collections.Counter(shapes)
        height, width = max(counts, key=lambda shape: (counts[shape], shape))
    return {"height": args.validation_height or height, "width": args.validation_width or width}


class BucketBatchSampler(torch.utils.data.Sampler):
    """Batches of one bucket each, in an order drawn from (seed, epoch) alone, so a resumed run skips to the
    same batch.

    Each epoch every bucket's images are shuffled and cut into batches of ``batch_size``; a bucket's last,
    partial batch is filled up with the first images of its order (already seen this epoch), so that no image is
    left out, a bucket smaller than a batch still trains, and every batch has the same size (on several
    processes, accelerate deals whole batches round-robin). Then the batches of all buckets are shuffled
    together. The number of batches is the same every epoch.

    ``dataset`` is a `datasets.TrainDataset` with ``shapes``; its ``epoch`` is the epoch drawn.
    """

    def __init__(self, dataset, batch_size, seed):
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.drop_last = False
        groups = collections.defaultdict(list)
        for index in range(len(dataset)):
            groups[dataset.shape_of(index)].append(index)
        self.groups = dict(sorted(groups.items()))

    def __len__(self):
        return sum(math.ceil(len(indices) / self.batch_size) for indices in self.groups.values())

    def __iter__(self):
        generator = torch.Generator().manual_seed(hash((self.seed, self.dataset.epoch)) & 0x7FFF_FFFF_FFFF_FFFF)
        batches = []
        for indices in self.groups.values():
            order = [indices[i] for i in torch.randperm(len(indices), generator=generator).tolist()]
            filler = (order * self.batch_size)[: -len(order) % self.batch_size]
            order += filler
            batches += [order[start:start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        for position in torch.randperm(len(batches), generator=generator).tolist():
            yield batches[position]

    def report(self):
        """One line per bucket: its images, its batches per epoch, and what fills its last batch."""
        lines = []
        for shape, indices in self.groups.items():
            batches, left_over = divmod(len(indices), self.batch_size)
            sides = "frames x height x width" if len(shape) == 3 else "height x width"
            # A shape may describe itself (an edit sample's: its target's and its references').
            label = getattr(shape, "label", f"{'x'.join(map(str, shape))} ({sides})")
            line = f"bucket {label}: {counted(len(indices), 'image')}, "
            if left_over:
                line += (f"{counted(batches + 1, 'batch')} an epoch; {left_over} left over at the end of an epoch, "
                         f"batched with {self.batch_size - left_over} of the bucket's images seen that epoch")
            else:
                line += f"{counted(batches, 'batch')} an epoch, none left over"
            lines.append(line)
        return lines


def counted(count, noun):
    return f"{count} {noun}{'' if count == 1 else 'es' if noun.endswith('ch') else 's'}"
