"""Peak accelerator memory and step time of each family's LoRA training at real size, beside the memory plan's
estimate: bf16 and an int8 base, without swapping and with N blocks swapped.

    bash tests/benchmarks/device.sh                                    # on the GPU machine: one call, <= 8 minutes
    python -m tests.benchmarks.device_memory --smoke --families flux2_klein   # on a CPU: the tiny fixtures' configs

What runs. For each family of `real_configs.FAMILIES` (smallest first), its script's own planning run
(``--print_memory_plan``'s steps, in this process: the pipeline on the meta device from the released configs, the
script's rank-16 LoRA on its default layers) gives the plan and the transformer with its adapter, still on the meta
device. Each configuration materialises a copy of it with random weights (frozen bf16, adapter fp32), quantises its
base (torchao int8 weight-only, as ``--quantize_base int8`` loads it) where asked, swaps its first N blocks
(`block_swap.BlockSwap`, as ``--blocks_to_swap N``; N is the plan's fewest that fit 24 GB, else half the blocks), and
trains it as the scripts do: gradient checkpointing, bf16 autocast, AdamW (`optimization.make_optimizer`), an EMA of
the adapter on the accelerator (`ema.make_ema`), batch 1 at 1024x1024 (video: 49 frames at 632x632, 480x832's area),
on random inputs that the family's own ``model_inputs`` lays out (random prompt features of the prompt length the
plan assumes). It reports the median step time over ``--steps`` steps after one warm-up step, the peak allocated
memory over all of them (``torch.cuda.max_memory_allocated``) and the plan's training-phase estimate for the same
flags: the text encoders and the VAE do not run here, so the plan's encoding phase is not measured.

Each family's table rows and JSON are written as they complete (``<output_dir>/device_memory_<gpu>.{md,json}``);
``--budget_s`` stops starting new families once spent (those left are listed as skipped). A configuration that runs
out of memory is a row saying so. ``--smoke`` runs the tiny fixtures' configs on the CPU at 32 px in fp32, with 16
prompt tokens.
"""

import argparse
import contextlib
import copy
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch

from training_utils.block_swap import BlockSwap, repeated_blocks
from training_utils.ema import make_ema
from training_utils.families import flux2, hidream, qwen_image, wan, z_image
from training_utils.memory_plan import GB, TEXT_TOKENS, make_plan, vae_compression
from training_utils.optimization import make_optimizer
from training_utils.outputs.run_status import RunRecord
from training_utils.quantization import follow_autocast
from training_utils.testing.tiny import build

from tests.benchmarks.memory_plan_table import fresh_accelerate_state, import_script, plan_argv
from tests.benchmarks.real_configs import FAMILIES, real_pipeline

REPOSITORY = Path(__file__).resolve().parents[2]
COLUMNS = ("model", "base", "blocks swapped", "step (s)", "peak allocated (GB)", "plan's estimate (GB)",
           "measured / estimate", "status")
# Smallest first: a budget cut short leaves the most families measured.
ORDER = ("flux2_klein", "z_image", "wan_14b", "hidream", "qwen_image", "flux2_dev")
FAMILY_MODULES = {"flux2_klein": flux2, "flux2_dev": flux2, "qwen_image": qwen_image, "z_image": z_image,
                  "hidream": hidream, "wan_14b": wan}


def planned_transformer(model, argv):
    """The plan of ``model``'s script with ``argv``, its meta pipeline and its transformer with the adapter."""
    module = import_script(model.script)
    kept = {}
    original = module.prepare_components

    def keeping(pipe, trained, *args, **kwargs):
        kept["pipe"], kept["trained"] = pipe, trained
        return original(pipe, trained, *args, **kwargs)

    fresh_accelerate_state()
    with mock.patch.object(module, "prepare_components", keeping):
        plan = make_plan(module.main, module.parse_args(argv), RunRecord())
    return plan, kept["pipe"], kept["trained"]["transformer"]


def materialised(meta_transformer, device, weight_dtype, generator_device):
    """A copy of ``meta_transformer`` with random weights on ``device``: frozen ones in ``weight_dtype``, trained ones
    in fp32 (small: the adapter's B is random too, so that every gradient flows)."""
    transformer = copy.deepcopy(meta_transformer)
    for module in transformer.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is None:
                continue
            dtype = torch.float32 if parameter.requires_grad else weight_dtype
            data = torch.empty(parameter.shape, dtype=dtype, device=generator_device).normal_(std=0.02)
            module._parameters[name] = torch.nn.Parameter(data.to(device), requires_grad=parameter.requires_grad)
    return transformer.to(device)


