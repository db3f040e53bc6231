"""Validation from the live components, with no side effects on training.

Rendering mutates scheduler state (timesteps, sigmas, multistep buffers), runs modules in eval mode
and, unless told otherwise, draws noise from the global RNG. `Validator` snapshots and restores
the schedulers, restores every module's train/eval mode, renders with seeded generators only
inside a forked RNG, and swaps EMA weights in and out bitwise. A run with validation therefore
ends with the same weights as the same run without it.
"""

import contextlib
import inspect
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from itertools import groupby
from operator import itemgetter
from pathlib import Path

import numpy as np
import torch

from .data.rendered_video import RenderedVideo, still
from .ema import tensors_swapped_in
from .grids import BASE, grid_path, progress_grid, progress_path, read_log, step_grid
from .names import LOG_NAME, VALIDATION_DIR
from .outputs.writing import stopping_on_write_errors
from .pipeline import modules_of, preserved_state
from .posthoc_ema.synthesis import synthesize
from .validation_guidance import guidance_used, with_validation_guidance

logger = logging.getLogger(__name__)


def validation_due(step, max_train_steps, validation_steps=None, validation_epochs=None, steps_per_epoch=None):
    """Whether ``step`` (1-based optimizer step) is validated: every ``validation_steps``, at the end of every
    ``validation_epochs``-th epoch, and at the final step. Asked once per step, so never twice."""
    if step == max_train_steps:
        return True
    if validation_steps is not None and step % validation_steps == 0:
        return True
    return (validation_epochs is not None and step % steps_per_epoch == 0
            and (step // steps_per_epoch) % validation_epochs == 0)


def make_validator(args, pipe, accelerator, prompts=None, **kwargs):
    """The `Validator` for ``--validation_prompt`` (or ``prompts``, when a script pairs them with more
    inputs) and the validation flags, or None without prompts. An unconditional pipeline (one whose call takes no
    prompt, as ``DDPMPipeline``'s) always validates: its one "prompt" is `UNCONDITIONAL`. ``kwargs`` are the script's
    own: ``ema``, ``posthoc``, ``schedulers``, ``weight_dtype``, ``call_kwargs``, ``prompt_kwargs``, ...."""
    prompts = args.validation_prompt if prompts is None else prompts
    if not prompts:
        if not is_unconditional(pipe):
            return None
        prompts = [UNCONDITIONAL]
    if args.num_validation_images == 0:
        if accelerator.is_main_process:
            logger.info("--num_validation_images 0: no validation images are rendered")
        return None
    call_kwargs = with_validation_guidance(args, pipe, kwargs.pop("call_kwargs", None))
    return Validator(pipe, accelerator, args.output_dir, prompts, args.num_validation_images,
                     args.validation_inference_steps, args.seed, sigma_rels=args.validation_sigma_rels,
                     call_kwargs=call_kwargs, **kwargs)


# The prompt that the log records and the grids name for the images of an unconditional pipeline.
UNCONDITIONAL = ""


def takes_generator_list(pipe):
    """Whether ``pipe``'s call takes a list of generators, one per image (``AmusedPipeline``'s takes one)."""
    generator = inspect.signature(pipe.__call__).parameters.get("generator")
    return generator is None or "list" in str(generator.annotation)


def is_unconditional(pipe):
    """Whether ``pipe`` renders without a prompt (its call takes none: ``DDPMPipeline``, ``DDIMPipeline``)."""
    return "prompt" not in inspect.signature(pipe.__call__).parameters


class Validator:
    """Renders the validation prompts from a pipeline built on the live components.

    ``schedulers`` are extra schedulers to protect besides ``pipe.scheduler`` (the training noise
    scheduler). ``call_kwargs`` go to every pipeline call (e.g. height/width); ``prompt_kwargs``
    holds one dict per prompt (e.g. a ControlNet's conditioning image). Images are written under
    ``output_dir/validation`` and described in ``validation/log.jsonl``, each record with the guidance scales the
    pipeline rendered at (`validation_guidance.guidance_used`).

    ``conditioning_images`` (per prompt: one PIL image, a list of them, or None) are the inputs shown beside each
    prompt's samples: each distinct image is saved once, as ``validation/conditioning-pNN.png`` (of a list,
    ``conditioning-pNN-KK.png``; ``conditioning_paths``: a path, a list of them, or None per prompt), shown in the
    first row of each step's grid (labelled ``conditioning_label``), logged to the trackers with every validation,
    and put into the model card by `card_records`. The log records keep their schema.

    ``encoders_on_device`` (a context manager factory, e.g. `frozen_encoders.FrozenEncoders.on_device`) is entered
    around each validation's rendering: it brings the encoders a script keeps off the accelerator back.

    With ``video_fps`` the pipeline renders videos (``num_videos_per_prompt``, ``.frames``): each is written as
    an mp4 at that frame rate with a PNG frame strip (`rendered_video.RenderedVideo`); the strips stand for the videos in
    the log's ``images``, the grids and the model card, and the log lists the mp4s in ``videos``.
    """

    def __init__(self, pipe, accelerator, output_dir, prompts, num_images, num_inference_steps, seed,
                 ema=None, schedulers=(), weight_dtype=torch.float32, call_kwargs=None, prompt_kwargs=None,
                 conditioning_images=None, posthoc=None, sigma_rels=None, encoders_on_device=contextlib.nullcontext,
                 video_fps=None, conditioning_label="conditioning", render_scheduler=None):
        self.pipe = pipe
        # A scheduler that validation renders with in place of the pipeline's, swapped in only while it renders
        # (an LCM-LoRA's LCMScheduler); protected like the others.
        self.render_scheduler = render_scheduler
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.prompts = list(prompts)
        self.num_images = num_images
        self.num_inference_steps = num_inference_steps
        self.seed = seed
        self.ema = ema
        self.schedulers = list(schedulers) + ([render_scheduler] if render_scheduler is not None else [])
        self.weight_dtype = weight_dtype
        self.call_kwargs = call_kwargs or {}
        self.prompt_kwargs = prompt_kwargs or [{} for _ in self.prompts]
        if len(self.prompt_kwargs) != len(self.prompts):
            raise ValueError(f"{len(self.prompt_kwargs)} prompt_kwargs for {len(self.prompts)} prompts")
        self.conditioning_images = list(conditioning_images or [None] * len(self.prompts))
        if len(self.conditioning_images) != len(self.prompts):
            raise ValueError(f"{len(self.conditioning_images)} conditioning_images for {len(self.prompts)} prompts")
        self.conditioning_label = conditioning_label
        self.conditioning_paths = self._save_conditioning_images()
        self.posthoc = posthoc
        self.sigma_rels = list(sigma_rels or (posthoc.sigma_rels if posthoc is not None else ()))
        self.encoders_on_device = encoders_on_device
        self.video_fps = video_fps

    @contextlib.contextmanager
    def _render_scheduler_swapped_in(self):
        """``render_scheduler`` as the pipeline's scheduler while validation renders (none: the pipeline's own)."""
        own = self.pipe.scheduler
        if self.render_scheduler is not None:
            self.pipe.scheduler = self.render_scheduler
        try:
            yield
        finally:
            self.pipe.scheduler = own

    def _save_conditioning_images(self):
        """Each distinct conditioning image once (main process); returns each prompt's path (a list of them for a
        list of images), or None."""
        saved = {}
        paths = []
        for index, given in enumerate(self.conditioning_images):
            images = given if isinstance(given, list) else [] if given is None else [given]
            for number, image in enumerate(images):
                if id(image) not in saved:
                    number = f"-{number:02d}" if isinstance(given, list) else ""
                    saved[id(image)] = f"{VALIDATION_DIR}/conditioning-p{index:02d}{number}.png"
                    if self.accelerator.is_main_process:
                        (self.output_dir / VALIDATION_DIR).mkdir(parents=True, exist_ok=True)
                        image.save(self.output_dir / saved[id(image)])
            prompt_paths = [saved[id(image)] for image in images]
            paths.append(prompt_paths if isinstance(given, list) else (prompt_paths or [None])[0])
        return paths

    def _conditioning_of(self, prompt_index):
        """The prompt's conditioning images, a list (maybe empty)."""
        given = self.conditioning_images[prompt_index]
        return given if isinstance(given, list) else [] if given is None else [given]

    def card_records(self, records):
        """``records`` for the model card, led by each prompt's conditioning image (variant "conditioning")."""
        if not records:
            return []
        step = records[-1]["step"]
        shown = [{"step": step, "variant": "conditioning", "prompt": prompt,
                  "images": paths if isinstance(paths, list) else [paths]}
                 for prompt, paths in zip(self.prompts, self.conditioning_paths) if paths]
        return shown + list(records)

    def draw_base(self):
        """Render the pictures of the base model, which the weights are before the first optimizer step, as step 0
        (variant "base"): the first column of the progress grids. Not again where the log holds them (a run started
        over in its folder)."""
        drawn = any(record["step"] == 0 for record in read_log(self.output_dir))
        self.accelerator.wait_for_everyone()  # every process has read the log before the main process writes it
        if not drawn:
            with stopping_on_write_errors(self.output_dir / VALIDATION_DIR):
                self(0)

    def __call__(self, step, final=False):
        """Render every prompt (raw, then EMA) at ``step``; returns the log records (main process only).

        At the ``final`` step of a run with a post-hoc EMA, also render the EMA of each of
        ``sigma_rels`` synthesized from the snapshots (variants ``ema_sigma_rel-<value>``), to choose the
        length by eye. Each prompt gets a labelled grid, a row per variant (`grids.step_grid`), and its
        progress grid over the run so far (`grids.progress_grid`); both go to the trackers too.

        Under several processes the pipeline calls (one per prompt and variant) are shared out
        round-robin and the images gathered on the main process, which alone writes files and logs:
        each call is the one a single process would make, so images and log are the same. Sharded (FSDP2), every
        process makes every call instead, since a sharded module's forward needs all of them; each renders the
        same images, and the main process writes its own.
        """
        sweep = final and self.posthoc is not None
        self.guidance = guidance_used(self.pipe, self.call_kwargs)
        variants = self._variants(step, sweep)
        work = [(variant, index) for variant in range(len(variants)) for index in range(len(self.prompts))]
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        if self.accelerator.is_fsdp2:
            rank, world = 0, 1
        is_main = self.accelerator.is_main_process
        if is_main:
            (self.output_dir / VALIDATION_DIR / f"step-{step:06d}").mkdir(parents=True, exist_ok=True)
        rendered = {}
        # PNG encoding and tracker logging release the GIL: writer threads overlap them with rendering
        # (one per image for the files; one for the trackers, which take their calls in order).
        with ThreadPoolExecutor(max_workers=4) as files, ThreadPoolExecutor(max_workers=1) as trackers:
            pending = []

            def write(item, images):
                record = self._record(step, variants[item[0]][0], item[1], images)
                pending.extend(files.submit(image.save, self.output_dir / path)
                               for path, image in zip(record["images"], images))
                pending.append(trackers.submit(self._show, f"validation/{record['variant']}/p{item[1]:02d}",
                                               record["prompt"], images, step))

            with (preserved_state([self.pipe.scheduler, *self.schedulers], modules_of(self.pipe).values()),
                  self.encoders_on_device(), self._render_scheduler_swapped_in()):
                # As a loaded pipeline renders: in training mode, some models compute otherwise (dropout, a LoRA's
                # included) or lay their output out otherwise (HiDream's transformer).
                for module in modules_of(self.pipe).values():
                    module.eval()
                for variant, items in groupby(work[rank::world], key=itemgetter(0)):
                    with variants[variant][1]():
                        for item in items:
                            rendered[item] = self._render(item[1])
                            if is_main:
                                write(item, rendered[item])
            if world > 1:
                mine = set(rendered)
                rendered = _gather_on_main(rendered, world, is_main)
                for item in work:
                    if is_main and item not in mine:
                        write(item, rendered[item])
            records = []
            if is_main:
                ordered = [(self._record(step, variants[item[0]][0], item[1], rendered[item]), rendered[item])
                           for item in work]
                pending.append(trackers.submit(self._log_conditioning_images, step))
                self._log(ordered)
                records = [record for record, _ in ordered]
                for future in pending:  # the progress grids read this step's images back
                    future.result()
                grids = self._write_grids(step, [name for name, _ in variants], rendered)
                pending = [trackers.submit(self._show, f"validation/grid/p{index:02d}", prompt, [grid], step)
                           for index, (prompt, grid) in enumerate(zip(self.prompts, grids))]
            for future in pending:
                future.result()
        self.accelerator.wait_for_everyone()
        return records

    def _variants(self, step, sweep):
        """``[(variant name, context manager factory putting its weights in)]``: raw, EMA, then the sweep's; at step
        0 the base alone, which the EMA then is too."""
        if step == 0:
            return [(BASE, contextlib.nullcontext)]
        variants = [("raw", contextlib.nullcontext)]
        if self.ema is not None:
            variants.append(("ema", self.ema.swapped_in))
        if sweep:
            if self.accelerator.num_processes > 1:
                self.accelerator.wait_for_everyone()  # the main process has written the last snapshot
            syntheses = cache(lambda: synthesize(self.output_dir, self.sigma_rels, step))

            @contextlib.contextmanager
            def synthesized(position):
                with tensors_swapped_in(self.posthoc.parameters, syntheses()[position].tensors):
                    yield

            variants += [(f"ema_sigma_rel-{float(sigma_rel):g}", partial(synthesized, position))
                         for position, sigma_rel in enumerate(self.sigma_rels)]
        return variants

    def _write_grids(self, step, variant_names, rendered):
        """Write each prompt's grid of this step (`grids.step_grid`) and its progress grid over the run so far,
        rebuilt from the log (`grids.progress_grid`); returns the step's grids."""
        log = read_log(self.output_dir)
        grids = []
        for index, prompt in enumerate(self.prompts):
            grid = step_grid(step, prompt, [(name, [still(image) for image in rendered[variant, index]])
                                            for variant, name in enumerate(variant_names)],
                             (self.conditioning_label, self._conditioning_of(index)))[0]
            grid.save(self.output_dir / grid_path(step, index))
            records = [record for record in log if record.get("progress") == progress_path(index)]
            progress_grid(records, prompt, self.output_dir)[0].save(self.output_dir / progress_path(index))
            grids.append(grid)
        return grids

    def _render(self, prompt_index):
        # CPU generators give the same noise on every device; one per image keeps a batched call
        # identical to rendering the images one at a time.
        generators = [torch.Generator().manual_seed(self.seed + i) for i in range(self.num_images)]
        device_type = self.accelerator.device.type
        autocast = (torch.autocast(device_type, dtype=self.weight_dtype) if self.weight_dtype != torch.float32
                    else contextlib.nullcontext())
        fork_devices = [self.accelerator.device] if device_type == "cuda" else []
        if is_unconditional(self.pipe):  # a batch of images, not images per prompt
            inputs = {"batch_size": self.num_images}
        else:
            inputs = {"prompt": self.prompts[prompt_index],
                      "num_videos_per_prompt" if self.video_fps else "num_images_per_prompt": self.num_images}
        with torch.random.fork_rng(devices=fork_devices), autocast, torch.no_grad():
            if not takes_generator_list(self.pipe):  # one call per image, each with its own generator
                return [image for generator in generators for image in self.pipe(
                    **{**inputs, "num_images_per_prompt": 1}, num_inference_steps=self.num_inference_steps,
                    generator=generator, **self.call_kwargs, **self.prompt_kwargs[prompt_index]).images]
            output = self.pipe(
                **inputs,
                num_inference_steps=self.num_inference_steps,
                generator=generators,
                **self.call_kwargs,
                **self.prompt_kwargs[prompt_index],
            )
        if self.video_fps:
            return [RenderedVideo(frames, self.video_fps) for frames in output.frames]
        return output.images

    def _record(self, step, variant, prompt_index, images):
        paths = [f"{VALIDATION_DIR}/step-{step:06d}/{variant}-p{prompt_index:02d}-{index:02d}.png"
                 for index in range(len(images))]
        record = {"step": step, "variant": variant, "prompt": self.prompts[prompt_index], "images": paths,
                  "grid": grid_path(step, prompt_index), "progress": progress_path(prompt_index), **self.guidance}
        if self.video_fps:
            record["videos"] = [path.removesuffix(".png") + ".mp4" for path in paths]
        return record

    def _log_conditioning_images(self, step):
        # One tag an image: a prompt's references may differ in size, which one tensorboard entry cannot hold.
        for index, prompt in enumerate(self.prompts):
            images = self._conditioning_of(index)
            for number, image in enumerate(images):
                suffix = f"-{number:02d}" if len(images) > 1 else ""
                self._show(f"validation/conditioning/p{index:02d}{suffix}", prompt, [image], step)

    def _log(self, rendered):
        with open(self.output_dir / VALIDATION_DIR / LOG_NAME, "a") as log:
            for record, _ in rendered:
                log.write(json.dumps(record) + "\n")

    def _show(self, tag, prompt, images, step):
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                tracker.writer.add_images(tag, np.stack([np.asarray(image.convert("RGB")) for image in images]),
                                          step, dataformats="NHWC")
            elif tracker.name == "wandb":
                import wandb

                tracker.log({tag: [wandb.Image(image, caption=prompt) for image in images]}, step=step)


def _gather_on_main(rendered, world, is_main):
    """Every process's ``{item: images}`` merged on the main process (rank 0); ``{}`` elsewhere."""
    parts = [None] * world if is_main else None
    torch.distributed.gather_object(rendered, parts, dst=0)
    return {item: images for part in parts for item, images in part.items()} if is_main else {}
