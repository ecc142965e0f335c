"""Where calibrated cost curves are cached, and under which key.

A verify-cost curve depends on the model file, the context's draft length, the machine
(its cores), the layer placement and the thread count; measuring one takes seconds, so
it is kept per key and reused by later runs."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from meshd.native.context import ContextConfig


def cost_model_key(model_path: Path, config: ContextConfig,
                   placement: Sequence[object] = ()) -> list[object]:
    """What a cost curve depends on besides the thread count."""
    st = model_path.stat()
    key: list[object] = [str(model_path), st.st_size, st.st_mtime_ns, config.draft_max,
                         os.cpu_count()]
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
