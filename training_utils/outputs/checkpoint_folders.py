"""The checkpoints in an output folder: which are complete, which one ``--resume_from_checkpoint`` names, whether it
is whole (its manifest, `manifest`), and which trajectory wrote it (the flags that decide the training trajectory,
recorded in each checkpoint's ``training_state.json``).
"""

import json
import logging
import re
from pathlib import Path

from ..errors import UsageError
from ..names import MANIFEST_FILE, STATE_FILE
from .manifest import check_manifest

logger = logging.getLogger(__name__)

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
# Checkpoints from format 2 on hold a manifest and their own random states.
CHECKPOINT_FORMAT = 3

# The flags that leave the training trajectory alone (where outputs go, what is logged and validated, checkpoint
# cadence, how long to go on, memory and loading options); every other flag is recorded in each checkpoint, and
# resuming with another value is refused unless --resume_with_changed_args.
TRAJECTORY_FREE_FLAGS = {
    "output_dir", "overwrite_output_dir", "logging_dir", "report_to", "tracker_project_name", "push_to_hub",
    "hub_token", "hub_model_id",
    "validation_prompt", "validation_image", "val_image_url", "num_validation_images", "validation_steps",
    "validation_epochs",
    "validation_inference_steps", "validation_height", "validation_width", "validation_sigma_rels",
    "validation_num_frames", "validation_fps", "validation_images",
    "validation_gen_length", "validation_temperature", "validation_use_chat_template",
    "checkpointing_steps", "checkpoints_total_limit",
    "resume_from_checkpoint", "resume_with_changed_args", "max_train_steps", "num_train_epochs",
    "dataloader_num_workers", "feature_cache_dir", "offload", "cache_dir", "skip_corrupt_images",
    "gradient_checkpointing", "torch_compile", "ema_posthoc_snapshot_steps", "sample_batch_size",
    "class_inference_steps", "fsdp_text_encoder", "blocks_to_swap",
}

# The flags that decide which tensors train (the adapter's kind and shape): a checkpoint of other values holds other
# tensors, which no run can load, --resume_with_changed_args or not.
TRAINED_TENSOR_FLAGS = ("adapter", "rank", "lokr_factor", "lokr_decompose_both", "oft_block_size")


def trajectory_flags(args):
    """The run's flags that decide its training trajectory, as JSON values by flag name."""
    return {name: json.loads(json.dumps(value, default=str)) for name, value in sorted(vars(args).items())
            if name not in TRAJECTORY_FREE_FLAGS}


def check_same_trained_tensors(path, saved, trajectory, spellings):
    """Refuse in one line, before anything loads, a checkpoint ``path`` whose run (its trajectory flags ``saved``)
    trained other tensors than this one's (`TRAINED_TENSOR_FLAGS`), naming the flags that resume it."""
    changed = [name for name in TRAINED_TENSOR_FLAGS if name in saved and saved[name] != trajectory.get(name)]
    if not changed:
        return
    spelled = {name: spellings.get(name, f"--{name}") for name in TRAINED_TENSOR_FLAGS}
    described = "; ".join(f"{spelled[name]} was {saved[name]!r}, now {trajectory.get(name)!r}" for name in changed)
    resuming = " ".join(spelled[name] if saved[name] is True else f"{spelled[name]} {saved[name]}"
                        for name in TRAINED_TENSOR_FLAGS if saved.get(name) not in (None, False))
    raise UsageError(spelled[changed[0]], trajectory.get(changed[0]),
                     f"the adapter that {path} holds ({described}): not even --resume_with_changed_args changes "
                     f"what trains; pass {resuming} to go on with it, or start a new run without "
                     f"--resume_from_checkpoint")


def complete_checkpoints(output_dir):
    """``[(step, path)]`` of the complete checkpoints under ``output_dir``, oldest first."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = []
    for path in output_dir.iterdir():
        match = CHECKPOINT_PATTERN.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def resolve_checkpoint(value, output_dir):
    """The checkpoint folder that ``--resume_from_checkpoint value`` means, or None to start fresh.

    "latest" is the newest complete checkpoint under ``output_dir`` (None when there is none);
    anything else is a path, or a name under ``output_dir``, and must exist.
    """
    if value is None:
        return None
    if value == "latest":
        checkpoints = complete_checkpoints(output_dir)
        return checkpoints[-1][1] if checkpoints else None
    for candidate in (Path(value), Path(output_dir) / value):
        if (candidate / STATE_FILE).is_file():
            return candidate
    raise UsageError("--resume_from_checkpoint", value,
                     f'"latest", or a checkpoint folder (a path, or a name under {output_dir}) holding {STATE_FILE}')


def checkpoint_problem(path):
    """What makes the checkpoint folder ``path`` unfit to resume from, or None. A checkpoint written before
    checkpoints held a manifest is taken as it is, with a warning."""
    try:
        state = json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError) as error:
        return f"{STATE_FILE} is unreadable ({error})"
    if state.get("format", 1) < CHECKPOINT_FORMAT and not (Path(path) / MANIFEST_FILE).exists():
        logger.warning(f"{path} has no manifest (it was written before checkpoints were verified): "
                       f"resuming from it unverified")
        return None
    return check_manifest(path)


def choose_checkpoint(value, output_dir):
    """The checkpoint ``--resume_from_checkpoint value`` resumes from, checked whole, or None to start fresh.

    "latest" passes over damaged checkpoints, saying why, to the newest whole one; a named checkpoint that is
    damaged is an error, as is a folder of checkpoints none of which is whole."""
    if value != "latest":
        path = resolve_checkpoint(value, output_dir)
        problem = path and checkpoint_problem(path)
        if problem:
            raise UsageError("--resume_from_checkpoint", value, f"a whole checkpoint: in {path}, {problem}")
        return path
    checkpoints = complete_checkpoints(output_dir)
    for _, path in reversed(checkpoints):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        logger.warning(f"not resuming from {path}: {problem}; trying the one before")
    if checkpoints:
        raise UsageError("--resume_from_checkpoint", value,
                         f"a whole checkpoint under {output_dir}: none of the {len(checkpoints)} there is")
    return None


def check_resume_from_checkpoint(value, output_dir):
    """Fail before anything loads if ``--resume_from_checkpoint`` names a checkpoint that does not exist
    ("latest" may find none: the run then starts fresh)."""
    if value not in (None, "latest"):
        resolve_checkpoint(value, output_dir)


def recorded_trajectory(path):
    """The trajectory flags that the checkpoint folder ``path`` recorded ({} for one that recorded none), or None
    if its ``training_state.json`` cannot be read."""
    try:
        return json.loads((Path(path) / STATE_FILE).read_text()).get("trajectory", {})
    except (OSError, ValueError, AttributeError):
        return None
