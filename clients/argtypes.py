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


def positive_seconds(text: str) -> float:
    """A duration in seconds > 0, or a usage error naming the value."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text}")
    return value


def gpu_layers(text: str) -> int:
    """``N|all``: layers to offload to accelerators; ``all`` is llama.cpp's -1."""
    if text.strip().lower() == "all":
        return -1
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of layers or 'all', got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more layers, or 'all', got {text}")
    return value


def weights(text: str) -> tuple[float, ...]:
    """``W[,W...]``: non-negative weights, not all zero (``--tensor-split 3,1``)."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 3,1, got {text}") from None
    if any(v < 0 or v != v for v in values) or not any(values):
        raise argparse.ArgumentTypeError(f"weights must be >= 0 and not all 0, got {text}")
    return values


def number(text: str) -> float:
    """Any finite number (a penalty; the protocol checks its range)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text}")
    return value


def token_bias(text: str) -> tuple[int, float]:
    """``ID=BIAS`` (a logit bias: ``--logit-bias 13=-100`` all but bans token 13)."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), number(bias)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, got {text!r}") from None

