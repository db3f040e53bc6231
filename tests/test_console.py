"""The libraries' known noise is kept off the console (training_utils.console): a script and the converter, started
as a user starts them, print none of it, and the filters drop those messages alone."""

import logging
import sys

import pytest

from helpers import launch, launching, run_bounded
from training_utils.console import KNOWN_NOISE, DropMessages

# The lines as the libraries log them (torch 2.13, torchao 0.18, transformers 5.25, diffusers 0.42), by logger.
NOISE = [
    ("torchao", "Failed to load /usr/lib/python3/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
                "Could not load this library: /usr/lib/python3/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux"
                "-gnu.so"),
    ("torchao", "Failed to load /usr/lib/python3/site-packages/torchao/_C_cutlass_90a.abi3.so: Could not load this "
                "library: /usr/lib/python3/site-packages/torchao/_C_cutlass_90a.abi3.so"),
    ("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
                            "torch.compile as an opaque value type. Calling register_constant() on Enum subclasses is "
                            "deprecated and will be an error in a future release."),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects. This may affect "
                                                       "loading checkpoints serialized with `torchao`"),
    ("transformers.utils.import_utils", "`CLIPImageProcessor` requires torchvision (not installed); falling back to "
                                        "`CLIPImageProcessorPil` for backward compatibility. Install torchvision to "
                                        "use the default backend, or import `CLIPImageProcessorPil` directly to "
                                        "silence this warning."),
    ("diffusers.models.modeling_utils", "There are modules in AutoencoderKL that should be kept in float32: []. "
                                        "Casting directly with `to()` can lead to inconsistent results; set "
                                        "`torch_dtype` in `from_pretrained()` instead to keep these modules in "
                                        "float32."),
]
# What the same loggers say that does concern a run, and stays.
KEPT = [
    ("torchao", "Skipping import of cpp extensions due to incompatible torch version."),
    ("diffusers.models.modeling_utils", "There are modules in SD3Transformer2DModel that should be kept in float32: "
                                        "['norm_out']. Casting directly with `to()` can lead to inconsistent results"),
    ("transformers.utils.import_utils", "`CLIPImageProcessor` requires torchvision"),
]
# A fragment of each noise line, to look for in a run's output.
FRAGMENTS = ["Failed to load", "is an Enum subclass", "Unable to import `torchao`", "requires torchvision",
             "that should be kept in float32: []"]


def record(name, message):
    return logging.LogRecord(name, logging.WARNING, __file__, 1, message, None, None)


@pytest.mark.parametrize(("name", "message"), NOISE)
def test_each_known_line_is_dropped_by_its_loggers_filter(name, message):
    assert not DropMessages(KNOWN_NOISE[name]).filter(record(name, message))
    assert any(fragment in message for fragment in FRAGMENTS)


@pytest.mark.parametrize(("name", "message"), KEPT)
def test_what_else_those_loggers_say_is_kept(name, message):
    assert DropMessages(KNOWN_NOISE[name]).filter(record(name, message))


@pytest.fixture(scope="module")
@launching
def demo_run(tiny, tmp_path_factory):
    """A short run of the demo's script, started as a user starts it (no warm interpreter: the imports happen), and the
    converter on its LoRA: ``(the run's stderr, the converter's stderr)``."""
    output_dir = tmp_path_factory.mktemp("console")
    run = launch("dreambooth/train_dreambooth_lora.py", "--pretrained_model_name_or_path", tiny["sd"],
                 "--instance_data_dir", tiny["shapes"], "--instance_prompt", "a sks shape", "--output_dir", output_dir,
                 "--resolution", 32, "--train_batch_size", 1, "--max_train_steps", 1, "--rank", 4,
                 "--validation_prompt", "a sks shape", "--num_validation_images", 1,
                 "--validation_inference_steps", 1, quiet=True)
    converted = run_bounded([sys.executable, "-m", "training_utils.adapters.convert", "--to", "kohya",
                             output_dir / "pytorch_lora_weights.safetensors", output_dir / "kohya.safetensors"])
    assert converted.returncode == 0, converted.stderr
    return run.stderr, converted.stderr


@pytest.mark.parametrize("command", ["script", "converter"])
def test_no_known_noise_reaches_the_console(demo_run, command):
    stderr = demo_run[["script", "converter"].index(command)]
    assert [line for line in stderr.splitlines() if any(fragment in line for fragment in FRAGMENTS)] == []
