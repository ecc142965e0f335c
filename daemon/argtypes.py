"""Argument types shared by the ``meshd`` subcommands (one definition, one message)."""

from __future__ import annotations

import argparse


def positive(text: str) -> int:
    """An integer >= 1, or a usage error naming the value."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def non_negative(text: str) -> int:
    """An integer >= 0, or a usage error naming the value."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
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