def quantise_base(transformer):
    """torchao's int8 weight-only quantisation of the frozen linear layers (the adapter's stay fp32)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(transformer, Int8WeightOnlyConfig(),
              filter_fn=lambda layer, name: isinstance(layer, torch.nn.Linear) and not layer.weight.requires_grad
              and "lora_" not in name)
    follow_autocast(transformer)


def swapped(transformer, count, device):
    """Swap ``transformer``'s first ``count`` blocks: their frozen weights back on the CPU, then `BlockSwap`."""
    if not count:
        return None
    for _, block in repeated_blocks(transformer)[:count]:
        for module in block.modules():
            for name, parameter in list(module._parameters.items()):
                if parameter is not None and not parameter.requires_grad:
                    module._parameters[name] = torch.nn.Parameter(parameter.data.to("cpu"), requires_grad=False)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return BlockSwap(transformer, count, device)


def random_inputs(family, pipe, transformer, resolution, frames, batch_size, device, dtype, generator,
                  text_tokens=TEXT_TOKENS):
    """The transformer's inputs at ``resolution`` (and ``frames``), as the family's ``model_inputs`` lays them out,
    from random latents and prompt features of the shapes its encoders give (``text_tokens`` long; HiDream's T5 and
    Llama features, 128, as its pipeline's default)."""
    config = transformer.config
    spatial, temporal, channels = vae_compression(pipe.vae)
    size = resolution // spatial

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype)

    timesteps = torch.full((batch_size,), 500.0, device=device)
    module = FAMILY_MODULES[family]
    if module is flux2:
        latents = randn(batch_size, 4 * channels, size // 2, size // 2)
        text = {"encoder_hidden_states": randn(batch_size, text_tokens, config.joint_attention_dim),
                "txt_ids": pipe._prepare_text_ids(torch.empty(batch_size, text_tokens, 1)).to(device)}
        inputs = flux2.model_inputs(pipe, latents, timesteps, text)
        if config.guidance_embeds:
            inputs["guidance"] = torch.full((batch_size,), 4.0, device=device)
        return inputs
    if module is qwen_image:
        text = {"encoder_hidden_states": randn(batch_size, text_tokens, config.joint_attention_dim),
                "encoder_hidden_states_mask": None}
        return qwen_image.model_inputs(pipe, randn(batch_size, channels, 1, size, size), timesteps, text)
    if module is z_image:
        text = {"cap_feats": [randn(text_tokens, config.cap_feat_dim) for _ in range(batch_size)]}
        return z_image.model_inputs(pipe, randn(batch_size, channels, size, size), timesteps, text)
    if module is hidream:
        t5, llama = config.caption_channels
        text = {"encoder_hidden_states_t5": randn(batch_size, 128, t5),
                "encoder_hidden_states_llama3": randn(max(config.llama_layers) + 1, batch_size, 128, llama),
                "pooled_embeds": randn(batch_size, config.text_emb_dim)}
        return hidream.model_inputs(pipe, randn(batch_size, channels, size, size), timesteps, text)
    latent_frames = (frames - 1) // temporal + 1
    text = {"encoder_hidden_states": randn(batch_size, text_tokens, config.text_dim)}
    return wan.model_inputs(pipe, randn(batch_size, channels, latent_frames, size, size), timesteps, text)


def output_loss(output):
    """A loss on the transformer's output (a tensor, or one per sample)."""
    tensors = output if isinstance(output, (list, tuple)) else [output]
    return sum(tensor.float().pow(2).mean() for tensor in tensors)


def measure(family, pipe, meta_transformer, scheme, blocks_to_swap, sizes, device, steps):
    """One configuration: ``{"step_seconds", "peak_bytes"}``."""
    weight_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gc.collect()  # what an earlier configuration (one out of memory, too) left
    if device.type == "cuda":
        torch.cuda.empty_cache()
    transformer = materialised(meta_transformer, device, weight_dtype, device)
    if scheme == "int8":
        quantise_base(transformer)
    swap = swapped(transformer, blocks_to_swap, device)
    transformer.enable_gradient_checkpointing()
    transformer.train()
    parameters = {f"transformer.{name}": parameter for name, parameter in transformer.named_parameters()
                  if parameter.requires_grad}
    args = SimpleNamespace(learning_rate=1e-4, scale_lr=False, adam_beta1=0.9, adam_beta2=0.999,
                           adam_weight_decay=1e-2, adam_epsilon=1e-8, use_8bit_adam=False, use_ema=True,
                           ema_decay=0.999, ema_update_every=1, ema_warmup=False, ema_inv_gamma=1.0, ema_power=2 / 3,
                           ema_device="accelerator")
    optimizer = make_optimizer(args, parameters, 1)
    ema = make_ema(args, parameters, SimpleNamespace(device=device))
    generator = torch.Generator(device).manual_seed(0)
    inputs = random_inputs(family, pipe, transformer, sizes["resolution"], sizes["frames"], 1, device, weight_dtype,
                           generator, sizes["text_tokens"])
    autocast = (torch.autocast(device.type, dtype=weight_dtype) if weight_dtype != torch.float32
                else contextlib.nullcontext())
    if device.type == "cuda":  # the peak of training, not of building, quantising and parking the model
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(1, steps + 2):
        start = time.perf_counter()
        with autocast:
            loss = output_loss(transformer(**inputs, return_dict=False)[0])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del transformer, swap, optimizer, ema, inputs
    return {"step_seconds": statistics.median(times[1:]), "peak_bytes": peak}


def gpu_name(device):
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return name.lower().replace("nvidia ", "").replace(" ", "_")


def markdown(records, device_name):
    lines = [f"Measured on {device_name}; the plan's estimate is its training phase for the same flags. GB = 10⁹ "
             f"bytes.", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for record in records:
        measured, estimate = record.get("peak_bytes"), record.get("estimate_bytes")
        ratio = f"{measured / estimate:.2f}" if measured and estimate else "–"
        cells = [record["model"], record["base"], str(record["blocks_to_swap"]),
                 f"{record['step_seconds']:.3f}" if record.get("step_seconds") else "–",
                 f"{measured / GB:.1f}" if measured else "–", f"{estimate / GB:.1f}" if estimate else "–", ratio,
                 record["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(ORDER))
    parser.add_argument("--schemes", nargs="+", choices=["none", "int8"], default=["none", "int8"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--budget_s", type=float, default=420, help="start no family after this many seconds")
    parser.add_argument("--gpu_memory_gb", type=float, default=24, help="the card the swap count is chosen for")
    parser.add_argument("--output_dir", default=str(REPOSITORY / "tests" / "benchmarks" / "results"))
    parser.add_argument("--smoke", action="store_true", help="the tiny fixtures' configs, 32 px, on the CPU")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    sizes = ({"image_resolution": 32, "video_resolution": 32, "num_frames": 5} if args.smoke else {})
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    stem = output_dir / f"device_memory_{gpu_name(device)}"
    started = time.perf_counter()
    records = []
    with tempfile.TemporaryDirectory() as work_dir:
        work_dir = Path(work_dir)
        tiny = work_dir / "tiny"
        build(tiny, ["instance", "moving_shapes", *{FAMILIES[family].fixture for family in args.families}])
        for family in args.families:
            model = FAMILIES[family]
            if time.perf_counter() - started > args.budget_s:
                records.append({"model": model.title, "base": "–", "blocks_to_swap": "–",
                                "status": "skipped: the time budget was spent"})
                continue
            pipeline = tiny / model.fixture if args.smoke else real_pipeline(family, work_dir / family, tiny)
            title = f"{model.title} (tiny)" if args.smoke else model.title
            for scheme in args.schemes:
                quantize = None if scheme == "none" else scheme
                argv_for = lambda count: plan_argv(model, pipeline, tiny, work_dir / "out", quantize,
                                                   args.gpu_memory_gb, **sizes,
                                                   extra=["--blocks_to_swap", count])
                plan, pipe, meta_transformer = planned_transformer(model, argv_for(0))
                fit = plan["smallest_fit"]
                count = (fit["blocks_to_swap"] if fit and fit["quantize_base"] == quantize and fit["blocks_to_swap"]
                         else max(1, plan["repeated_blocks"] // 2))
                for blocks_to_swap in (0, count):
                    estimate = planned_transformer(model, argv_for(blocks_to_swap))[0]
                    record = {"model": title, "base": scheme, "blocks_to_swap": blocks_to_swap,
                              "estimate_bytes": estimate["accelerator_peak_bytes_estimate_by_phase"]["training"],
                              "resolution": estimate["activations_bytes_estimate"]["resolution"],
                              "frames": estimate["activations_bytes_estimate"]["frames"]}
                    try:
                        record.update(measure(family, pipe, meta_transformer, scheme, blocks_to_swap,
                                              {"resolution": record["resolution"], "frames": record["frames"],
                                               "text_tokens": 16 if args.smoke else TEXT_TOKENS},
                                              device, args.steps), status="ok")
                    except torch.OutOfMemoryError:
                        record["status"] = "out of memory"
                    records.append(record)
                    print(json.dumps(record), flush=True)
                    stem.with_suffix(".json").write_text(json.dumps({"device": gpu_name(device),
                                                                     "records": records}, indent=1))
                    stem.with_suffix(".md").write_text(markdown(records, gpu_name(device)))
    stem.with_suffix(".md").write_text(markdown(records, gpu_name(device)))
    return records


if __name__ == "__main__":
    main()
