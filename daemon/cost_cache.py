"""Calibrated cost curves: measured once, cached, and under which key.

A verify-cost curve depends on the model file, the context's draft length, the machine
(its cores), the layer placement, the thread count and how the threads wait (sleeping
threads make a one-row decode relatively dearer than a wide forward); measuring one
takes seconds, so it is kept per key and reused by later runs."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from meshd.native.calibrate import measure_row_costs, measure_row_costs_timed
from meshd.native.context import ContextConfig, TargetContext
from meshd.native.cpus import openmp_wait_settings
from meshd.policy.costs import SPOT_K, is_plausible, spot_agrees, within_rows

#: Interleaved rounds of the start-up check of a cached curve (its first sizes only).
SPOT_REPS = 3
#: A one-row forward shorter than this (a tiny model) is timed by the scheduler's noise
#: more than by its work: its cached curve is kept without the check.
SPOT_MIN_S = 0.002


class _Bar(Protocol):
    def done(self, result: str = "done") -> None: ...


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


def load_or_measure_costs(context: TargetContext, path: Path, *, threads: int | None,
                          placement: Sequence[object], note: Callable[[str, str], None],
                          step: Callable[[str], _Bar]) -> list[float]:
    """The calibrated curve of ``context``'s model: cached per model and machine (and
    measured again where a quick check of its first sizes disagrees:
    :func:`~meshd.policy.costs.spot_agrees`), measured (and measured again once if
    implausible) otherwise. A curve still implausible after that (heavy contention) is
    used capped at each size's rows and never cached; the online cost model corrects it
    from real forwards."""
    config = context.config
    cache = cost_cache_path(path, config, threads, placement)
    model_key = cost_model_key(path, config, placement)
    try:
        cached = [float(c) for c in json.loads(cache.read_text())["costs"]]
    except (OSError, ValueError, KeyError, TypeError):
        cached = []
    if is_plausible(cached) and len(cached) == config.draft_max + 1:
        spot, unit_s = measure_row_costs_timed(context, min(SPOT_K, config.draft_max),
                                               reps=SPOT_REPS)
        if unit_s < SPOT_MIN_S or spot_agrees(cached, spot):
            return cached
        note("recalibrating", "measuring the verify cost again: the cached curve "
             f"({_first(cached, len(spot))}) disagrees with what these forwards cost now "
             f"({_first(spot, len(spot))}); it was probably measured while other work ran")
    else:
        others = [t for t in cached_thread_counts(model_key) if t != threads]
        if others:
            def name(t: int | None) -> str:
                return f"--threads {t}" if t else "the default threads"

            note("recalibrating", f"measuring the verify cost again for {name(threads)}: "
                 "the cached measurement is for "
                 f"{', '.join(sorted({name(t) for t in others}))} "
                 "(it depends on the thread count)")
    bar = step("measuring the verify cost (once per model, threads and machine)")
    costs = measure_row_costs(context, config.draft_max)
    if not is_plausible(costs):  # measured under contention: try once more
        costs = measure_row_costs(context, config.draft_max, reps=9)
    bar.done()
    if not is_plausible(costs):
        return within_rows(costs)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text(json.dumps({"costs": costs, "model": model_key, "threads": threads}))
        tmp.replace(cache)
    except OSError as exc:  # serving goes on; the next start measures again
        note("cost_cache_unwritable", f"cannot keep the measured verify cost in "
             f"{cache.parent}: {exc.strerror or exc}; the next start will measure it again "
             "(make the directory writable, or set XDG_CACHE_HOME / CACHE_DIRECTORY)")
    return costs


def _first(costs: Sequence[float], n: int) -> str:
    """``c(1)=1.39, c(2)=2.03``: a curve's first sizes, for a note."""
    return ", ".join(f"c({k})={c:.2f}" for k, c in enumerate(costs[:n]) if k)
