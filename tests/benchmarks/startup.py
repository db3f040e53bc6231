"""The tiny CI-style job's wall time, ours beside upstream's, and where ours goes.

    python -m tests.benchmarks.startup [--diffusers_repo PATH] [--repeats 3] [--json startup.json]

The job: the text-to-image LoRA script on the tiny SD fixture and shapes dataset, 20 steps of batch 2 at 32 pixels,
three validations of 4 images (steps 10 and 18 and the final step; upstream: its two epoch ends and its final
inference), tensorboard logging, each run through ``accelerate launch`` on one CPU process. Each script runs
``--repeats`` times, interleaved; the medians' ratio is printed (issue target: ours <= 0.60 of upstream's).

Upstream's script is read from a diffusers checkout (``--diffusers_repo``, default ``$DIFFUSERS_REPO``) if one is
there; without one, or if it does not run here (it needs torchvision), its column says why and the ratio is left
out. Then ours is split into phases: the launcher and the interpreter with the script's imports (the walls of
``--help`` with and without ``accelerate launch``), and, from one more run under cProfile, ``main()``'s pipeline
load, data preparation, training steps, validation, saving and the model card.

Not part of the test suite: timings depend on the machine and on what else runs on it.
"""

import argparse
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from training_utils.testing import launch_command, launch_environment
from training_utils.testing.tiny import build

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "examples/text_to_image/train_text_to_image_lora.py"
UPSTREAM_SCRIPT = "examples/text_to_image/train_text_to_image_lora.py"
STEPS, BATCH, IMAGES = 20, 2, 36  # 18 steps an epoch

# The profiled functions whose cumulative time makes each phase (by file suffix and function name).
PHASES = {
    "pipeline load": [("training_utils/pipeline.py", "load_pipeline")],
    "data preparation": [("training_utils/data/datasets.py", "load_train_dataset"),
                         ("training_utils/data/frozen_encoders.py", "text_embeddings"),
                         ("training_utils/data/frozen_encoders.py", "cache_dataset_images")],
    "training steps": [("training_utils/loop.py", "backward_and_step")],
    "validation": [("training_utils/validation.py", "__call__")],
    "saving and model card": [("training_utils/outputs/export.py", "save_with_ema"), ("training_utils/outputs/hub.py", "finish_run")],
}


def job_flags(fixtures, output_dir):
    return ["--pretrained_model_name_or_path", fixtures["sd"], "--train_data_dir", fixtures["shapes"],
            "--output_dir", output_dir, "--resolution", 32, "--train_batch_size", BATCH, "--max_train_steps", STEPS,
            "--learning_rate", 1e-3, "--seed", 0, "--validation_prompt", "a red circle",
            "--num_validation_images", 4, "--validation_inference_steps", 2, "--report_to", "tensorboard"]


def ours(fixtures, output_dir):
    return [*job_flags(fixtures, output_dir), "--validation_steps", 10, "--checkpointing_steps", 1000]


def upstream(fixtures, output_dir):
    return [*job_flags(fixtures, output_dir), "--num_validation_epochs", 1, "--checkpointing_steps", 1000,
            "--image_column", "image", "--caption_column", "text"]


def timed_launch(script, args):
    """(wall seconds, completed process) of ``accelerate launch script args`` on one CPU process, offline."""
    start = time.perf_counter()
    result = subprocess.run(launch_command(script, *args), env=launch_environment(1), capture_output=True, text=True,
                            cwd=REPO)
    return time.perf_counter() - start, result


def upstream_script(diffusers_repo):
    """Upstream's script in ``diffusers_repo``, or (None, why not)."""
    if not diffusers_repo:
        return None, "no diffusers checkout (--diffusers_repo or $DIFFUSERS_REPO)"
    path = Path(diffusers_repo) / UPSTREAM_SCRIPT
    return (path, None) if path.is_file() else (None, f"{path} not found")


def start_up_phases(repeats):
    """{"accelerate launch": s, "interpreter and imports": s}: medians of the walls of our script's ``--help``
    (which exits once the imports are done and the flags parsed) with and without the launcher."""
    bare, launched = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, SCRIPT, "--help"], env=launch_environment(1), capture_output=True, cwd=REPO,
                       check=True)
        bare.append(time.perf_counter() - start)
        launched.append(timed_launch(SCRIPT, ["--help"])[0])
    return {"accelerate launch": statistics.median(launched) - statistics.median(bare),
            "interpreter and imports": statistics.median(bare)}


def main_phases(fixtures, output_dir):
    """{phase: seconds} of ``main()``, from one run of our script under cProfile (without the launcher)."""
    profile = Path(output_dir) / "profile.out"
    command = [sys.executable, "-m", "cProfile", "-o", profile, SCRIPT,
               *ours(fixtures, Path(output_dir) / "run")]
    subprocess.run([str(part) for part in command], env=launch_environment(1), capture_output=True, cwd=REPO,
                   check=True)
    stats = pstats.Stats(str(profile)).stats
    cumulative = {}
    for (filename, _, name), (_, _, _, seconds, _) in stats.items():
        for phase, functions in PHASES.items():
            if any(filename.endswith(suffix) and name == function for suffix, function in functions):
                cumulative[phase] = cumulative.get(phase, 0.0) + seconds
    main_seconds = sum(seconds for (filename, _, name), (_, _, _, seconds, _) in stats.items()
                       if filename.endswith(SCRIPT) and name == "main")
    return {**cumulative, "other (accelerator, optimizer, EMA, trackers)": main_seconds - sum(cumulative.values())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--diffusers_repo", default=os.environ.get("DIFFUSERS_REPO"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as root:
        fixtures = build(Path(root) / "tiny", ["sd", "shapes"])
        upstream_path, skipped = upstream_script(args.diffusers_repo)
        walls = {"ours": [], "upstream": []}
        for repeat in range(args.repeats):
            wall, result = timed_launch(SCRIPT, ours(fixtures, Path(root) / f"ours-{repeat}"))
            if result.returncode != 0:
                raise SystemExit(f"our script failed:\n{result.stderr[-3000:]}")
            walls["ours"].append(wall)
            if upstream_path is not None and skipped is None:
                wall, result = timed_launch(upstream_path, upstream(fixtures, Path(root) / f"upstream-{repeat}"))
                if result.returncode != 0:
                    skipped = f"it failed here: {result.stderr.strip().splitlines()[-1]}"
                else:
                    walls["upstream"].append(wall)
        launched_wall = statistics.median(walls["ours"])
        phases = {**start_up_phases(args.repeats), **main_phases(fixtures, root)}

    figures = {"job": f"LoRA, {STEPS} steps of {BATCH}, 3 validations of 4 images, tensorboard",
               "ours_wall_s": launched_wall, "ours_walls_s": walls["ours"], "phases_s": phases}
    print(f"{figures['job']}: ours {launched_wall:.1f} s (median of {args.repeats})")
    if walls["upstream"]:
        figures["upstream_wall_s"] = statistics.median(walls["upstream"])
        figures["ratio"] = launched_wall / figures["upstream_wall_s"]
        print(f"upstream {figures['upstream_wall_s']:.1f} s; ours / upstream = {figures['ratio']:.2f} (target <= 0.60)")
    else:
        figures["upstream_skipped"] = skipped
        print(f"upstream: skipped, {skipped}")
    for phase, seconds in phases.items():
        print(f"{phase}: {seconds:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
