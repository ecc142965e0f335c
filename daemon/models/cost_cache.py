"""Calibrated cost curves: measured once, cached, and under which key.

A verify-cost curve depends on the model file, the context's draft length, the machine
(its cores), the layer placement, the thread count and how the threads wait (sleeping
threads make a one-row decode relatively dearer than a wide forward); measuring one
takes seconds, so it is kept per key and reused by later runs (measured and checked by
:mod:`.calibration`; only a curve measured on a quiet machine is kept)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from meshd.native.context import ContextConfig
from meshd.native.cpus import openmp_wait_settings


def cost_model_key(model_path: Path, config: ContextConfig,
                   placement: Sequence[object] = ()) -> list[object]:
    """What a cost curve depends on besides the thread count."""
    st = model_path.stat()
    key: list[object] = [str(model_path), st.st_size, st.st_mtime_ns, config.draft_max,
                         os.cpu_count(), *openmp_wait_settings()]
    if placement:  # layers on remote workers cost what their network and cores cost
        key.append(list(placement))
    return key


def cost_cache_dir() -> Path:
    """Where calibrated cost curves are kept.

    Under systemd (``CacheDirectory=meshd`` / ``StateDirectory=meshd``) the service's own
    writable directories, since a hardened unit can write nowhere else (its home may be
    ``/``); otherwise ``$XDG_CACHE_HOME/meshd/costs`` (default ``~/.cache``).
    """
    for variable in ("CACHE_DIRECTORY", "STATE_DIRECTORY"):
        value = os.environ.get(variable)
        if value:  # systemd passes a colon-separated list; the first is ours
            return Path(value.split(":")[0]) / "costs"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "meshd" / "costs"


def cost_cache_path(model_path: Path, config: ContextConfig, threads: int | None,
                    placement: Sequence[object] = ()) -> Path:
    key = json.dumps([*cost_model_key(model_path, config, placement), threads])
    return cost_cache_dir() / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".json")


def cached_thread_counts(model_key: list[object]) -> list[int | None]:
    """Thread counts with a cached curve for this model (a different ``--threads`` needs
    its own: the cost of a batch against one decode depends on it)."""
    found: list[int | None] = []
    try:
        files = list(cost_cache_dir().glob("*.json"))
    except OSError:
        return found
    for f in files:
        try:
            data = json.loads(f.read_text())
            if data.get("model") == model_key:
                found.append(data.get("threads"))
        except (OSError, ValueError, AttributeError):
            continue
    return found


def read_cached_costs(cache: Path) -> list[float] | None:
    """The curve kept at ``cache`` (None: none, or unreadable)."""
    try:
        return [float(c) for c in json.loads(cache.read_text())["costs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_cached_mtp(cache: Path) -> tuple[float, float] | None:
    """The MTP head's costs kept with the curve at ``cache`` (overhead, cost per drafted
    token; None: none, or unreadable)."""
    try:
        overhead, draft_cost = (float(c) for c in json.loads(cache.read_text())["mtp"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (overhead, draft_cost) if overhead >= 0 and draft_cost >= 0 else None


def write_cached_costs(cache: Path, costs: Sequence[float], model_key: list[object],
                       threads: int | None,
                       mtp: tuple[float, float] | None = None) -> OSError | None:
    """Keep ``costs`` (and the MTP head's, where measured) at ``cache`` (atomically);
    the error where it cannot be written (serving goes on; the next start measures
    again)."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        record: dict[str, object] = {"costs": list(costs), "model": model_key,
                                     "threads": threads}
        if mtp is not None:
            record["mtp"] = list(mtp)
        tmp.write_text(json.dumps(record))
        tmp.replace(cache)
    except OSError as exc:
        return exc
    return None


def check_writable(cache: Path) -> OSError | None:
    """Whether a curve can be kept at ``cache`` (checked when a run starts to measure
    one, so that an unwritable directory is said at once, not after the measurement)."""
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        probe = cache.with_suffix(".probe")
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        return exc
    return None


def unwritable_note(cache: Path, exc: OSError) -> str:
    return (f"cannot keep the measured verify cost in {cache.parent}: "
            f"{exc.strerror or exc}; the next start will measure it again (make the "
            "directory writable, or set XDG_CACHE_HOME / CACHE_DIRECTORY)")


def other_threads_note(model_key: list[object], threads: int | None) -> str | None:
    """Why a curve is measured where one is cached for other thread counts (None: none
    is)."""
    others = [t for t in cached_thread_counts(model_key) if t != threads]
    if not others:
        return None

    def name(t: int | None) -> str:
        return f"--threads {t}" if t else "the default threads"

    return (f"measuring the verify cost again for {name(threads)}: the cached measurement "
            f"is for {', '.join(sorted({name(t) for t in others}))} "
            "(it depends on the thread count)")
