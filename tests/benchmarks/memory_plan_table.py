"""The memory plan's estimates for each family at its real size: the table of docs/memory.md's "## Memory plan".

    python -m tests.benchmarks.memory_plan_table                       # prints the table (a minute on a CPU)
    python -m tests.benchmarks.memory_plan_table --write docs/memory.md   # and puts it in the page's section,
                                                                         # and in the README's memory section

Each family's script runs with ``--print_memory_plan`` (in this process, on the meta device: no weights exist) on a
pipeline folder of its released configs (`real_configs.real_pipeline`), as a LoRA run would be launched: a rank-16
LoRA on the script's default layers, gradient checkpointing, batch 1, bf16, an EMA of the adapter on the
accelerator, at 1024x1024 (video: 49 frames at 480x832's area, ``--resolution 632``), in bf16 and with
``--quantize_base int8``, and ``--gpu_memory_gb 24``: the plan names the fewest blocks to swap that fit 24 GB.
"""

import argparse
import functools
import importlib.util
import re
import tempfile
from pathlib import Path

import diffusers
import torch
from accelerate import init_empty_weights
from accelerate.state import AcceleratorState

from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_lora
from training_utils.block_swap import repeated_blocks
from training_utils.memory_plan import (GB, TEXT_TOKENS, activation_bytes, hidden_size, make_plan,
                                        optimizer_state_bytes, parameter_bytes, swapped_off, tensor_bytes,
                                        training_bytes)
from training_utils.outputs.run_status import RunRecord
from training_utils.testing.tiny import build

from tests.benchmarks.real_configs import FAMILIES, TRANSFORMER_ONLY, real_pipeline

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GPU_MEMORY_GB = 24
SECTION = "## Memory plan"
SCHEMES = (None, "int8")


@functools.cache
def import_script(script):
    """The module of ``examples/<script>`` (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan_argv(model, pipeline, tiny, output_dir, scheme, gpu_memory_gb=GPU_MEMORY_GB, image_resolution=1024,
              video_resolution=632, num_frames=49, extra=()):
    """The flags of a LoRA run of ``model`` (a `real_configs.RealModel`) on ``pipeline`` that only plans."""
    if model.video:
        data = ["--train_data_dir", tiny / "moving_shapes", "--num_frames", num_frames,
                "--resolution", video_resolution]
    else:
        data = ["--instance_data_dir", tiny / "instance", "--instance_prompt", "a photo of sks triangle",
                "--resolution", image_resolution]
    if model.fixture == "hidream":
        data += ["--pretrained_text_encoder_4_name_or_path", pipeline / "text_encoder_4",
                 "--pretrained_tokenizer_4_name_or_path", pipeline / "tokenizer_4"]
    return [str(value) for value in [
        "--pretrained_model_name_or_path", pipeline, *data, "--output_dir", output_dir, "--rank", 16,
        "--gradient_checkpointing", "--mixed_precision", "bf16", "--use_ema", "--report_to", "none",
        "--gpu_memory_gb", gpu_memory_gb, *(["--quantize_base", scheme] if scheme else []), *extra]]


def fresh_accelerate_state():
    """Forget the accelerate state that an earlier run in this process left (its mixed precision, for one): every
    `Accelerator` shares it, and each run made here must make its own, as a process of its own would."""
    AcceleratorState._reset_state(reset_partial_state=True)


def plan_of(model, argv):
    """The memory plan of ``model``'s script with ``argv``, made in this process."""
    module = import_script(model.script)
    fresh_accelerate_state()
    return make_plan(module.main, module.parse_args(argv), RunRecord())


def real_plans(work_dir, families=None, schemes=SCHEMES, **sizes):
    """``{(family, scheme): plan}`` for each family at real size."""
    work_dir = Path(work_dir)
    tiny = work_dir / "tiny"
    if not tiny.exists():
        build(tiny, ["instance", "moving_shapes", *{FAMILIES[family].fixture for family in families or FAMILIES}])
    plans = {}
    for family in families or FAMILIES:
        model = FAMILIES[family]
        pipeline = real_pipeline(family, work_dir / family, tiny)
        for scheme in schemes:
            plans[family, scheme] = plan_of(model, plan_argv(model, pipeline, tiny, work_dir / "out", scheme,
                                                             **sizes))
    return plans


