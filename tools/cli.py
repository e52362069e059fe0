"""What every tool's command line shares: a `--help` that shows each flag's default.

A tool builds its parser from the standard library (and megatron_moe.config, which is pure Python) only, and
imports torch and megatron-core after parsing, so that `--help` and a mistyped flag answer at once rather than
after seconds of imports (tests/unit/test_tool_cli.py runs every tool's `--help` and checks that neither loaded).
"""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (the tools' docstrings hold example commands), each flag's help followed by
    ``(default: X)``, unless the help already says what the default is or there is none to say (None, an off
    switch, a suppressed default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not shows_default(action) or "default" in text.lower():
            return text
        value = "%(default)s"
        if isinstance(action.default, (list, tuple)):  # as typed on the command line: `a b`, not `['a', 'b']`
            value = " ".join(map(str, action.default)).replace("%", "%%")
        return f"{text} (default: {value})" if text else f"(default: {value})"


def shows_default(action: argparse.Action) -> bool:
    """Whether a flag has a default worth printing: set, not an off switch, not argparse's own (--help)."""
    default = action.default
    if default is None or default is False or default == argparse.SUPPRESS:
        return False
    return bool(action.option_strings) and not isinstance(action, argparse._HelpAction)
