"""MTP proposer: drafts from the model's own multi-token-prediction head.

Thin on purpose: the head (``ProposerEnv.mtp``, a :class:`DraftHead` bound to this
session by the engine) already tracks the committed sequence, so this proposer only asks
it for ``k`` tokens. How many to ask for is the adaptive layer's decision (it sets
``ProposalRequest.max_len``). The optional ``min_prob`` cut exists for heads whose
probabilities are well calibrated: drafting stops at the first token the head itself
rates below the threshold. It defaults to 0 (no cut) because per-position acceptance
measured by the adaptive layer is the more reliable signal.
"""

from __future__ import annotations

from .base import (
    Capabilities,
    DraftHead,
    Outcome,
    Proposal,
    ProposalRequest,
    ProposerEnv,
    ProposerUnavailable,
)
from .registry import float_option, int_option

DEFAULT_MAX_LEN = 8


class MtpProposer:
    """Proposer over a session's native MTP head."""

    name = "mtp"

    def __init__(self, head: DraftHead, *, max_len: int = DEFAULT_MAX_LEN, min_prob: float = 0.0):
        if max_len < 1:
            raise ValueError("max_len must be >= 1")
        self.head = head
        self.min_prob = min_prob
        self.capabilities = Capabilities(needs_mtp_head=True, max_len=max_len)

    def propose(self, request: ProposalRequest) -> Proposal | None:
        k = min(request.max_len, self.capabilities.max_len)
        if k <= 0:
            return None
        cut = self.min_prob > 0.0
        tokens, probs = self.head.draft(k, probs=cut)
        n = min(len(tokens), k)
        if cut:
            n = next((i for i in range(min(n, len(probs))) if probs[i] < self.min_prob),
                     min(n, len(probs)))
        if n == 0:
            return None
        return Proposal(tuple(int(t) for t in tokens[:n]))

    def observe(self, outcome: Outcome) -> None:
        """Nothing to learn here: the engine keeps the head in step with the commits."""

    def close(self) -> None:
        """The head belongs to the engine's session; nothing of ours to release."""


def mtp_factory(env: ProposerEnv) -> MtpProposer:
    """Entry point ``mtp``. Options: ``max_len``, ``min_prob`` (0 = never cut)."""
    if env.mtp is None:
        raise ProposerUnavailable("mtp: this model has no MTP head")
    return MtpProposer(
        env.mtp,
        max_len=int_option(env.options, "max_len", DEFAULT_MAX_LEN, minimum=1),
        min_prob=float_option(env.options, "min_prob", 0.0, minimum=0.0, maximum=1.0),
    )
