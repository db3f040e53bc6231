"""Smoke tests for a training script: run it for a few steps on the tiny offline models and check what it wrote.

A script copied from ``examples/`` keeps its smoke test beside it: for ``train_text_to_image_lora.py``, this
``test_train_text_to_image_lora.py`` (run with ``pytest``; no network, a CPU is enough, about a minute)::

    from pathlib import Path

    from training_utils.testing import (assert_lora_changes_pipeline_output, assert_validated_at, launch_script,
                                        tiny_fixture)


    def test_train_text_to_image_lora(tmp_path):
        model, data, out = tiny_fixture("sd", tmp_path), tiny_fixture("shapes", tmp_path), tmp_path / "out"
        launch_script(Path(__file__).with_name("train_text_to_image_lora.py"), "--pretrained_model_name_or_path",
                      model, "--train_data_dir", data, "--output_dir", out, "--resolution", 32, "--max_train_steps",
                      2, "--learning_rate", 1e-3, "--validation_prompt", "a red circle", "--validation_steps", 1)
        assert_validated_at(out, steps=[1, 2])
        assert_lora_changes_pipeline_output(model, out)

`launch_script` runs the script with ``accelerate launch`` on the CPU, offline, bounded in time, and raises with
the end of its output if it fails. The checks read the output directory's documented layout: the LoRA file or model
folders, ``validation/log.jsonl`` and ``checkpoint-<step>/``. Nothing here needs pytest: a failed check raises
`AssertionError`.
"""

import collections
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from . import tiny
from .validation import read_log

# A tiny run takes seconds; one that has not finished after this long hangs.
RUN_TIMEOUT_S = 300
# What every launched run gets on top of the caller's environment: offline, quiet and single-threaded (the tiny
# models gain nothing from more threads), and Python's stacks on SIGABRT, which `run_with_timeout` sends to a hung run.
SMOKE_TEST_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
    "OMP_NUM_THREADS": "1",
    "PYTHONFAULTHANDLER": "1",
}


def tiny_fixture(name, directory):
    """Build the tiny fixture ``name`` of `training_utils.tiny` (e.g. "sd", "sdxl", "sd3", "controlnet",
    "sdxl_controlnet" pipelines and models, "shapes", "shapes_controlnet", "instance" datasets) in
    ``directory/name``, and return that path. Random weights with a fixed seed: the same fixture every time."""
    if name not in tiny.FIXTURES:
        raise ValueError(f"unknown tiny fixture {name!r}; expected one of {', '.join(tiny.FIXTURES)}")
    return tiny.build(directory, [name])[name]


def free_port():
    """A TCP port nothing listens on now, for one multi-process run's rendezvous: sharing the default port
    with another run (a leftover, or another job on this machine) could join the wrong one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch_command(script, *args, processes=1, quiet=False):
    """The ``accelerate launch`` command that runs ``script`` with ``args`` on ``processes`` CPU processes (gloo,
    on a free port of the loopback interface, when more than one). ``quiet`` drops accelerate's own traceback
    after a failing script, leaving the script's output alone."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1", "--mixed_precision", "no",
               "--dynamo_backend", "no", "--num_processes", str(processes)]
    if processes > 1:
        command += ["--multi_gpu", "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    if quiet:
        command += ["--quiet"]
    return [*command, str(script), *map(str, args)]


def launch_environment(processes=1, env=None):
    """The environment of a launched run: this process's, `SMOKE_TEST_ENV`, then ``env``. Several processes
    are kept on the CPU and talk over loopback, whatever this machine's hostname resolves to."""
    environment = {**os.environ, **SMOKE_TEST_ENV}
    if processes > 1:
        environment["ACCELERATE_USE_CPU"] = "1"
        if "lo" in dict(socket.if_nameindex()).values():
            environment["GLOO_SOCKET_IFNAME"] = "lo"
    return {**environment, **(env or {})}


def run_captured(command, env=None, timeout=RUN_TIMEOUT_S, cwd=None, stop=None):
    """``(result, stopped)``: ``command``'s `subprocess.CompletedProcess`, its output captured, and None; or, if it
    was still running after ``timeout`` seconds, what ``stop(process, stderr_file)`` returned when it ended it (by
    default SIGABRT, then SIGKILL, to every process of the run, returning True).

    Output goes to files rather than pipes, so that a worker outliving its launcher cannot block the read.
    """
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True,
                                   env=env, cwd=cwd)
        try:
            process.wait(timeout)
            stopped = None
        except subprocess.TimeoutExpired:
            stopped = (stop or _stop)(process, stderr)
            process.wait()
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read()), stopped


