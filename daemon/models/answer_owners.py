"""Whose answer each running generation is, so history lookup keeps it for that owner.

Why apart from the ledger: the ledger holds what was learned (the answers, by owner);
this holds who is asking now, for generations still running, and forgets them with the
generation (weakly held: one dropped without :meth:`AnswerOwners.finished` leaves
nothing behind).
"""

from __future__ import annotations

import weakref

from meshd.daemon.engine.generation import Generation
from meshd.plugins.history import HistoryStore, HistoryView
from meshd.plugins.match_stats import SharedMatchStats

__all__ = ["AnswerOwners"]


class AnswerOwners:
    """The owners of one model's running generations, and their views of its history."""

    def __init__(self, store: HistoryStore, stats: SharedMatchStats, *,
                 prompts: bool = False) -> None:
        """``prompts``: keep each prompt with its answer (default: the output only)."""
        self.store = store
        self.stats = stats
        self.prompts = prompts
        self._owners: weakref.WeakKeyDictionary[Generation, str] = weakref.WeakKeyDictionary()

    def view(self, owner: str) -> HistoryView:
        """The model's history as ``owner`` may see it."""
        return HistoryView(self.store, owner, prompts=self.prompts, stats=self.stats)

    def started(self, gen: Generation, owner: str | None) -> None:
        """``gen`` runs for ``owner`` (None: unknown, nothing is kept)."""
        if owner is not None and self.store.enabled:
            self._owners[gen] = owner

    def finished(self, gen: Generation, *, decoded: bool = True) -> None:
        """``gen`` ended: what it committed (where it ``decoded``) joins its owner's
        history."""
        owner = self._owners.pop(gen, None)
        if decoded and owner is not None and gen.committed:
            self.view(owner).remember(gen.prompt, gen.committed)
