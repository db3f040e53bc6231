"""Smoke tests for a training script: run it for a few steps on the tiny offline models and check what it wrote.

A script copied from ``examples/`` keeps its smoke test beside it: for ``train_text_to_image_lora.py``, this
``test_train_text_to_image_lora.py`` (run with ``pytest``; no network, a CPU is enough, about a minute)::

    from pathlib import Path

    from training_utils.testing import (assert_lora_changes_pipeline_output, assert_validated_at, launch_script,
                                        tiny_fixture)


    def test_train_text_to_image_lora(tmp_path):
        model, data, out = tiny_fixture("sd", tmp_path), tiny_fixture("shapes", tmp_path), tmp_path / "out"
        launch_script(Path(__file__).with_name("train_text_to_image_lora.py"), "--pretrained_model_name_or_path",
                      model, "--train_data_dir", data, "--output_dir", out, "--resolution", 32, "--max_train_steps",
                      2, "--learning_rate", 1e-3, "--validation_prompt", "a red circle", "--validation_steps", 1)
        assert_validated_at(out, steps=[1, 2])
        assert_lora_changes_pipeline_output(model, out)

`launch_script` (in `launch`) runs the script with ``accelerate launch`` on the CPU, offline, bounded in time, and
raises with the end of its output if it fails. The checks (in `checks`) read the output directory's documented
layout: the LoRA file or model folders, ``validation/log.jsonl`` and ``checkpoint-<step>/``. Nothing here needs
pytest: a failed check raises `AssertionError`. `tiny_fixture` builds the tiny offline models and data of `tiny`.
"""

from . import tiny
from ..grids import read_log
from .checks import (assert_checkpoint_is_the_output, assert_close_files, assert_close_validations,
                     assert_latents_cached_per_bucket, assert_lora_changes_pipeline_output, assert_model_folder_loads,
                     assert_resumes_exactly, assert_same_files, assert_same_tensors, assert_validated_at,
                     checkpoint_names, checkpoint_weight_files, differing_keys, most_common_bucket, rendered_images,
                     reported_buckets)
from .launch import (RUN_TIMEOUT_S, SMOKE_TEST_ENV, free_port, launch_command, launch_environment, launch_script,
                     run_captured, run_with_timeout)

__all__ = [
    "RUN_TIMEOUT_S", "SMOKE_TEST_ENV", "assert_checkpoint_is_the_output", "assert_close_files",
    "assert_close_validations", "assert_latents_cached_per_bucket", "assert_lora_changes_pipeline_output",
    "assert_model_folder_loads", "assert_resumes_exactly", "assert_same_files", "assert_same_tensors",
    "assert_validated_at", "checkpoint_names", "checkpoint_weight_files", "differing_keys", "free_port",
    "launch_command", "launch_environment", "launch_script", "most_common_bucket", "read_log", "rendered_images",
    "reported_buckets", "run_captured", "run_with_timeout", "tiny", "tiny_fixture",
]


def tiny_fixture(name, directory):
    """Build the tiny fixture ``name`` of `tiny` (e.g. "sd", "sdxl", "sd3", "controlnet",
    "sdxl_controlnet" pipelines and models, "shapes", "shapes_controlnet", "instance" datasets) in
    ``directory/name``, and return that path. Random weights with a fixed seed: the same fixture every time."""
    if name not in tiny.FIXTURES:
        raise ValueError(f"unknown tiny fixture {name!r}; expected one of {', '.join(tiny.FIXTURES)}")
    return tiny.build(directory, [name])[name]
