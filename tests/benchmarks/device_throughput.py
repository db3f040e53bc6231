"""Training throughput on one GPU: the SDXL UNet and the FLUX.2 [klein] 4B transformer, eager vs ``--torch_compile``.

    bash tests/benchmarks/device.sh                                   # on the GPU machine: one call, <= 8 minutes
    python -m tests.benchmarks.device_throughput --smoke --inline      # on a CPU, tiny configs, in seconds

What it measures. Each model at real size from its real config, random weights (built on the device: nothing
is downloaded), bf16 frozen weights under bf16 autocast, a rank-16 LoRA in fp32 (SDXL: the attention
projections; klein: the flux2 script's default layers, its double blocks' attention projections and its single
blocks' fused input projection and output), gradient checkpointing, AdamW as `make_optimizer` makes it (fused on
CUDA), at 1024x1024 (SDXL: 128x128 latents; klein: 64x64 tokens of 128 channels beside 512 text tokens). One step
is forward, MSE loss, backward, optimizer step. For each model and mode (eager; compiled with
`training_utils.compile.compile_repeated_blocks`):

* batch 1: median step time over ``--steps`` steps after ``--warmup`` (the first step's time, which includes
  compiling, is reported too);
* the largest batch that fits in ``--memory_limit_gb`` (80 GB by default, the issue's budget, enforced with
  ``torch.cuda.set_per_process_memory_fraction`` on a larger GPU): eager doubles the batch from 2 while a step
  fits, up to ``--max_batch`` and as long as the next trial and its measurement fit in the time left; compiled
  starts from eager's largest and halves it until a step fits. The largest is then timed over
  ``--large_batch_steps`` steps (its trial step was the warm-up);
* peak allocated memory of the measured steps; achieved TFLOP/s and their share of ``--peak_tflops`` (989: the
  H200's and the H100 SXM's dense bf16 peak).

FLOPs are model FLOPs: forward and backward of one sample counted with ``FlopCounterMode`` on a copy of the
model on the meta device (no memory, no time), times the batch (every operation is per sample). They leave out
gradient checkpointing's recomputed forward, as model-FLOP utilisation does.

With ``--quantize_base nf4`` klein also runs eagerly at batch 1 with its frozen weights in bitsandbytes' NF4 (saved
in bf16 and reloaded through diffusers' ``BitsAndBytesConfig``, as ``--quantize_base nf4`` loads them); skipped,
with the reason, where CUDA or bitsandbytes is missing.

Robustness. Each configuration (model, mode, base) runs in a process of its own, so that a hang, a crash or an
exhausted GPU cannot take the others with it. ``--budget_s`` is shared among the configurations not yet run by
their expected cost (a compiled one counts double); a process is killed, with its compile workers, at the end of
its share, and one whose share is under 30 s is skipped. A step that fails (out of memory, or a compile error)
ends its batch search, not the run. Each measurement is appended as it completes, and the table
(``<output_dir>/device_<gpu>.md``) and the JSON beside it are rewritten after every configuration: a run cut short
still leaves what it measured. ``--inline`` runs the configurations in this process instead (no isolation, no
kill: for the smoke test, where starting a process per configuration costs more than the work). ``--smoke``
measures tiny configs in fp32 (a CPU's bf16 is slow) and compiles with the "eager" backend (dynamo only).
"""

import argparse
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_lora, linear_layers_named
from training_utils.compile import compile_repeated_blocks
from training_utils.optimization import make_optimizer

from tests.benchmarks.unet_step import CONFIGS as UNET_CONFIGS
from tests.benchmarks.unet_step import step_loss as unet_step_loss
from tests.benchmarks.unet_step import synthetic_batch as unet_synthetic_batch

REPOSITORY = Path(__file__).resolve().parents[2]
COLUMNS = ("model", "mode", "base", "batch", "step (s)", "samples/s", "TFLOP/s", "share of peak",
           "peak memory (GB)", "first step (s)", "status")
