"""How close a training script runs to the bare compute it asks for, measured in one process.

    python -m tests.benchmarks.run --script text_to_image_lora --model tiny --json bench.json

runs the script's own ``main()`` in-process (data loading, accelerate, `TrainingLoop`, EMA, tracker
logging and validation all included), timing it through hooks on `TrainingLoop`, `Validator` and
`EMA`; then, on the very same live modules, batch and dtype, a bare loop (forward, loss, backward,
optimizer step) and bare ``pipe(...)`` calls rendering the same validation images. It prints and
writes (``--json``, and a Markdown table beside it):

* step: the script's steady-state step time over the bare step's (target <= 1.05);
* validation: one validation over the bare pipeline calls that render its images (target <= 1.10);
* EMA: one update's share of the step (LoRA target <= 1%) and its bytes over the trained fp32 tensors (1);
* peak resident memory, and the time from calling ``main()`` to the end of the first step.

``--script`` is one of `SCRIPTS`. ``--model`` is "tiny" (the script's test fixture), "wide" (an SD 1.x
pipeline with a 17M-parameter UNet, a more realistic CPU figure, for the SD 1.x scripts) or a pipeline
folder. ``--profile`` also prints where the validation time goes (cProfile, cumulative).
Not part of the test suite: timings depend on the machine and on what else runs on it.
"""

import argparse
import contextlib
import cProfile
import importlib.util
import io
import json
import os
import pstats
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from PIL import Image

from training_utils import ema as ema_module
from training_utils import loop as loop_module
from training_utils import validation as validation_module
from training_utils.data.frozen_encoders import sample_latents
from training_utils.outputs.run_status import RunRecord
from training_utils.pipeline import weight_dtype_for

from tests.benchmarks.models import model_path

REPO = Path(__file__).resolve().parents[2]
TARGETS = {"step_over_bare": 1.05, "validation_over_bare": 1.10, "ema_fraction_of_step": 0.01,
           "ema_bytes_over_trained_fp32": 1.0}
PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


def sample_noisy_latents(batch, vae, noise_scheduler, weight_dtype, cached_latents):
    """``(noisy latents, timesteps, noise)`` as the UNet scripts draw them, from the batch's images: cached latent
    parameters (``--cache_latents``) or pixels."""
    if cached_latents:
        latents = sample_latents(batch["image"])
    else:
        latents = vae.encode(batch["image"].to(weight_dtype)).latent_dist.sample()
    latents = latents.contiguous() * vae.config.scaling_factor
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],),
                              device=latents.device)
    return noise_scheduler.add_noise(latents, noise, timesteps), timesteps, noise


def text_to_image_step(pipe, noise_scheduler, weight_dtype, cached_latents):
    """The compute of one step of train_text_to_image(_lora).py, without anything around it. Like the
    scripts, it reads the cached text embeddings from the batch."""
    def step(batch):
        noisy_latents, timesteps, noise = sample_noisy_latents(batch, pipe.vae, noise_scheduler, weight_dtype,
                                                               cached_latents)
        model_pred = pipe.unet(noisy_latents, timesteps, batch["encoder_hidden_states"], return_dict=False)[0]
        return F.mse_loss(model_pred.float(), noise.float())

    return step


def text_to_image_lora_sdxl_step(pipe, noise_scheduler, weight_dtype, cached_latents):
    """The compute of one step of train_text_to_image_lora_sdxl.py (frozen, cached text encoders)."""
    def step(batch):
        noisy_latents, timesteps, noise = sample_noisy_latents(batch, pipe.vae, noise_scheduler, weight_dtype,
                                                               cached_latents)
        conditioning = {"text_embeds": batch["pooled_prompt_embeds"], "time_ids": batch["time_ids"]}
        model_pred = pipe.unet(noisy_latents, timesteps, batch["prompt_embeds"], added_cond_kwargs=conditioning,
                               return_dict=False)[0]
        return F.mse_loss(model_pred.float(), noise.float())

    return step


class Script(NamedTuple):
    path: str              # under examples/
    bare_step: Callable    # (pipe, noise_scheduler, weight_dtype, cached_latents) -> step(batch) -> loss
    tiny_fixture: str      # the `training_utils.testing.tiny` pipeline that --model tiny means


