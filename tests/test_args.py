"""Flags and fail-fast checks of training_utils.args: every bad value is one "error: " line, exit 2."""

import argparse
import collections
from unittest import mock

import pytest
import torch
from diffusers import Flux2KleinPipeline, StableDiffusionPipeline

from helpers import SCRIPTS, import_script
from training_utils.adapters.config import fill_adapter_settings
from training_utils.args import (add_cache_args, add_diffusion_loss_args, add_lora_args, check_args, export_formats,
                                 fill_dependent_defaults, training_parser)
from training_utils.errors import UsageError, exit_on_usage_error
from training_utils.outputs.checkpoint_folders import trajectory_flags
from training_utils.parser import RefusedFlag, TrainingArgumentParser, add_refused_args
from training_utils.pipeline import is_hub_id


@pytest.fixture
def model_dir(tmp_path):
    """A folder that passes the pipeline check (only model_index.json is looked at)."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "model_index.json").write_text("{}")
    return path


@pytest.fixture
def no_cuda(monkeypatch):
    """Make the fp16 check see a machine without CUDA, whatever this machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def full_parser():
    parser = training_parser("test")
    add_lora_args(parser, StableDiffusionPipeline, train_text_encoder=True)
    add_diffusion_loss_args(parser)
    add_cache_args(parser)
    return parser


def parse_and_check(argv):
    parser = full_parser()
    with exit_on_usage_error():
        args = parser.parse_args(argv)
        check_args(args)
        fill_dependent_defaults(args)
    return args


