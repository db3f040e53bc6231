"""Checkpoints of training_utils.outputs.checkpointing: naming, resolving, pruning and an exact save/load round trip.

accelerate's AcceleratorState is a process-wide singleton, so this module makes one
``Accelerator(cpu=True)`` and every test leaves it as it found it: no registered hooks and no
prepared objects (see the ``acc`` fixture).
"""

import json
import os
import re
import shutil

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file, save_file

from helpers import forget_prepared
from training_utils.ema import EMA
from training_utils.errors import RunStopped, UsageError
from training_utils.names import EMA_FOLDER, MANIFEST_FILE, STATE_FILE
from training_utils.outputs import checkpointing, export, writing
from training_utils.outputs.checkpoint_folders import choose_checkpoint, complete_checkpoints, resolve_checkpoint
from training_utils.outputs.checkpointing import (EARLIER_EMA_FILE, EARLIER_TRAINED_FILE, WRITE_FAILED_EXIT_CODE, Checkpointer, resume_position)
from training_utils.outputs.export import TENSORS_NAME, TensorsExport
from training_utils.outputs.manifest import check_manifest, write_manifest


@pytest.fixture(scope="module")
def module_accelerator():
    return Accelerator(cpu=True)


@pytest.fixture
def acc(module_accelerator):
    forget_prepared(module_accelerator)
    yield module_accelerator
    forget_prepared(module_accelerator)


def make_checkpoint(output_dir, step, complete=True):
    path = output_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    if complete:
        (path / STATE_FILE).write_text(json.dumps({"global_step": step}))
    return path


def bits(tensor):
    return tensor.detach().contiguous().view(torch.int32)


# ---------------------------------------------------------------------------------------------
# finding checkpoints


def test_complete_checkpoints_sorted_numerically_and_filtered(tmp_path):
    for step in (9, 10, 2, 100):
        make_checkpoint(tmp_path, step)
    (tmp_path / ".checkpoint-200.incomplete").mkdir()
    (tmp_path / "checkpoint-abc").mkdir()
    (tmp_path / "checkpoint-5-old").mkdir()
    (tmp_path / "mycheckpoint-7").mkdir()
    (tmp_path / "checkpoint-300").write_text("a file, not a folder")
    (tmp_path / "logs").mkdir()
    found = complete_checkpoints(tmp_path)
    assert found == [(2, tmp_path / "checkpoint-2"), (9, tmp_path / "checkpoint-9"),
                     (10, tmp_path / "checkpoint-10"), (100, tmp_path / "checkpoint-100")]


def test_complete_checkpoints_of_missing_or_empty_dir(tmp_path):
    assert complete_checkpoints(tmp_path / "nope") == []
    assert complete_checkpoints(tmp_path) == []
    assert complete_checkpoints(str(tmp_path)) == []


def test_resolve_none_is_a_fresh_start(tmp_path):
    make_checkpoint(tmp_path, 3)
    assert resolve_checkpoint(None, tmp_path) is None


def test_resolve_latest(tmp_path):
    assert resolve_checkpoint("latest", tmp_path) is None
    assert resolve_checkpoint("latest", tmp_path / "not_yet_created") is None
    make_checkpoint(tmp_path, 9)
    make_checkpoint(tmp_path, 10)
    (tmp_path / ".checkpoint-11.incomplete").mkdir()
    assert resolve_checkpoint("latest", tmp_path) == tmp_path / "checkpoint-10"


def test_resolve_latest_ignores_only_incomplete(tmp_path):
    (tmp_path / ".checkpoint-4.incomplete").mkdir()
    assert resolve_checkpoint("latest", tmp_path) is None


def test_resolve_name_under_output_dir(tmp_path, monkeypatch):
    output_dir = tmp_path / "out"
    make_checkpoint(output_dir, 4)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert resolve_checkpoint("checkpoint-4", output_dir) == output_dir / "checkpoint-4"


def test_resolve_absolute_path(tmp_path):
    path = make_checkpoint(tmp_path / "other_run", 8)
    assert resolve_checkpoint(str(path), tmp_path / "out") == path


