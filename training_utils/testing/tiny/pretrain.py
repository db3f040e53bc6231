"""How the pretrained tiny Stable Diffusion 1.x was made: a VAE that reconstructs the shapes, a UNet that draws them.

The random fixtures of `sd` render coloured noise, so a run on them shows the machinery but not learning. The
pretrained one's VAE reconstructs the shapes, and its UNet, after 450 steps, draws the shape, colour and background a
prompt names, large and centred ("a red circle on a white background": a red disc on white; "a red square ...": a
red square; `training_utils.testing.learning.BASE_THRESHOLDS` measures both), so that a LoRA trained on it (`make
demo`, the learning tests) starts from a model that follows its prompts' words. Its weights are committed
(`sd.PRETRAINED`, safetensors, about 4 MB; the fixture ``sd_pretrained`` copies them), made deterministically on the
CPU (the VAE in two threads, the UNet in two processes of one thread: 105 s of wall time on an idle two-core
machine, 32 s of it until the VAE was trained, 192 s of CPU; the recipe before, 600 UNet steps after a VAE of 300 on
one thread, took 128 s there, run just before; at a slower hour the same machine took 133 s for this one, 171 s for
that; rerun from a fresh clone, every weight reproduced bitwise) by::

    python -m training_utils.testing.tiny.pretrain

which trains the tiny VAE on pictures of the shapes with `train_vae` (there is no VAE training script; the routine
is a few lines), then the whole UNet with our own full fine-tune script, ``examples/text_to_image/
train_text_to_image.py``, on captioned pictures of `PRETRAINING_SHAPES` in `PRETRAINING_COLORS` on
`PRETRAINING_BACKGROUNDS`, and keeps its EMA UNet. What made 450 steps enough (each measured against the fixture
pretrained before, whose pictures had none of the prompted colour, or the same blob for a circle and a square):
shapes that nearly fill the picture (`PRETRAINING_EXTENT`), only circles and squares, in few colours; velocity
prediction; empty captions for classifier-free guidance (`PREDICTION_TYPE`, `CAPTION_DROPOUT`); a learning rate of
3e-3. The VAE's 400 steps: at 300 (on two threads) its reconstruction error was 0.0145, 0.032 on the demo's purple
star, which no picture of its training shows, and the learning runs' LoRAs did not draw the star; at 400, 0.0075 and
0.014.
"""

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from .data import BACKGROUNDS, COLORS, LARGE_EXTENT, SEED, SHAPES, build_shapes, draw_shape
from .parts import sd_components, sd_inference_scheduler, tiny_unet
from .sd import PRETRAINED

REPOSITORY = Path(__file__).parents[3]
FULL_FINE_TUNE = REPOSITORY / "examples" / "text_to_image" / "train_text_to_image.py"
RESOLUTION = 32
# How the committed weights were trained (the command above uses these).
VAE_STEPS = 400
UNET_STEPS = 450
UNET_LEARNING_RATE = 3e-3
# The UNet predicts the velocity, whose scale is the same at every noise level (predicting the noise, a tiny model's
# colours come out wrong: at high noise the implied picture amplifies the prediction's error many times), and an
# empty caption one time in ten, so that classifier-free guidance, which validation applies, has an unconditional
# prediction to steer from (without it the pictures on white backgrounds came out gray, whatever the colour asked).
PREDICTION_TYPE = "v_prediction"
CAPTION_DROPOUT = 0.1
# The CPU threads of every step of the UNet's: one, as float reductions depend on their number. The VAE trains on
# two (1.6 times as fast as on one: its convolutions are the largest of the tiny models'), in the one process that
# runs then; the number is set, so that every rerun splits the work the same way, whatever the machine's cores.
THREADS = 1
VAE_THREADS = 2
# The UNet trains in two processes of one thread each (data parallel over gloo, 8 pictures each, the same batch of
# 16): on two cores that halves the wall-clock time, and the run is as reproducible as on one.
PROCESSES = 2
# What the UNet learns to draw: circles and squares in few, distinct colours (orange, purple and the gray background
# are left for what a LoRA teaches later), so that 2 minutes suffice: with triangles too, 500 steps drew the red
# circle as much a square as a circle. The shapes nearly fill the picture (50 to 58 of 64 pixels, 2 to 6 of play):
# then a shape's corners, or their absence, are much of each picture, and the UNet learns to draw the shape its
# caption names (with `LARGE_EXTENT`, 40 to 52 pixels at up to 22 pixels of play, circles and squares came out as
# the same blob).
PRETRAINING_SHAPES = ("circle", "square")
PRETRAINING_COLORS = ("red", "green", "blue", "yellow")
PRETRAINING_BACKGROUNDS = ("white", "black")
PRETRAINING_EXTENT = (50, 58)
PRETRAINING_IMAGES = 192  # every shape, colour and background combination, 12 times at other places and sizes
VAE_PICTURES = 216  # every shape, colour (all of them) and background combination, four times


