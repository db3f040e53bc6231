"""TrainingLoop on a toy regression: step bookkeeping, due work, preemption and a broken loss."""

import json
import os
import shutil
import signal
import traceback
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator

from helpers import forget_prepared
from training_utils.accelerator import end_training
from training_utils.data.datasets import TrainDataset, make_dataloader, stack_collate
from training_utils.ema import EMA
from training_utils.errors import NON_FINITE_EXIT_CODE, PREEMPTED_EXIT_CODE, RunStopped, UsageError
from training_utils.loop import TrainingLoop
from training_utils.names import STATUS_FILE
from training_utils.optimization import training_length
from training_utils.outputs.export import TensorsExport
from training_utils.outputs.run_status import RunRecord, read_status
from training_utils.pipeline import trainable_parameters
from training_utils.posthoc_ema import PostHocEMA, read_snapshots

NUM_SAMPLES, BATCH = 10, 2  # 5 steps per epoch


@pytest.fixture(scope="module")
def module_accelerator():
    return Accelerator(cpu=True)


@pytest.fixture
def accelerator(module_accelerator):
    yield module_accelerator
    forget_prepared(module_accelerator)


class RecordingValidator:
    def __init__(self):
        self.steps = []
        self.final_steps = []
        self.base_drawn = False

    def draw_base(self):
        assert not self.steps, "the base is drawn before the first validation"
        self.base_drawn = True

    def __call__(self, step, final=False):
        self.steps.append(step)
        if final:
            self.final_steps.append(step)
        return [{"step": step}]

    def card_records(self, records):
        return [{"shown": "first"}, *records]


