"""The end of a run: the model card, the optional upload to the hub, and where everything went.

The model card, written into every output folder, says how to load what was trained and shows the last
validation's images.
"""

import json
from pathlib import Path

from ..names import STAGING_PREFIX
from .writing import write_atomically

LORA_HOW_TO_LOAD = """
from diffusers import {imports}

pipe = {pipeline_class}.from_pretrained("{base_model}"{load_options})
pipe.load_lora_weights("{output_dir}")            # or "{output_dir}/ema" for the EMA adapter
image = pipe("{prompt}").images[0]
"""
# A LoRA that the trained model itself loads (`adapters.export.ModelLoraExport`): the export fills in {component}.
MODEL_LORA_HOW_TO_LOAD = """
from diffusers import {imports}

pipe = {pipeline_class}.from_pretrained("{base_model}"{load_options})
pipe.{component}.load_lora_adapter("{output_dir}", prefix=None, use_safetensors=True)  # or "{output_dir}/ema"
output = pipe("{prompt}")
"""

# LoKr, LoHa and OFT, in peft's own format: PeftModel.from_pretrained adds each component's adapter to the pipeline's
# module in place. The export fills in {components} (`adapters.export.PeftExport.loading_code`).
PEFT_HOW_TO_LOAD = """
from diffusers import {imports}
from peft import PeftModel

pipe = {pipeline_class}.from_pretrained("{base_model}"{load_options})
for component in {components}:  # or "{output_dir}/ema/" + component for the EMA adapter
    PeftModel.from_pretrained(getattr(pipe, component), "{output_dir}/" + component)
image = pipe("{prompt}").images[0]
"""

# A full fine-tune's pipeline folder, and where it has an EMA, the EMA denoiser (UNet or transformer) swapped in.
FINE_TUNE_HOW_TO_LOAD = """
from diffusers import {pipeline_class}, {model_class}

pipe = {pipeline_class}.from_pretrained("{output_dir}")
{swap_in_ema}image = pipe("{prompt}").images[0]
"""
EMA_SWAP = """# the EMA {model} instead of the raw one:
pipe.{model} = {model_class}.from_pretrained("{output_dir}/ema/{model}")
"""
VIDEO_LORA_HOW_TO_LOAD = """
from diffusers import {imports}
from diffusers.utils import export_to_video

pipe = {pipeline_class}.from_pretrained("{base_model}"{load_options})
{load_lora}
video = pipe(prompt="{prompt}", num_frames={num_frames}).frames[0]
export_to_video(video, "video.mp4", fps={fps})
"""


def write_model_card(output_dir, base_model, title, how_to_load, records=(), captions=()):
    """``README.md`` in ``output_dir``: base model, how to load, a few of the training ``captions`` (if given), and
    for each validation prompt its progress grid (each variant at every validated step) and the last validation's
    grid (every image of every variant).

    ``base_model`` is None for a model trained from scratch.

    ``records`` are the last validation's log records (``Validator`` returns them); their image paths are
    relative to ``output_dir``, so the card's pictures show on the hub and on disk alike.
    """
    lines = [
        "---",
        *([f"base_model: {base_model}"] if base_model is not None else []),
        "library_name: diffusers",
        "tags: [diffusers, text-to-image, training_utils]",
        "---",
        "",
        f"# {title}",
        "",
        f"Trained from `{base_model}`." if base_model is not None else "Trained from scratch.",
        "",
        "## How to load",
        "",
        "```python",
        how_to_load.strip(),
        "```",
    ]
    if captions:
        lines += ["", "## Training captions", "", *(f"- {json.dumps(caption)}" for caption in captions)]
    if records:
        lines += ["", f"## Validation at step {records[-1]['step']}", ""]
        guidance = [f"{name} {records[-1][name]:g}" for name in ("guidance_scale", "true_cfg_scale")
                    if records[-1].get(name) is not None]
        if guidance:
            lines += [f"Rendered at {', '.join(guidance)}.", ""]
        shown_grids = set()
        for record in records:
            if "grid" not in record:  # an input shown as it is (a ControlNet's conditioning image)
                lines += [f"**{record['variant']}**, *{record['prompt']}*", "",
                          " ".join(f"![{record['variant']}]({path})" for path in record["images"]), ""]
            elif record["grid"] not in shown_grids:
                shown_grids.add(record["grid"])
                prompt = f"*{record['prompt']}*" if record["prompt"] else "Unconditional samples"
                lines += [f"{prompt}: each variant over the run, then at the last step", "",
                          f"![progress]({record['progress']})", "", f"![step {record['step']}]({record['grid']})", ""]
    text = "\n".join(lines) + "\n"
    write_atomically(output_dir, lambda staging: Path(staging, "README.md").write_text(text))
    return Path(output_dir) / "README.md"