def shape_pictures(count=VAE_PICTURES, resolution=RESOLUTION, seed=SEED):
    """``count`` large pictures (`LARGE_EXTENT`) of every shape, colour and background in turn, drawn at 64 px
    and resized to ``resolution`` as the scripts resize them (lanczos), as a ``(count, 3, resolution,
    resolution)`` tensor in [-1, 1]."""
    rng = random.Random(seed)
    combos = [(shape, color, background) for shape in SHAPES for color in COLORS for background in BACKGROUNDS]
    pictures = []
    for index in range(count):
        image, _ = draw_shape(*combos[index % len(combos)], rng=rng, extent=LARGE_EXTENT)
        pixels = np.asarray(image.resize((resolution, resolution), Image.LANCZOS), dtype=np.float32)
        pictures.append(torch.from_numpy(pixels).permute(2, 0, 1) / 127.5 - 1)
    return torch.stack(pictures)


def train_vae(vae, pictures, steps=VAE_STEPS, batch_size=16, learning_rate=2e-3, kl_weight=1e-4, seed=SEED):
    """Train ``vae`` in place to reconstruct ``pictures`` (mean squared error plus a small KL term, as VAEs are
    trained), on `VAE_THREADS` threads, deterministic on the CPU; then set its ``scaling_factor`` so that scaled latents
    have unit variance, as Stable Diffusion's does. Returns the reconstruction error of the pictures' mean
    latents."""
    threads = torch.get_num_threads()
    torch.set_num_threads(VAE_THREADS)
    try:
        generator = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.AdamW(vae.parameters(), lr=learning_rate, weight_decay=0.0)
        vae.train()
        for _ in range(steps):
            batch = pictures[torch.randint(0, len(pictures), (batch_size,), generator=generator)]
            posterior = vae.encode(batch).latent_dist
            latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
            loss = (vae.decode(latents).sample - batch).pow(2).mean() + kl_weight * posterior.kl().mean() / batch[
                0].numel()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        vae.eval()
        with torch.no_grad():
            means = vae.encode(pictures).latent_dist.mean
            error = (vae.decode(means).sample - pictures).pow(2).mean().item()
        vae.register_to_config(scaling_factor=1.0 / means.std().item())
        return error
    finally:
        torch.set_num_threads(threads)


def distinct_token_embeddings(text_encoder, seed=SEED):
    """Redraw the random CLIP text encoder's token embeddings with unit variance (CLIP draws them, like its position
    embeddings, with 0.02): each caption word then dominates its position's output, as in a trained CLIP, instead
    of prompts that differ in a word giving nearly the same embeddings. Nothing trains the text encoder."""
    weight = text_encoder.get_input_embeddings().weight
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)))


