"""The output folder (training_utils.outputs.folder): another run's outputs are refused before anything loads,
cleared only on --overwrite_output_dir, and what killed writes left is removed by the next run."""

import errno
import json
import logging

import pytest

from helpers import usage_error
from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.names import STATUS_FILE
from training_utils.outputs import writing
from training_utils.outputs.folder import check_output_dir, prepare_output_dir, run_outputs
from training_utils.outputs.run_status import RunRecord, read_status


def earlier_run(folder, reason="completed", checkpoints=("checkpoint-2",)):
    """What a LoRA run that ended for ``reason`` leaves in ``folder``, beside a file of the user's; returns every
    file's bytes by path."""
    for checkpoint in checkpoints:
        (folder / checkpoint).mkdir(parents=True)
        (folder / checkpoint / "pytorch_lora_weights.safetensors").write_bytes(b"checkpoint weights")
    (folder / "ema").mkdir(parents=True)
    for name in ("pytorch_lora_weights.safetensors", "ema/pytorch_lora_weights.safetensors", "README.md",
                 "logs/events", "notes.txt"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(f"{name} of the earlier run".encode())
    (folder / STATUS_FILE).write_text(json.dumps({"reason": reason}))
    return files_of(folder)


def files_of(folder):
    return {path.relative_to(folder).as_posix(): path.read_bytes() for path in sorted(folder.rglob("*"))
            if path.is_file()}


def parsed(output_dir, *flags):
    return training_parser("test").parse_args(["--pretrained_model_name_or_path", "some/model", "--output_dir",
                                               str(output_dir), *map(str, flags)])


def test_run_outputs_are_what_runs_write_not_logs_statuses_staging_or_the_users_files(tmp_path):
    earlier_run(tmp_path)
    (tmp_path / ".incomplete-abc").mkdir()
    (tmp_path / "checkpoint-notes").write_text("a file, not a checkpoint")
    assert run_outputs(tmp_path) == ["README.md", "checkpoint-2", "ema", "pytorch_lora_weights.safetensors"]
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                           "unet": ["diffusers", "UNet2DConditionModel"]}))
    (tmp_path / "unet").mkdir()
    assert {"unet", "model_index.json"} <= set(run_outputs(tmp_path))
    (tmp_path / "transformer").mkdir()
    (tmp_path / "my_notes").mkdir()
    assert "transformer" not in run_outputs(tmp_path)
    (tmp_path / "transformer" / "adapter_config.json").write_text("{}")  # a LoKr, LoHa or OFT in peft's format
    assert "transformer" in run_outputs(tmp_path) and "my_notes" not in run_outputs(tmp_path)
    (tmp_path / "transformer_2").mkdir()  # Wan 2.2's low-noise expert's LoRA, beside the high-noise one's
    assert "transformer_2" not in run_outputs(tmp_path)
    (tmp_path / "transformer_2" / "pytorch_lora_weights.safetensors").write_bytes(b"")
    assert "transformer_2" in run_outputs(tmp_path)
    assert run_outputs(tmp_path / "missing") == []


def test_a_fresh_run_refuses_another_runs_folder_in_one_line_before_anything_loads_and_touches_nothing(tmp_path):
    before = earlier_run(tmp_path)
    line = usage_error("text_to_image/train_text_to_image_lora.py", "--pretrained_model_name_or_path", "some/model",
                       "--train_data_dir", tmp_path, "--output_dir", tmp_path, "--checkpoints_total_limit", 1)
    assert line == (f"error: --output_dir={str(tmp_path)!r}: expected a folder without another run's outputs (it "
                    f"holds README.md, checkpoint-2, ema, pytorch_lora_weights.safetensors): pass "
                    f"--resume_from_checkpoint latest to continue that run, or --overwrite_output_dir to clear the "
                    f"folder first")
    assert files_of(tmp_path) == before


@pytest.mark.parametrize("reason, accepted", [("completed", False), (None, False), ("preempted", True),
                                              ("non-finite loss", True), ("running", True)])
def test_resuming_latest_without_a_checkpoint_starts_over_only_a_run_that_did_not_complete(tmp_path, reason,
                                                                                           accepted):
    earlier_run(tmp_path, reason, checkpoints=())
    if reason is None:
        (tmp_path / STATUS_FILE).unlink()
    args = parsed(tmp_path, "--resume_from_checkpoint", "latest")
    if accepted:
        check_output_dir(args)
        return
    with pytest.raises(UsageError, match=f"^--resume_from_checkpoint='latest': expected a checkpoint in {tmp_path} "
                                         f"to resume from: it holds .* of a run that "
                                         f"{'completed' if reason else 'left no run_status.json'}, but no checkpoint; "
                                         f"{'pass --overwrite_output_dir' if reason else 'choose another'}"):
        check_output_dir(args)


def test_a_new_run_takes_the_folder_when_it_is_ready_and_a_resumed_one_leaves_it_to_the_loop(tmp_path):
    earlier_run(tmp_path / "resumed")
    for output_dir, flags, taken in [(tmp_path / "new", (), True), (tmp_path / "resumed", ("--resume_from_checkpoint",
                                                                                          "latest"), False),
                                     (tmp_path / "started over", ("--resume_from_checkpoint", "latest"), True)]:
        args, run = parsed(output_dir, *flags), RunRecord()
        check_output_dir(args)
        prepare_output_dir(args, run)
        assert (run.output_dir == str(output_dir)) == taken
        assert read_status(output_dir) == ({"reason": "running", "exit_status": None, "last_step": None,
                                            "resume_from": None, "message": ""} if taken else {"reason": "completed"})


