"""The model card written into every output directory, and the optional upload to the hub."""

from pathlib import Path


def write_model_card(output_dir, base_model, title, how_to_load, records=()):
    """``README.md`` in ``output_dir``: base model, how to load, and the last validation's images.

    ``records`` are the validation log records (``Validator`` returns them); their image paths are
    relative to ``output_dir``, so the card's pictures show on the hub and on disk alike.
    """
    lines = [
        "---",
        f"base_model: {base_model}",
        "library_name: diffusers",
        "tags: [diffusers, text-to-image, training_utils]",
        "---",
        "",
        f"# {title}",
        "",
        f"Trained from `{base_model}`.",
        "",
        "## How to load",
        "",
        "```python",
        how_to_load.strip(),
        "```",
    ]
    if records:
        lines += ["", f"## Validation at step {records[-1]['step']}", ""]
        for record in records:
            lines.append(f"**{record['variant']}**, *{record['prompt']}*")
            lines.append("")
            lines.append(" ".join(f"![{record['variant']}]({path})" for path in record["images"]))
            lines.append("")
    path = Path(output_dir) / "README.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def push_to_hub(output_dir, hub_model_id, hub_token=None):
    """Upload ``output_dir`` (without checkpoints) to ``hub_model_id``, creating the repo if needed."""
    from huggingface_hub import create_repo, upload_folder

    repo_id = create_repo(hub_model_id or Path(output_dir).resolve().name, exist_ok=True, token=hub_token).repo_id
    upload_folder(repo_id=repo_id, folder_path=output_dir, token=hub_token,
                  ignore_patterns=["checkpoint-*", ".checkpoint-*", "logs/*"])
    return repo_id


def finish_run(args, title, how_to_load, records, saved):
    """The end every script shares, on the main process: the model card, the upload if asked,
    and where everything went. ``saved`` maps a description ("raw LoRA") to a written path."""
    write_model_card(args.output_dir, args.pretrained_model_name_or_path, title, how_to_load, records)
    if args.push_to_hub:
        push_to_hub(args.output_dir, args.hub_model_id, args.hub_token)
    for description, path in saved.items():
        print(f"{description}: {path}")
    if records:
        print(f"validation images: {Path(args.output_dir) / 'validation'} (log.jsonl lists them)")
    if args.ema_posthoc_sigma_rels:
        print(f"post-hoc EMA snapshots: {Path(args.output_dir) / 'posthoc_ema'}; choose a length with "
              f"python -m training_utils.posthoc_ema --output_dir {args.output_dir} --sigma_rel 0.08")