def transformer_only_row(model, resolution=632, num_frames=49, rank=16, budget=GPU_MEMORY_GB * GB):
    """A table row for a `real_configs.TransformerOnly` family: the training phase of the same LoRA run, planned with
    `memory_plan`'s own pieces on its transformer alone (no text encoder, no pipeline), bf16 and int8."""
    with init_empty_weights():
        transformer = getattr(diffusers, model.class_name).from_config(model.config)
    add_lora(transformer, rank, ATTENTION_PROJECTIONS)
    for parameter in transformer.parameters():
        parameter.data = parameter.data.float() if parameter.requires_grad else parameter.data.to(torch.bfloat16)
    trained = [parameter for parameter in transformer.parameters() if parameter.requires_grad]
    trainable = sum(tensor_bytes(parameter) for parameter in trained)
    side = -(-resolution // model.spatial)
    tokens = side * side * ((num_frames - 1) // model.temporal + 1) + TEXT_TOKENS
    blocks = repeated_blocks(transformer)
    activations = activation_bytes([(tokens, hidden_size(transformer.config))] * len(blocks), 1, torch.bfloat16, True)
    cells = []
    for scheme in SCHEMES:
        def frozen(module):
            return parameter_bytes(module, scheme) - sum(tensor_bytes(parameter) for parameter in module.parameters()
                                                         if parameter.requires_grad)

        def peak(blocks_to_swap):
            resident = frozen(transformer) - swapped_off(transformer, blocks_to_swap, frozen)
            return training_bytes(resident, trainable, optimizer_state_bytes(trained), trainable, activations)

        fit = next((count for count in range(len(blocks) + 1) if peak(count) <= budget), None)
        cells += [f"{gb(peak(0))} / –",
                  "none fits" if fit is None else f"{fit} of {len(blocks)}: {gb(peak(fit))} (training)"]
    parameters = sum(parameter.numel() for parameter in transformer.parameters())  # as the plans count (adapter too)
    return (f"| {model.title} ({num_frames} frames at {resolution}², transformer only) | {parameters / 1e9:.1f}B "
            f"| – | " + " | ".join(cells) + " |")


def gb(value):
    return f"{value / GB:.1f}"


def fewest_swapped(plan, scheme):
    """The plan's fewest blocks to swap that fit, for the run's own quantisation (else "none fits")."""
    fit = plan["smallest_fit"]
    if fit is None or fit["quantize_base"] != scheme:
        return "none fits"
    return f"{fit['blocks_to_swap']} of {plan['repeated_blocks']}: {gb(fit['accelerator_peak_bytes_estimate'])}"


def markdown(plans):
    """The table: per family, the transformer and text encoders' sizes and, for bf16 and int8, the peak without
    swapping (training; the encoding phase's beside it) and the fewest blocks to swap that fit."""
    lines = [f"| model | transformer parameters | text encoders (bf16) | bf16: peak (training / encoding) | bf16: "
             f"fewest blocks swapped for {GPU_MEMORY_GB} GB | int8: peak (training / encoding) | int8: fewest blocks "
             f"swapped for {GPU_MEMORY_GB} GB |",
             "|---|---|---|---|---|---|---|"]
    for family, model in FAMILIES.items():
        if (family, None) not in plans:
            continue
        cells = []
        for scheme in SCHEMES:
            plan = plans[family, scheme]
            phases = plan["accelerator_peak_bytes_estimate_by_phase"]
            cells += [f"{gb(phases['training'])} / {gb(phases['encoding'])}", fewest_swapped(plan, scheme)]
        components = plans[family, None]["components"]
        encoders = sum(entry["bytes"] for name, entry in components.items() if name.startswith("text_encoder"))
        sizes = plans[family, None]["activations_bytes_estimate"]
        size = f"{sizes['frames']} frames at {sizes['resolution']}²" if model.video else f"{sizes['resolution']}²"
        parameters = components["transformer"]["parameters"]
        lines.append(f"| {model.title} ({size}) | {parameters / 1e9:.1f}B | {gb(encoders)} "
                     f"| " + " | ".join(cells) + " |")
    lines += [transformer_only_row(model) for model in TRANSFORMER_ONLY.values()]
    return "\n".join(lines)


INTRO = f"""{SECTION}

`--print_memory_plan` prints what a run would hold, from the configs alone, and exits (nothing is loaded); with
`--gpu_memory_gb G` it names the fewest `--blocks_to_swap` (and quantisation) that fit, and a real run that would
not fit stops before loading, in one line, unless `--ignore_memory_plan`. Parameter, optimizer and EMA bytes are
counted as the run allocates them (`tests/test_memory_plan.py` checks them against real runs of the tiny models);
activations and the peak are **estimates**, not yet checked on a GPU (`tests/benchmarks/device.sh memory` will
measure them beside the plan; no GPU figure exists yet). What the plan counts: `training_utils/memory_plan.py`.

```
python examples/dreambooth/train_dreambooth_lora_qwen_image.py --pretrained_model_name_or_path ./Qwen-Image \\
  --instance_data_dir dog --instance_prompt "a photo of sks dog" --resolution 1024 --mixed_precision bf16 \\
  --gradient_checkpointing --use_ema --print_memory_plan --gpu_memory_gb 24
```

prints `components` (each with `parameters`, `bytes` at the run's dtype and quantisation, and `device`),
`trainable_parameters`, `optimizer_state_bytes`, `ema_bytes`, `activations_bytes_estimate` (with and without
gradient checkpointing, at the run's resolution, frame count and batch size), `blocks_to_swap`,
`accelerator_peak_bytes_estimate` (and `…_by_phase`: training, encoding), and with `--gpu_memory_gb` whether it
`fits` and the `smallest_fit` (`blocks_to_swap`, `quantize_base`, its peak), or `null` where nothing does. The
memory plan flags are the LoRA scripts' (every script with an adapter); the full fine-tune and ControlNet scripts
do not have them yet.

**Estimates**, GB = 10⁹ bytes, of a rank-16 LoRA with an EMA, gradient checkpointing, batch 1, bf16, made by
`python -m tests.benchmarks.memory_plan_table --write docs/memory.md` from the released configs
(`tests/benchmarks/real_configs.py`). *Training*: the frozen weights on the accelerator (less the swapped blocks,
but for two), the adapter, its gradients, AdamW's state, the EMA and the activations. *Encoding*: the frozen weights
and the adapter while the text encoders run, once, before training (with `--feature_cache_dir` they run once ever;
`--quantize_text_encoders` shrinks them). The fewest blocks swapped are the plan's answer for both phases, so a
text encoder larger than the card leaves none that fits. LTX-2 and HunyuanVideo 1.5 have classes in diffusers
0.42.1 but no training script here yet: their rows plan the same LoRA (on the attention projections) on the
transformer alone, the training phase only (no encoders, no prompt encoding).

"""


def write_section(page, table):
    """Put the section (`INTRO` and ``table``) into ``page``, replacing the section there, else appending it."""
    page = Path(page)
    text = page.read_text() if page.exists() else "# Memory\n"
    section = INTRO + table + "\n"
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = (pattern.sub(lambda found: section + ("\n" if found.end() < len(text) else ""), text) if pattern.search(text)
            else text.rstrip("\n") + "\n\n" + section)
    page.write_text(text)


# The table's first line, wherever a page shows it.
TABLE_START = "| model | transformer parameters |"
README = Path(__file__).resolve().parents[2] / "README.md"


def replace_table(page, table):
    """Put ``table`` in place of the table that ``page`` shows already (the README's copy of the section's)."""
    page = Path(page)
    pattern = re.compile(rf"^{re.escape(TABLE_START)}.*?(?=\n\n|\Z)", re.S | re.M)
    text = page.read_text()
    if not pattern.search(text):
        raise ValueError(f"{page} shows no memory plan table to replace")
    page.write_text(pattern.sub(lambda found: table, text, count=1))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", default=None,
                        help="the page whose section to write (docs/memory.md); the README's copy is replaced too")
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work_dir:
        table = markdown(real_plans(work_dir, args.families))
    print(table)
    if args.write:
        write_section(args.write, table)
        replace_table(README, table)


if __name__ == "__main__":
    main()
