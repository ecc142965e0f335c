"""The draft models one runtime's requests draft with (``draft:PATH``), loaded once.

Why a set with a gate: a socket client names the path, so only the files the daemon
was started with (``--draft-model``) may load; every request on the model shares each
one, and they live as long as the runtime.
"""

from __future__ import annotations

from pathlib import Path

from meshd.daemon.engine.request_errors import RequestError
from meshd.daemon.models.timed_steps import Events, timed
from meshd.native.context import ContextConfig
from meshd.native.draft import DraftModel
from meshd.native.errors import ModelLoadError
from meshd.native.model import Model

__all__ = ["DraftModels"]


class DraftModels:
    """The draft models loaded for one target model, by resolved path."""

    def __init__(self, allowed: tuple[str, ...] | None, *, events: Events | None = None,
                 ) -> None:
        """``allowed``: the paths requests may name (None: any readable file, for
        in-process use by the local user)."""
        self.allowed = allowed
        self._events = events
        #: Resolved path -> the loaded draft (the thread tuning sets their threads too).
        self.loaded: dict[str, DraftModel] = {}

    def get(self, path: str, target: Model, config: ContextConfig) -> DraftModel:
        """The draft model at ``path``, loaded on first use with the target context's
        shape (``config``); RequestError where it is not allowed or fails to load."""
        key = str(Path(path).resolve())
        allowed = self.allowed
        if allowed is not None and key not in {str(Path(p).resolve()) for p in allowed}:
            offered = ", ".join(allowed) if allowed else "none (meshd serve --draft-model PATH)"
            raise RequestError(f"draft model {path} is not one this daemon serves; "
                               f"allowed: {offered}")
        if key not in self.loaded:
            try:
                with timed("draft_model_load", self._events, path=key):
                    self.loaded[key] = DraftModel(
                        key, target=target, n_ctx_seq=config.n_ctx_seq,
                        n_seq_max=config.n_seq_max, n_threads=config.n_threads,
                    )
            except ModelLoadError as exc:
                raise RequestError(str(exc)) from exc
        return self.loaded[key]

    def close(self) -> None:
        for draft in self.loaded.values():
            draft.close()
        self.loaded.clear()