def run_with_timeout(command, env=None, timeout=RUN_TIMEOUT_S, cwd=None):
    """``subprocess.run(command)`` with its output captured, given up after ``timeout`` seconds (`run_captured`):
    with ``PYTHONFAULTHANDLER`` set, as `SMOKE_TEST_ENV` sets it, each process of a hung run prints its Python
    stacks, and an `AssertionError` gives the end of the output."""
    result, stopped = run_captured(command, env, timeout, cwd)
    if stopped is not None:
        raise AssertionError(f"no result within {timeout} s (a hang?); the end of its output:\n"
                             f"{result.stdout[-2000:]}\n{result.stderr[-8000:]}")
    return result


def _stop(process, log):
    """`run_captured`'s default stop: SIGABRT to ``process`` and its descendants (torchrun starts its workers in
    sessions of their own, out of reach of a process-group kill), up to 5 s for them to print their stacks and
    end, then SIGKILL to what is left."""
    tree = [process.pid, *_descendants(process.pid)]
    _send(tree, signal.SIGABRT)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (process.poll() is None or any(map(_running, tree[1:]))):
        time.sleep(0.05)
    if process.poll() is None:
        process.kill()
    _send(filter(_running, tree[1:]), signal.SIGKILL)  # an ended process's pid may be another's by now
    return True


def _send(pids, signal_number):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal_number)


def _running(pid):
    """Whether ``pid`` exists and is no zombie, as ``/proc`` says."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid):
    """The pids of ``pid``'s descendants, as ``/proc`` lists them (Linux; elsewhere none are found)."""
    children = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name in parentheses may hold spaces
            children[parent].append(int(stat.parent.name))
    found, pending = [], [pid]
    while pending:
        descendants = children[pending.pop()]
        found += descendants
        pending += descendants
    return found


def launch_script(script, *args, processes=1, timeout=RUN_TIMEOUT_S, check=True, quiet=False, env=None,
                  run=run_with_timeout):
    """Run ``script`` (a path) with ``args`` through ``accelerate launch`` on ``processes`` CPU processes, offline,
    within ``timeout`` seconds; returns the `subprocess.CompletedProcess`. With ``check``, a failed run raises
    `AssertionError` with the end of its output. ``env`` adds variables (see `launch_environment`); ``run``, called
    as ``run(command, env, timeout)``, replaces `run_with_timeout`, e.g. by one that reports more of a hang."""
    result = run(launch_command(script, *args, processes=processes, quiet=quiet), launch_environment(processes, env),
                 timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{script} failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
                             f"{result.stderr[-6000:]}")
    return result


def assert_validated_at(output_dir, steps, variants=("raw",), prompts=None, num_images=None):
    """The run in ``output_dir`` validated at ``steps`` (in order; the final step once) and nowhere else: each
    step's records are one per variant (``variants``: "raw", and "ema" with ``--use_ema``) and prompt (``prompts``;
    by default those of the first step), and name images that exist (``num_images`` each, if given), the step's
    grid and the prompt's progress grid. Returns the records."""
    log = read_log(output_dir)
    if prompts is None:
        prompts = [record["prompt"] for record in log if record["step"] == log[0]["step"]
                   and record["variant"] == log[0]["variant"]] if log else []
    validated = [(record["step"], record["variant"], record["prompt"]) for record in log]
    expected = [(step, variant, prompt) for step in steps for variant in variants for prompt in prompts]
    assert validated == expected, f"validated (step, variant, prompt): {validated}; expected {expected}"
    for record in log:
        assert record["images"] and all((Path(output_dir) / path).is_file() for path in record["images"]), record
        assert num_images is None or len(record["images"]) == num_images, record
        assert all((Path(output_dir) / record[grid]).is_file() for grid in ("grid", "progress")), record
    return log