# The flux2 klein script's default --lora_layers (upstream's default targets).
FLUX2_LORA_LAYERS = ["to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj", "attn.to_out"]


# --- the models ---------------------------------------------------------------------------------------------

def unet_architecture(config):
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**config)


def flux2_architecture(config):
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(**config)


def flux2_batch(model_config, inputs, batch_size, generator):
    """What the klein script feeds the transformer: packed latent tokens and their position ids, the text
    encoder's features (three Qwen3 layers side by side) and their ids, the timestep over 1000; and a target."""
    from diffusers import Flux2KleinPipeline

    grid, text_tokens = inputs["latent_grid"], inputs["text_tokens"]
    tokens = grid * grid
    return {
        "hidden_states": torch.randn(batch_size, tokens, model_config["in_channels"], generator=generator),
        "encoder_hidden_states": torch.randn(batch_size, text_tokens, model_config["joint_attention_dim"],
                                             generator=generator),
        "timestep": torch.rand(batch_size, generator=generator),
        "img_ids": Flux2KleinPipeline._prepare_latent_ids(torch.empty(batch_size, 1, grid, grid)),
        "txt_ids": Flux2KleinPipeline._prepare_text_ids(torch.empty(batch_size, text_tokens, 1)),
        "target": torch.randn(batch_size, tokens, model_config["in_channels"], generator=generator),
    }


def flux2_loss(transformer, batch):
    inputs = {name: value for name, value in batch.items() if name != "target"}
    prediction = transformer(**inputs, return_dict=False)[0]
    return F.mse_loss(prediction.float(), batch["target"].float())


@dataclass(frozen=True)
class Family:
    label: str
    architecture: Callable[[dict], torch.nn.Module]  # the model, made on the current default device
    lora_targets: Callable[[torch.nn.Module], list]
    batch: Callable  # (model config, input sizes, batch size, generator) -> {name: CPU tensor}
    loss: Callable[[torch.nn.Module, dict], torch.Tensor]
    sizes: dict  # "real" / "smoke" -> {"model": constructor kwargs, "inputs": input sizes}


def unet_batch(model_config, inputs, batch_size, generator):
    return unet_synthetic_batch(model_config, batch_size, "cpu", generator)


FAMILIES = {
    "sdxl": Family(
        "SDXL UNet", unet_architecture, lambda model: ATTENTION_PROJECTIONS, unet_batch, unet_step_loss,
        {"real": {"model": UNET_CONFIGS["sdxl"], "inputs": {}},
         "smoke": {"model": UNET_CONFIGS["sdxl-small"], "inputs": {}}}),
    "flux2_klein": Family(
        "FLUX.2 [klein] transformer", flux2_architecture,
        lambda model: linear_layers_named(model, FLUX2_LORA_LAYERS), flux2_batch, flux2_loss,
        {
            # FLUX.2 [klein] 4B (black-forest-labs/FLUX.2-klein-4B, 3.9B parameters): 5 double-stream and 20
            # single-stream blocks of 24 heads x 128, 128 latent channels (32 VAE channels in 2x2 patches),
            # text features of three Qwen3-4B layers (3 x 2560), no guidance embedding; diffusers' defaults
            # (FLUX.2 [dev]'s) for the rest.
            "real": {"model": dict(num_layers=5, num_single_layers=20, num_attention_heads=24,
                                   attention_head_dim=128, joint_attention_dim=3 * 2560, in_channels=128,
                                   guidance_embeds=False),
                     "inputs": {"latent_grid": 64, "text_tokens": 512}},
            "smoke": {"model": dict(num_layers=1, num_single_layers=2, num_attention_heads=2, attention_head_dim=16,
                                    joint_attention_dim=96, in_channels=16, timestep_guidance_channels=32,
                                    axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False),
                      "inputs": {"latent_grid": 8, "text_tokens": 16}},
        }),
}


def on_device(batch, device):
    return {name: value.to(device) for name, value in batch.items()}