def push_to_hub(output_dir, hub_model_id, hub_token=None, private=False):
    """Upload ``output_dir`` (without checkpoints) to ``hub_model_id``, creating the repo if needed (``private``: as
    a private one)."""
    from huggingface_hub import create_repo, upload_folder

    repo_id = create_repo(hub_model_id or Path(output_dir).resolve().name, exist_ok=True, token=hub_token,
                          private=private).repo_id
    upload_folder(repo_id=repo_id, folder_path=output_dir, token=hub_token,
                  ignore_patterns=["checkpoint-*", f"{STAGING_PREFIX}*", "logs/*"])
    return repo_id


def how_to_load(template, args, pipe, **fields):
    """The model card's loading code: ``template`` (e.g. `LORA_HOW_TO_LOAD`) with ``pipeline_class`` (``pipe``'s
    class), ``base_model``, ``output_dir`` and ``prompt`` (the first validation prompt) filled in, and
    ``imports`` (the pipeline class) and ``load_options`` (none) unless ``fields`` give them or others."""
    pipeline_class = type(pipe).__name__
    defaults = {"pipeline_class": pipeline_class, "imports": pipeline_class, "load_options": "",
                "base_model": args.pretrained_model_name_or_path, "output_dir": args.output_dir,
                "prompt": args.validation_prompt[0] if args.validation_prompt else "a photo"}
    return template.format(**{**defaults, **fields})


def fine_tuned_unet_how_to_load(args, pipe, ema, **fields):
    """`fine_tuned_how_to_load` of a full UNet fine-tune."""
    return fine_tuned_how_to_load(args, pipe, ema, "unet", **fields)


def fine_tuned_how_to_load(args, pipe, ema, model, template=FINE_TUNE_HOW_TO_LOAD, **fields):
    """The model card's loading code of a full fine-tune of ``pipe``'s component ``model`` ("unet", "transformer"):
    the pipeline folder, and the EMA model swapped in where the run kept an EMA (``ema``, or None); ``template``
    with the fields of `FINE_TUNE_HOW_TO_LOAD` (a Control pipeline's adds its conditioning image) and ``fields`` as
    `how_to_load`'s (a DreamBooth run's prompt)."""
    model_class = type(getattr(pipe, model)).__name__
    swap_in_ema = (EMA_SWAP.format(output_dir=args.output_dir, model=model, model_class=model_class)
                   if ema is not None else "")
    return how_to_load(template, args, pipe, swap_in_ema=swap_in_ema, model_class=model_class, **fields)


def finish_run(args, title, how_to_load, records, saved, what, captions=()):
    """The end every script shares, on the main process: the model card (with a few training ``captions``, if
    given), the upload if asked, and where everything went. ``saved`` maps each variant ("raw", "ema") of ``what``
    ("LoRA") to its written path."""
    write_model_card(args.output_dir, args.pretrained_model_name_or_path, title, how_to_load, records, captions)
    if args.push_to_hub:
        push_to_hub(args.output_dir, args.hub_model_id, args.hub_token, getattr(args, "hub_private_repo", False))
    for variant, path in saved.items():
        print(f"{variant} {what}: {path}")
    if records:
        print(f"validation images: {Path(args.output_dir) / 'validation'} (log.jsonl lists them)")
    if args.ema_posthoc_sigma_rels:
        print(f"post-hoc EMA snapshots: {Path(args.output_dir) / 'posthoc_ema'}; choose a length with "
              f"python -m training_utils.posthoc_ema --output_dir {args.output_dir} --sigma_rel 0.08")
