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


def workers(text: str) -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT...]``: remote workers (llama.cpp RPC servers)."""
    from meshd.native.rpc import parse_endpoints

    try:
        return tuple(str(ep) for ep in parse_endpoints(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def weights(text: str) -> tuple[float, ...]:
    """``W[,W...]``: non-negative weights, not all zero (``--tensor-split 3,1``)."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 3,1, got {text}") from None
    if any(v < 0 or v != v for v in values) or not any(values):
        raise argparse.ArgumentTypeError(f"weights must be >= 0 and not all 0, got {text}")
    return values


def add_placement_arguments(p: argparse.ArgumentParser) -> None:
    """``--rpc`` and ``--tensor-split``: split the model's layers across workers."""
    p.add_argument("--rpc", type=workers, default=(), metavar="HOST:PORT[,...]",
                   help="remote workers (meshd worker) to split the model's layers across")
    p.add_argument("--tensor-split", type=weights, default=(), metavar="W[,W...]",
                   help="weigh the layer split: one weight per device (local GPUs, then "
                        "each worker's devices); default: by free memory")
