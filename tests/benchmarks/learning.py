"""Where the learning tests' thresholds come from, and proof that they catch broken training.

    python -m tests.benchmarks.learning [--kind unet|flow_matching] [--seeds 0 1 2 3 4] [--variants correct ...]
                                        [--json out.json]

Trains a learning run of ``tests/test_learning.py`` (`training_utils.testing.learning.LEARNING_RUNS`: a DreamBooth
LoRA, with ``make demo``'s recipe, teaching the demo's orange "sks" star to the pretrained tiny SD for ``unet``, to
the pretrained tiny SD3 for ``flow_matching``) once per seed and variant, and prints the measures of each run's raw
and EMA weights and the thresholds they fail. The variants are the script with one deliberate bug, patched in before the
script imports what it patches (each patch is of what both kinds' scripts call; each script calls its own):

- ``wrong_sign``: the loss target negated (the model learns to predict minus its target: the UNet scripts' noise or
  velocity, `diffusion.prediction_target`; the flow-matching scripts' velocity, `flow_matching.velocity`);
- ``unscaled_latents``: the VAE's latents not normalized by its config (``scaling_factor``, and SD3's
  ``shift_factor``) before noising;
- ``lora_on_no_layer``: the LoRA adapters added but scaled by 0, so they act on no layer (their gradients vanish).

Every ``correct`` run must pass its kind's thresholds and every broken one fail at least one. Not part of the test
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
VARIANTS = ("correct", "wrong_sign", "unscaled_latents", "lora_on_no_layer")
MEASURES = ("color_fraction", "shape_overlap", "held_out_loss_ratio")


# The names of the patched functions that the script called: a variant whose patch the script never calls trains
# correctly (as the LoRA-on-no-layer variant once did, patching a function the script no longer called).
patches_called = set()


def break_training(variant):
    """Patch ``variant``'s bug into training_utils, before the script imports the patched names."""
    from training_utils import diffusion, flow_matching
    from training_utils.adapters import injection as lora
    from training_utils.families import sd, sd3

    def called(name, function):
        def patched(*args, **kwargs):
            patches_called.add(name)
            return function(*args, **kwargs)
        return patched

    if variant == "wrong_sign":
        target, velocity = diffusion.prediction_target, flow_matching.velocity
        diffusion.prediction_target = called("prediction_target", lambda *args, **kwargs: -target(*args, **kwargs))
        flow_matching.velocity = called("velocity", lambda *args, **kwargs: -velocity(*args, **kwargs))
    elif variant == "unscaled_latents":
        sd.normalized_latents = called("sd.normalized_latents", lambda pipe, latents: latents)
        sd3.normalized_latents = called("sd3.normalized_latents", lambda pipe, latents: latents)
    elif variant == "lora_on_no_layer":
        add_adapter = lora.add_adapter

        def add_adapter_scaled_to_nothing(model, *args, **kwargs):
            patches_called.add("add_adapter")
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


def run_variant(variant, script, flags):
    """Run ``script`` with ``variant``'s bug in this process (a child of `train`)."""
    break_training(variant)
    sys.argv = [script, *flags]
    runpy.run_path(script, run_name="__main__")
    if variant != "correct" and not patches_called:
        raise RuntimeError(f"{variant}: the script called none of the functions patched to break it")


def train(variant, script, flags):
    """One run of ``script`` with ``variant``'s bug, in a fresh single-threaded process as the tests run it."""
    from training_utils.testing import SMOKE_TEST_ENV

    env = {**os.environ, **SMOKE_TEST_ENV, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "tests.benchmarks.learning", "--run_variant", variant,
                             "--run_script", str(REPO / "examples" / script), "--", *map(str, flags)], cwd=REPO,
                            env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{variant} run failed:\n{result.stderr[-3000:]}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=["unet", "flow_matching"], default="unet", help="which learning run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--json", help="also write the measures here")
    parser.add_argument("--learning_rate", type=float, help="instead of the learning run's")
    parser.add_argument("--steps", type=int, help="instead of the learning run's")
    parser.add_argument("--run_variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--run_script", help=argparse.SUPPRESS)
    parser.add_argument("flags", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_variant:
        return run_variant(args.run_variant, args.run_script, args.flags)

    from training_utils.testing.learning import LEARNING_RUNS, failed_thresholds, final_images
    from training_utils.testing.tiny import build
    from training_utils.testing.tiny.data import STAR_PROMPT

    run = LEARNING_RUNS[args.kind]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        tiny = build(scratch, [run.base, run.instance])
        held_out = run.held_out(Path(scratch) / "held_out")
        for variant in args.variants:
            for seed in args.seeds:
                output_dir = Path(scratch) / f"{variant}-{seed}"
                options = {"learning_rate": args.learning_rate, "steps": args.steps}
                train(variant, run.script, run.flags(tiny[run.base], tiny[run.instance], output_dir, seed,
                                                     **{name: value for name, value in options.items() if value}))
                for weights, lora_dir in (("raw", output_dir), ("ema", output_dir / "ema")):
                    measures = run.measures(tiny[run.base], lora_dir, final_images(output_dir, weights), held_out,
                                            STAR_PROMPT)
                    rows.append({"kind": args.kind, "variant": variant, "seed": seed, "weights": weights, **measures,
                                 "fails": failed_thresholds(measures, run.thresholds)})
                    print(json.dumps(rows[-1]), flush=True)
    print(f"\nthresholds: {run.thresholds}")
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
