"""The tiny video dataset: clips of a coloured shape moving across a plain background, written as mp4 with PyAV,
of several lengths (so that they fall in several frame buckets), with a still image among them and captions in
``metadata.jsonl`` or sidecar ``.txt`` files."""

import json
import random
from pathlib import Path

import numpy as np

from .data import COLORS, SEED, draw_shape

# (shape, colour, background, frames): 9 frames (the 9-frame bucket), 7 and 6 (the 5-frame bucket), 12.
CLIPS = [("circle", "red", "white", 9), ("square", "blue", "black", 7), ("triangle", "green", "gray", 12),
         ("circle", "yellow", "black", 6)]
SIZE = 32


def moving_shape(shape, color, background, frames, size=SIZE, seed=SEED):
    """``frames`` pictures of one shape moving right by two pixels a frame, uint8 ``(frames, size, size, 3)``."""
    picture = np.asarray(draw_shape(shape, color, background, size, rng=random.Random(seed))[0])
    return np.stack([np.roll(picture, 2 * frame, axis=1) for frame in range(frames)])


def build_moving_shapes(path):
    """Four mp4 clips of 6 to 12 frames (captions: the first two in ``metadata.jsonl``, the others in sidecar
    ``.txt`` files) and one still image (a one-frame clip)."""
    from training_utils.data.rendered_video import write_mp4

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "metadata.jsonl", "w") as metadata:
        for index, (shape, color, background, frames) in enumerate(CLIPS):
            name, caption = f"{index:02d}.mp4", f"a {color} {shape} on a {background} background"
            write_mp4(path / name, moving_shape(shape, color, background, frames, seed=index), fps=8)
            if index < 2:
                metadata.write(json.dumps({"file_name": name, "text": caption}) + "\n")
            else:
                (path / name).with_suffix(".txt").write_text(caption + "\n")
    image, _ = draw_shape("square", "purple", "white", SIZE, rng=random.Random(SEED))
    image.save(path / "still.png")
    (path / "still.txt").write_text("a purple square on a white background\n")


FIXTURES = {"moving_shapes": build_moving_shapes}
assert set(color for _, color, _, _ in CLIPS) <= set(COLORS)