SCRIPTS = {
    "text_to_image_lora": Script("text_to_image/train_text_to_image_lora.py", text_to_image_step, "sd"),
    "text_to_image": Script("text_to_image/train_text_to_image.py", text_to_image_step, "sd"),
    "text_to_image_lora_sdxl": Script("text_to_image/train_text_to_image_lora_sdxl.py",
                                      text_to_image_lora_sdxl_step, "sdxl"),
}


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timing(function, totals, key):
    """``function``, adding the seconds each call takes to ``totals[key]``."""
    def timed(*args, **kwargs):
        synchronize()
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            synchronize()
            totals[key] += time.perf_counter() - start
    return timed


class Hooks:
    """Times the script's steps, validations and EMA updates by wrapping the shared classes' methods.

    The machine's load changes while it runs (other jobs share the cores), so each measurement is
    paired with its bare counterpart right after it, outside the timed span: a bare step after each
    script step past warm-up, and bare pipeline calls after each validation.
    """

    def __init__(self, make_bare_step, warmup):
        self.make_bare_step = make_bare_step
        self.warmup = warmup
        self.started = None
        self.resumed = None          # when the script got control back after the previous step's hook
        self.step_seconds = []       # steady-state script steps (no validation, no checkpoint)
        self.bare_step_seconds = []
        self.first_step_end = None
        self.busy = False            # this step validated or checkpointed
        self.validation_seconds = []
        self.validation_parts = []   # per validation: seconds in the pipeline calls, PNG writes, tracker logging
        self.bare_validation_seconds = []
        self.ema_seconds = []
        self.loop = None
        self.first_batch = None
        self.bare = None
        self.profile = None

    def bare_step(self, loop):
        if self.bare is None:
            pipe = loop.validator.pipe
            weight_dtype = weight_dtype_for(loop.accelerator.mixed_precision)
            template = loop.optimizer.optimizer
            settings = {key: template.defaults[key] for key in ("lr", "betas", "eps", "weight_decay")}
            self.bare = {
                "step": self.make_bare_step(pipe, loop.validator.schedulers[0], weight_dtype, loop.args.cache_latents),
                "optimizer": type(template)(loop.parameters, **settings),
                "autocast": torch.autocast(loop.accelerator.device.type, dtype=weight_dtype,
                                           enabled=weight_dtype != torch.float32),
                "batch": {key: value.to(loop.accelerator.device) for key, value in self.first_batch.items()},
            }
        bare = self.bare
        synchronize()
        start = time.perf_counter()
        with bare["autocast"]:
            loss = bare["step"](bare["batch"])
        loss.backward()
        bare["optimizer"].step()
        bare["optimizer"].zero_grad()
        synchronize()
        self.bare_step_seconds.append(time.perf_counter() - start)

    @contextlib.contextmanager
    def installed(self, profile=False):
        hooks = self
        original_step = loop_module.TrainingLoop.backward_and_step
        original_iter = loop_module.TrainingLoop.__iter__
        original_save = loop_module.Checkpointer.save
        original_validate = validation_module.Validator.__call__
        original_update = ema_module.EMA.update
        self.profile = cProfile.Profile() if profile else None

        def backward_and_step(loop, loss):
            hooks.loop = loop
            hooks.busy = False
            stepped = original_step(loop, loss)
            if not stepped:
                return stepped
            synchronize()
            end = time.perf_counter()
            if hooks.first_step_end is None:
                hooks.first_step_end = end
            elif loop.global_step > hooks.warmup and not hooks.busy:
                hooks.step_seconds.append(end - hooks.resumed)
            if loop.global_step > hooks.warmup:
                hooks.bare_step(loop)
            synchronize()
            hooks.resumed = time.perf_counter()
            return stepped

        def iterate(loop):
            for batch in original_iter(loop):
                if hooks.first_batch is None:
                    hooks.first_batch = {key: value.detach().clone() for key, value in batch.items()}
                yield batch

        def save(checkpointer, step):
            hooks.busy = True
            return original_save(checkpointer, step)

        def validate(validator, step, final=False):
            hooks.busy = True
            parts = {"pipeline": 0.0, "png_writes": 0.0, "trackers": 0.0}
            timed = [(type(validator.pipe), "__call__", "pipeline"), (Image.Image, "save", "png_writes"),
                     (validation_module.Validator, "_show", "trackers")]
            saved = [(owner, name, getattr(owner, name)) for owner, name, _ in timed]
            for owner, name, part in timed:
                setattr(owner, name, timing(getattr(owner, name), parts, part))
            synchronize()
            start = time.perf_counter()
            if hooks.profile is not None:
                hooks.profile.enable()
            try:
                records = original_validate(validator, step, final)
            finally:
                if hooks.profile is not None:
                    hooks.profile.disable()
                synchronize()
                hooks.validation_seconds.append(time.perf_counter() - start)
                for owner, name, original in saved:
                    setattr(owner, name, original)
                hooks.validation_parts.append(parts)
            if validator.accelerator.is_main_process:
                hooks.bare_validation_seconds.append(bare_validation_seconds(validator))
            return records

        def update(ema, step):
            synchronize()
            start = time.perf_counter()
            original_update(ema, step)
            synchronize()
            hooks.ema_seconds.append(time.perf_counter() - start)

        patches = [(loop_module.TrainingLoop, "backward_and_step", backward_and_step),
                   (loop_module.TrainingLoop, "__iter__", iterate), (loop_module.Checkpointer, "save", save),
                   (validation_module.Validator, "__call__", validate), (ema_module.EMA, "update", update)]
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
        for owner, name, replacement in patches:
            setattr(owner, name, replacement)
        try:
            yield self
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)


