"""How the pretrained tiny Stable Diffusion 3 was made: the SD 1.x fixture's VAE, a transformer that draws the shapes.

The flow-matching counterpart of `pretrain`: a tiny SD3 whose transformer draws the colour, background and rough shape
that a prompt names ("a red circle on a white background": a red round blob on a light background;
`training_utils.testing.learning.SD3_BASE_THRESHOLDS` measures it), so that a LoRA trained on it (the flow-matching
learning test) starts from a model that follows its prompts' colour words. Its weights are committed
(`sd3.PRETRAINED`, safetensors, 2.6 MB, half of it the transformer's fixed positional embedding; the fixture
``sd3_pretrained`` copies them), made deterministically on the CPU (single-threaded: 82 s of wall and CPU time on a
two-core machine, 103 s when the same machine ran slower; rerun, every weight reproduced bitwise) by::

    python -m training_utils.testing.tiny.pretrain_sd3

It builds the random tiny SD3 of `sd3.sd3_pipeline` (the random fixture's transformer, 79k parameters), gives it
the committed SD 1.x fixture's VAE (trained on the shapes by `pretrain.train_vae`; its latents shifted and scaled
to zero mean and unit variance, SD3's ``shift_factor`` and ``scaling_factor``) and CLIP encoders whose prompts
differ in their words (`pretrain.distinct_token_embeddings`), then trains the transformer with our own SD3 script,
``examples/dreambooth/train_dreambooth_lora_sd3.py``, on captioned pictures of every shape in
`pretrain.PRETRAINING_COLORS` on `pretrain.PRETRAINING_BACKGROUNDS` (``--dataset_name`` with its ``text`` column),
400 steps of 16, and fuses the EMA adapter into the transformer. The adapter is a full-rank LoRA: rank `RANK`, the
transformer's width, on every linear layer and the patch embedding, so that it can express any update of those
weights (only the biases and the positional embedding keep their random values). The script rather than a loop of
our own, so that the script's noise sampler, inputs and loss are what made the base. What made 400 steps enough: the
learning rate (at 3e-3, 300 steps drew faint red speckles), `CAPTION_DROPOUT` empty captions for classifier-free
guidance, as for SD 1.x, and the random fixture's patch size of 1 (with patches of 2 a step costs a third, but
neither 300 steps at this width nor 800 at twice it drew any red).

Its pictures of "a red circle on a white background", seeds 0-4 one by one (rendered as `learning.base_images`
renders them), measured red fractions 0.268-0.315 and circle overlaps 0.688-0.788 (a speckled red-orange round blob
on lavender), against `learning.SD3_BASE_THRESHOLDS` of 0.2 and 0.6: 0.068 and 0.088 of margin (the random fixture
``sd3`` fails them). Blue squares on black came out too (blue 0.32-0.38, square overlap 0.57-0.71), green triangles
not (green 0.00). It does not tell a circle from a square: "a red square on a white background" is the same round
blob (its square overlap minus its circle overlap -0.04 to +0.01, seeds 0-4). With the SD 1.x fixture's earlier VAE,
trained instead on shapes that nearly fill the picture (50 to 58 of 64 pixels), its circles got rounder (overlap
0.90-0.92) but its squares became red rings around green (square overlap 0.31-0.38).

Every run of the fixture renders with ``max_sequence_length`` `MAX_SEQUENCE_LENGTH`: T5's padding is part of the
transformer's input (the SD3 pipeline passes no attention mask), so prompts padded to other lengths read differently.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

from .data import LARGE_EXTENT, SEED, build_shapes
from .pretrain import (PRETRAINING_BACKGROUNDS, PRETRAINING_COLORS, PRETRAINING_IMAGES, REPOSITORY, RESOLUTION,
                       cpu_time, distinct_token_embeddings, script_environment, shape_pictures)
from .sd import PRETRAINED as SD_PRETRAINED
from .sd3 import PRETRAINED, sd3_pipeline

SCRIPT = REPOSITORY / "examples" / "dreambooth" / "train_dreambooth_lora_sd3.py"
# How the committed weights were trained (the command above uses these).
STEPS = 400
LEARNING_RATE = 1e-2
RANK = 32  # the transformer's width: a LoRA of this rank can express any update of its layers
CAPTION_DROPOUT = 0.1
MAX_SEQUENCE_LENGTH = 16  # T5 tokens per prompt, in training and at every render; the captions need 8


def sd3_base():
    """The random tiny SD3 that the pretraining starts from (see the module's docstring)."""
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(SD_PRETRAINED / "vae")
    with torch.no_grad():
        latents = vae.encode(shape_pictures()).latent_dist.mean
    vae.register_to_config(shift_factor=latents.mean().item(), scaling_factor=1.0 / latents.std().item())
    pipe = sd3_pipeline(vae=vae)
    for seed, text_encoder in enumerate((pipe.text_encoder, pipe.text_encoder_2), start=SEED):
        distinct_token_embeddings(text_encoder, seed=seed)
    return pipe


def adapted_layers(transformer):
    """The full names of the transformer's layers that the full-rank LoRA adapts: every linear layer and the patch
    embedding's convolution."""
    return [name for name, module in transformer.named_modules() if isinstance(module, (nn.Linear, nn.Conv2d))]


def pretrain_sd3(output_dir, steps=STEPS, learning_rate=LEARNING_RATE, work_dir=None, log=print):
    """Train the tiny SD3's transformer with a full-rank LoRA of the DreamBooth SD3 script, fuse the EMA adapter
    into it, and save the pipeline to ``output_dir``."""
    from diffusers import StableDiffusion3Pipeline

    from ..launch import launch_script

    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=work_dir) as scratch:
        scratch = Path(scratch)
        base = sd3_base()
        base.save_pretrained(scratch / "base")
        build_shapes(scratch / "shapes", num_images=PRETRAINING_IMAGES, extent=LARGE_EXTENT,
                     colors=PRETRAINING_COLORS, backgrounds=PRETRAINING_BACKGROUNDS)
        # Every picture has its caption (the dataset's "text"); the instance prompt captions none.
        launch_script(SCRIPT, "--pretrained_model_name_or_path", scratch / "base", "--dataset_name",
                      scratch / "shapes", "--caption_column", "text", "--instance_prompt", "", "--output_dir",
                      scratch / "out", "--resolution", RESOLUTION, "--center_crop", "--random_flip", "--cache_latents",
                      "--train_batch_size", 16, "--caption_dropout", CAPTION_DROPOUT, "--max_sequence_length",
                      MAX_SEQUENCE_LENGTH, "--rank", RANK, "--lora_layers", ",".join(adapted_layers(base.transformer)),
                      "--max_train_steps", steps, "--learning_rate", learning_rate, "--use_ema", "--ema_decay", 0.99,
                      "--seed", SEED, "--checkpointing_steps", 10 * steps, "--validation_prompt",
                      "a red circle on a white background", "--num_validation_images", 4,
                      "--validation_inference_steps", 20, "--validation_steps", steps, timeout=1800,
                      env=script_environment())
        log(f"transformer: {steps} steps of train_dreambooth_lora_sd3.py ({time.monotonic() - started:.0f} s)")
        pipe = StableDiffusion3Pipeline.from_pretrained(scratch / "base")
        pipe.load_lora_weights(scratch / "out" / "ema")
        pipe.fuse_lora()
        pipe.unload_lora_weights()
        pipe.save_pretrained(output_dir)
        shutil.copy(scratch / "out" / "validation" / "progress-p00.png", Path(output_dir) / "validation.png")
    cpu_seconds = cpu_time()
    log(f"CPU time: {cpu_seconds:.0f} s, this process and the script's")
    (Path(output_dir) / "pretraining.json").write_text(json.dumps(
        {"steps": steps, "learning_rate": learning_rate, "rank": RANK, "caption_dropout": CAPTION_DROPOUT,
         "max_sequence_length": MAX_SEQUENCE_LENGTH, "cpu_seconds": round(cpu_seconds),
         "command": "python -m training_utils.testing.tiny.pretrain_sd3"}, indent=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default=str(PRETRAINED),
                        help=f"where the pipeline goes (default: {PRETRAINED})")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--learning_rate", type=float, default=LEARNING_RATE)
    args = parser.parse_args(argv)
    pretrain_sd3(args.output_dir, args.steps, args.learning_rate, log=lambda line: print(line, file=sys.stderr))


if __name__ == "__main__":
    main()
