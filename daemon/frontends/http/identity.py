"""What the HTTP answers say about the build and the model: ``system_fingerprint`` and
llama-server's ``build_info``.

Why derived, not random: OpenAI clients compare ``system_fingerprint`` across answers to
tell whether the backend changed (a seeded request is reproducible only on the same
one), so it must stay the same while meshd's version and the model file do, and change
when either does. The file is known by its name and size (hashing gigabytes per start
would cost seconds; a re-quantised file differs in size).
"""

from __future__ import annotations

import functools
import hashlib
import os

from meshd.daemon.requests.service import Service, server_version

__all__ = ["build_info", "system_fingerprint"]


def build_info() -> str:
    """``meshd <version>`` (llama-server puts its build number there)."""
    return f"meshd {server_version()}"


def system_fingerprint(service: Service, model: str | None = None) -> str:
    """``fp_`` and 12 hex digits of meshd's version, the model file's name and size
    (``model``: the name of the model, loaded, that answers; None: the default)."""
    runtime = service.models.get(model).runtime
    assert runtime is not None
    info = runtime.model.info
    return _fingerprint(server_version(), os.path.basename(info.path), info.size_bytes)


@functools.cache
def _fingerprint(version: str, name: str, size: int) -> str:
    digest = hashlib.sha256(f"{version}\0{name}\0{size}".encode()).hexdigest()
    return f"fp_{digest[:12]}"