@pytest.mark.parametrize("value", ["checkpoint-5", "/nonexistent/checkpoint-5", "checkpoint-incomplete"])
def test_resolve_missing_raises_usage_error(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    make_checkpoint(tmp_path, 3)
    make_checkpoint(tmp_path / "out", 6)
    make_checkpoint(tmp_path / "out", 5, complete=False)  # a folder without training_state.json is not one
    (tmp_path / "out" / "checkpoint-incomplete").mkdir()
    with pytest.raises(UsageError) as raised:
        resolve_checkpoint(value, tmp_path / "out")
    assert str(raised.value).startswith(f"--resume_from_checkpoint={value!r}")


@pytest.mark.parametrize(
    "global_step, steps_per_epoch, accumulation, expected",
    [
        (0, 5, 1, (0, 0)),
        (4, 5, 1, (0, 4)),
        (5, 5, 1, (1, 0)),
        (7, 3, 2, (2, 2)),
        (12, 4, 4, (3, 0)),
        (13, 4, 4, (3, 4)),
    ],
)
def test_resume_position(global_step, steps_per_epoch, accumulation, expected):
    assert resume_position(global_step, steps_per_epoch, accumulation) == expected


# ---------------------------------------------------------------------------------------------
# pruning


def linear_export(name="linear", out_features=3):
    """The export of a run training one ``nn.Linear(4, out_features)`` named ``name``."""
    return TensorsExport({name: torch.nn.Linear(4, out_features)})


def ema_of(export):
    return EMA(checkpointing.trainable_parameters(export.trained))


def test_prune_keeps_newest_total_limit(tmp_path, acc):
    for step in (1, 2, 3, 9, 10):
        make_checkpoint(tmp_path, step)
    staging = tmp_path / ".incomplete-checkpoint-11"
    staging.mkdir()
    Checkpointer(acc, tmp_path, linear_export(), total_limit=2).prune()
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [9, 10]
    assert staging.is_dir()


def test_prune_without_limit_keeps_all(tmp_path, acc):
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step)
    Checkpointer(acc, tmp_path, linear_export()).prune()
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [1, 2, 3]


def test_prune_limit_one(tmp_path, acc):
    for step in (5, 50, 500):
        make_checkpoint(tmp_path, step)
    Checkpointer(acc, tmp_path, linear_export(), total_limit=1).prune()
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [500]


def test_pruning_removes_only_the_checkpoints_of_the_runs_own_trajectory(tmp_path, acc):
    """Checkpoints 1 and 2 of a run before --resume_with_changed_args (another seed) stay, whatever the limit."""
    for step, seed in ((1, 1), (2, 1), (3, 2), (4, 2), (5, 2)):
        (make_checkpoint(tmp_path, step) / STATE_FILE).write_text(json.dumps({"trajectory": {"seed": seed}}))
    Checkpointer(acc, tmp_path, linear_export(), total_limit=2, trajectory={"seed": 2}).prune()
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [1, 2, 4, 5]


def test_prune_tolerates_a_vanished_folder(tmp_path, acc, monkeypatch):
    for step in (2, 3, 4):
        make_checkpoint(tmp_path, step)
    listed = complete_checkpoints(tmp_path)
    vanished = tmp_path / "checkpoint-1"  # listed, but deleted by someone else before prune reaches it
    monkeypatch.setattr(checkpointing, "complete_checkpoints", lambda output_dir: [(1, vanished)] + listed)
    Checkpointer(acc, tmp_path, linear_export(), total_limit=2).prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3", "checkpoint-4"]


# ---------------------------------------------------------------------------------------------
# save / load round trip


