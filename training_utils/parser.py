"""The command-line parser of every script and command here: errors in one line, and upstream flags refused.

A flag of an upstream diffusers script that a script here does not carry is refused in one line saying why, as
soon as it is parsed, before anything loads (`add_refused_args`); a bad value is one line too::

    error: --resolution=500: expected a positive multiple of 8
    error: --optimizer is not supported here: AdamW is the only optimizer here ...
"""

import argparse
import sys

from .errors import UsageError


class TrainingArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line, like the checks that follow parsing.

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
        return super().parse_known_args(args, namespace)

    def error(self, message):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


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
