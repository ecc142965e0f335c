"""Command-line pieces shared by ``meshctl`` and ``meshd``: the help formatter, the
version option, subcommand parsers and the sampling options.

Why here rather than with the daemon's options: ``meshctl`` must not load the daemon
(numpy, llama.cpp) to parse its arguments, and both command lines must offer the same
sampling options with the same defaults, the protocol's.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import textwrap
from typing import Any

from meshd.protocol import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P

from .argtypes import integer, non_negative, non_negative_float, probability

__all__ = ["HelpFormatter", "add_version", "sampling_options", "seed_note", "subparser",
           "version_string"]


def version_string(prog: str) -> str:
    """``PROG VERSION`` from the installed distribution's metadata."""
    try:
        version = importlib.metadata.version("meshd")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown (not installed)"
    return f"{prog} {version}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps descriptions as written and appends ``(default: X)`` to each option's help.

    Options whose default is ``None``, ``False`` or empty say what happens in their own
    help text instead (``(default: None)`` would tell a user nothing).
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default is None or default is False or default == []
                or default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


def sampling_options() -> argparse.ArgumentParser:
    """``--temperature``, ``--seed``, ``--top-k``, ``--top-p``, with the protocol's
    defaults (the engine's too)."""
    p = argparse.ArgumentParser(add_help=False, formatter_class=HelpFormatter)
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=non_negative_float,
                   default=DEFAULT_TEMPERATURE, metavar="T",
                   help="0 is greedy decoding")
    g.add_argument("--seed", type=integer, default=None, metavar="S",
                   help="random seed for temperature > 0 (seeded sampling is reproducible "
                        "and keeps speculation on)")
    g.add_argument("--top-k", type=non_negative, default=DEFAULT_TOP_K, metavar="K",
                   help="sample among the K most likely tokens; 0 keeps all")
    g.add_argument("--top-p", type=probability, default=DEFAULT_TOP_P, metavar="P",
                   help="sample among the most likely tokens whose probabilities add up to P")
    return p


def seed_note(temperature: float, seed: int | None) -> str | None:
    """What to tell a user who gave ``--seed`` at temperature 0 (else None).

    Why: greedy decoding uses no randomness, so the seed changes nothing (``done.seed``
    is null), and a user who expected varied, reproducible samples would not know why.
    """
    if seed is None or temperature > 0:
        return None
    return (f"--seed {seed} has no effect at temperature 0 (greedy decoding uses no "
            "randomness); give --temperature > 0 to sample")


def add_version(parser: argparse.ArgumentParser, prog: str) -> None:
    """``--version``: the installed meshd version."""
    parser.add_argument("--version", action="version", version=version_string(prog),
                        help="print the version and exit")


def subparser(sub: Any, name: str, *, help: str, description: str | None = None,
              parents: list[argparse.ArgumentParser] | None = None,
              ) -> argparse.ArgumentParser:
    """A subcommand parser with the shared formatter (defaults shown in the help)."""
    text = description or (help[:1].upper() + help[1:] + ".")
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=textwrap.fill(text, 88), parents=parents or [],
        formatter_class=HelpFormatter,
    )
    return parser