class Run:
    """A tiny training run: nn.Linear, AdamW prepared by accelerate, optionally an EMA."""

    def __init__(self, accelerator, output_dir, use_ema=True, total_limit=None, seed=0):
        torch.manual_seed(seed)
        self.accelerator = accelerator
        export = linear_export()
        optimizer = torch.optim.AdamW(export.trained["linear"].parameters(), lr=0.05)
        self.model, self.optimizer = accelerator.prepare(export.trained["linear"], optimizer)
        self.parameters = checkpointing.trainable_parameters(export.trained)
        self.ema = EMA(self.parameters, decay=0.9) if use_ema else None
        self.checkpointer = Checkpointer(accelerator, output_dir, export, ema=self.ema, total_limit=total_limit)
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.step = 0

    def train(self, steps):
        for _ in range(steps):
            inputs = torch.randn(8, 4, generator=self.generator)
            loss = (self.model(inputs) - 1).pow(2).mean()
            self.accelerator.backward(loss)
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.step += 1
            if self.ema is not None:
                self.ema.update(self.step)

    def snapshot(self):
        state = {
            "parameters": {name: p.detach().clone() for name, p in self.parameters.items()},
            "optimizer": {
                (index, key): value.clone()
                for index, per_param in self.optimizer.state_dict()["state"].items()
                for key, value in per_param.items()
            },
        }
        if self.ema is not None:
            state["shadows"] = {name: s.clone() for name, s in self.ema.shadows.items()}
            state["ema_step"] = self.ema.step
        return state


def assert_same_state(actual, expected):
    assert actual.keys() == expected.keys()
    for name, tensor in expected["parameters"].items():
        assert torch.equal(bits(actual["parameters"][name]), bits(tensor)), name
    assert actual["optimizer"].keys() == expected["optimizer"].keys()
    for key, tensor in expected["optimizer"].items():
        assert torch.equal(actual["optimizer"][key], tensor), key
    if "shadows" in expected:
        for name, tensor in expected["shadows"].items():
            assert torch.equal(bits(actual["shadows"][name]), bits(tensor)), name
        assert actual["ema_step"] == expected["ema_step"]


def test_save_load_round_trip_is_bitwise(tmp_path, acc):
    run = Run(acc, tmp_path)
    run.train(3)
    saved = run.snapshot()
    path = run.checkpointer.save(3, {"skipped_images": 2})
    rng_after_save = torch.rand(4)

    assert path == tmp_path / "checkpoint-3"
    # the trained weights once, as the export writes them, and the EMA's in the same layout
    assert (path / TENSORS_NAME).is_file() and (path / EMA_FOLDER / TENSORS_NAME).is_file()
    assert json.loads((path / STATE_FILE).read_text()) == {"format": 3, "global_step": 3, "processes": 1,
                                                           "skipped_images": 2, "ema_step": 3}
    assert not (tmp_path / ".checkpoint-3.incomplete").exists()
    # the hook replaces accelerate's whole-model weights by the trained tensors
    assert not list(path.glob("model*.safetensors")) and not list(path.glob("pytorch_model*.bin"))

    run.train(2)  # perturb everything: weights, optimizer moments, EMA shadows and step
    moved = run.snapshot()
    assert not torch.equal(moved["parameters"]["linear.weight"], saved["parameters"]["linear.weight"])
    assert not torch.equal(moved["shadows"]["linear.weight"], saved["shadows"]["linear.weight"])
    assert moved["ema_step"] == 5

    parameter_objects = dict(run.parameters)
    assert run.checkpointer.load(path) == 3
    assert run.checkpointer.loaded_state == {"format": 3, "global_step": 3, "processes": 1, "skipped_images": 2,
                                             "ema_step": 3}
    assert_same_state(run.snapshot(), saved)
    # restored in place: the optimizer and EMA still hold the very same tensors
    assert all(run.parameters[name] is parameter_objects[name] for name in parameter_objects)
    assert all(p is q for p, q in zip(run.model.parameters(), run.parameters.values()))
    # the RNG states come back too, so the run continues exactly
    assert torch.equal(torch.rand(4), rng_after_save)


def test_round_trip_continues_like_an_uninterrupted_run(tmp_path, acc):
    run = Run(acc, tmp_path)
    run.train(2)
    path = run.checkpointer.save(2)
    generator_state = run.generator.get_state()
    run.train(3)
    uninterrupted = run.snapshot()

    run.checkpointer.load(path)
    run.step = 2
    run.generator.set_state(generator_state)
    run.train(3)
    assert_same_state(run.snapshot(), uninterrupted)


