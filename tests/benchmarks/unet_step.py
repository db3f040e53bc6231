"""Step time of a LoRA on a synthetic UNet: a bare loop vs the scripts' `TrainingLoop` with EMA.

Random weights built from a config (no download), random latents and text embeddings, so it runs
anywhere; ``--config sdxl`` is the full-size SDXL UNet at 1024x1024 (latents 128x128), for a GPU::

    python -m tests.benchmarks.unet_step --config sdxl --mixed_precision bf16 --json sdxl.json

The bare loop is forward, loss, backward and optimizer step under the same autocast; the looped
run is the same step inside ``TrainingLoop`` (data loader, accelerate's wrappers, grad clipping,
lr schedule, logging, EMA update, progress bar), built with the scripts' own helpers. Achieved
TFLOP/s come from counting one bare step with ``FlopCounterMode``.
"""

import argparse
import json
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from training_utils.accelerator import make_accelerator
from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_lora
from training_utils.args import training_parser
from training_utils.ema import make_ema
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import TensorsExport
from training_utils.outputs.run_status import RunRecord
from training_utils.pipeline import trainable_parameters, weight_dtype_for

CONFIGS = {
    # SDXL base's UNet (2.6B parameters).
    "sdxl": dict(
        block_out_channels=(320, 640, 1280), layers_per_block=2, transformer_layers_per_block=(1, 2, 10),
        cross_attention_dim=2048, attention_head_dim=(5, 10, 20), addition_embed_type="text_time",
        projection_class_embeddings_input_dim=2816, addition_time_embed_dim=256, use_linear_projection=True,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), sample_size=128,
        in_channels=4, out_channels=4,
    ),
    # The same architecture, narrow and shallow: checks this file on a CPU in seconds.
    "sdxl-small": dict(
        block_out_channels=(32, 64, 64), layers_per_block=1, transformer_layers_per_block=(1, 1, 2),
        cross_attention_dim=64, attention_head_dim=(2, 4, 4), addition_embed_type="text_time",
        projection_class_embeddings_input_dim=64 + 6 * 8, addition_time_embed_dim=8, use_linear_projection=True,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), sample_size=16,
        in_channels=4, out_channels=4, norm_num_groups=8,
    ),
}


def build_unet(config, device, weight_dtype, rank):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a CPU init of 2.6B parameters takes minutes
        unet = UNet2DConditionModel(**config)
    add_lora(unet, rank, ATTENTION_PROJECTIONS)
    # as prepare_components does: frozen weights in weight_dtype, trained (LoRA) tensors in fp32
    for parameter in unet.parameters():
        parameter.data = parameter.data.float() if parameter.requires_grad else parameter.data.to(weight_dtype)
    return unet.to(device)


def synthetic_batch(config, batch_size, device, generator):
    size = config["sample_size"]
    pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
    return {
        "latents": torch.randn(batch_size, 4, size, size, generator=generator).to(device),
        "encoder_hidden_states": torch.randn(batch_size, 77, config["cross_attention_dim"],
                                             generator=generator).to(device),
        "text_embeds": torch.randn(batch_size, pooled, generator=generator).to(device),
        "time_ids": torch.tensor([[size * 8, size * 8, 0, 0, size * 8, size * 8]] * batch_size, dtype=torch.float32,
                                 device=device),
    }