def load_script(relative_path):
    path = REPO / "examples" / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bare_validation_seconds(validator):
    """Seconds of the pipeline calls a validation makes (each prompt, raw and EMA), with nothing around them."""
    calls = len(validator.prompts) * (2 if validator.ema is not None else 1)
    autocast = torch.autocast(validator.accelerator.device.type, dtype=validator.weight_dtype,
                              enabled=validator.weight_dtype != torch.float32)
    synchronize()
    start = time.perf_counter()
    for call in range(calls):
        index = call % len(validator.prompts)
        generators = [torch.Generator().manual_seed(validator.seed + i) for i in range(validator.num_images)]
        with autocast, torch.no_grad():
            validator.pipe(prompt=validator.prompts[index], num_images_per_prompt=validator.num_images,
                           num_inference_steps=validator.num_inference_steps, generator=generators,
                           **validator.call_kwargs, **validator.prompt_kwargs[index])
    synchronize()
    return time.perf_counter() - start


def script_argv(options, model, output_dir, data):
    return [
        "--pretrained_model_name_or_path", model, "--train_data_dir", data, "--output_dir", output_dir,
        "--resolution", str(options.resolution), "--train_batch_size", str(options.batch_size),
        "--max_train_steps", str(options.steps), "--learning_rate", "1e-4", "--seed", "0",
        "--mixed_precision", options.mixed_precision, "--use_ema", "--ema_decay", "0.999",
        "--checkpointing_steps", str(options.steps + 1),
        "--validation_prompt", *PROMPTS, "--num_validation_images", str(options.num_validation_images),
        "--validation_inference_steps", str(options.validation_inference_steps),
        "--validation_steps", str(options.validation_steps), *options.script_args,
    ]


