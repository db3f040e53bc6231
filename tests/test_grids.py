"""Labelled validation grids (training_utils.grids): every image in its cell, labels beside and above them."""

import json

import numpy as np
from PIL import Image

from training_utils.grids import BACKGROUND, labelled_grid, progress_grid, step_grid


def solid(value, size=(24, 16)):
    return Image.new("RGB", size, (value, 255 - value, value // 2))


def cell(grid, layout, row, column):
    return np.asarray(grid.crop(layout.box(row, column)))


def test_each_image_sits_in_its_cell_and_the_labels_take_their_own_space():
    rows = [[solid(10), solid(20), solid(30)], [solid(40), solid(50), solid(60)]]
    grid, layout = labelled_grid("step 4: a red circle", ["raw", "ema_sigma_rel-0.05"], ["0", "1", "2"], rows)
    assert layout.cell_size == (24, 16) and layout.label_width > 0 and layout.header_height > 0
    assert grid.size == (layout.label_width + 3 * 24, layout.header_height + 2 * 16)
    for row, images in enumerate(rows):
        for column, image in enumerate(images):
            assert np.array_equal(cell(grid, layout, row, column), np.asarray(image))
    pixels = np.asarray(grid)
    background = np.array(BACKGROUND)
    # Ink in the label column beside each row and in the header band above the cells.
    for row in range(2):
        top = layout.box(row, 0)[1]
        assert (pixels[top:top + 16, :layout.label_width] != background).any()
    assert (pixels[:layout.header_height] != background).any()


def test_column_labels_wider_than_the_cells_space_the_columns_rather_than_overlap():
    images = [solid(10, (8, 16)), solid(20, (8, 16))]
    grid, layout = labelled_grid("a prompt", ["raw"], ["step 100", "step 200"], [images])
    assert layout.cell_size == (8, 16) and layout.column_width > 8
    assert grid.size[0] == layout.label_width + 2 * layout.column_width
    assert all(np.array_equal(cell(grid, layout, 0, column), np.asarray(image)) for column, image in enumerate(images))
    # The first label's ink ends before the second column starts: a band of background between them.
    header = np.asarray(grid)[layout.header_height // 2:layout.header_height]
    gap = header[:, layout.box(0, 1)[0] - 2:layout.box(0, 1)[0]]
    assert (gap == np.array(BACKGROUND)).all() and (header[:, layout.label_width:layout.box(0, 1)[0]] != 255).any()


def test_a_long_title_widens_the_grid_rather_than_being_cut():
    short, _ = labelled_grid("x", ["raw"], ["0"], [[solid(1)]])
    long, _ = labelled_grid("step 100000: " + "a very long prompt " * 6, ["raw"], ["0"], [[solid(1)]])
    assert long.size[0] > short.size[0] and long.size[1] == short.size[1]


def test_step_grid_has_a_row_per_variant_and_a_column_per_image():
    variants = [("raw", [solid(1), solid(2)]), ("ema", [solid(3), solid(4)])]
    grid, layout = step_grid(7, "a prompt", variants)
    assert np.array_equal(cell(grid, layout, 1, 0), np.asarray(solid(3)))
    assert grid.size[1] == layout.header_height + 2 * 16


def test_step_grid_shows_the_inputs_first_each_fitted_into_a_cell():
    variants = [("raw", [solid(1), solid(2)]), ("ema", [solid(3), solid(4)])]
    tall, wide, small = Image.new("RGB", (8, 32), (9, 9, 9)), Image.new("RGB", (48, 32), (7, 7, 7)), solid(5)
    grid, layout = step_grid(7, "a prompt", variants, ("references", [tall, wide, small]))
    assert grid.size[1] == layout.header_height + 3 * 16
    assert grid.size[0] == layout.label_width + 3 * 24  # three references, two images a variant
    assert np.array_equal(cell(grid, layout, 1, 0), np.asarray(solid(1)))  # raw below the references
    first = cell(grid, layout, 0, 0)  # 4x16, centred on the background
    assert (first[:, 10:14] == 9).all() and (first[:, :10] == BACKGROUND).all() and (first[:, 14:] == BACKGROUND).all()
    assert (cell(grid, layout, 0, 1) == 7).all() and np.array_equal(cell(grid, layout, 0, 2), np.asarray(small))
    assert step_grid(7, "a prompt", variants, ("references", []))[0].size == step_grid(7, "a prompt", variants)[0].size


def test_progress_grid_shows_each_variants_first_image_per_step_and_blanks_where_it_was_not_rendered(tmp_path):
    records = []
    for step, variants in ((2, ["raw", "ema"]), (4, ["raw", "ema", "ema_sigma_rel-0.1"])):
        for variant in variants:
            for prompt in ("a", "b"):
                paths = []
                for index in range(2):
                    path = f"validation/step-{step:06d}/{variant}-{prompt}-{index}.png"
                    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
                    solid(step * 10 + len(variant) + index + ord(prompt)).save(tmp_path / path)
                    paths.append(path)
                records.append({"step": step, "variant": variant, "prompt": prompt, "images": paths})
    records = json.loads(json.dumps(records))  # as read back from log.jsonl

    grid, layout = progress_grid([record for record in records if record["prompt"] == "b"], "b", tmp_path)
    assert grid.size[1] == layout.header_height + 3 * 16  # raw, ema, the sweep
    for row, variant in enumerate(["raw", "ema", "ema_sigma_rel-0.1"]):
        for column, step in enumerate([2, 4]):
            first = [r for r in records if (r["step"], r["variant"], r["prompt"]) == (step, variant, "b")]
            expected = (np.asarray(Image.open(tmp_path / first[0]["images"][0])) if first
                        else np.full((16, 24, 3), BACKGROUND, dtype=np.uint8))
            assert np.array_equal(cell(grid, layout, row, column), expected), (variant, step)


def test_progress_grid_leads_every_row_with_the_base_models_picture(tmp_path):
    records = []
    for step, variant, value in ((0, "base", 10), (3, "raw", 20), (3, "ema", 30)):
        path = f"validation/step-{step:06d}/{variant}-p00-00.png"
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        solid(value).save(tmp_path / path)
        records.append({"step": step, "variant": variant, "prompt": "a", "images": [path]})

    alone, alone_layout = progress_grid(records[:1], "a", tmp_path)  # before the first validation
    assert alone.size[1] == alone_layout.header_height + 16
    assert np.array_equal(cell(alone, alone_layout, 0, 0), np.asarray(solid(10)))
    grid, layout = progress_grid(records, "a", tmp_path)
    assert grid.size == (layout.label_width + 2 * layout.column_width, layout.header_height + 2 * 16)  # raw, ema
    for row, value in enumerate((20, 30)):
        assert np.array_equal(cell(grid, layout, row, 0), np.asarray(solid(10)))
        assert np.array_equal(cell(grid, layout, row, 1), np.asarray(solid(value)))
