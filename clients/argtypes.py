"""Argument types shared by the ``meshd`` and ``meshctl`` command lines (one definition,
one message).

argparse reports a plain ValueError from a type as "invalid <function name> value"; these
raise ArgumentTypeError so the message says what was expected.
"""

from __future__ import annotations

import argparse
import re
from typing import Final


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


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A value that does not parse: argparse reports its message as it is (it is an
    ArgumentTypeError), a configuration check catches it as the ValueError it also is."""


_NUMBER: Final = r"(\d+(?:\.\d*)?|\.\d+)"
_DURATION_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART: Final = re.compile(_NUMBER + r"(ms|s|m|h)")
DURATION_HELP: Final = "seconds like 300 or 2.5, or 30s, 5m, 1h, 1h30m; 0 means at once, -1 forever"


def duration_seconds(text: str) -> float:
    """A duration in seconds: ``300``, ``2.5``, ``30s``, ``5m``, ``1h`` (or ``1h30m``,
    ``500ms``); any negative one means forever and is -1.0 (as Ollama's keep_alive)."""
    body = text.strip()
    sign = -1.0 if body.startswith("-") else 1.0
    body = body[1:] if body[:1] in ("-", "+") else body
    if re.fullmatch(_NUMBER, body):
        value = float(body)
    elif body and re.fullmatch(f"(?:{_DURATION_PART.pattern})+", body):
        value = sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(body))
    else:
        raise BadValue(f"expected a duration ({DURATION_HELP}), got {text!r}")
    return -1.0 if sign < 0 and value > 0 else value


_SIZE: Final = re.compile(_NUMBER + r"\s*(?:([KMGT])(i?B)?|B)?", re.IGNORECASE)
_SIZE_POWERS: Final = {"K": 1, "M": 2, "G": 3, "T": 4}
SIZE_HELP: Final = ("bytes, or with K, M, G, T, also spelt KiB, MiB, GiB, TiB (powers of "
                    "1024), or KB, MB, GB, TB (powers of 1000), e.g. 8G")


def size_bytes(text: str) -> int:
    """A size in bytes > 0: ``123``, ``64K``, ``512M``, ``1.5G``, ``2T`` (powers of 1024,
    as ``MiB``/``GiB``); ``MB``/``GB`` are the SI powers of 1000, as on a disk's label."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise BadValue(f"expected a size ({SIZE_HELP}), got {text!r}")
    number, unit, suffix = match.groups()
    base = 1000 if suffix is not None and suffix.lower() == "b" else 1024
    value = int(float(number) * base ** _SIZE_POWERS[unit.upper()]) if unit \
        else int(float(number))
    if value < 1:
        raise BadValue(f"expected a size of at least 1 byte, got {text!r}")
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


def comma_list(text: str) -> tuple[str, ...]:
    """``A[,B...]``: the non-empty items, stripped (``--alias a,b``, ``A,B`` in the
    environment for a list key)."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


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