def pretrain_sd(output_dir, vae_steps=VAE_STEPS, unet_steps=UNET_STEPS, unet_learning_rate=UNET_LEARNING_RATE,
                work_dir=None, log=print):
    """Train the tiny SD 1.x pipeline's VAE (`train_vae`), then its whole UNet with the full fine-tune script, and
    save the pipeline, with the EMA UNet, to ``output_dir``."""
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    from ..launch import launch_script

    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=work_dir) as scratch:
        scratch = Path(scratch)
        components = sd_components()
        distinct_token_embeddings(components["text_encoder"])
        error = train_vae(components["vae"], shape_pictures(), steps=vae_steps)
        log(f"VAE: {vae_steps} steps, reconstruction error {error:.4f} ({time.monotonic() - started:.0f} s)")
        StableDiffusionPipeline(unet=tiny_unet(), scheduler=sd_inference_scheduler(), safety_checker=None,
                                feature_extractor=None, requires_safety_checker=False,
                                **components).save_pretrained(scratch / "base")
        build_shapes(scratch / "shapes", num_images=PRETRAINING_IMAGES, extent=PRETRAINING_EXTENT,
                     colors=PRETRAINING_COLORS, backgrounds=PRETRAINING_BACKGROUNDS, shapes=PRETRAINING_SHAPES)
        launch_script(FULL_FINE_TUNE, "--pretrained_model_name_or_path", scratch / "base", "--train_data_dir",
                      scratch / "shapes", "--output_dir", scratch / "out", "--resolution", RESOLUTION,
                      "--center_crop", "--random_flip", "--cache_latents", "--train_batch_size", 16 // PROCESSES,
                      "--prediction_type", PREDICTION_TYPE, "--caption_dropout", CAPTION_DROPOUT,
                      "--max_train_steps", unet_steps, "--learning_rate", unet_learning_rate, "--lr_warmup_steps", 50,
                      "--use_ema", "--ema_decay", 0.99, "--seed", SEED, "--checkpointing_steps", 10 * unet_steps,
                      "--validation_prompt", "a red circle on a white background", "--num_validation_images", 4,
                      "--validation_inference_steps", 20, "--validation_steps", unet_steps,
                      processes=PROCESSES, timeout=1800, env=script_environment())
        log(f"UNet: {unet_steps} steps of train_text_to_image.py ({time.monotonic() - started:.0f} s)")
        pipe = StableDiffusionPipeline.from_pretrained(scratch / "out")
        pipe.unet = UNet2DConditionModel.from_pretrained(scratch / "out" / "ema" / "unet")
        pipe.save_pretrained(output_dir)
        shutil.copy(scratch / "out" / "validation" / "progress-p00.png", Path(output_dir) / "validation.png")
    cpu_seconds = cpu_time()
    log(f"CPU time: {cpu_seconds:.0f} s, this process and the script's")
    (Path(output_dir) / "pretraining.json").write_text(json.dumps(
        {"vae_steps": vae_steps, "vae_threads": VAE_THREADS, "unet_steps": unet_steps,
         "unet_learning_rate": unet_learning_rate, "unet_shapes": PRETRAINING_SHAPES,
         "unet_shape_extent": PRETRAINING_EXTENT, "unet_processes": PROCESSES,
         "prediction_type": PREDICTION_TYPE, "caption_dropout": CAPTION_DROPOUT,
         "vae_reconstruction_error": round(error, 5), "cpu_seconds": round(cpu_seconds),
         "command": "python -m training_utils.testing.tiny.pretrain"}, indent=1))


def script_environment():
    """The variables the pretraining's script runs with: this repository first on the path (its ``training_utils``,
    whatever else is installed) and `THREADS` threads."""
    return {"PYTHONPATH": os.pathsep.join([str(REPOSITORY), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": str(THREADS)}


def cpu_time():
    """The CPU seconds (user and system) spent so far by this process and the child processes it waited for: the
    pretraining's cost on a shared machine, where the wall-clock time says more about the others' load."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=str(PRETRAINED),
                        help=f"where the pipeline goes (default: {PRETRAINED})")
    parser.add_argument("--vae_steps", type=int, default=VAE_STEPS)
    parser.add_argument("--unet_steps", type=int, default=UNET_STEPS)
    parser.add_argument("--unet_learning_rate", type=float, default=UNET_LEARNING_RATE)
    args = parser.parse_args(argv)
    pretrain_sd(args.output_dir, args.vae_steps, args.unet_steps, args.unet_learning_rate,
                log=lambda line: print(line, file=sys.stderr))


if __name__ == "__main__":
    main()
