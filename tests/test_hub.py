"""The end of a run (training_utils.outputs.hub): the model card, its loading code, and what is printed."""

import re
from types import SimpleNamespace

import pytest

from training_utils.outputs.hub import LORA_HOW_TO_LOAD, finish_run, how_to_load, write_model_card

HOW_TO_LOAD = """
from diffusers import StableDiffusionPipeline

pipe = StableDiffusionPipeline.from_pretrained("base/model")
pipe.load_lora_weights("out")
"""


@pytest.fixture
def records(tmp_path):
    records = []
    for variant in ("raw", "ema"):
        images = []
        for index in range(2):
            relative = f"validation/step-000010/{variant}-0-{index}.png"
            (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / relative).write_bytes(b"png")
            images.append(relative)
        records.append({"step": 10, "variant": variant, "prompt": "a red circle", "images": images,
                        "grid": "validation/step-000010/grid-p00.png", "progress": "validation/progress-p00.png"})
    return records


def front_matter(text):
    match = re.match(r"---\n(.*?)\n---\n", text, re.S)
    assert match, text[:200]
    return dict(line.split(": ", 1) for line in match.group(1).splitlines())


def test_front_matter_names_the_base_model(tmp_path):
    path = write_model_card(tmp_path, "owner/base-model", "My LoRA", HOW_TO_LOAD)
    assert path == tmp_path / "README.md"
    meta = front_matter(path.read_text())
    assert meta["base_model"] == "owner/base-model"
    assert meta["library_name"] == "diffusers"
    assert "diffusers" in meta["tags"]


def test_title_and_how_to_load_block(tmp_path):
    text = write_model_card(tmp_path, "owner/base-model", "My LoRA", HOW_TO_LOAD).read_text()
    assert "\n# My LoRA\n" in text
    assert "`owner/base-model`" in text
    block = re.search(r"## How to load\n\n```python\n(.*?)\n```", text, re.S)
    assert block, text
    assert block.group(1) == HOW_TO_LOAD.strip()
    compile(block.group(1), "card", "exec")  # the snippet is valid Python


def test_without_records_no_validation_section(tmp_path):
    text = write_model_card(tmp_path, "b/m", "t", "x = 1").read_text()
    assert "Validation" not in text and "Training captions" not in text
    assert "![" not in text


def test_training_captions_are_listed_quoted(tmp_path):
    text = write_model_card(tmp_path, "b/m", "t", "x = 1", captions=['a "sks" dog', "sks dog, running"]).read_text()
    assert '## Training captions\n\n- "a \\"sks\\" dog"\n- "sks dog, running"\n' in text


def test_each_prompt_shows_its_progress_and_last_grid_once_with_links_relative_to_output_dir(tmp_path, records):
    conditioning = {"step": 10, "variant": "conditioning", "prompt": "a red circle",
                    "images": ["validation/conditioning-p00.png"]}
    text = write_model_card(tmp_path, "owner/base-model", "My LoRA", HOW_TO_LOAD, [conditioning, *records]).read_text()
    links = re.findall(r"!\[([\w ]+)\]\(([^)]+)\)", text)
    assert links == [("conditioning", "validation/conditioning-p00.png"), ("progress", "validation/progress-p00.png"),
                     ("step 10", "validation/step-000010/grid-p00.png")]
    assert not any(path.startswith("/") or str(tmp_path) in path for _, path in links)
    assert "## Validation at step 10" in text
    assert text.count("*a red circle*") == 2  # beside its conditioning image, and above its grids


def test_heading_takes_the_last_records_step(tmp_path, records):
    later = dict(records[-1], step=20)
    text = write_model_card(tmp_path, "b/m", "t", "x = 1", records[:1] + [later]).read_text()
    assert "## Validation at step 20" in text


def test_overwrites_existing_card(tmp_path):
    (tmp_path / "README.md").write_text("old card")
    write_model_card(tmp_path, "b/m", "New title", "x = 1")
    text = (tmp_path / "README.md").read_text()
    assert "old card" not in text and "# New title" in text
    assert text.endswith("\n")


class MyPipeline:
    """Stands in for a pipeline: the loading code names the class of the pipeline that trained."""


def run_args(tmp_path, **overrides):
    return SimpleNamespace(**{"pretrained_model_name_or_path": "base/model", "output_dir": str(tmp_path),
                              "validation_prompt": ["a red circle", "a blue square"], "push_to_hub": False,
                              "ema_posthoc_sigma_rels": None, **overrides})


def test_how_to_load_fills_the_pipeline_class_base_model_output_dir_and_first_prompt(tmp_path):
    text = how_to_load(LORA_HOW_TO_LOAD, run_args(tmp_path), MyPipeline())
    assert "from diffusers import MyPipeline\n" in text
    assert 'pipe = MyPipeline.from_pretrained("base/model")' in text
    assert f'pipe.load_lora_weights("{tmp_path}")' in text and 'pipe("a red circle")' in text
    options = how_to_load(LORA_HOW_TO_LOAD, run_args(tmp_path, validation_prompt=None), MyPipeline(),
                          imports="AutoencoderKL, MyPipeline", load_options=", vae=vae")
    assert "from diffusers import AutoencoderKL, MyPipeline\n" in options
    assert 'MyPipeline.from_pretrained("base/model", vae=vae)' in options and 'pipe("a photo")' in options


def test_finish_run_writes_the_card_and_says_where_everything_went(tmp_path, records, capsys):
    saved = {"raw": tmp_path / "weights", "ema": tmp_path / "ema" / "weights"}
    finish_run(run_args(tmp_path, ema_posthoc_sigma_rels=[0.05, 0.1]), "A title", "load it", records, saved, "LoRA")
    card = (tmp_path / "README.md").read_text()
    assert "# A title" in card and "load it" in card and records[-1]["grid"] in card
    printed = capsys.readouterr().out.splitlines()
    assert printed[:3] == [f"raw LoRA: {tmp_path / 'weights'}", f"ema LoRA: {tmp_path / 'ema' / 'weights'}",
                           f"validation images: {tmp_path / 'validation'} (log.jsonl lists them)"]
    assert printed[3].startswith("post-hoc EMA snapshots:") and "python -m training_utils.posthoc_ema" in printed[3]