def model_flops_per_sample(family, size, rank):
    """Forward and backward FLOPs of one sample, counted on a meta-device copy (shapes only: no memory, no
    time). fp32 and no autocast there, which changes no FLOP count; no gradient checkpointing: model FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = family.architecture(size["model"])
    add_lora(model, rank, family.lora_targets(model))
    batch = on_device(family.batch(size["model"], size["inputs"], 1, torch.Generator().manual_seed(0)), "meta")
    with FlopCounterMode(display=False) as counter:
        family.loss(model, batch).backward()
    return counter.get_total_flops()


def weight_dtype_on(device):
    # bf16 where it is measured; fp32 on a CPU, whose bf16 convolutions are slower than its fp32 ones
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def cast_for_training(model, weight_dtype):
    """As `prepare_components`: trained (LoRA) tensors fp32, frozen ones in ``weight_dtype``; a quantised model's
    frozen tensors stay as they loaded."""
    quantized = getattr(model, "is_quantized", False)
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
        elif not quantized:
            parameter.data = parameter.data.to(weight_dtype)


def loaded_in_nf4(folder, architecture_class):
    """The model saved in ``folder``, its linear layers loaded in NF4, as ``--quantize_base nf4`` loads them
    (diffusers places a bitsandbytes model on the current CUDA device)."""
    from diffusers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    return architecture_class.from_pretrained(folder, quantization_config=config, torch_dtype=torch.bfloat16)


def build(family, size, device, rank, quantize_base):
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a CPU init of billions of parameters takes minutes
        model = family.architecture(size["model"])
    if quantize_base == "nf4":
        with tempfile.TemporaryDirectory() as folder:
            architecture_class = type(model)
            model.to(torch.bfloat16).save_pretrained(folder)
            del model  # before loading: the bf16 weights must not stay beside the NF4 ones
            torch.cuda.empty_cache()
            model = loaded_in_nf4(folder, architecture_class)
    add_lora(model, rank, family.lora_targets(model))
    cast_for_training(model, weight_dtype_on(device))
    model.enable_gradient_checkpointing()
    return model.train()


# --- one configuration: a model in one mode, measured ---------------------------------------------------------

@dataclass(frozen=True)
class Configuration:
    model: str
    mode: str  # "eager" or "compiled"
    quantize_base: str  # "none" or "nf4"
    smoke: bool
    backend: str
    rank: int
    warmup: int
    steps: int
    large_batch_steps: int
    max_batch: int
    memory_limit_gb: float
    peak_tflops: float
    deadline: float  # time.time() after which the batch search tries no further batch
    flops_per_sample: int  # `model_flops_per_sample`, counted once for every configuration of the model
    batch_hint: Optional[int] = None  # eager's largest batch, where compiled starts looking


def quantization_unavailable(device):
    """Why NF4 cannot run here, or None."""
    if device.type != "cuda":
        return "skipped: bitsandbytes' NF4 needs CUDA"
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return "skipped: bitsandbytes is not installed (pip install -e '.[quantization]')"
    return None


class Worker:
    """Measures one `Configuration`, appending each record to ``records_path`` as a JSON line when it is done."""

    def __init__(self, configuration, records_path):
        self.configuration = configuration
        self.records_path = Path(records_path)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.family = FAMILIES[configuration.model]
        self.size = self.family.sizes["smoke" if configuration.smoke else "real"]

    def record(self, batch, status, **figures):
        record = {"model": self.configuration.model, "mode": self.configuration.mode,
                  "quantize_base": self.configuration.quantize_base, "batch": batch, "status": status, **figures}
        with open(self.records_path, "a") as records:
            records.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)
        return record

    def run(self):
        configuration = self.configuration
        if configuration.quantize_base == "nf4" and quantization_unavailable(self.device):
            self.record(1, quantization_unavailable(self.device))
            return
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, configuration.memory_limit_gb * 1e9 / total))
        self.model = build(self.family, self.size, self.device, configuration.rank, configuration.quantize_base)
        compile_repeated_blocks(self.model, configuration.backend if configuration.mode == "compiled" else None)
        trained = {name: parameter for name, parameter in self.model.named_parameters() if parameter.requires_grad}
        self.optimizer = make_optimizer(SimpleNamespace(
            learning_rate=1e-4, scale_lr=False, use_8bit_adam=False, adam_beta1=0.9, adam_beta2=0.999,
            adam_weight_decay=1e-2, adam_epsilon=1e-8), trained, num_processes=1)

        batch_1 = self.measure(1, configuration.warmup, configuration.steps)
        if configuration.quantize_base != "none" or batch_1["status"] != "ok":
            return  # the quantised base is compared at batch 1
        largest = (self.shrink_to_fit(configuration.batch_hint) if configuration.batch_hint
                   else self.grow_until_full(batch_1["step_seconds"]))
        if largest:
            self.measure(largest, 0, configuration.large_batch_steps)  # the search's step at it was the warm-up

    def step(self, batch):
        weight_dtype = weight_dtype_on(self.device)
        with torch.autocast(self.device.type, dtype=weight_dtype, enabled=weight_dtype != torch.float32):
            loss = self.family.loss(self.model, batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed_steps(self, batch_size, count):
        """``(seconds, loss)`` of each of ``count`` steps at ``batch_size``, or the reason they could not run."""
        batch = on_device(self.family.batch(self.size["model"], self.size["inputs"], batch_size,
                                            torch.Generator().manual_seed(batch_size)), self.device)
        steps = []
        try:
            for _ in range(count):
                self.synchronize()
                started = time.perf_counter()
                loss = self.step(batch)
                self.synchronize()
                steps.append((time.perf_counter() - started, loss.item()))
            return steps
        except torch.cuda.OutOfMemoryError:
            failure = "out of memory"
        except Exception as error:  # a compile error or a crash of one batch size ends its search, not the run
            failure = f"failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
        # outside the handler, so that the error's frames (and the activations they hold) are gone
        self.optimizer.zero_grad(set_to_none=True)
        del batch
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return failure

    def trial_step(self, batch_size):
        """The seconds of one step at ``batch_size`` (which also warms that size up), or None if it failed."""
        result = self.timed_steps(batch_size, 1)
        if isinstance(result, str):
            print(f"{self.configuration.model} {self.configuration.mode} batch {batch_size}: {result}", flush=True)
            return None
        return result[0][0]

    def affordable(self, step_seconds):
        """Whether a trial at twice the batch of a ``step_seconds`` step, and measuring there, end before the
        deadline (a step's time grows with the batch)."""
        return time.time() + 2 * step_seconds * (1 + self.configuration.large_batch_steps) < self.configuration.deadline

    def grow_until_full(self, batch_1_seconds):
        """The largest of 2, 4, 8, ... up to ``--max_batch`` whose step fits, within the time left, or None."""
        largest, batch_size, step_seconds = None, 2, batch_1_seconds
        while batch_size <= self.configuration.max_batch and self.affordable(step_seconds):
            step_seconds = self.trial_step(batch_size)
            if step_seconds is None:
                break
            largest, batch_size = batch_size, batch_size * 2
        return largest

    def shrink_to_fit(self, batch_size):
        """``batch_size``, halved until a step fits; None if only batch 1 does or time runs out."""
        while batch_size > 1 and time.time() < self.configuration.deadline:
            if self.trial_step(batch_size) is not None:
                return batch_size
            batch_size //= 2
        return None

    def measure(self, batch_size, warmup, steps):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        result = self.timed_steps(batch_size, warmup + steps)
        if isinstance(result, str):
            return self.record(batch_size, result)
        times = [seconds for seconds, _ in result]
        step_seconds = statistics.median(times[warmup:])
        flops = self.configuration.flops_per_sample * batch_size
        tflops = flops / step_seconds / 1e12
        return self.record(
            batch_size, "ok", step_seconds=step_seconds, first_step_seconds=times[0], first_loss=result[0][1],
            samples_per_second=batch_size / step_seconds, flops_per_step=flops, tflops=tflops,
            share_of_peak=tflops / self.configuration.peak_tflops,
            peak_memory_bytes=torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None)


# --- the run: every configuration, isolated, within the budget ----------------------------------------------------

def read_records(path):
    if not Path(path).exists():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_isolated(configuration, records_path, timeout):
    """`Worker` in a child process of its own session, killed with everything it started (inductor compiles in
    worker processes) after ``timeout`` seconds. Returns None, or why it stopped early."""
    command = [sys.executable, "-m", "tests.benchmarks.device_throughput", "--worker",
               json.dumps(asdict(configuration)), "--records", str(records_path)]
    child = subprocess.Popen(command, cwd=REPOSITORY, start_new_session=True)
    try:
        code = child.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    finally:
        end_session(child)
    return None if code == 0 else f"crashed (exit code {code})"


def end_session(child):
    """Kill whatever is left of ``child``'s session (all of it, if this process is being stopped)."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def run_inline(configuration, records_path):
    try:
        Worker(configuration, records_path).run()
    finally:
        torch._dynamo.reset()  # the next configuration compiles afresh, as it would in a process of its own
    return None


def configurations(options):
    base = Configuration(
        model="", mode="eager", flops_per_sample=0, deadline=0.0, quantize_base="none", smoke=options.smoke,
        backend=options.backend or ("eager" if options.smoke else "inductor"), rank=options.rank,
        warmup=options.warmup, steps=options.steps, large_batch_steps=options.large_batch_steps,
        max_batch=options.max_batch, memory_limit_gb=options.memory_limit_gb, peak_tflops=options.peak_tflops)
    # eager first (fast, and compiled starts its batch search from eager's largest); NF4 last
    flops = {model: model_flops_per_sample(FAMILIES[model], FAMILIES[model].sizes["smoke" if options.smoke else "real"],
                                           options.rank) for model in options.models}
    planned = [replace(base, model=model, mode=mode, flops_per_sample=flops[model])
               for mode in options.modes for model in options.models]
    if "nf4" in options.quantize_base and "flux2_klein" in options.models:
        planned.append(replace(base, model="flux2_klein", quantize_base="nf4", flops_per_sample=flops["flux2_klein"]))
    return planned


def expected_cost(configuration):
    """A configuration's share of the time budget, relative to the others': compiling makes it about double."""
    return 2 if configuration.mode == "compiled" else 1


def eager_largest_batch(records, model):
    """The largest batch above 1 that eager measured for ``model``, or None."""
    largest = max((record["batch"] for record in records
                   if record["model"] == model and record["mode"] == "eager" and record["quantize_base"] == "none"
                   and record["status"] == "ok"), default=1)
    return largest if largest > 1 else None


def device_name():
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def number(value, digits):
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(records, options):
    lines = [f"# Training throughput on {device_name()}", "",
             f"{'bf16' if torch.cuda.is_available() else 'fp32'}, LoRA rank {options.rank}, gradient checkpointing, "
             f"{'tiny smoke configs' if options.smoke else '1024x1024'}; "
             f"largest batch within {options.memory_limit_gb:g} GB (cap {options.max_batch}); "
             f"share of {options.peak_tflops:g} TFLOP/s. Model FLOPs (no recompute). "
             f"Written by `tests/benchmarks/device_throughput.py`.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for record in records:
        peak = record.get("peak_memory_bytes")
        cells = [FAMILIES[record["model"]].label, record["mode"], record["quantize_base"], str(record["batch"]),
                 number(record.get("step_seconds"), 3), number(record.get("samples_per_second"), 2),
                 number(record.get("tflops"), 1),
                 "–" if record.get("share_of_peak") is None else f"{record['share_of_peak']:.1%}",
                 number(None if peak is None else peak / 1e9, 1), number(record.get("first_step_seconds"), 1),
                 record["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| model | batch (eager / compiled) | eager samples/s | compiled samples/s | compiled / eager "
              "| first loss (eager / compiled) |", "|---|---|---|---|---|---|"]
    for model in options.models:
        for kind, pick in (("1", min), ("largest", max)):
            eager, compiled = (pick((r for r in records if r["model"] == model and r["mode"] == mode
                                     and r["quantize_base"] == "none" and r["status"] == "ok"),
                                    key=lambda r: r["batch"], default=None) for mode in ("eager", "compiled"))
            if eager and compiled:
                # at batch 1 both start from the same weights and batch; after the batch search they do not
                losses = f"{eager['first_loss']:.5f} / {compiled['first_loss']:.5f}" if kind == "1" else "–"
                lines.append(f"| {FAMILIES[model].label} | {kind} ({eager['batch']} / {compiled['batch']}) | "
                             f"{eager['samples_per_second']:.2f} | {compiled['samples_per_second']:.2f} | "
                             f"{compiled['samples_per_second'] / eager['samples_per_second']:.2f}x | {losses} |")
    return "\n".join(lines) + "\n"


def write_results(records, options):
    slug = re.sub(r"[^a-z0-9]+", "_", device_name().lower()).strip("_")
    output_dir = Path(options.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    table = markdown(records, options)
    (output_dir / f"device_{slug}.md").write_text(table)
    settings = {key: value for key, value in vars(options).items() if key not in ("worker", "records")}
    (output_dir / f"device_{slug}.json").write_text(json.dumps(
        {"device": device_name(), "torch": torch.__version__, "settings": settings, "records": records}, indent=2))
    return table


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny configs (for a CPU): checks this script")
    parser.add_argument("--inline", action="store_true",
                        help="run the configurations in this process: no per-configuration timeout or isolation")
    parser.add_argument("--models", nargs="+", choices=sorted(FAMILIES), default=["sdxl", "flux2_klein"])
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    parser.add_argument("--quantize_base", nargs="+", choices=["none", "nf4"], default=["none", "nf4"],
                        help="nf4 adds klein at batch 1 with its frozen weights in NF4")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default: inductor; eager with --smoke)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps at batch 1")
    parser.add_argument("--large_batch_steps", type=int, default=3, help="timed steps at the largest batch")
    parser.add_argument("--max_batch", type=int, default=32)
    parser.add_argument("--memory_limit_gb", type=float, default=80.0)
    parser.add_argument("--peak_tflops", type=float, default=989.0, help="the GPU's dense bf16 peak")
    parser.add_argument("--budget_s", type=float, default=440.0,
                        help="seconds for all configurations, shared by expected cost (compiled: twice eager's); "
                             "each runs in a process killed at the end of its share")
    parser.add_argument("--output_dir", default=str(REPOSITORY / "tests" / "benchmarks" / "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a Configuration as JSON: run it (run_isolated)
    parser.add_argument("--records", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    options = parse_args(argv)
    if options.worker:
        Worker(Configuration(**json.loads(options.worker)), options.records).run()
        return None
    if not options.inline:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds, so that the running worker is killed too
    started = time.time()
    deadline = started + options.budget_s
    planned = configurations(options)
    records = []
    with tempfile.TemporaryDirectory() as scratch:
        for index, configuration in enumerate(planned):
            # what is left, shared among the configurations left by their expected cost
            share = ((deadline - time.time()) * expected_cost(configuration)
                     / sum(expected_cost(later) for later in planned[index:]))
            configuration = replace(configuration, deadline=time.time() + share - 10,
                                    batch_hint=(eager_largest_batch(records, configuration.model)
                                                if configuration.mode == "compiled" else None))
            records_path = Path(scratch) / f"{index}.jsonl"
            if share < 30:
                stopped = "skipped: out of time"
            elif options.inline:
                stopped = run_inline(configuration, records_path)
            else:
                stopped = run_isolated(configuration, records_path, share)
            records += read_records(records_path)
            if stopped:
                records.append({"model": configuration.model, "mode": configuration.mode,
                                "quantize_base": configuration.quantize_base, "batch": "–", "status": stopped})
            table = write_results(records, options)
    print(table)
    print(f"{time.time() - started:.0f} s in all")
    return records


if __name__ == "__main__":
    main()
