"""The command-line parser of every script and command here: errors in one line, and upstream flags refused.

A flag of an upstream diffusers script that a script here does not carry is refused in one line saying why, as
soon as it is parsed, before anything loads (`add_refused_args`); a bad value is one line too, naming the flag as
the user spelled it where it has several spellings (`flag_name`)::

    error: --resolution=500: expected a positive multiple of 8
    error: --proportion_empty_prompts=2.0: expected a number in [0, 1]
    error: --optimizer is not supported here: AdamW is the only optimizer here ...
"""

import argparse
import sys

from .errors import UsageError


# Flags of the upstream diffusers scripts that no script here carries, and why; a script refuses those its
# upstream counterpart has (`add_refused_args`), with reasons of its own beside these.
NOT_CARRIED = {
    "--optimizer": "AdamW is the only optimizer here (--use_8bit_adam for bitsandbytes' 8-bit AdamW); Prodigy is "
                   "not carried",
    **dict.fromkeys(["--prodigy_beta3", "--prodigy_decouple", "--prodigy_use_bias_correction",
                     "--prodigy_safeguard_warmup"], "Prodigy is not carried (AdamW only)"),
    **dict.fromkeys(["--lr_num_cycles", "--lr_power"],
                    "the learning-rate schedules run with diffusers' defaults (one cycle, power 1)"),
    "--upcast_before_saving": "the adapters train in fp32 and are always saved in fp32",
    "--skip_final_inference": "there is no separate final inference: validation renders in the loop (the final step "
                              "included) and only with --validation_prompt",
    "--final_validation_prompt": "validation renders --validation_prompt in the loop, the final step included",
    "--prior_generation_precision": "class images are rendered by the pipeline that trains, in --mixed_precision's "
                                    "dtype",
    "--local_rank": "accelerate launch (or torchrun) tells each process its rank",
    "--enable_npu_flash_attention": "Ascend NPUs are not supported",
    "--enable_xformers_memory_efficient_attention": "attention runs on PyTorch's scaled_dot_product_attention "
                                                    "(diffusers' default), as fast on current PyTorch, nothing to "
                                                    "install",
    "--tokenizer_name": "the tokenizers are the pipeline's (--pretrained_model_name_or_path)",
}


class ParsedArgs(argparse.Namespace):
    """The parsed flags, as argparse gives them; ``spellings`` holds how the user wrote each flag given that has
    several spellings (by its name), kept out of ``vars()``, which is what checkpoints and trackers record."""

    __slots__ = ("spellings",)


class TrainingArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, like the checks that follow parsing, and whose results are
    `ParsedArgs`.

    ``refused`` (``{flag: why}``) are flags of the upstream scripts that are refused in one line saying why
    (`add_refused_args`), each unless the script added a flag of that name itself: they are added when parsing
    starts, after everything the script added."""

    def __init__(self, *args, refused=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.refused = dict(refused or {})

    def parse_known_args(self, args=None, namespace=None):
        refused = {flag: why for flag, why in self.refused.items() if flag not in self._option_string_actions}
        if refused:
            add_refused_args(self, refused)
        self.refused = {}
        namespace = ParsedArgs() if namespace is None else namespace
        parsed, extras = super().parse_known_args(args, namespace)
        if isinstance(parsed, ParsedArgs):
            parsed.spellings = self.spellings(sys.argv[1:] if args is None else [str(arg) for arg in args])
        return parsed, extras

    def spellings(self, argv):
        """``{name: the option string last given for it}`` for the flags of ``argv`` that have several spellings,
        abbreviations resolved as argparse resolves them."""
        spellings = {}
        for token in argv:
            option = self.typed_option(token.partition("=")[0])
            action = self._option_string_actions.get(option)
            if action is not None and len(action.option_strings) > 1:
                spellings[action.dest] = option
        return spellings

    def typed_option(self, typed):
        """The option string that ``typed`` names: itself, or the one option it abbreviates; None for neither."""
        if not typed.startswith("--") or typed in self._option_string_actions:
            return typed
        completions = [option for option in self._option_string_actions if option.startswith(typed)]
        return completions[0] if self.allow_abbrev and len(completions) == 1 else None

    def error(self, message):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def flag_name(args, name):
    """The flag ``name`` (an argument's ``dest``) as the user spelled it, for a message about its value."""
    return getattr(args, "spellings", {}).get(name, f"--{name}")


class RefusedFlag(argparse.Action):
    """A flag accepted only to stop the run, as soon as it is parsed, with one line saying why it is refused."""

    def __init__(self, option_strings, dest, why, **kwargs):
        super().__init__(option_strings, dest, nargs="?", default=None, help=f"not supported: {why}", **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        raise UsageError(None, None, f"{option_string} is not supported here: {self.why}")


def add_refused_args(parser, refused):
    """Add ``refused`` (``{flag: why}``), flags of the upstream script that this one does not carry: given one,
    with or without a value, parsing stops with one line saying why, before anything loads (never silently
    ignored, never a bare "unrecognized arguments"). A flag the parser already has, from a shared group that
    this script does not read, is replaced."""
    group = parser.add_argument_group("upstream flags not supported here", conflict_handler="resolve")
    for flag, why in refused.items():
        group.add_argument(flag, action=RefusedFlag, why=why)
