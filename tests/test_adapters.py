"""The adapter flags (training_utils.adapters.config): each kind's settings and defaults, peft's config made of them, and a
setting that the chosen kind lacks, or a bad value, refused in one line before anything loads."""

import pytest
from diffusers import StableDiffusionPipeline
from peft import LoHaConfig, LoKrConfig, LoraConfig, OFTConfig

from training_utils.adapters.config import adapter_config, check_adapter_args, fill_adapter_settings
from training_utils.args import add_lora_args, training_parser
from training_utils.errors import UsageError
from training_utils.outputs.checkpoint_folders import trajectory_flags


def checked(*flags):
    parser = training_parser("test")
    add_lora_args(parser, StableDiffusionPipeline)
    args = parser.parse_args(["--pretrained_model_name_or_path", "a/b", *map(str, flags)])
    check_adapter_args(args)
    fill_adapter_settings(args)
    return args


@pytest.mark.parametrize("flags, config_class, settings", [
    ((), LoraConfig, {"r": 4, "lora_alpha": 4, "lora_dropout": 0.0, "use_dora": False}),
    (("--use_dora",), LoraConfig, {"r": 4, "lora_alpha": 4, "use_dora": True}),
    (("--adapter", "dora", "--rank", 8, "--lora_alpha", 2, "--lora_dropout", 0.1), LoraConfig,
     {"r": 8, "lora_alpha": 2, "lora_dropout": 0.1, "use_dora": True}),
    (("--adapter", "lokr",), LoKrConfig, {"r": 8, "alpha": 8, "decompose_factor": -1, "decompose_both": False}),
    (("--adapter", "lokr", "--lokr_factor", 4, "--lokr_decompose_both", "--rank", 16), LoKrConfig,
     {"r": 16, "alpha": 16, "decompose_factor": 4, "decompose_both": True}),
    (("--adapter", "loha",), LoHaConfig, {"r": 8, "alpha": 4}),
    (("--adapter", "loha", "--rank", 16, "--lora_alpha", 1), LoHaConfig, {"r": 16, "alpha": 1}),
    (("--adapter", "oft",), OFTConfig, {"oft_block_size": 32, "r": 0}),
    (("--adapter", "oft", "--oft_block_size", 8), OFTConfig, {"oft_block_size": 8}),
])
def test_each_adapter_is_peft_config_with_its_settings_and_defaults(flags, config_class, settings):
    config = adapter_config(checked(*flags), ["to_q"])
    assert type(config) is config_class and config.target_modules == {"to_q"}
    assert {name: getattr(config, name) for name in settings} == settings


def test_the_adapter_and_its_settings_are_recorded_as_trajectory_flags():
    flags = trajectory_flags(checked("--adapter", "lokr"))
    assert {name: flags[name] for name in ("adapter", "rank", "lora_alpha", "lokr_factor", "lokr_decompose_both",
                                           "oft_block_size", "lora_dropout")} == {
        "adapter": "lokr", "rank": 8, "lora_alpha": None, "lokr_factor": -1, "lokr_decompose_both": False,
        "oft_block_size": None, "lora_dropout": None}
    # A LoRA run records what runs before the adapter flags recorded: a resume from their checkpoints is not refused.
    lora = trajectory_flags(checked())
    assert (lora["rank"], lora["lora_alpha"], lora["lora_dropout"]) == (4, None, 0.0)


@pytest.mark.parametrize("flags, message", [
    (("--adapter", "lora", "--lokr_factor", 4), "--lokr_factor=4: expected no --lokr_factor with --adapter lora "
                                                 "(a setting of LoKr)"),
    (("--adapter", "loha", "--lokr_decompose_both"), "--lokr_decompose_both=True: expected no --lokr_decompose_both "
                                                      "with --adapter loha (a setting of LoKr)"),
    (("--adapter", "lokr", "--lora_dropout", 0.1), "--lora_dropout=0.1: expected no --lora_dropout with --adapter "
                                                    "lokr (a setting of LoRA, DoRA)"),
    (("--adapter", "oft", "--rank", 4), "--rank=4: expected no --rank with --adapter oft (a setting of LoRA, DoRA, "
                                        "LoKr, LoHa)"),
    (("--adapter", "oft", "--lora_alpha", 4), "--lora_alpha=4.0: expected no --lora_alpha with --adapter oft"),
    (("--oft_block_size", 8), "--oft_block_size=8: expected no --oft_block_size with --adapter lora (a setting of "
                              "OFT)"),
    (("--use_dora", "--adapter", "lokr"), "--adapter='lokr': expected dora or nothing beside --use_dora"),
    (("--rank", 0), "--rank=0: expected a positive integer"),
    (("--lora_alpha", 0), "--lora_alpha=0.0: expected a positive number"),
    (("--lora_dropout", 1), "--lora_dropout=1.0: expected a number in [0, 1)"),
    (("--adapter", "lokr", "--lokr_factor", 0), "--lokr_factor=0: expected -1 (near the square root) or a positive"),
    (("--adapter", "oft", "--oft_block_size", 1), "--oft_block_size=1: expected an integer above 1"),
])
def test_a_setting_the_adapter_lacks_or_a_bad_value_is_one_line(flags, message):
    with pytest.raises(UsageError) as error:
        checked(*flags)
    assert str(error.value).startswith(message)


def test_an_oft_block_size_that_does_not_divide_an_adapted_layer_is_one_line_before_the_adapter_is_added():
    """peft would train a 24-wide layer with blocks of 8 (its nearest divisor) while adapter_config.json records 7."""
    import torch

    from training_utils.adapters.injection import add_adapter

    model = torch.nn.ModuleDict({"to_q": torch.nn.Linear(24, 8), "to_k": torch.nn.Linear(36, 8),
                                 "proj_out": torch.nn.Linear(5, 8)})  # not adapted: its width does not count
    with pytest.raises(UsageError, match=r"^--oft_block_size=7: expected a divisor of every adapted layer's input "
                                         r"width \(24, 36\): 2, 3, 4, 6, 12$"):
        add_adapter(model, adapter_config(checked("--adapter", "oft", "--oft_block_size", 7), ["to_q", "to_k"]))
    assert not any(name.startswith("oft") for name, _ in model.named_parameters())  # refused before adding
    add_adapter(model, adapter_config(checked("--adapter", "oft", "--oft_block_size", 6), ["to_q", "to_k"]))
    assert {module.oft_block_size["default"] for module in (model["to_q"], model["to_k"])} == {6}
