"""How far ComfyUI's rendering of a trained DoRA is from peft's: the figures docs/ui-files.md gives.

    python -m tests.benchmarks.dora_comfyui                          # trains a DoRA on the tiny SD 1.x, then measures
    python -m tests.benchmarks.dora_comfyui --model wide --resolution 64 --learning_rate 1e-4
    python -m tests.benchmarks.dora_comfyui --output_dir out --base tiny/sd   # a DoRA run of yours (kohya layout)

peft (and LyCORIS, and diffusers' ``load_lora_weights``) rescale each output row of ``W + delta`` to its trained
magnitude by that row's norm; ComfyUI (``comfy/weight_adapter/base.py`` ``weight_decompose``, and Forge, which copies
it) by the norm of the base weight ``W``'s row. So ComfyUI's rows are peft's times ``rho = |W + delta| / |W|``, row by
row. This measures, on every DoRA module of the run's kohya file, ComfyUI's weight (`comfyui.comfyui_weight`, our
re-implementation of its loader) against peft's merged one: the error relative to the adapter's own change
(``|W_comfyui - W_peft| / |W_peft - W|``), the spread of ``rho``, and LyCORIS's convention (the file read with the
merged weight's norms) against peft's; then the images the pipeline renders with ComfyUI's weights against peft's.
Not part of the test suite.
"""

import argparse
import copy
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from diffusers import StableDiffusionPipeline
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # the test helpers import each other by bare name, as pytest puts them on the path

from comfyui import comfyui_weight, module_weights  # noqa: E402

from training_utils.adapters.convert import target_of
from training_utils.adapters.export import converted_name
from training_utils.families.registry import family_of
from training_utils.testing import launch_script, tiny_fixture

from tests.benchmarks.models import model_path

SCRIPT = TESTS.parent / "examples" / "text_to_image" / "train_text_to_image_lora.py"
PROMPT = "a red circle on a white background"


def train(directory, args):
    """A DoRA of rank 8 trained as ``make demo`` trains its LoRA, on the shapes; returns (run, base model)."""
    base, data = model_path(args.model, directory), tiny_fixture("shapes", directory)
    output_dir = Path(directory) / "dora"
    launch_script(SCRIPT, "--pretrained_model_name_or_path", base, "--train_data_dir", data, "--output_dir",
                  output_dir, "--resolution", args.resolution, "--train_batch_size", 4, "--max_train_steps",
                  args.steps, "--learning_rate", args.learning_rate, "--random_flip", "--adapter", "dora", "--rank", 8,
                  "--checkpointing_steps", 100000, "--output_kohya_format", "--report_to", "none", timeout=7200)
    return output_dir, base


def measure(output_dir, base, resolution):
    def render(pipe):
        return pipe(PROMPT, num_inference_steps=20, height=resolution, width=resolution, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    pipe = StableDiffusionPipeline.from_pretrained(base)
    pipe.set_progress_bar_config(disable=True)
    base_images = render(pipe)
    pipe.load_lora_weights(output_dir)
    peft_images = render(pipe)
    modules, unread = module_weights(load_file(Path(output_dir) / converted_name("kohya")))
    assert not unread, unread
    errors, lycoris_errors, rhos, comfyui_weights = [], [], [], {}
    for path, layer in pipe.unet.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        module = modules[target_of(family_of("sd"), "unet", path).name]
        weight = layer.get_base_layer().weight.detach().float()
        merged = copy.deepcopy(layer)
        merged.merge()
        expected = merged.get_base_layer().weight.detach()
        comfyui_weights[path] = comfyui_weight(module, weight, dora="comfyui")
        errors.append(((comfyui_weights[path] - expected).norm() / (expected - weight).norm()).item())
        lycoris_errors.append((comfyui_weight(module, weight, dora="lycoris") - expected).abs().max().item())
        change = comfyui_weight({name: t for name, t in module.items() if name != "dora_scale"}, weight)
        rhos += (change.norm(dim=1) / weight.norm(dim=1)).tolist()
    pipe.unload_lora_weights()
    with torch.no_grad():
        for path, weight in comfyui_weights.items():
            pipe.unet.get_submodule(path).weight.copy_(weight)
    comfyui_images = render(pipe)
    return {
        "modules": len(errors),
        "weight_error_over_change_median": statistics.median(errors), "weight_error_over_change_max": max(errors),
        "rho_min": min(rhos), "rho_max": max(rhos),
        "lycoris_max_abs_error": max(lycoris_errors),
        "image_comfyui_vs_peft_mean_abs_8bit": float(np.abs(comfyui_images - peft_images).mean() * 255),
        "image_comfyui_vs_peft_max_abs_8bit": float(np.abs(comfyui_images - peft_images).max() * 255),
        "image_peft_vs_base_mean_abs_8bit": float(np.abs(peft_images - base_images).mean() * 255),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=None, help="a DoRA run with a kohya file (default: train one)")
    parser.add_argument("--base", default=None, help="its base pipeline (with --output_dir)")
    parser.add_argument("--model", default="tiny", help='the DoRA trained here: on "tiny" or "wide" (SD 1.x)')
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        output_dir, base = (args.output_dir, args.base) if args.output_dir else train(directory, args)
        figures = measure(output_dir, base, args.resolution)
    for name, value in figures.items():
        print(f"{name}: {value:.4g}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
