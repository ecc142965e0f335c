"""Draft-model proposer: a second, smaller model with the same vocabulary drafts tokens.

The model itself is loaded once by the daemon (``meshd.native.draft.DraftModel``) and
handed over as ``ProposerEnv.resources.draft_model`` because the factory declares
``Need.DRAFT_MODEL``, exactly as a third-party plugin would; this proposer only owns one
request's sequence in it. Plugins never import the native layer: the narrow protocols
in :mod:`meshd.plugins.resources` are all this module knows about it.
"""

from __future__ import annotations

from .base import (
    Capabilities,
    Outcome,
    Proposal,
    ProposalRequest,
    ProposerEnv,
    ProposerUnavailable,
)
from .registry import int_option
from .resources import DraftModelLike, DraftSequenceLike, Need, requires

DEFAULT_MAX_LEN = 16


class DraftProposer:
    """One request's proposer over a shared draft model."""

    name = "draft"

    def __init__(self, sequence: DraftSequenceLike, *, max_len: int = DEFAULT_MAX_LEN) -> None:
        self.sequence = sequence
        self.capabilities = Capabilities(max_len=max_len)

    def propose(self, request: ProposalRequest) -> Proposal | None:
        k = min(request.max_len, self.capabilities.max_len)
        tokens, _probs = self.sequence.draft(request.tokens, k)
        if not tokens:
            return None
        return Proposal(tuple(tokens[:k]))

    def observe(self, outcome: Outcome) -> None:
        """Nothing to learn: the next ``draft`` call re-syncs with the committed tokens."""

    def close(self) -> None:
        self.sequence.close()


@requires(Need.DRAFT_MODEL)
def draft_factory(env: ProposerEnv) -> DraftProposer:
    """Entry point ``draft``. Needs a draft model; option ``max_len``."""
    model = env.resources.draft_model
    if not isinstance(model, DraftModelLike):
        raise ProposerUnavailable(
            "draft: no draft model is loaded; ask for 'draft:PATH' with a GGUF that "
            "shares the target's vocabulary"
        )
    return DraftProposer(
        model.open_sequence(),
        max_len=int_option(env.options, "max_len", DEFAULT_MAX_LEN, minimum=1),
    )
