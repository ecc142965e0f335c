"""Where a model's layers go when some of them run on remote workers.

Why not llama.cpp's own split: it offloads the LAST layers over its devices in list
order, so with every device remote the MTP (nextn) block and the output head would sit
on a worker, and every draft step and every forward's logits would cross the network.
So the devices are listed in llama.cpp's ``--rpc`` order with this machine last (its CPU
as one more device when it has no accelerator), and the split is given as whole layer
counts per device: the MTP blocks and the output head on the local device, the trunk
over the others by weight. Drafting then costs no round trip, and a target forward
brings back one hidden row per token instead of a row of logits. A model loaded without
a placement (a draft model) never goes to a worker: RPC devices are not in ggml's
device registry, so llama.cpp's default selection does not see them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import gguf

from .llama import lc

__all__ = ["LayerPlan", "Placement", "apportion", "block_counts", "plan_for"]


@attrs.frozen
class LayerPlan:
    """How many layers of a model go to each device (llama.cpp's units: every block,
    the MTP blocks included, plus one for the output head)."""

    counts: tuple[int, ...]
    #: Units left on this CPU in front of the offloaded ones (``--gpu-layers`` < all).
    on_cpu: int
    #: Units kept on the last (local) device: the MTP blocks and the output head.
    tail: int


def apportion(total: int, weights: Sequence[float]) -> list[int]:
    """``total`` whole units over ``weights`` (largest remainder; ties to the earlier
    device). Weights must be >= 0 with a positive sum."""
    s = float(sum(weights))
    if total < 0 or s <= 0 or any(w < 0 for w in weights):
        raise ValueError("weights must be >= 0 and not all 0")
    quotas = [total * w / s for w in weights]
    counts = [int(q) for q in quotas]
    left = total - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


@attrs.frozen
class Placement:
    """Devices in llama.cpp's split order, the last one local, and the weights of the
    trunk's share (one per device; the CPU as a tail-only device weighs 0)."""

    devices: tuple[int, ...]
    weights: tuple[float, ...]
    #: Raises when a device of this placement is gone (checked around every forward).
    check: Callable[[], None] | None = attrs.field(default=None, eq=False)
    #: Whether the last device is this machine's CPU (no local accelerator).
    cpu_tail: bool = False

    def __attrs_post_init__(self) -> None:
        if len(self.weights) != len(self.devices):
            raise ValueError("one weight per device")

    def plan(self, n_blocks: int, n_nextn: int, n_gpu_layers: int) -> LayerPlan:
        """The layer counts for a model of ``n_blocks`` blocks (``n_nextn`` of them MTP)
        with ``n_gpu_layers`` offloaded (-1: all), as llama.cpp counts them."""
        units = n_blocks + 1
        offloaded = units if n_gpu_layers < 0 else min(n_gpu_layers, units)
        tail = min(n_nextn + 1, offloaded)
        rest = offloaded - tail
        counts = apportion(rest, self.weights) if rest else [0] * len(self.devices)
        counts[-1] += tail
        return LayerPlan(tuple(counts), units - offloaded, tail)

    def apply(self, params: Any, keep: list[Any], plan: LayerPlan) -> None:
        """Set ``params`` (llama_model_params); ``keep`` holds the arrays alive."""
        set_devices(params, keep, self.devices)
        n = int(lc.llama_max_devices())
        if len(self.devices) > n:
            raise ValueError(f"the split has {len(self.devices)} devices; llama.cpp "
                             f"takes at most {n}")
        if sum(plan.counts):  # all zero would mean "by free memory" to llama.cpp
            split = (ctypes.c_float * n)(*(float(c) for c in plan.counts))
            params.tensor_split = split
            keep.append(split)


def set_devices(params: Any, keep: list[Any], devices: Sequence[int]) -> None:
    """``params.devices`` = exactly ``devices`` (NULL-terminated; empty: only the CPU)."""
    arr = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
    params.devices = ctypes.cast(arr, ctypes.c_void_p)
    keep.append(arr)


def plan_for(placement: Placement, path: Path, n_gpu_layers: int) -> LayerPlan:
    """The plan for the GGUF at ``path``: its block count and MTP block count are read
    from the file's metadata, before llama.cpp loads it."""
    n_blocks, n_nextn = block_counts(path)
    return placement.plan(n_blocks, n_nextn, n_gpu_layers)


def block_counts(path: Path, reader: Any = None) -> tuple[int, int]:
    """``(block_count, nextn_predict_layers)`` of a GGUF file (what llama.cpp calls
    ``n_layer_all`` and ``n_layer_nextn``); ``reader``: the file's ``gguf.GGUFReader``
    when the caller has one (parsing the metadata takes seconds on a large vocabulary)."""
    if reader is None:
        reader = gguf.GGUFReader(str(path), "r")
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ValueError(f"{path} has no general.architecture")
    arch = str(arch_field.contents())

    def number(key: str, default: int | None) -> int:
        field = reader.fields.get(f"{arch}.{key}")
        if field is None:
            if default is None:
                raise ValueError(f"{path} has no {arch}.{key}")
            return default
        return int(field.contents())

    return number("block_count", None), number("nextn_predict_layers", 0)
