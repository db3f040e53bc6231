"""Validation renders at the guidance asked for (--validation_guidance_scale, --validation_true_cfg_scale), and the
log and the model card say which (training_utils.validation_guidance)."""

from types import SimpleNamespace

import numpy as np
import pytest
from accelerate import Accelerator
from PIL import Image

from training_utils.errors import UsageError
from training_utils.grids import read_log
from training_utils.outputs.hub import write_model_card
from training_utils.validation import make_validator
from training_utils.validation_guidance import guidance_used, with_validation_guidance


class TrueCfgPipeline:
    """A pipeline's signature as Qwen-Image's: true classifier-free guidance against a negative prompt."""

    def __call__(self, prompt, negative_prompt=None, true_cfg_scale=4.0, guidance_scale=None):
        raise AssertionError("not rendered")


def flags(guidance_scale=None, true_cfg_scale=None, **others):
    return SimpleNamespace(validation_guidance_scale=guidance_scale, validation_true_cfg_scale=true_cfg_scale,
                           **others)


def test_unset_flags_leave_the_call_and_record_the_pipelines_defaults(tiny_sd_pipe):
    assert with_validation_guidance(flags(), tiny_sd_pipe, {"height": 32}) == {"height": 32}
    assert guidance_used(tiny_sd_pipe, {"height": 32}) == {"guidance_scale": 7.5}
    assert guidance_used(TrueCfgPipeline(), {"true_cfg_scale": 1.0}) == {"guidance_scale": None, "true_cfg_scale": 1.0}


def test_validation_guidance_overrides_the_scripts_for_validation_only(tiny_sd_pipe):
    # As a FLUX [dev] script's: its --guidance_scale, which training embeds and class images render with.
    script_kwargs = {"guidance_scale": 3.5, "max_sequence_length": 512}
    validation_kwargs = with_validation_guidance(flags(2.0), tiny_sd_pipe, script_kwargs)
    assert validation_kwargs == {"guidance_scale": 2.0, "max_sequence_length": 512}
    assert script_kwargs == {"guidance_scale": 3.5, "max_sequence_length": 512}


def test_true_cfg_renders_against_the_empty_prompt_where_the_pipeline_takes_it(tiny_sd_pipe):
    assert with_validation_guidance(flags(true_cfg_scale=4.0), TrueCfgPipeline(), {"true_cfg_scale": 1.0}) == {
        "true_cfg_scale": 4.0, "negative_prompt": ""}
    assert with_validation_guidance(flags(true_cfg_scale=1.0), TrueCfgPipeline(), {}) == {"true_cfg_scale": 1.0}
    with pytest.raises(UsageError, match="--validation_true_cfg_scale.*StableDiffusionPipeline takes none"):
        with_validation_guidance(flags(true_cfg_scale=4.0), tiny_sd_pipe, {})


def render(pipe, output_dir, guidance_scale):
    args = flags(guidance_scale, validation_prompt=["a red circle"], num_validation_images=1, output_dir=output_dir,
                 validation_inference_steps=2, seed=7, validation_sigma_rels=None)
    validator = make_validator(args, pipe, Accelerator(cpu=True), call_kwargs={"height": 32, "width": 32})
    records = validator(1)
    with Image.open(output_dir / records[0]["images"][0]) as image:
        return records, np.asarray(image.convert("RGB"))


def test_the_log_and_card_record_the_guidance_validation_rendered_at(tiny_sd_pipe, tmp_path):
    default_records, default_image = render(tiny_sd_pipe, tmp_path / "default", None)
    records, image = render(tiny_sd_pipe, tmp_path / "asked", 1.0)
    assert [record["guidance_scale"] for record in read_log(tmp_path / "default")] == [7.5]
    assert [record["guidance_scale"] for record in read_log(tmp_path / "asked")] == [1.0]
    assert not np.array_equal(image, default_image)
    card = write_model_card(tmp_path / "asked", "tiny", "A LoRA", "", records).read_text()
    assert "Rendered at guidance_scale 1." in card