def test_save_without_ema_and_load(tmp_path, acc):
    run = Run(acc, tmp_path, use_ema=False)
    run.train(2)
    saved = run.snapshot()
    path = run.checkpointer.save(2)
    assert not (path / EMA_FOLDER).exists()
    run.train(1)
    assert run.checkpointer.load(path) == 2
    assert_same_state(run.snapshot(), saved)


def test_saving_prunes_to_total_limit(tmp_path, acc):
    run = Run(acc, tmp_path, total_limit=2)
    for step in (1, 2, 3):
        run.train(1)
        run.checkpointer.save(step)
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2, 3]
    assert not list(tmp_path.glob(".incomplete-*"))


def test_save_replaces_stale_staging_and_existing_checkpoint(tmp_path, acc):
    run = Run(acc, tmp_path)
    run.train(1)
    stale = tmp_path / ".incomplete-checkpoint-4"
    stale.mkdir()
    (stale / "junk.txt").write_text("left by a crash")
    run.checkpointer.save(4)
    assert not (tmp_path / "checkpoint-4" / "junk.txt").exists()
    run.train(1)
    second = run.snapshot()
    run.checkpointer.save(4)  # the same step again: the newer state wins
    run.train(1)
    assert run.checkpointer.load(tmp_path / "checkpoint-4") == 4
    assert_same_state(run.snapshot(), second)


def save_one(acc, output_dir, use_ema=True):
    run = Run(acc, output_dir, use_ema=use_ema)
    run.train(1)
    path = run.checkpointer.save(1)
    forget_prepared(acc)
    return path


def test_load_with_different_parameter_names_raises(tmp_path, acc):
    path = save_one(acc, tmp_path)
    export = linear_export(name="unet")
    checkpointer = Checkpointer(acc, tmp_path, export, ema=ema_of(export))
    with pytest.raises(UsageError) as raised:
        checkpointer.load(path)
    message = str(raised.value)
    assert message.startswith("--resume_from_checkpoint=")
    assert "unet.weight" in message and "linear.weight" in message


def test_load_with_different_shapes_raises(tmp_path, acc):
    path = save_one(acc, tmp_path)
    export = linear_export(out_features=5)
    checkpointer = Checkpointer(acc, tmp_path, export, ema=ema_of(export))
    with pytest.raises(UsageError, match="linear.weight"):
        checkpointer.load(path)


def test_load_ema_checkpoint_into_run_without_ema_raises(tmp_path, acc):
    path = save_one(acc, tmp_path, use_ema=True)
    checkpointer = Checkpointer(acc, tmp_path, linear_export(), ema=None)
    with pytest.raises(UsageError, match="--use_ema"):
        checkpointer.load(path)


def test_load_checkpoint_without_ema_into_run_with_ema_raises(tmp_path, acc):
    path = save_one(acc, tmp_path, use_ema=False)
    export = linear_export()
    checkpointer = Checkpointer(acc, tmp_path, export, ema=ema_of(export))
    with pytest.raises(UsageError, match="--use_ema"):
        checkpointer.load(path)


# ---------------------------------------------------------------------------------------------
# verification: the manifest, damaged checkpoints, random states, failed writes


def two_checkpoints(acc, output_dir):
    """A run checkpointed at steps 1 and 2, and its state at step 1."""
    run = Run(acc, output_dir)
    run.train(1)
    run.checkpointer.save(1)
    at_step_1 = run.snapshot()
    run.train(1)
    run.checkpointer.save(2)
    return run, at_step_1


