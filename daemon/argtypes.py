"""Argument types shared by the ``meshd`` and ``meshctl`` command lines (one definition,
one message).

argparse reports a plain ValueError from a type as "invalid <function name> value"; these
raise ArgumentTypeError so the message says what was expected.
"""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def non_negative(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def integer(text: str) -> int:
    """Any integer (a seed)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def non_negative_float(text: str) -> float:
    """A number >= 0 (temperature)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0.0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1] (top-p)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value