def measure(options):
    script = SCRIPTS[options.script]
    fixtures = Path(options.fixtures_dir)
    model = model_path(options.model, fixtures, script.tiny_fixture)
    data = options.data
    if data is None:
        data = fixtures / "shapes"
        if not (data / "metadata.jsonl").exists():
            from training_utils.testing.tiny import build

            build(fixtures, ["shapes"])
    module = load_script(script.path)
    hooks = Hooks(script.bare_step, options.warmup)
    with tempfile.TemporaryDirectory() as output_dir:
        args = module.parse_args(script_argv(options, model, output_dir, str(data)))
        with hooks.installed(profile=options.profile):
            hooks.started = time.perf_counter()
            module.main(args, RunRecord())
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    loop = hooks.loop
    script_step = statistics.median(hooks.step_seconds)
    bare_step = statistics.median(hooks.bare_step_seconds)
    validation = statistics.median(hooks.validation_seconds)
    bare_validation = statistics.median(hooks.bare_validation_seconds)
    ema_update = statistics.median(hooks.ema_seconds[options.warmup:])
    trained_fp32_bytes = sum(parameter.numel() * 4 for parameter in loop.parameters)
    figures = {
        "script": options.script, "model": options.model, "device": str(loop.accelerator.device),
        "mixed_precision": options.mixed_precision, "resolution": options.resolution, "batch_size": options.batch_size,
        "unet_parameters": sum(p.numel() for p in loop.validator.pipe.unet.parameters()),
        "trained_parameters": sum(p.numel() for p in loop.parameters),
        "timed_steps": len(hooks.step_seconds), "validations": len(hooks.validation_seconds),
        "images_per_validation": len(PROMPTS) * 2 * options.num_validation_images,
        "script_step_seconds": script_step, "bare_step_seconds": bare_step, "step_over_bare": script_step / bare_step,
        "validation_seconds": validation, "bare_validation_seconds": bare_validation,
        "validation_over_bare": validation / bare_validation,
        # PNG writes and tracker logging run on the validator's writer thread, mostly hidden behind rendering
        **{f"validation_{part}_seconds": statistics.median(parts[part] for parts in hooks.validation_parts)
           for part in hooks.validation_parts[0]},
        "validation_outside_pipeline_seconds": statistics.median(
            seconds - parts["pipeline"] for seconds, parts in zip(hooks.validation_seconds, hooks.validation_parts)),
        "ema_update_seconds": ema_update, "ema_fraction_of_step": ema_update / script_step,
        "ema_bytes": loop.ema.num_bytes, "trained_fp32_bytes": trained_fp32_bytes,
        "ema_bytes_over_trained_fp32": loop.ema.num_bytes / trained_fp32_bytes,
        "peak_rss_bytes": peak_rss,
        "peak_cuda_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "seconds_to_first_step": hooks.first_step_end - hooks.started,
    }
    return figures, hooks.profile


def table(figures):
    rows = ["| figure | value | target |", "| --- | --- | --- |"]
    for key, value in figures.items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        target = TARGETS.get(key)
        verdict = "" if target is None else f"<= {target:g}" if key != "ema_bytes_over_trained_fp32" else "= 1"
        if target is not None and isinstance(value, float):
            ok = abs(value - 1.0) < 1e-9 if key == "ema_bytes_over_trained_fp32" else value <= target
            verdict += " ok" if ok else " MISSED"
        rows.append(f"| {key} | {shown} | {verdict} |")
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", choices=sorted(SCRIPTS), default="text_to_image_lora")
    parser.add_argument("--model", default="tiny", help='"tiny", "wide" or a pipeline folder')
    parser.add_argument("--data", default=None, help="the script's training data (default: the tiny shapes)")
    parser.add_argument("--fixtures_dir", default=str(REPO / "tiny"),
                        help="where the tiny and wide models are (built if missing)")
    parser.add_argument("--resolution", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40, help="training steps; the first --warmup are not timed")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"], default="no")
    parser.add_argument("--validation_steps", type=int, default=10)
    parser.add_argument("--num_validation_images", type=int, default=2)
    parser.add_argument("--validation_inference_steps", type=int, default=10)
    parser.add_argument("--profile", action="store_true",
                        help="print the validations' cProfile (cumulative; it slows what it profiles)")
    parser.add_argument("--json", default=None, help="write the figures here, and a Markdown table beside it (.md)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="after --: more flags for the script")
    options = parser.parse_args(argv)
    if options.script_args[:1] == ["--"]:
        options.script_args = options.script_args[1:]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    figures, profile = measure(options)
    print(table(figures))
    if profile is not None:
        stream = io.StringIO()
        pstats.Stats(profile, stream=stream).sort_stats("cumulative").print_stats(30)
        print(stream.getvalue())
    if options.json:
        Path(options.json).parent.mkdir(parents=True, exist_ok=True)
        Path(options.json).write_text(json.dumps(figures, indent=2) + "\n")
        Path(options.json).with_suffix(".md").write_text(table(figures) + "\n")
    return figures


if __name__ == "__main__":
    sys.exit(main() and 0)