def toy_run(accelerator, output_dir, max_train_steps, resume=None, on_step=None, validation_steps=3,
            posthoc_sigma_rels=None, shapes=None, resume_with_changed_args=False, run=None):
    """Train a linear regression; ``on_step(step, loss)`` may replace the loss or send a signal; ``shapes`` puts
    the samples in aspect-ratio buckets; ``run`` is the script's run record (a new one if None)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    export = TensorsExport({"model": model})
    parameters = trainable_parameters(export.trained)
    ema = EMA(parameters, decay=0.5)
    posthoc = PostHocEMA(parameters, posthoc_sigma_rels) if posthoc_sigma_rels else None
    inputs = torch.randn(NUM_SAMPLES, 3)
    targets = inputs.sum(dim=1, keepdim=True)

    def preprocess(index, generator):
        return {"x": inputs[index], "y": targets[index] + 0.1 * torch.randn(1, generator=generator)}

    dataset = TrainDataset(list(range(NUM_SAMPLES)), preprocess, seed=0, shapes=shapes)
    dataloader = accelerator.prepare(make_dataloader(dataset, BATCH, 0, stack_collate, seed=0))
    args = SimpleNamespace(gradient_accumulation_steps=1, checkpointing_steps=4, validation_steps=validation_steps,
                           validation_epochs=None, output_dir=str(output_dir), max_train_steps=max_train_steps,
                           num_train_epochs=1, ema_posthoc_snapshot_steps=3, resume_from_checkpoint=resume,
                           checkpoints_total_limit=None, max_grad_norm=1.0,
                           resume_with_changed_args=resume_with_changed_args)
    max_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer, lr_scheduler = accelerator.prepare(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1))
    validator = RecordingValidator()
    loop = TrainingLoop(accelerator, args, RunRecord() if run is None else run, dataloader, optimizer, lr_scheduler,
                        export, max_steps, steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    for batch in loop:
        loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
        if on_step is not None:
            loss = on_step(loop.global_step + 1, loss)
        loop.backward_and_step(loss)
    state = {name: p.detach().clone() for name, p in parameters.items()}
    return loop, validator, state, {name: s.clone() for name, s in ema.shadows.items()}


def test_runs_to_max_steps_across_epochs_doing_due_work(accelerator, tmp_path):
    loop, validator, _, _ = toy_run(accelerator, tmp_path, max_train_steps=7)
    assert loop.global_step == 7
    assert validator.steps == [3, 6, 7] and validator.final_steps == [7] and validator.base_drawn
    assert loop.records == [{"shown": "first"}, {"step": 7}]  # the last validation's, as the model card shows them
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"]


def test_sigterm_finishes_the_step_checkpoints_and_resumes_exactly(accelerator, tmp_path):
    def preempt_during_step_3(step, loss):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    handler_before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunStopped) as stopped:
        toy_run(accelerator, tmp_path / "a", max_train_steps=7, on_step=preempt_during_step_3)
    assert stopped.value.exit_code == PREEMPTED_EXIT_CODE
    assert "SIGTERM after step 3" in str(stopped.value)
    assert signal.getsignal(signal.SIGTERM) is handler_before
    assert (tmp_path / "a" / "checkpoint-3").is_dir()

    forget_prepared(accelerator)
    resumed, validator, state, ema = toy_run(accelerator, tmp_path / "a", max_train_steps=7, resume="latest")
    assert resumed.global_step == 7 and validator.steps == [6, 7] and not validator.base_drawn

    forget_prepared(accelerator)
    _, _, expected_state, expected_ema = toy_run(accelerator, tmp_path / "b", max_train_steps=7)
    assert all(torch.equal(state[name], expected_state[name]) for name in state)
    assert all(torch.equal(ema[name], expected_ema[name]) for name in ema)


def test_a_signal_during_the_last_step_checkpoints_it_and_stops_so_that_a_rerun_writes_the_outputs(accelerator,
                                                                                                   tmp_path):
    def preempt_during_step_7(step, loss):
        if step == 7:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    run = RunRecord()
    with pytest.raises(RunStopped) as stopped:
        toy_run(accelerator, tmp_path, max_train_steps=7, on_step=preempt_during_step_7, run=run)
    assert (stopped.value.exit_code, stopped.value.reason) == (PREEMPTED_EXIT_CODE, "preempted")
    assert "SIGTERM after step 7; checkpoint saved" in str(stopped.value)
    assert (tmp_path / "checkpoint-7").is_dir() and run.last_step == 7
    forget_prepared(accelerator)
    resumed, validator, _, _ = toy_run(accelerator, tmp_path, max_train_steps=7, resume="latest")
    assert resumed.global_step == 7 and validator.steps == []


def test_with_buckets_a_resumed_run_ends_as_the_straight_one_and_other_buckets_are_refused(accelerator, tmp_path):
    shapes = [(8, 16)] * 5 + [(16, 8)] * 5  # 3 + 3 batches an epoch, the last of each filled up
    toy_run(accelerator, tmp_path / "a", max_train_steps=9, shapes=shapes)
    forget_prepared(accelerator)
    _, _, straight, _ = toy_run(accelerator, tmp_path / "b", max_train_steps=9, shapes=shapes)
    shutil.rmtree(tmp_path / "b" / "checkpoint-8")
    forget_prepared(accelerator)
    _, _, resumed, _ = toy_run(accelerator, tmp_path / "b", max_train_steps=9, resume="latest", shapes=shapes)
    assert all(torch.equal(resumed[name], straight[name]) for name in straight)
    forget_prepared(accelerator)
    with pytest.raises(UsageError, match="other aspect-ratio buckets"):
        toy_run(accelerator, tmp_path / "a", max_train_steps=9, resume="latest", shapes=[(8, 16), (16, 8)] * 5)


def test_the_folder_becomes_the_runs_once_the_checkpoint_to_resume_is_accepted_and_a_refusal_leaves_it(accelerator,
                                                                                                     tmp_path):
    shapes = [(8, 16)] * 5 + [(16, 8)] * 5
    toy_run(accelerator, tmp_path, max_train_steps=9, shapes=shapes)
    completed = json.dumps({"reason": "completed", "exit_status": 0, "last_step": 9})
    (tmp_path / STATUS_FILE).write_text(completed)
    forget_prepared(accelerator)
    refused = RunRecord()
    with pytest.raises(UsageError, match="other aspect-ratio buckets"):
        toy_run(accelerator, tmp_path, max_train_steps=12, resume="latest", shapes=[(8, 16), (16, 8)] * 5,
                run=refused)
    assert refused.output_dir is None and (tmp_path / STATUS_FILE).read_text() == completed
    forget_prepared(accelerator)
    accepted = RunRecord()
    loop, _, _, _ = toy_run(accelerator, tmp_path, max_train_steps=9, resume="latest", shapes=shapes, run=accepted)
    assert accepted.output_dir == str(tmp_path) and loop.global_step == accepted.last_step == 9
    assert (read_status(tmp_path)["reason"], read_status(tmp_path)["last_step"]) == ("running", 8)


def test_a_non_finite_loss_stops_before_anything_is_written(accelerator, tmp_path):
    def break_step_5(step, loss):
        return loss * float("nan") if step == 5 else loss

    run = RunRecord()
    with pytest.raises(RunStopped) as stopped:
        toy_run(accelerator, tmp_path, max_train_steps=7, on_step=break_step_5, run=run)
    assert (stopped.value.exit_code, stopped.value.reason) == (NON_FINITE_EXIT_CODE, "non-finite loss")
    assert str(stopped.value) == (f"the loss is nan at step 5; stopped before writing anything from these weights "
                                  f"({tmp_path / 'checkpoint-4'} is the last checkpoint)")
    assert run.last_step == 4
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4"]
    # The progress bar was closed (drawn for the last time) before the stop left the loop.
    bars = [frame.f_locals["loop"]._progress for frame, _ in traceback.walk_tb(stopped.tb) if "loop" in frame.f_locals]
    assert bars and all(bar.disable for bar in bars)


def test_a_non_finite_loss_before_any_checkpoint_says_none_was_written(accelerator, tmp_path):
    with pytest.raises(RunStopped, match="^the loss is inf at step 2; stopped before writing anything from these "
                                         "weights \\(no checkpoint was written\\)$"):
        toy_run(accelerator, tmp_path, max_train_steps=7, on_step=lambda step, loss: loss / 0 if step == 2 else loss)


def test_a_validation_image_that_cannot_be_written_stops_the_run_in_one_line(accelerator, tmp_path, monkeypatch):
    def disk_full(self, step, final=False):
        raise OSError(28, "No space left on device", str(tmp_path / "validation" / "step-000003" / "raw-p00-00.png"))

    monkeypatch.setattr(RecordingValidator, "__call__", disk_full)
    with pytest.raises(RunStopped) as stopped:
        toy_run(accelerator, tmp_path, max_train_steps=7)
    assert (stopped.value.exit_code, stopped.value.reason) == (74, "write failed")
    assert str(stopped.value) == (f"could not write to {tmp_path / 'validation'}: {tmp_path}/validation/step-000003/"
                                  f"raw-p00-00.png: No space left on device")


def test_each_step_logs_its_own_loss_and_lr(accelerator, tmp_path, monkeypatch):
    losses, logged = {}, {}
    monkeypatch.setattr(accelerator, "log", lambda values, step: logged.setdefault(step, values))

    def record(step, loss):
        losses[step] = loss.item()
        return loss

    toy_run(accelerator, tmp_path, max_train_steps=3, on_step=record)
    assert {step: values["train_loss"] for step, values in logged.items()} == losses
    assert all(values["lr"] == 0.1 for values in logged.values()) and len(set(losses.values())) == 3


def test_resuming_at_or_past_the_last_step_trains_nothing(accelerator, tmp_path):
    toy_run(accelerator, tmp_path, max_train_steps=4)
    forget_prepared(accelerator)
    trained_steps = []
    loop, validator, _, _ = toy_run(accelerator, tmp_path, max_train_steps=3, resume="latest",
                                    on_step=lambda step, loss: trained_steps.append(step) or loss)
    assert loop.global_step == 4 and trained_steps == [] and validator.steps == []


def test_posthoc_snapshots_every_n_steps_and_at_the_end_and_resume(accelerator, tmp_path):
    toy_run(accelerator, tmp_path, max_train_steps=5, posthoc_sigma_rels=[0.05, 0.1])
    assert sorted({snapshot.step for snapshot in read_snapshots(tmp_path)}) == [3, 5]
    assert len(read_snapshots(tmp_path)) == 4
    forget_prepared(accelerator)
    # Resuming from checkpoint-4 replaces the snapshots after step 4, then continues every 3 steps.
    toy_run(accelerator, tmp_path, max_train_steps=7, resume="checkpoint-4", posthoc_sigma_rels=[0.05, 0.1])
    assert sorted({snapshot.step for snapshot in read_snapshots(tmp_path)}) == [3, 6, 7]


def test_end_training_waits_for_every_process_before_the_teardown():
    calls = []
    accelerator = SimpleNamespace(wait_for_everyone=lambda: calls.append("barrier"),
                                  end_training=lambda: calls.append("teardown"))
    end_training(accelerator)
    assert calls == ["barrier", "teardown"]


def test_a_checkpoint_of_another_number_of_processes_goes_on_in_this_runs_epochs_only_when_asked(accelerator, tmp_path):
    import json

    from training_utils.outputs.checkpoint_folders import STATE_FILE
    from training_utils.outputs.manifest import write_manifest
    toy_run(accelerator, tmp_path, max_train_steps=4)
    checkpoint = tmp_path / "checkpoint-4"
    state = json.loads((checkpoint / STATE_FILE).read_text())
    # As if written by 2 processes, each with 3 batches an epoch (this run has 5).
    (checkpoint / STATE_FILE).write_text(json.dumps({**state, "processes": 2, "steps_per_epoch": 3}))
    write_manifest(checkpoint)
    forget_prepared(accelerator)
    with pytest.raises(UsageError, match="a run on as many processes as the checkpoint's 2"):
        toy_run(accelerator, tmp_path, max_train_steps=7, resume="latest")
    forget_prepared(accelerator)
    loop, _, _, _ = toy_run(accelerator, tmp_path, max_train_steps=7, resume="latest", resume_with_changed_args=True)
    assert loop.global_step == 7 and loop.checkpointer.resharded
