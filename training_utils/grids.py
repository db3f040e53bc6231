"""Labelled grids of validation images, to compare variants (raw, EMA, post-hoc EMA) at a glance.

A grid is a table of equally sized images: a label for each row on its left and for each column above it, and a
title on top. Each validation writes one per prompt (`step_grid`: a row per variant, a column per image), and the
run's progress is one per prompt (`progress_grid`: a row per variant, a column per validated step, each variant's
first image, led by the base model's from before the first step), rebuilt from ``validation/log.jsonl`` (`read_log`)
and the images it names after every validation, so it also spans resumed runs.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from .names import LOG_NAME, VALIDATION_DIR

# The variant of the pictures drawn before the first optimizer step (step 0), which stand in every variant's row.
BASE = "base"
BACKGROUND = (255, 255, 255)
INK = (0, 0, 0)
PADDING = 4


@dataclass(frozen=True)
class GridLayout:
    """Where the cells of a grid are: a label column ``label_width`` wide, a title and column-label band
    ``header_height`` high, then cells of ``cell_size`` (width, height), one every ``column_width`` pixels across
    (the cells' width, or a wider column label's)."""

    label_width: int
    header_height: int
    cell_size: tuple
    column_width: int

    def box(self, row, column):
        """The ``(left, top, right, bottom)`` box of the cell at ``row``, ``column``."""
        width, height = self.cell_size
        left, top = self.label_width + column * self.column_width, self.header_height + row * height
        return left, top, left + width, top + height


def grid_path(step, prompt_index):
    """Where one validation's grid for one prompt goes, relative to the output folder."""
    return f"{VALIDATION_DIR}/step-{step:06d}/grid-p{prompt_index:02d}.png"


def progress_path(prompt_index):
    """Where a prompt's progress grid goes, relative to the output folder."""
    return f"{VALIDATION_DIR}/progress-p{prompt_index:02d}.png"


def read_log(output_dir):
    """The records of ``validation/log.jsonl``, oldest first ([] before the first validation)."""
    path = Path(output_dir) / VALIDATION_DIR / LOG_NAME
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def font_for(cell_height):
    """A font that stays legible beside small images and does not dwarf large ones."""
    return ImageFont.load_default(size=max(10, cell_height // 24))


def labelled_grid(title, row_labels, column_labels, rows):
    """``(grid, layout)``: the images of ``rows`` (one list per row, all of one size) in a grid, with
    ``row_labels`` on the left, ``column_labels`` above the columns and ``title`` on top."""
    cell_width, cell_height = rows[0][0].size
    font = font_for(cell_height)
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line_height = font.getbbox("Ag")[3] + PADDING

    def text_width(text):
        return int(measure.textlength(text, font=font)) + 2 * PADDING

    label_width = max(text_width(label) for label in row_labels)
    header_height = line_height * (2 if any(column_labels) else 1) + PADDING
    column_width = max([cell_width, *(text_width(label) for label in column_labels)])
    layout = GridLayout(label_width, header_height, (cell_width, cell_height), column_width)
    width = max(label_width + column_width * max(len(images) for images in rows), text_width(title))
    grid = Image.new("RGB", (width, header_height + cell_height * len(rows)), BACKGROUND)
    draw = ImageDraw.Draw(grid)
    draw.text((PADDING, PADDING // 2), title, fill=INK, font=font)
    for column, label in enumerate(column_labels):
        draw.text((layout.box(0, column)[0] + PADDING, line_height + PADDING // 2), label, fill=INK, font=font)
    for row, (label, images) in enumerate(zip(row_labels, rows)):
        top = layout.box(row, 0)[1]
        draw.text((PADDING, top + (cell_height - line_height) // 2), label, fill=INK, font=font)
        for column, image in enumerate(images):
            grid.paste(image.convert("RGB"), layout.box(row, column)[:2])
    return grid, layout


def step_grid(step, prompt, variants, inputs=None):
    """One validation's grid for one prompt: ``variants`` is ``[(variant, images)]``, a row each. ``inputs``,
    ``(label, images)``, are what the prompt renders from (a ControlNet's conditioning image, an edit's
    references), shown in the first row, each fitted into a cell."""
    rows = list(variants)
    if inputs is not None and inputs[1]:
        cell_size = variants[0][1][0].size
        rows.insert(0, (inputs[0], [fitted(image, cell_size) for image in inputs[1]]))
    return labelled_grid(f"step {step}: {prompt}", [variant for variant, _ in rows],
                         [str(index) for index in range(len(variants[0][1]))], [images for _, images in rows])


def fitted(image, cell_size):
    """``image`` scaled to fit a cell of ``cell_size`` (width, height), its aspect kept, centred on the background."""
    scale = min(cell_size[0] / image.width, cell_size[1] / image.height)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    cell = Image.new("RGB", cell_size, BACKGROUND)
    cell.paste(image.convert("RGB").resize(size, Image.BICUBIC),
               ((cell_size[0] - size[0]) // 2, (cell_size[1] - size[1]) // 2))
    return cell


def progress_grid(records, prompt, root):
    """The progress of one prompt over a run: each variant's first image (a row per variant) at every validated
    step (a column per step), from the validation log's ``records`` of that prompt (image paths relative to
    ``root``). The base model's pictures (variant `BASE`, step 0) head every row, in a column labelled "base". A
    variant rendered at some steps only (the post-hoc sweep, at the final one) has blank cells at the others."""
    first_images = {}
    for record in records:
        with Image.open(Path(root) / record["images"][0]) as image:
            first_images[record["variant"], record["step"]] = image.convert("RGB")
    steps = sorted({step for _, step in first_images})
    variants = [variant for variant in dict.fromkeys(variant for variant, _ in first_images) if variant != BASE]
    variants = variants or [BASE]
    blank = Image.new("RGB", next(iter(first_images.values())).size, BACKGROUND)
    rows = [[first_images.get((variant, step), first_images.get((BASE, step), blank)) for step in steps]
            for variant in variants]
    labels = [BASE if (BASE, step) in first_images else f"step {step}" for step in steps]
    return labelled_grid(prompt, variants, labels, rows)