def reported_buckets(stderr):
    """``{(height, width): images}`` of the aspect-ratio buckets a run reported, one line each
    (`buckets.BucketBatchSampler.report`)."""
    lines = re.findall(r"bucket (\d+)x(\d+) \(height x width\): (\d+) images?", stderr)
    return {(int(height), int(width)): int(images) for height, width, images in lines}


def assert_latents_cached_per_bucket(features_dir, stderr, vae_scale_factor, repeats=2):
    """A run's ``--feature_cache_dir`` holds one latent store per aspect-ratio bucket it reported: each image once,
    unflipped and flipped (though it trains ``repeats`` times an epoch), at the bucket's latent size. Returns
    ``{latent (height, width): [images, flips, ...] tensor}``."""
    stores = (load_file(shard)["0/parameters"] for shard in Path(features_dir).glob("latents-*/shard-*"))
    latents = {tuple(parameters.shape[-2:]): parameters for parameters in stores}
    assert {(height * vae_scale_factor, width * vae_scale_factor): repeats * len(parameters)
            for (height, width), parameters in latents.items()} == reported_buckets(stderr)
    assert all(parameters.shape[1] == 2 for parameters in latents.values())
    return latents


def most_common_bucket(buckets):
    """The bucket of ``{(height, width): images}`` that validation renders at by default: the one with the most
    images, the largest of equally common ones (`buckets.validation_size`)."""
    return max(buckets, key=lambda shape: (buckets[shape], shape))


def rendered_images(output_dir):
    """The validation images a run rendered (not its grids, nor a ControlNet's conditioning images)."""
    return sorted(path for path in (Path(output_dir) / "validation").glob("step-*/*.png")
                  if not path.name.startswith("grid-"))


