"""Draft-model proposer: a second, smaller model with the same vocabulary drafts tokens.

The model itself is loaded once by the daemon (``meshd.native.draft.DraftModel``) and
handed over as ``ProposerEnv.resources["draft_model"]``; this proposer only owns one
request's sequence in it. Plugins never import the native layer: the two narrow
protocols below are all this module knows about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from .base import (
    Capabilities,
    Outcome,
    Proposal,
    ProposalRequest,
    ProposerEnv,
    ProposerUnavailable,
)
from .registry import int_option

DEFAULT_MAX_LEN = 16


class DraftSequenceLike(Protocol):
    def draft(self, tokens: Sequence[int], k: int) -> tuple[list[int], list[float]]: ...

    def close(self) -> None: ...


@runtime_checkable
class DraftModelLike(Protocol):
    def open_sequence(self) -> DraftSequenceLike: ...


class DraftProposer:
    """One request's proposer over a shared draft model."""

    name = "draft"

    def __init__(self, sequence: DraftSequenceLike, *, max_len: int = DEFAULT_MAX_LEN) -> None:
        self.sequence = sequence
        self.capabilities = Capabilities(provides_probs=True, max_len=max_len)

    def propose(self, request: ProposalRequest) -> Proposal | None:
        k = min(request.max_len, self.capabilities.max_len)
        tokens, probs = self.sequence.draft(request.tokens, k)
        if not tokens:
            return None
        return Proposal(tuple(tokens[:k]), tuple(probs[:k]))

    def observe(self, outcome: Outcome) -> None:
        """Nothing to learn: the next ``draft`` call re-syncs with the committed tokens."""

    def close(self) -> None:
        self.sequence.close()


def draft_factory(env: ProposerEnv) -> DraftProposer:
    """Entry point ``draft``. Needs ``resources["draft_model"]``; option ``max_len``."""
    model = env.resources.get("draft_model")
    if not isinstance(model, DraftModelLike):
        raise ProposerUnavailable(
            "draft: no draft model is loaded; ask for 'draft:PATH' with a GGUF that "
            "shares the target's vocabulary"
        )
    return DraftProposer(
        model.open_sequence(),
        max_len=int_option(env.options, "max_len", DEFAULT_MAX_LEN, minimum=1),
    )