def test_the_manifest_lists_every_file_of_the_checkpoint_with_its_size(tmp_path, acc):
    run, _ = two_checkpoints(acc, tmp_path)
    path = tmp_path / "checkpoint-2"
    listed = json.loads((path / MANIFEST_FILE).read_text())["files"]
    on_disk = {file.relative_to(path).as_posix(): file.stat().st_size for file in path.rglob("*")
               if file.is_file() and file.name != MANIFEST_FILE}
    assert {name: entry["bytes"] for name, entry in listed.items()} == on_disk
    assert {TENSORS_NAME, f"{EMA_FOLDER}/{TENSORS_NAME}", STATE_FILE, "optimizer.bin", "random_states_0.pkl",
            "random_state_0.safetensors"} <= set(listed)
    assert check_manifest(path) is None


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def alter(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


TRUNCATED = "is \\d+ bytes, not the \\d+ it was written with \\(truncated or replaced\\)"
DAMAGE = [  # (file, damage, what the message says)
    ("random_states_0.pkl", lambda path: path.unlink(), "random_states_0.pkl is missing"),
    (TENSORS_NAME, truncate, f"{TENSORS_NAME} {TRUNCATED}"),
    (f"{EMA_FOLDER}/{TENSORS_NAME}", truncate, f"{EMA_FOLDER}/{TENSORS_NAME} {TRUNCATED}"),
    ("optimizer.bin", truncate, f"optimizer.bin {TRUNCATED}"),
    ("random_state_0.safetensors", alter,
     "random_state_0.safetensors does not hold the bytes it was written with \\(altered or corrupt\\)"),
    (MANIFEST_FILE, lambda path: path.unlink(), f"{MANIFEST_FILE} is missing"),
]


@pytest.mark.parametrize("name, damage, message", DAMAGE, ids=[case[0] for case in DAMAGE])
def test_a_damaged_checkpoint_named_is_one_line_and_latest_falls_back_to_the_one_before(
        tmp_path, acc, name, damage, message, caplog):
    run, at_step_1 = two_checkpoints(acc, tmp_path)
    damage(tmp_path / "checkpoint-2" / name)
    with pytest.raises(UsageError, match=f"^--resume_from_checkpoint='checkpoint-2': expected a whole checkpoint: "
                                         f"in {tmp_path / 'checkpoint-2'}, {message}$"):
        run.checkpointer.resume("checkpoint-2")
    assert run.checkpointer.resume("latest") == 1
    assert_same_state(run.snapshot(), at_step_1)
    assert f"not resuming from {tmp_path / 'checkpoint-2'}: " in caplog.text


def test_latest_with_no_whole_checkpoint_is_an_error(tmp_path, acc):
    two_checkpoints(acc, tmp_path)
    for step in (1, 2):
        truncate(tmp_path / f"checkpoint-{step}" / TENSORS_NAME)
    with pytest.raises(UsageError, match="none of the 2 there is"):
        choose_checkpoint("latest", tmp_path)


def to_earlier_layout(path):
    """Rewrite a checkpoint's weights as checkpoints before format 3 held them: the trained tensors in one file,
    the EMA's shadows and step in another."""
    save_file(load_file(path / TENSORS_NAME), path / EARLIER_TRAINED_FILE)
    shadows = load_file(path / EMA_FOLDER / TENSORS_NAME)
    ema = EMA({name: torch.nn.Parameter(tensor) for name, tensor in shadows.items()})
    ema.step = json.loads((path / STATE_FILE).read_text())["ema_step"]
    ema.save(path / EARLIER_EMA_FILE)
    (path / TENSORS_NAME).unlink()
    shutil.rmtree(path / EMA_FOLDER)


def test_a_checkpoint_from_before_manifests_resumes_unverified_but_not_without_its_random_states(
        tmp_path, acc, caplog):
    run, at_step_1 = two_checkpoints(acc, tmp_path)
    old = tmp_path / "checkpoint-1"
    to_earlier_layout(old)
    for name in (MANIFEST_FILE, "random_state_0.safetensors"):
        (old / name).unlink()
    state = json.loads((old / STATE_FILE).read_text())
    (old / STATE_FILE).write_text(json.dumps({"global_step": 1, "skipped_images": state["skipped_images"]}
                                             if "skipped_images" in state else {"global_step": 1}))
    assert run.checkpointer.resume("checkpoint-1") == 1
    assert "resuming from it unverified" in caplog.text
    assert_same_state(run.snapshot(), at_step_1)
    (old / "random_states_0.pkl").unlink()
    with pytest.raises(UsageError, match="random_states_0.pkl \\(without it the run would go on with other random"):
        run.checkpointer.resume("checkpoint-1")


def test_resuming_restores_the_checkpoints_own_random_state(tmp_path, acc):
    run = Run(acc, tmp_path)
    run.train(1)
    path = run.checkpointer.save(1)
    expected = torch.rand(8)
    (path / "random_states_0.pkl").write_bytes(b"")  # accelerate cannot load it: only our own state restores
    write_manifest(path)
    run.checkpointer.load(path)
    assert torch.equal(torch.rand(8), expected)


def test_a_checkpoint_of_another_number_of_processes_is_refused_unless_asked_and_then_loads_not_exact(
        tmp_path, acc, caplog):
    run, _ = two_checkpoints(acc, tmp_path)
    path = tmp_path / "checkpoint-2"
    state = json.loads((path / STATE_FILE).read_text())
    (path / STATE_FILE).write_text(json.dumps({**state, "processes": 2}))
    write_manifest(path)
    with pytest.raises(UsageError, match="a run on as many processes as the checkpoint's 2 \\(this one has 1\\): "
                                         ".*or --resume_with_changed_args to load it resharded, no longer exact$"):
        run.checkpointer.load(path)
    run.checkpointer.allow_changed_trajectory = True
    assert run.checkpointer.load(path) == 2
    assert "resuming a checkpoint of 2 processes on 1, resharded: the run is no longer exact" in caplog.text


def test_a_sharded_checkpoint_resumes_only_sharded(tmp_path, acc):
    run, _ = two_checkpoints(acc, tmp_path)
    path = tmp_path / "checkpoint-2"
    state = json.loads((path / STATE_FILE).read_text())
    assert "sharded" not in state
    (path / STATE_FILE).write_text(json.dumps({**state, "sharded": True}))
    write_manifest(path)
    with pytest.raises(UsageError, match="a run launched as the checkpoint's was, sharded \\(accelerate launch "
                                         "--use_fsdp --fsdp_version 2\\): accelerate's state in it is sharded$"):
        run.checkpointer.load(path)


def test_a_failed_write_stops_the_run_in_one_line_and_keeps_the_previous_checkpoint(tmp_path, acc, monkeypatch):
    run = Run(acc, tmp_path)
    run.train(1)
    run.checkpointer.save(1)

    def disk_full(tensors, path, metadata=None):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(export, "save_file", disk_full)
    monkeypatch.setattr(checkpointing, "end_training", lambda accelerator: None)  # the module's accelerator lives on
    run.train(1)
    with pytest.raises(RunStopped) as stopped:
        run.checkpointer.save(2)
    assert stopped.value.exit_code == WRITE_FAILED_EXIT_CODE
    staging = tmp_path / ".incomplete-checkpoint-2"
    assert re.fullmatch(f"could not write {tmp_path / 'checkpoint-2'}: {staging}/.incomplete-\\w+/{TENSORS_NAME}: "
                        f"No space left on device; {tmp_path / 'checkpoint-1'} is the latest whole checkpoint",
                        str(stopped.value))
    assert not staging.exists() and not (tmp_path / "checkpoint-2").exists()
    assert check_manifest(tmp_path / "checkpoint-1") is None
    assert choose_checkpoint("latest", tmp_path) == tmp_path / "checkpoint-1"


def test_a_full_disk_says_so_though_torch_does_not(tmp_path, acc, monkeypatch):
    run = Run(acc, tmp_path)
    run.train(1)
    run.checkpointer.save(1)

    def save_state_on_a_full_disk(path):
        os.makedirs(path)
        torch.save({"optimizer": torch.zeros(2**16)}, "/dev/full")  # "unexpected pos", as on a full disk

    monkeypatch.setattr(acc, "save_state", save_state_on_a_full_disk)
    monkeypatch.setattr(writing.tempfile, "TemporaryFile", lambda dir: open("/dev/full", "wb"))
    monkeypatch.setattr(checkpointing, "end_training", lambda accelerator: None)
    with pytest.raises(RunStopped) as stopped:
        run.checkpointer.save(2)
    staging = tmp_path / ".incomplete-checkpoint-2"
    assert str(stopped.value) == (f"could not write {tmp_path / 'checkpoint-2'}: {staging}: No space left on device; "
                                  f"{tmp_path / 'checkpoint-1'} is the latest whole checkpoint")
    assert stopped.value.reason == "write failed"


def test_resuming_with_changed_flags_never_lets_the_run_replace_later_checkpoints_of_the_run_before(tmp_path, acc):
    run = Run(acc, tmp_path)
    run.checkpointer.trajectory = {"seed": 3}
    for step in (1, 2):
        run.train(1)
        run.checkpointer.save(step)
    run.checkpointer.trajectory, run.checkpointer.allow_changed_trajectory = {"seed": 4}, True
    with pytest.raises(UsageError, match=f"no later checkpoints of the run before the change in {tmp_path} \\(it holds "
                                         f"checkpoint-2, which this run's checkpoints could replace\\)"):
        run.checkpointer.load(tmp_path / "checkpoint-1")
    assert run.checkpointer.load(tmp_path / "checkpoint-2") == 2


def test_resuming_with_a_changed_trajectory_flag_is_refused_unless_asked_and_then_said(tmp_path, acc, caplog):
    run = Run(acc, tmp_path)
    run.checkpointer.trajectory = {"seed": 3, "learning_rate": 0.001}
    run.train(1)
    path = run.checkpointer.save(1)
    run.checkpointer.trajectory = {"seed": 4, "learning_rate": 0.001}
    with pytest.raises(UsageError, match="--seed was 3, now 4\\), or --resume_with_changed_args to go on anyway$"):
        run.checkpointer.load(path)
    run.checkpointer.allow_changed_trajectory = True
    assert run.checkpointer.load(path) == 1
    assert "resuming with changed flags (--seed was 3, now 4): the run is no longer exact" in caplog.text


def test_a_changed_flag_is_named_as_the_user_typed_it(tmp_path, acc):
    run = Run(acc, tmp_path)
    run.checkpointer.trajectory = {"caption_dropout": 0.1}
    run.train(1)
    path = run.checkpointer.save(1)
    run.checkpointer.trajectory = {"caption_dropout": 0.2}
    run.checkpointer.spellings = {"caption_dropout": "--proportion_empty_prompts"}
    with pytest.raises(UsageError, match="\\(--proportion_empty_prompts was 0.1, now 0.2\\)"):
        run.checkpointer.load(path)


def test_a_changed_rank_is_named_as_a_flag_before_any_shape_is_compared(tmp_path, acc):
    run = Run(acc, tmp_path)
    run.checkpointer.trajectory = {"rank": 4}
    run.train(1)
    path = run.checkpointer.save(1)
    forget_prepared(acc)
    wider = linear_export(out_features=5)
    checkpointer = Checkpointer(acc, tmp_path, wider, ema=ema_of(wider), trajectory={"rank": 8})
    with pytest.raises(UsageError, match="\\(--rank was 4, now 8\\), or --resume_with_changed_args"):
        checkpointer.load(path)


def test_resuming_a_lora_as_another_adapter_is_refused_in_the_scripts_terms_even_with_changed_args(tmp_path, acc):
    """Before loading: the converter would otherwise say that a LoRA's folder is no peft adapter folder."""
    run = Run(acc, tmp_path)
    run.checkpointer.trajectory = {"adapter": "lora", "rank": 4, "oft_block_size": None, "seed": 3}
    run.train(1)
    path = run.checkpointer.save(1)
    run.checkpointer.trajectory = {"adapter": "oft", "rank": None, "oft_block_size": 32, "seed": 3}
    run.checkpointer.allow_changed_trajectory = True
    with pytest.raises(UsageError, match=re.escape(
            f"--adapter='oft': expected the adapter that {path} holds (--adapter was 'lora', now 'oft'; --rank was 4, "
            f"now None; --oft_block_size was None, now 32): not even --resume_with_changed_args changes what trains; "
            f"pass --adapter lora --rank 4 to go on with it, or start a new run without --resume_from_checkpoint")):
        run.checkpointer.load(path)