def step_loss(unet, batch):
    latents = batch["latents"]
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, 1000, (latents.shape[0],), device=latents.device)
    noisy = latents + noise * (timesteps.float() / 1000).view(-1, 1, 1, 1)  # the cost of add_noise, not its math
    prediction = unet(noisy, timesteps, batch["encoder_hidden_states"], return_dict=False,
                      added_cond_kwargs={"text_embeds": batch["text_embeds"], "time_ids": batch["time_ids"]})[0]
    return F.mse_loss(prediction.float(), noise.float())


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bare_step_seconds(unet, batch, parameters, device, weight_dtype, warmup, steps):
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)
    autocast = torch.autocast(device.type, dtype=weight_dtype, enabled=weight_dtype != torch.float32)
    times = []
    for index in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        with autocast:
            loss = step_loss(unet, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_flops(unet, batch, device, weight_dtype):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        with torch.autocast(device.type, dtype=weight_dtype, enabled=weight_dtype != torch.float32):
            loss = step_loss(unet, batch)
        loss.backward()
    unet.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def looped_step_seconds(args, unet, batch, warmup, steps):
    """Median seconds per optimizer step of ``TrainingLoop`` with EMA, and of its EMA updates alone."""
    run = RunRecord()
    accelerator = make_accelerator(args, run)
    export = TensorsExport({"unet": unet})
    parameters = trainable_parameters(export.trained)
    ema = make_ema(args, parameters, accelerator)
    examples = [{key: value[0].cpu() for key, value in batch.items()}] * (warmup + steps)
    dataloader = accelerator.prepare(torch.utils.data.DataLoader(examples, batch_size=1, shuffle=False))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    model, optimizer, lr_scheduler = accelerator.prepare(unet, optimizer, lr_scheduler)
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema)

    ema_times = []
    update = ema.update

    def timed_update(step):
        synchronize(accelerator.device)
        start = time.perf_counter()
        update(step)
        synchronize(accelerator.device)
        ema_times.append(time.perf_counter() - start)

    ema.update = timed_update
    step_ends = []
    for batch_on_device in loop:
        with accelerator.accumulate(model):
            loop.backward_and_step(step_loss(model, batch_on_device))
        synchronize(accelerator.device)
        step_ends.append(time.perf_counter())
    step_times = [b - a for a, b in zip(step_ends[warmup - 1:], step_ends[warmup:])]
    return statistics.median(step_times), statistics.median(ema_times[warmup:]), ema


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="sdxl-small")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default=None, help="also write the figures here")
    options = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    weight_dtype = weight_dtype_for(options.mixed_precision)
    config = CONFIGS[options.config]
    started = time.perf_counter()
    unet = build_unet(config, device, weight_dtype, options.rank)
    batch = synthetic_batch(config, options.batch_size, device, torch.Generator().manual_seed(0))
    parameters = [p for p in unet.parameters() if p.requires_grad]
    built = time.perf_counter() - started
    unet.train()

    flops = step_flops(unet, batch, device, weight_dtype)
    bare = bare_step_seconds(unet, batch, parameters, device, weight_dtype, options.warmup, options.steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with tempfile.TemporaryDirectory() as output_dir:
        args = training_parser("bench").parse_args([
            "--pretrained_model_name_or_path", "none", "--output_dir", output_dir, "--use_ema",
            "--mixed_precision", options.mixed_precision, "--train_batch_size", str(options.batch_size),
            "--checkpointing_steps", "1000000", "--learning_rate", "1e-4"])
        looped, ema_update, ema = looped_step_seconds(args, unet, batch, options.warmup, options.steps)
    trained_fp32_bytes = sum(p.numel() * 4 for p in parameters)
    figures = {
        "config": options.config, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "mixed_precision": options.mixed_precision, "batch_size": options.batch_size, "rank": options.rank,
        "unet_parameters": sum(p.numel() for p in unet.parameters()),
        "trained_parameters": sum(p.numel() for p in parameters),
        "build_seconds": built, "flops_per_step": flops,
        "bare_step_seconds": bare, "looped_step_seconds": looped, "looped_over_bare": looped / bare,
        "tflops_bare": flops / bare / 1e12, "tflops_looped": flops / looped / 1e12,
        "ema_update_seconds": ema_update, "ema_update_fraction_of_step": ema_update / looped,
        "ema_bytes": ema.num_bytes, "ema_bytes_over_trained_fp32": ema.num_bytes / trained_fp32_bytes,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
    for key, value in figures.items():
        print(f"{key:32s} {value:.4g}" if isinstance(value, float) else f"{key:32s} {value}")
    if options.json:
        with open(options.json, "w") as file:
            json.dump(figures, file, indent=2)
    return figures


if __name__ == "__main__":
    main()
