"""The tiny datasets: pictures of coloured shapes, drawn in code, with captions that describe them.

Every picture is a coloured circle, square or triangle at a jittered place on a plain background; its caption
says which (``a red circle on a white background``), and its mask (the shape in white) is a ControlNet's
conditioning image.
"""

import json
import math
import random
from pathlib import Path

from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 30, 30),
    "green": (30, 170, 60),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 170),
    "orange": (240, 130, 20),
}
BACKGROUNDS = {"white": (245, 245, 245), "black": (15, 15, 15), "gray": (128, 128, 128)}
SHAPES = ("circle", "square", "triangle")

IMAGE_SIZE = 64
# (width, height) of the pictures of mixed shapes: landscape 2:1 and 4:3, portrait 1:2, square, a square smaller
# than the tests' 32-pixel resolution, and 4:1.
MIXED_SIZES = [(64, 32), (32, 64), (48, 48), (64, 48), (24, 24), (96, 24)]
SEED = 0


def draw_shape(shape, color, background, size=IMAGE_SIZE, rng=None, extent=None):
    """One synthetic picture and its mask: a coloured shape (one of `SHAPES`, or the DreamBooth demo's ``star``,
    which no caption of the datasets names) at a jittered position on a plain background, a
    ``size`` square or ``size`` (width, height).

    The shape's side is drawn from ``extent`` (lowest, highest) in pixels, by default a third to a half of the
    shorter side. Returns ``(image, mask)``; the mask is white where the shape is, black elsewhere.
    """
    rng = rng or random.Random(SEED)
    width, height = (size, size) if isinstance(size, int) else size
    image = Image.new("RGB", (width, height), BACKGROUNDS[background])
    mask = Image.new("RGB", (width, height), (0, 0, 0))
    extent = rng.randint(*(extent or (min(width, height) // 3, min(width, height) // 2)))
    left = rng.randint(2, width - extent - 2)
    top = rng.randint(2, height - extent - 2)
    box = (left, top, left + extent, top + extent)
    for canvas, fill in ((image, COLORS[color]), (mask, (255, 255, 255))):
        draw = ImageDraw.Draw(canvas)
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        elif shape == "star":
            draw.polygon(star_points(box), fill=fill)
        else:
            draw.polygon([(left + extent // 2, top), (left, top + extent), (left + extent, top + extent)], fill=fill)
    return image, mask


def star_points(box):
    """The corners of a five-pointed star, point up, inscribed in ``box`` (left, top, right, bottom)."""
    left, top, right, bottom = box
    center_x, center_y, radius = (left + right) / 2, (top + bottom) / 2, (right - left) / 2
    return [(center_x + r * math.sin(math.pi * k / 5), center_y - r * math.cos(math.pi * k / 5))
            for k, r in enumerate([radius, radius * 0.45] * 5)]


def build_shapes(path, num_images=36, with_conditioning=False, sizes=(IMAGE_SIZE,), extent=None, colors=COLORS,
                 backgrounds=BACKGROUNDS, shapes=SHAPES):
    """An imagefolder dataset: ``metadata.jsonl`` with ``file_name`` and ``text`` captions that describe the image.

    ``with_conditioning`` adds a ``conditioning_image`` column (ControlNet layout): the shape's mask. The images
    take the ``sizes`` (see `draw_shape`) in turn; the shapes' sides are drawn from ``extent`` (see `draw_shape`).
    Each of the ``shapes`` comes in each of the ``colors`` on each of the ``backgrounds`` (names of `SHAPES`,
    `COLORS` and `BACKGROUNDS`), in a shuffled order, repeated.
    """
    path = Path(path)
    (path / "conditioning").mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    combos = [(s, c, b) for s in shapes for c in colors for b in backgrounds]
    rng.shuffle(combos)
    with open(path / "metadata.jsonl", "w") as metadata:
        for index in range(num_images):
            shape, color, background = combos[index % len(combos)]
            row = {"file_name": f"{index:04d}.png"}
            image, mask = draw_shape(shape, color, background, sizes[index % len(sizes)], rng=rng, extent=extent)
            image.save(path / row["file_name"])
            if with_conditioning:
                row["conditioning_image_file_name"] = f"conditioning/{index:04d}.png"
                mask.save(path / row["conditioning_image_file_name"])
            row["text"] = f"a {color} {shape} on a {background} background"
            metadata.write(json.dumps(row) + "\n")
    if not with_conditioning:
        (path / "conditioning").rmdir()


def build_shapes_controlnet(path):
    """The shapes dataset with ``image``, ``conditioning_image`` (the shape's mask) and ``text``."""
    build_shapes(path, with_conditioning=True)


def build_shapes_mixed(path):
    """The shapes dataset, with conditioning images, in landscape, portrait, square, small and 4:1 pictures
    (`MIXED_SIZES`), for aspect-ratio buckets."""
    build_shapes(path, num_images=12, with_conditioning=True, sizes=MIXED_SIZES)


def build_instance(path, num_images=6, sizes=(IMAGE_SIZE,)):
    """A DreamBooth instance folder: a few pictures of one subject (a purple triangle), no captions; the images
    take the ``sizes`` (see `draw_shape`) in turn."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED + 1)
    for index in range(num_images):
        image, _ = draw_shape("triangle", "purple", rng.choice(list(BACKGROUNDS)), sizes[index % len(sizes)],
                              rng=rng)
        image.save(path / f"{index:04d}.png")


def build_instance_mixed(path):
    """The DreamBooth instance folder in the `MIXED_SIZES`, for aspect-ratio buckets."""
    build_instance(path, sizes=MIXED_SIZES)


# The captions of `build_instance_captioned`'s pictures, of several lengths (batched, the shorter ones are padded);
# the last repeats the third.
INSTANCE_CAPTIONS = ["sks triangle on a gray background", "sks triangle, small, on a plain background, seen from the "
                     "front", "a sks triangle", "a drawing of sks triangle in purple", "sks", "a sks triangle"]
CAPTION_FILES = 4  # the first four pictures have sidecar caption files; the last two have none


def build_instance_captioned(path):
    """The DreamBooth instance folder in the `MIXED_SIZES`, captioned twice: a ``.txt`` caption file beside each of
    the first `CAPTION_FILES` pictures (the others take the instance prompt), and ``metadata.jsonl`` with every
    picture's `INSTANCE_CAPTIONS` in ``text`` (the folder as a ``--dataset_name`` imagefolder)."""
    build_instance_mixed(path)
    path = Path(path)
    with open(path / "metadata.jsonl", "w") as metadata:
        for index, caption in enumerate(INSTANCE_CAPTIONS):
            metadata.write(json.dumps({"file_name": f"{index:04d}.png", "text": caption}) + "\n")
            if index < CAPTION_FILES:
                (path / f"{index:04d}.txt").write_text(caption + "\n")


# The sides of large shapes, nearly centred (a 64-pixel picture leaves them 2 to 10 pixels of play): the pictures
# the pretrained fixtures' VAE and SD3 transformer learn from.
LARGE_EXTENT = (40, 52)
STAR_PROMPT = "a sks star on a white background"


# The star `make demo` and the learning tests teach: orange, a colour the pretrained fixtures do not draw for its
# prompt (for the unknown "sks star" the SD 1.x base draws a purple-blue blob, so a purple star, taught before,
# would pass the tests' colour measure untaught), and one picture, centred, at one size, so that a minute of LoRA
# training moves the base's blob toward it (jittered stars of several sizes stayed a blob).
DEMO_STAR = ("star", "orange", "white")
DEMO_STAR_EXTENT = 50


def build_demo_star_instance(path, num_images=8):
    """The DreamBooth instance folder of `make demo`: ``num_images`` copies of one `DEMO_STAR`, centred, of side
    `DEMO_STAR_EXTENT` in a 64-pixel picture."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _, color, background = DEMO_STAR
    corner = (IMAGE_SIZE - DEMO_STAR_EXTENT) / 2
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUNDS[background])
    ImageDraw.Draw(image).polygon(star_points((corner, corner, corner + DEMO_STAR_EXTENT,
                                               corner + DEMO_STAR_EXTENT)), fill=COLORS[color])
    for index in range(num_images):
        image.save(path / f"{index:04d}.png")


# How many reference images each row of `build_shapes_edit` has, and the sizes they take in turn: (width, height).
EDIT_REFERENCE_COUNTS = (1, 2, 0, 1, 2, 0)
EDIT_REFERENCE_SIZES = [(64, 64), (96, 64), (64, 80)]  # FLUX.2's pipelines take none under 64 pixels
EDIT_TARGET_SIZES = [IMAGE_SIZE, IMAGE_SIZE, (64, 32)]


def build_shapes_edit(path):
    """An edit dataset, an imagefolder: a row's target (``file_name``), its reference images
    (``reference_file_names``: `EDIT_REFERENCE_COUNTS` of them) and its instruction (``text``). With one reference
    the target is its shape recoloured ("make the circle blue"); with two, that shape recoloured on the second's
    background; without, a shape the caption describes (a text-to-image row)."""
    path = Path(path)
    (path / "references").mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED + 3)
    with open(path / "metadata.jsonl", "w") as metadata:
        for index, count in enumerate(EDIT_REFERENCE_COUNTS):
            shape, color, recolor = rng.choice(SHAPES), *rng.sample(sorted(COLORS), 2)
            background, other = rng.sample(sorted(BACKGROUNDS), 2)
            size = EDIT_TARGET_SIZES[index % len(EDIT_TARGET_SIZES)]
            state = rng.getstate()  # the target's shape sits where the reference's does
            target = draw_shape(shape, recolor, other if count == 2 else background, size, rng=rng)[0]
            row = {"file_name": f"{index:04d}.png", "reference_file_names": []}
            target.save(path / row["file_name"])
            for number in range(count):
                rng.setstate(state)
                reference_size = EDIT_REFERENCE_SIZES[(index + number) % len(EDIT_REFERENCE_SIZES)]
                reference = (draw_shape(shape, color, background, reference_size, rng=rng)[0] if number == 0
                             else Image.new("RGB", reference_size, BACKGROUNDS[other]))
                row["reference_file_names"].append(f"references/{index:04d}-{number}.png")
                reference.save(path / row["reference_file_names"][-1])
            row["text"] = [f"a {recolor} {shape} on a {background} background", f"make the {shape} {recolor}",
                           f"make the {shape} {recolor} on the second image's background"][count]
            metadata.write(json.dumps(row) + "\n")


def build_shapes_instruct_pix2pix(path, num_images=6):
    """An InstructPix2Pix dataset, an imagefolder: ``input_image`` (a shape), ``edited_image`` (the same shape at the
    same place, recoloured) and ``edit_prompt`` ("make the circle blue"), upstream's columns."""
    path = Path(path)
    (path / "edited").mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED + 4)
    with open(path / "metadata.jsonl", "w") as metadata:
        for index in range(num_images):
            shape, background = rng.choice(SHAPES), rng.choice(sorted(BACKGROUNDS))
            color, recolor = rng.sample(sorted(COLORS), 2)
            state = rng.getstate()  # the edited shape sits where the original one does
            original = draw_shape(shape, color, background, rng=rng)[0]
            rng.setstate(state)
            edited = draw_shape(shape, recolor, background, rng=rng)[0]
            row = {"input_image_file_name": f"{index:04d}.png", "edited_image_file_name": f"edited/{index:04d}.png",
                   "edit_prompt": f"make the {shape} {recolor}"}
            original.save(path / row["input_image_file_name"])
            edited.save(path / row["edited_image_file_name"])
            metadata.write(json.dumps(row) + "\n")


def build_shapes_wds(path, num_images=16, num_shards=2):
    """The shapes as WebDataset tar shards (``00000.tar``, ...) laid out as LAION's, which upstream's LCM scripts
    read: each sample a .jpg, its caption (.txt) and its metadata (.json: the original size) under one key."""
    import io
    import tarfile
    import tempfile

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        build_shapes(folder, num_images=num_images)
        rows = [json.loads(line) for line in (Path(folder) / "metadata.jsonl").read_text().splitlines()]
        per_shard = -(-len(rows) // num_shards)
        for shard in range(num_shards):
            with tarfile.open(path / f"{shard:05d}.tar", "w") as tar:
                for index, row in enumerate(rows[shard * per_shard:(shard + 1) * per_shard], shard * per_shard):
                    image = Image.open(Path(folder) / row["file_name"]).convert("RGB")
                    encoded = io.BytesIO()
                    image.save(encoded, format="JPEG", quality=95)
                    metadata = {"original_width": image.width, "original_height": image.height}
                    for name, data in ((f"{index:06d}.jpg", encoded.getvalue()),
                                       (f"{index:06d}.txt", row["text"].encode()),
                                       (f"{index:06d}.json", json.dumps(metadata).encode())):
                        info = tarfile.TarInfo(name)
                        info.size, info.mtime = len(data), 0
                        tar.addfile(info, io.BytesIO(data))


FIXTURES = {
    "shapes": build_shapes,
    "shapes_wds": build_shapes_wds,
    "shapes_edit": build_shapes_edit,
    "shapes_controlnet": build_shapes_controlnet,
    "shapes_instruct_pix2pix": build_shapes_instruct_pix2pix,
    "instance": build_instance,
    "shapes_mixed": build_shapes_mixed,
    "instance_mixed": build_instance_mixed,
    "instance_captioned": build_instance_captioned,
    "instance_star_demo": build_demo_star_instance,
}
