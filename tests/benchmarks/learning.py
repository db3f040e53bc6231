"""Where the learning tests' thresholds come from, and proof that they catch broken training.

    python -m tests.benchmarks.learning [--seeds 0 1 2 3 4] [--variants correct wrong_sign ...] [--json out.json]

Trains the learning run of ``tests/test_learning.py`` (a DreamBooth LoRA teaching the pretrained tiny SD the purple
"sks" star of ``make demo``; `training_utils.testing.learning.star_lora_flags`) once per seed and variant, and prints
the measures (`star_measures`) of each run's raw and EMA weights and the thresholds they fail. The variants are the
script with one deliberate bug, patched in before the script imports what it patches:

- ``wrong_sign``: the loss target negated (the model learns to predict minus its target);
- ``unscaled_latents``: the VAE's latents not multiplied by its ``scaling_factor`` before noising;
- ``lora_on_no_layer``: the LoRA adapters added but scaled by 0, so they act on no layer (their gradients vanish).

Every ``correct`` run must pass `STAR_THRESHOLDS` and every broken one fail at least one. Not part of the test
suite: each run is a fresh interpreter and launcher (a minute or two on a busy two-core machine), and the variants are
run only here, to keep the suite's time.
"""

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "dreambooth" / "train_dreambooth_lora.py"
VARIANTS = ("correct", "wrong_sign", "unscaled_latents", "lora_on_no_layer")
MEASURES = ("color_fraction", "shape_overlap", "held_out_loss_ratio")


def break_training(variant):
    """Patch ``variant``'s bug into training_utils, before the script imports the patched names."""
    from training_utils import diffusion, lora
    from training_utils.families import sd

    if variant == "wrong_sign":
        target = diffusion.prediction_target
        diffusion.prediction_target = lambda *args, **kwargs: -target(*args, **kwargs)
    elif variant == "unscaled_latents":
        sd.normalized_latents = lambda pipe, latents: latents
    elif variant == "lora_on_no_layer":
        add_adapter = lora.add_adapter

        def add_adapter_scaled_to_nothing(model, *args, **kwargs):
            config = add_adapter(model, *args, **kwargs)
            scaled = [module for module in model.modules() if isinstance(getattr(module, "scaling", None), dict)]
            if not scaled:
                raise RuntimeError("lora_on_no_layer: no adapter layer found to scale to nothing")
            for module in scaled:
                module.scaling = dict.fromkeys(module.scaling, 0.0)
            return config

        lora.add_adapter = add_adapter_scaled_to_nothing
    elif variant != "correct":
        raise ValueError(f"unknown variant {variant!r}")


def run_variant(variant, flags):
    """Run the script with ``variant``'s bug in this process (a child of `train`)."""
    break_training(variant)
    sys.argv = [str(SCRIPT), *flags]
    runpy.run_path(str(SCRIPT), run_name="__main__")


def train(variant, flags):
    """One run of the script with ``variant``'s bug, in a fresh single-threaded process as the tests run it."""
    from training_utils.testing import SMOKE_TEST_ENV

    env = {**os.environ, **SMOKE_TEST_ENV, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "tests.benchmarks.learning", "--run_variant", variant, "--",
                             *map(str, flags)], cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{variant} run failed:\n{result.stderr[-3000:]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--json", help="also write the measures here")
    parser.add_argument("--learning_rate", type=float, help="instead of the tests' STAR_LORA_LEARNING_RATE")
    parser.add_argument("--steps", type=int, help="instead of the tests' STAR_LORA_STEPS")
    parser.add_argument("--run_variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("flags", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_variant:
        return run_variant(args.run_variant, args.flags)

    from training_utils.testing.learning import (STAR_THRESHOLDS, failed_thresholds, final_images, held_out_stars,
                                                 star_lora_flags, star_measures)
    from training_utils.testing.tiny import build
    from training_utils.testing.tiny.data import STAR_PROMPT

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tiny = build(scratch, ["sd_pretrained", "instance_star_demo"])
        held_out = held_out_stars(Path(scratch) / "held_out")
        for variant in args.variants:
            for seed in args.seeds:
                output_dir = Path(scratch) / f"{variant}-{seed}"
                options = {"learning_rate": args.learning_rate, "steps": args.steps}
                train(variant, star_lora_flags(tiny["sd_pretrained"], tiny["instance_star_demo"], output_dir, seed,
                                               **{name: value for name, value in options.items() if value}))
                for weights, lora_dir in (("raw", output_dir), ("ema", output_dir / "ema")):
                    measures = star_measures(tiny["sd_pretrained"], lora_dir, final_images(output_dir, weights),
                                             held_out, STAR_PROMPT)
                    rows.append({"variant": variant, "seed": seed, "weights": weights, **measures,
                                 "fails": failed_thresholds(measures)})
                    print(json.dumps(rows[-1]), flush=True)
    print(f"\nthresholds: {STAR_THRESHOLDS}")
    for variant in args.variants:
        runs = [row for row in rows if row["variant"] == variant]
        summary = {name: (min(row[name] for row in runs), max(row[name] for row in runs)) for name in MEASURES}
        failing = sum(bool(row["fails"]) for row in runs)
        print(f"{variant}: {failing} of {len(runs)} runs fail; " +
              ", ".join(f"{name} {low:.3f}-{high:.3f}" for name, (low, high) in summary.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