# (id, extra argv, flag the message must name, text of the bad value the message must show or None)
BAD_INPUTS = [
    ("model-absolute-missing", ["--pretrained_model_name_or_path", "/nonexistent/model"],
     "--pretrained_model_name_or_path", "/nonexistent/model"),
    ("model-relative-missing", ["--pretrained_model_name_or_path", "./missing"],
     "--pretrained_model_name_or_path", "./missing"),
    ("model-no-model-index", ["--pretrained_model_name_or_path", "{empty_dir}"],
     "--pretrained_model_name_or_path", "{empty_dir}"),
    ("model-is-a-file", ["--pretrained_model_name_or_path", "{a_file}"],
     "--pretrained_model_name_or_path", "{a_file}"),
    ("resolution-not-multiple-of-8", ["--resolution", "500"], "--resolution", "500"),
    ("resolution-zero", ["--resolution", "0"], "--resolution", "0"),
    ("resolution-negative", ["--resolution=-8"], "--resolution", "-8"),
    ("resolution-not-an-int", ["--resolution", "abc"], "--resolution", "abc"),
    ("batch-size-zero", ["--train_batch_size", "0"], "--train_batch_size", "0"),
    ("batch-size-negative", ["--train_batch_size=-2"], "--train_batch_size", "-2"),
    ("epochs-zero", ["--num_train_epochs", "0"], "--num_train_epochs", "0"),
    ("max-train-steps-zero", ["--max_train_steps", "0"], "--max_train_steps", "0"),
    ("grad-accumulation-zero", ["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps", "0"),
    ("num-validation-images-negative", ["--num_validation_images", "-1"], "--num_validation_images", "-1"),
    ("validation-steps-zero", ["--validation_steps", "0"], "--validation_steps", "0"),
    ("validation-epochs-zero", ["--validation_epochs", "0"], "--validation_epochs", "0"),
    ("validation-inference-steps-zero", ["--validation_inference_steps", "0"], "--validation_inference_steps", "0"),
    ("checkpointing-steps-zero", ["--checkpointing_steps", "0"], "--checkpointing_steps", "0"),
    ("ema-decay-one", ["--ema_decay", "1.0"], "--ema_decay", "1.0"),
    ("ema-decay-negative", ["--ema_decay=-0.1"], "--ema_decay", "-0.1"),
    ("ema-decay-nan", ["--ema_decay", "nan"], "--ema_decay", "nan"),
    ("ema-update-every-zero", ["--ema_update_every", "0"], "--ema_update_every", "0"),
    ("checkpoints-total-limit-zero", ["--checkpoints_total_limit", "0"], "--checkpoints_total_limit", "0"),
    ("learning-rate-zero", ["--learning_rate", "0"], "--learning_rate", "0"),
    ("learning-rate-nan", ["--learning_rate", "nan"], "--learning_rate", "nan"),
    ("max-grad-norm-zero", ["--max_grad_norm", "0"], "--max_grad_norm", "0"),
    ("lr-warmup-negative", ["--lr_warmup_steps=-1"], "--lr_warmup_steps", "-1"),
    ("max-train-samples-zero", ["--max_train_samples", "0"], "--max_train_samples", "0"),
    ("rank-zero", ["--rank", "0"], "--rank", "0"),
    ("lora-dropout-one", ["--lora_dropout", "1.0"], "--lora_dropout", "1.0"),
    ("snr-gamma-zero", ["--snr_gamma", "0"], "--snr_gamma", "0"),
    ("feature-cache-dir-a-file", ["--feature_cache_dir", "{a_file}"], "--feature_cache_dir", "{a_file}"),
    ("resume-missing", ["--resume_from_checkpoint", "checkpoint-123"], "--resume_from_checkpoint", "checkpoint-123"),
    ("resume-missing-absolute", ["--resume_from_checkpoint", "/nonexistent/checkpoint-5"],
     "--resume_from_checkpoint", "/nonexistent/checkpoint-5"),
    ("fp16-without-cuda", ["--mixed_precision", "fp16"], "--mixed_precision", "fp16"),
    ("mixed-precision-unknown", ["--mixed_precision", "fp8"], "--mixed_precision", "fp8"),
    ("lr-scheduler-unknown", ["--lr_scheduler", "sometimes"], "--lr_scheduler", "sometimes"),
    ("empty-validation-prompt", ["--validation_prompt", ""], "--validation_prompt", None),
    ("blank-second-validation-prompt", ["--validation_prompt", "a red circle", "   "], "--validation_prompt", None),
    ("hub-token-with-wandb", ["--hub_token", "hf_secret123", "--report_to", "wandb"], "--hub_token", None),
    ("hub-token-with-all", ["--hub_token", "hf_secret123", "--report_to", "all"], "--hub_token", None),
    ("repeats-zero", ["--repeats", "0"], "--repeats", "0"),
    ("caption-dropout-above-one", ["--caption_dropout", "1.5"], "--caption_dropout", "1.5"),
    ("proportion-empty-prompts-negative", ["--proportion_empty_prompts=-0.1"], "--proportion_empty_prompts=-0.1", None),
    ("proportion-empty-prompts-abbreviated", ["--proportion_empty", "2"], "--proportion_empty_prompts=2.0", None),
    ("lora-alpha-nan", ["--lora_alpha", "nan"], "--lora_alpha=nan", None),
    ("lora-alpha-negative", ["--lora_alpha=-4"], "--lora_alpha=-4.0", None),
    ("output-dir-is-a-file", ["--output_dir", "{a_file}"], "--output_dir", "{a_file}"),
    ("output-dir-under-a-file", ["--output_dir", "{a_file}/out"], "--output_dir", "{a_file} is a file, not a folder"),
    ("overwrite-output-dir-while-resuming", ["--overwrite_output_dir", "--resume_from_checkpoint", "latest"],
     "--overwrite_output_dir", "no --resume_from_checkpoint with it"),
    ("feature-cache-dir-is-a-file", ["--feature_cache_dir", "{a_file}"], "--feature_cache_dir", "{a_file}"),
    ("feature-cache-dir-under-a-file", ["--feature_cache_dir", "{a_file}/cache"], "--feature_cache_dir",
     "{a_file} is a file, not a folder"),
    ("validation-height-not-multiple-of-8", ["--validation_height", "30"], "--validation_height", "30"),
    ("bucket-list-malformed", ["--aspect_ratio_buckets", "512x768"], "--aspect_ratio_buckets", "512x768"),
    ("bucket-not-multiple-of-8", ["--aspect_ratio_buckets", "512,772;768,512"], "--aspect_ratio_buckets", "512,772"),
    ("missing-required-model", None, "--pretrained_model_name_or_path", None),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(case, model_dir, tmp_path, capsys, no_cuda, monkeypatch):
    _, extra, flag, value = case
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    a_file = tmp_path / "model_index.json"
    a_file.write_text("{}")
    monkeypatch.chdir(tmp_path)  # relative paths (./missing, checkpoint-123) resolve in an empty place

    def fill(text):
        return text.format(empty_dir=empty_dir, a_file=a_file)

    if extra is None:
        argv = []
    else:
        argv = ["--pretrained_model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "out")]
        argv += [fill(item) for item in extra]
    with pytest.raises(SystemExit) as exited:
        parse_and_check(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    line = lines[0]
    assert line.startswith("error: ")
    assert flag in line
    assert "Traceback" not in captured.err
    if value is not None:
        assert fill(value) in line
    assert "hf_secret123" not in captured.err  # a token never reaches the terminal or logs


def test_hub_token_message_hides_the_token(model_dir, capsys):
    with pytest.raises(SystemExit):
        parse_and_check(["--pretrained_model_name_or_path", str(model_dir), "--hub_token", "hf_abcdef",
                         "--report_to", "wandb"])
    err = capsys.readouterr().err
    assert "hf_abcdef" not in err
    assert "<hidden>" in err


def test_argparse_error_is_one_line_without_usage(capsys):
    parser = TrainingArgumentParser(description="x")
    parser.add_argument("--count", type=int)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--count", "many"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["error: argument --count: invalid int value: 'many'"]


def test_parser_error_method_directly(capsys):
    parser = TrainingArgumentParser()
    with pytest.raises(SystemExit) as exited:
        parser.error("something is off")
    assert exited.value.code == 2
    assert capsys.readouterr().err == "error: something is off\n"


GOOD_INPUTS = [
    [],
    ["--resolution", "8"],
    ["--resolution", "64", "--center_crop", "--random_flip", "--cache_latents"],
    ["--resolution", "64", "--random_flip", "--cache_latents"],
    ["--ema_decay", "0"],
    ["--ema_decay", "0.999", "--use_ema", "--ema_update_every", "10", "--ema_device", "cpu"],
    ["--rank", "1", "--lora_dropout", "0.0", "--lora_alpha", "8", "--train_text_encoder"],
    ["--snr_gamma", "5.0", "--prediction_type", "v_prediction", "--noise_offset", "0.1"],
    ["--mixed_precision", "bf16"],
    ["--mixed_precision", "no"],
    ["--validation_prompt", "a red circle", "a blue square", "--num_validation_images", "1"],
    ["--validation_prompt", "a red circle", "--num_validation_images", "0"],
    ["--resume_from_checkpoint", "latest"],
    ["--hub_token", "hf_x", "--report_to", "tensorboard"],
    ["--report_to", "wandb"],
    ["--max_train_steps", "3", "--checkpoints_total_limit", "1", "--max_train_samples", "2"],
    ["--lr_warmup_steps", "0", "--dataloader_num_workers", "0", "--learning_rate", "1e-6", "--scale_lr"],
]


@pytest.mark.parametrize("extra", GOOD_INPUTS, ids=lambda extra: " ".join(extra) or "defaults")
def test_good_inputs_pass(extra, model_dir, tmp_path, capsys, no_cuda):
    args = parse_and_check(["--pretrained_model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "out")]
                           + extra)
    assert args.pretrained_model_name_or_path == str(model_dir)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("model", ["runwayml/stable-diffusion-v1-5", "stabilityai/sdxl-turbo", "gpt2"])
def test_hub_ids_pass_without_network(model, capsys):
    args = parse_and_check(["--pretrained_model_name_or_path", model])
    assert args.pretrained_model_name_or_path == model


@pytest.mark.parametrize("value, expected", [("gpt2", True), ("owner/name-1.5", True), ("./model", False),
                                             (".hidden", False), ("a/b/c", False), ("/abs/path", False)])
def test_is_hub_id_tells_hub_ids_from_paths(value, expected):
    assert is_hub_id(value) is expected


def test_resume_from_existing_checkpoint_passes(model_dir, tmp_path):
    checkpoint = tmp_path / "out" / "checkpoint-7"
    checkpoint.mkdir(parents=True)
    (checkpoint / "training_state.json").write_text('{"global_step": 7}')
    for value in ("checkpoint-7", str(checkpoint)):
        args = parse_and_check(["--pretrained_model_name_or_path", str(model_dir),
                                "--output_dir", str(tmp_path / "out"), "--resume_from_checkpoint", value])
        assert args.resume_from_checkpoint == value


def test_fp16_is_accepted_when_cuda_is_there(model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    args = parse_and_check(["--pretrained_model_name_or_path", str(model_dir), "--mixed_precision", "fp16"])
    assert args.mixed_precision == "fp16"
    # accelerate launch sets ACCELERATE_USE_CPU=False on GPU machines: that is not the CPU.
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")
    assert parse_and_check(["--pretrained_model_name_or_path", str(model_dir), "--mixed_precision", "fp16"])
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    with pytest.raises(SystemExit):
        parse_and_check(["--pretrained_model_name_or_path", str(model_dir), "--mixed_precision", "fp16"])


@pytest.mark.parametrize(
    "extra, expected_steps, expected_epochs",
    [
        ([], 100, None),
        (["--validation_steps", "7"], 7, None),
        (["--validation_epochs", "2"], None, 2),
        (["--validation_steps", "5", "--validation_epochs", "3"], 5, 3),
    ],
)
def test_validation_steps_default(extra, expected_steps, expected_epochs, model_dir):
    args = parse_and_check(["--pretrained_model_name_or_path", str(model_dir)] + extra)
    assert args.validation_steps == expected_steps
    assert args.validation_epochs == expected_epochs


def test_parse_alone_leaves_validation_steps_unset(model_dir):
    args = training_parser("x").parse_args(["--pretrained_model_name_or_path", str(model_dir)])
    assert args.validation_steps is None


def test_the_checks_fill_in_nothing_and_the_dependent_defaults_are_filled_in_one_step(model_dir):
    args = full_parser().parse_args(["--pretrained_model_name_or_path", str(model_dir), "--adapter", "lokr"])
    parsed = dict(vars(args))
    check_args(args)
    assert vars(args) == parsed
    fill_dependent_defaults(args)
    assert {name: value for name, value in vars(args).items() if value != parsed[name]} == {
        "validation_steps": 100, "rank": 8, "lokr_factor": -1, "lokr_decompose_both": False}


def test_defaults_and_parser_options():
    args = training_parser("x", validation_inference_steps=12, resolution=1024).parse_args(
        ["--pretrained_model_name_or_path", "a/b"])
    assert args.validation_inference_steps == 12
    assert args.resolution == 1024
    assert args.ema_decay == 0.9999
    assert args.ema_update_every == 1
    assert args.ema_device == "accelerator"
    assert args.use_ema is False
    assert args.validation_prompt is None
    assert args.checkpoints_total_limit is None
    assert args.image_column == "image" and args.caption_column == "text"
    assert not hasattr(args, "rank")
    assert not hasattr(args, "snr_gamma")


def test_validation_prompt_takes_several():
    args = training_parser("x").parse_args(["--pretrained_model_name_or_path", "a/b",
                                            "--validation_prompt", "one prompt", "two"])
    assert args.validation_prompt == ["one prompt", "two"]


def test_lora_and_loss_groups():
    parser = training_parser("x")
    add_lora_args(parser, StableDiffusionPipeline)
    add_diffusion_loss_args(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "a/b"])
    fill_adapter_settings(args)
    assert (args.adapter, args.rank, args.lora_alpha, args.lora_dropout) == ("lora", 4, None, 0.0)
    assert not hasattr(args, "train_text_encoder")
    assert (args.prediction_type, args.snr_gamma, args.noise_offset) == (None, None, 0.0)
    assert export_formats(args) == ["diffusers"]
    parser = training_parser("x")
    add_lora_args(parser, StableDiffusionPipeline, train_text_encoder=True)
    args = parser.parse_args(["--pretrained_model_name_or_path", "a/b", "--train_text_encoder", "--rank", "16"])
    assert args.train_text_encoder is True and args.rank == 16


def test_export_formats_are_those_of_the_family_and_upstreams_kohya_flag_adds_one(capsys):
    def parse(pipeline_class, *flags):
        parser = training_parser("x")
        add_lora_args(parser, pipeline_class)
        return parser.parse_args(["--pretrained_model_name_or_path", "a/b", *flags])

    assert export_formats(parse(StableDiffusionPipeline, "--output_kohya_format")) == ["diffusers", "kohya"]
    assert export_formats(parse(StableDiffusionPipeline, "--export_formats", "comfyui", "kohya",
                                "--output_kohya_format")) == ["diffusers", "comfyui", "kohya"]
    assert export_formats(parse(Flux2KleinPipeline, "--export_formats", "comfyui")) == ["diffusers", "comfyui"]
    with pytest.raises(SystemExit):
        parse(Flux2KleinPipeline, "--export_formats", "kohya")
    assert "invalid choice: 'kohya' (choose from 'diffusers', 'comfyui')" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(Flux2KleinPipeline, "--output_kohya_format")


def test_every_design_flag_exists():
    flags = """--pretrained_model_name_or_path --revision --variant --output_dir --seed --resolution
    --train_batch_size --num_train_epochs --max_train_steps --checkpointing_steps --checkpoints_total_limit
    --resume_from_checkpoint --gradient_accumulation_steps --gradient_checkpointing --learning_rate --scale_lr
    --lr_scheduler --lr_warmup_steps --use_8bit_adam --dataloader_num_workers --adam_beta1 --adam_beta2
    --adam_weight_decay --adam_epsilon --max_grad_norm --push_to_hub --hub_token --hub_model_id --logging_dir
    --allow_tf32 --report_to --mixed_precision --dataset_name --dataset_config_name --train_data_dir
    --image_column --caption_column --max_train_samples --cache_dir --center_crop --random_flip
    --validation_prompt --num_validation_images --validation_steps --validation_inference_steps
    --validation_epochs --use_ema --ema_decay --ema_update_every --ema_device""".split()
    known = set(training_parser("x")._option_string_actions)
    assert [flag for flag in flags if flag not in known] == []


def test_bf16_needs_a_gpu_that_supports_it(model_dir, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    with pytest.raises(SystemExit) as exit_info:
        parse_and_check(["--pretrained_model_name_or_path", str(model_dir), "--mixed_precision", "bf16"])
    assert exit_info.value.code == 2
    expected = "error: --mixed_precision='bf16': expected a GPU with bf16 support (use fp16 on this one)\n"
    assert capsys.readouterr().err == expected
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert parse_and_check(["--pretrained_model_name_or_path", str(model_dir), "--mixed_precision", "bf16"])


def test_trajectory_flags_record_what_decides_training_and_nothing_secret(model_dir, tmp_path):

    args = parse_and_check(["--pretrained_model_name_or_path", str(model_dir), "--output_dir", str(tmp_path / "out"),
                            "--hub_token", "hf_secret", "--validation_prompt", "a red circle", "--seed", "5"])
    recorded = trajectory_flags(args)
    assert recorded["seed"] == 5 and recorded["pretrained_model_name_or_path"] == str(model_dir)
    assert recorded["learning_rate"] == args.learning_rate and recorded["train_batch_size"] == args.train_batch_size
    for free in ("hub_token", "output_dir", "validation_prompt", "max_train_steps", "checkpointing_steps"):
        assert free not in recorded


@pytest.mark.parametrize("damage, problem", [
    (lambda path: path.write_bytes(path.read_bytes()[:-100]), "is \\d+ bytes, but its header describes \\d+"),
    (lambda path: path.write_bytes(path.read_bytes()[:4]), "has no readable header"),
    (lambda path: path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}"), "has a corrupt header"),
])
def test_a_damaged_weight_file_of_the_model_is_named_before_anything_loads(tiny, tmp_path, damage, problem):
    import shutil

    from training_utils.args import check_pretrained_path

    model = tmp_path / "model"
    shutil.copytree(tiny["sd"], model)
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    check_pretrained_path(str(model))
    damage(weights)
    with pytest.raises(UsageError, match=f"^--pretrained_model_name_or_path='{model}': expected a pipeline whose "
                                         f"weight files are whole: {weights} {problem}"):
        check_pretrained_path(str(model))


@pytest.mark.parametrize("argv, message", [
    (["--do_fp8_training"], "--do_fp8_training is not supported here: float8 training is not carried"),
    (["--guidance_scale", "1"], "--guidance_scale is not supported here: there is no guidance embedding"),
    (["--dataset_name=dogs"], "--dataset_name is not supported here: the images come from a folder"),
])
def test_refused_flags_stop_parsing_with_one_line_saying_why(model_dir, argv, message):
    parser = training_parser("test")
    add_refused_args(parser, {"--do_fp8_training": "float8 training is not carried",
                              "--guidance_scale": "there is no guidance embedding",
                              "--dataset_name": "the images come from a folder"})
    args = parser.parse_args(["--pretrained_model_name_or_path", str(model_dir)])
    assert args.do_fp8_training is args.guidance_scale is args.dataset_name is None
    # The shared group's --dataset_name is replaced, not doubled.
    assert [action.dest for action in parser._actions].count("dataset_name") == 1
    with pytest.raises(UsageError) as error:
        parser.parse_args(["--pretrained_model_name_or_path", str(model_dir), *argv])
    assert str(error.value) == message


class Parsing(Exception):
    """Raised where a script's parser starts parsing: everything it declares has been declared."""


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_scripts_parser_declares_each_flag_once(script):
    """Two declarations of a flag would be two defaults, the one added last winning. The one replacement allowed is a
    shared flag refused by a script that does not read it (DreamBooth's --train_data_dir)."""
    declared = collections.Counter()
    add_argument = argparse._ActionsContainer.add_argument

    def counting(container, *names, **kwargs):
        if kwargs.get("action") is not RefusedFlag:
            declared.update(name for name in names if name.startswith("--"))
        return add_argument(container, *names, **kwargs)

    def stop(parser, args=None, namespace=None):
        raise Parsing

    with mock.patch.object(argparse._ActionsContainer, "add_argument", counting), \
            mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop), pytest.raises(Parsing):
        import_script(script).parse_args([])
    assert "--dataset_name" in declared
    assert [flag for flag, count in declared.items() if count > 1] == []