def assert_lora_changes_pipeline_output(base_model, *lora_dirs, prompt="a photo", resolution=32,
                                        num_inference_steps=2, atol=1e-4):
    """Render ``prompt`` with the pipeline saved in ``base_model``, then with the LoRA of each of ``lora_dirs``
    loaded in turn (``pipe.load_lora_weights(lora_dir)``, as a user loads it), all with one seed: each LoRA must
    load and change the images by more than ``atol``. Returns the images (numpy), the base model's first."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(base_model)
    pipe.set_progress_bar_config(disable=True)

    def render():
        return pipe(prompt=prompt, num_inference_steps=num_inference_steps, height=resolution, width=resolution,
                    output_type="np", generator=torch.Generator().manual_seed(0)).images

    images = [render()]
    for lora_dir in lora_dirs:
        pipe.load_lora_weights(lora_dir)
        images.append(render())
        pipe.unload_lora_weights()
        assert not np.allclose(images[0], images[-1], atol=atol), f"the LoRA in {lora_dir} changes no image"
    return images


def assert_model_folder_loads(model_class, folder, initial=None):
    """``model_class.from_pretrained(folder)`` loads (e.g. ``ControlNetModel`` and a ControlNet script's output_dir,
    ``UNet2DConditionModel`` and ``output_dir/unet``), and the folder's safetensors files hold fp32 weights. Given
    ``initial`` (the folder of the model training started from), also: the same tensor names as it, and some
    tensors changed. Returns the model."""
    saved = [load_file(path) for path in sorted(Path(folder).glob("*.safetensors"))]
    assert saved and all(tensor.dtype == torch.float32 for tensors in saved for tensor in tensors.values()), \
        f"{folder}: expected fp32 safetensors"
    model = model_class.from_pretrained(folder)
    if initial is not None:
        weights, initial_weights = model.state_dict(), model_class.from_pretrained(initial).state_dict()
        assert weights.keys() == initial_weights.keys(), f"{folder} holds other tensors than {initial}"
        assert differing_keys(weights, initial_weights), f"{folder} holds the weights of {initial}, untrained"
    return model


def checkpoint_names(output_dir):
    """The names of the checkpoints in ``output_dir``, oldest first (``checkpoint-<step>``)."""
    return sorted((path.name for path in Path(output_dir).glob("checkpoint-*")), key=lambda name: int(name[11:]))


def checkpoint_weight_files(checkpoint):
    """The safetensors files of a checkpoint folder that hold weights, as a set of paths relative to it (each
    process's random state left out): a test compares them with the final output's layout, to show that the
    checkpoint holds each trained tensor once, where the stock loaders find it."""
    checkpoint = Path(checkpoint)
    return {path.relative_to(checkpoint).as_posix() for path in checkpoint.rglob("*.safetensors")
            if not path.name.startswith("random_state_")}


def assert_checkpoint_is_the_output(checkpoint, output_dir, files):
    """``checkpoint`` (taken at the final step) holds exactly the weight ``files`` of ``output_dir``, bitwise
    equal: it loads as the final output does. ``files`` are paths relative to both folders, or a dict of
    ``{path in the checkpoint: path in output_dir}`` where they differ (a ControlNet's ``controlnet/…``)."""
    files = files if isinstance(files, dict) else {name: name for name in files}
    assert checkpoint_weight_files(checkpoint) == set(files), checkpoint_weight_files(checkpoint)
    for in_checkpoint, in_output in files.items():
        assert_same_files(Path(checkpoint) / in_checkpoint, Path(output_dir) / in_output)


def assert_resumes_exactly(script, args_for, straight_dir, resumed_dir, step, weight_files, launch=launch_script):
    """The run in ``straight_dir``, resumed from its ``checkpoint-<step>``, ends with bitwise the same
    ``weight_files`` (paths relative to the output directory) as the run that went straight on.

    The checkpoint is copied into ``resumed_dir``, and ``script`` is launched with ``args_for(resumed_dir)`` and
    ``--resume_from_checkpoint latest``: ``args_for(output_dir)`` gives the flags of the straight run, and may drop
    its validation or change its checkpointing, which leave the weights alone. ``launch(script, *args)`` is
    `launch_script` by default. Returns the resumed run's `subprocess.CompletedProcess`."""
    checkpoint = Path(resumed_dir) / f"checkpoint-{step}"
    shutil.copytree(Path(straight_dir) / checkpoint.name, checkpoint)
    result = launch(script, *args_for(resumed_dir), "--resume_from_checkpoint", "latest")
    assert f"resumed from {checkpoint} at step {step}" in result.stdout, result.stdout[-3000:]
    for name in weight_files:
        assert_same_files(Path(resumed_dir) / name, Path(straight_dir) / name)
    return result


def differing_keys(a, b):
    """The keys whose tensors are not bitwise equal in two state dicts with the same keys."""
    return [key for key in a if not torch.equal(a[key], b[key])]


def assert_same_tensors(a, b, where=""):
    """Two state dicts hold the same keys and bitwise-equal tensors."""
    assert a.keys() == b.keys() and len(a) > 0, (where, sorted(a.keys() ^ b.keys())[:3])
    different = differing_keys(a, b)
    assert not different, f"{len(different)} of {len(a)} tensors differ in {where}, e.g. {different[0]}"


def assert_same_files(a, b):
    """Two safetensors files hold the same keys and bitwise-equal tensors."""
    assert_same_tensors(load_file(a), load_file(b), f"{a} and {b}")


def assert_close_files(a, b, atol=1e-5):
    """Two safetensors files hold the same keys and tensors within ``atol`` (e.g. the weights of an uncached
    and a cached run, equal up to float noise); returns ``b``'s tensors for further checks."""
    a_tensors, b_tensors = load_file(a), load_file(b)
    assert a_tensors.keys() == b_tensors.keys() and len(b_tensors) > 0, (str(a), str(b))
    for key in b_tensors:
        assert torch.allclose(b_tensors[key], a_tensors[key], atol=atol), (str(b), key)
    return b_tensors


def assert_close_validations(a, b, expected, max_difference=2):
    """The runs in ``a`` and ``b`` both logged the validations ``expected`` (``[(step, variant)]``), with images at
    most ``max_difference`` levels apart: e.g. cached against uncached encoders, equal up to float noise."""
    a, b = Path(a), Path(b)
    logs = read_log(a), read_log(b)
    for log in logs:
        assert [(record["step"], record["variant"]) for record in log] == expected
    for record_a, record_b in zip(*logs):
        for path_a, path_b in zip(record_a["images"], record_b["images"], strict=True):
            image_a, image_b = (np.asarray(Image.open(path), dtype=np.int16) for path in (a / path_a, b / path_b))
            assert np.abs(image_a - image_b).max() <= max_difference, path_b
