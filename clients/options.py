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

from .argtypes import integer, non_negative, non_negative_float, number, probability, token_bias

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
    g.add_argument("--min-p", type=number, default=None, metavar="P",
                   help="drop tokens less likely than P times the most likely one")
    g.add_argument("--typical-p", type=number, default=None, metavar="P",
                   help="locally typical sampling's mass (1 disables)")
    g.add_argument("--repeat-penalty", type=number, default=None, metavar="X",
                   help="penalise tokens among the last --repeat-last-n (1 disables)")
    g.add_argument("--repeat-last-n", type=non_negative, default=None, metavar="N",
                   help="how many latest tokens the penalties look at (default 64)")
    g.add_argument("--presence-penalty", type=number, default=None, metavar="X",
                   help="subtracted once from each recent token's logit (-2..2)")
    g.add_argument("--frequency-penalty", type=number, default=None, metavar="X",
                   help="subtracted per occurrence from each recent token's logit (-2..2)")
    g.add_argument("--logit-bias", type=token_bias, action="append", default=[],
                   metavar="ID=BIAS", help="add BIAS to token ID's logit (repeatable)")
    return p


#: The sampling options that are only sent when given (the protocol has the defaults).
_EXTRAS = ("min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
           "frequency_penalty")


def sampling_extras(args: argparse.Namespace) -> dict[str, Any]:
    """The penalties and filters given on the command line, as the engine's
    ``SamplingParams`` keywords (``logit_bias`` as ``(id, bias)`` pairs)."""
    out: dict[str, Any] = {k: getattr(args, k) for k in _EXTRAS
                           if getattr(args, k, None) is not None}
    if getattr(args, "logit_bias", None):
        out["logit_bias"] = tuple(sorted(dict(args.logit_bias).items()))
    return out


def sampling_argv(args: argparse.Namespace) -> list[str]:
    """Those same options as command-line flags (to hand them on to another command)."""
    argv: list[str] = []
    for key, value in sampling_extras(args).items():
        if key == "logit_bias":
            argv += [a for token, bias in value for a in ("--logit-bias", f"{token}={bias}")]
        else:
            argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


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