def test_a_folder_on_a_read_only_file_system_is_one_line(tmp_path, monkeypatch):
    def read_only(dir):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(writing.tempfile, "TemporaryFile", read_only)
    with pytest.raises(UsageError) as error:
        check_output_dir(parsed(tmp_path / "out"))
    assert str(error.value) == (f"--output_dir={str(tmp_path / 'out')!r}: expected a folder this run can write "
                                f"({tmp_path}: Read-only file system)")


def test_overwrite_output_dir_clears_what_runs_write_and_keeps_the_users_files(tmp_path):
    earlier_run(tmp_path)
    (tmp_path / "ema" / ".incomplete-xyz").mkdir()
    args = parsed(tmp_path, "--overwrite_output_dir")
    check_output_dir(args)
    prepare_output_dir(args, RunRecord())
    assert sorted(files_of(tmp_path)) == ["notes.txt", STATUS_FILE]
    assert read_status(tmp_path)["reason"] == "running"


def test_overwrite_output_dir_never_clears_a_logging_dir_outside_the_folder(tmp_path):
    output_dir, elsewhere = tmp_path / "out", tmp_path / "logs"
    earlier_run(output_dir)
    (elsewhere / "events").parent.mkdir()
    (elsewhere / "events").write_text("another folder's logs")
    for logging_dir in (str(elsewhere), "../logs", "."):
        prepare_output_dir(parsed(output_dir, "--overwrite_output_dir", "--logging_dir", logging_dir), RunRecord())
    assert (elsewhere / "events").read_text() == "another folder's logs"
    assert (output_dir / "notes.txt").is_file()


def test_the_next_run_removes_what_killed_writes_left_wherever_they_were(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="training_utils.outputs.folder")
    earlier_run(tmp_path, "preempted")
    left = [tmp_path / ".incomplete-a1" / "vae" / "diffusion_pytorch_model.safetensors",
            tmp_path / "ema" / ".incomplete-b2" / "pytorch_lora_weights.safetensors",
            tmp_path / ".incomplete-checkpoint-4" / "optimizer.bin", tmp_path / ".checkpoint-6.incomplete" / "x"]
    for path in left:
        path.parent.mkdir(parents=True)
        path.write_bytes(b"half written")
    before = files_of(tmp_path)
    args = parsed(tmp_path, "--resume_from_checkpoint", "latest")
    check_output_dir(args)
    prepare_output_dir(args, RunRecord())
    assert files_of(tmp_path) == {name: data for name, data in before.items() if "incomplete" not in name}
    assert len(files_of(tmp_path)) == len(before) - len(left)
    assert "removed what 4 interrupted write(s) left" in caplog.text


def model_folder(folder):
    """A pipeline folder as a user's fine-tuned base is, README included; returns every file's bytes by path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                         **{name: ["diffusers", "x"] for name in ("unet", "vae")}}))
    for name in ("unet/config.json", "unet/diffusion_pytorch_model.safetensors", "vae/config.json", "README.md"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(f"the base model's {name}")
    return files_of(folder)


@pytest.mark.parametrize("script", ["text_to_image/train_text_to_image_lora.py",
                                    "text_to_image/train_text_to_image.py"])
@pytest.mark.parametrize("output_dir", ["model", "./work/../model", "link to model", "model/unet", "model/lora",
                                        "."])
def test_the_output_folder_is_never_a_model_folder_the_run_reads_inside_it_or_holding_it(tmp_path, monkeypatch,
                                                                                          script, output_dir):
    monkeypatch.chdir(tmp_path)
    before = model_folder(tmp_path / "model")
    (tmp_path / "link to model").symlink_to(tmp_path / "model")
    line = usage_error(script, "--pretrained_model_name_or_path", "model",
                       "--train_data_dir", tmp_path, "--output_dir", output_dir, "--overwrite_output_dir")
    assert line == (f"error: --output_dir={output_dir!r}: expected a folder apart from the model folder of "
                    f"--pretrained_model_name_or_path (model): not that folder, inside it or holding it, where this "
                    f"run's outputs would mix with the model's files")
    assert files_of(tmp_path / "model") == before


def test_every_model_folder_flag_is_kept_apart_from_the_output_folder(tmp_path):
    model_folder(tmp_path / "controlnet")
    args = parsed(tmp_path / "controlnet" / "out")
    args.controlnet_model_name_or_path = str(tmp_path / "controlnet")
    with pytest.raises(UsageError, match="apart from the model folder of --controlnet_model_name_or_path"):
        check_output_dir(args)
    check_output_dir(parsed(tmp_path / "out"))


def test_overwrite_output_dir_never_clears_a_folder_no_run_wrote_into(tmp_path):
    before = model_folder(tmp_path)
    with pytest.raises(UsageError) as refused:
        check_output_dir(parsed(tmp_path, "--overwrite_output_dir"))
    assert str(refused.value) == (f"--overwrite_output_dir=True: expected an --output_dir that runs of these scripts "
                                  f"wrote into (with {STATUS_FILE}); {tmp_path} holds README.md, model_index.json, "
                                  f"unet, vae without one, which --overwrite_output_dir never removes: choose another "
                                  f"--output_dir")
    prepare_output_dir(parsed(tmp_path, "--overwrite_output_dir"), RunRecord())
    assert {name: data for name, data in files_of(tmp_path).items() if name != STATUS_FILE} == before


def test_the_refusal_suggests_overwrite_output_dir_only_for_a_folder_a_run_wrote_into(tmp_path):
    model_folder(tmp_path)
    with pytest.raises(UsageError) as refused:
        check_output_dir(parsed(tmp_path))
    assert str(refused.value).endswith("pass --resume_from_checkpoint latest to continue that run, or choose another "
                                       "--output_dir")
