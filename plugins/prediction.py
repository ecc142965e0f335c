"""The prediction proposer: OpenAI's Predicted Outputs, drafted like any proposer.

Why a proposer: a client that edits a file sends the text it expects back
(``prediction: {"type": "content", "content": ...}``). Most of the answer then copies it;
drafting from it turns those tokens into verify windows. Every draft is verified, so the
answer is the one the request gives without a prediction.

Where the answer is in the prediction: after the longest suffix of the committed text
(up to :data:`MAX_MATCH` tokens, at least :data:`MIN_MATCH`) that the prediction holds,
the latest such place first; the draft is what follows it there. A diff-style edit
that leaves the prediction (a changed line) finds it again a few tokens later.
"""

from __future__ import annotations

from collections.abc import Sequence

from .base import Capabilities, Outcome, Proposal, ProposalRequest, ProposerEnv
from .registry import int_option

__all__ = ["PredictionProposer", "prediction_factory"]

#: Longest committed suffix looked up in the prediction, and the shortest that counts.
MAX_MATCH = 8
MIN_MATCH = 2
#: Places of one n-gram compared per step (the latest ones: a repeated line).
MAX_CANDIDATES = 64


class PredictionProposer:
    """Drafts the tokens that follow the committed text's place in the prediction."""

    name = "prediction"

    def __init__(self, prediction: Sequence[int], *, max_len: int = 16) -> None:
        self.prediction = tuple(prediction)
        self.capabilities = Capabilities(max_len=max_len)
        # n-gram (n = MIN_MATCH) -> the positions after it, latest last.
        self._after: dict[tuple[int, ...], list[int]] = {}
        p = self.prediction
        for i in range(len(p) - MIN_MATCH + 1):
            self._after.setdefault(p[i:i + MIN_MATCH], []).append(i + MIN_MATCH)
        self.accepted = 0

    def propose(self, request: ProposalRequest) -> Proposal | None:
        tokens = request.tokens
        if len(tokens) < MIN_MATCH:
            return None
        start = self._place(tokens)
        if start is None or start >= len(self.prediction):
            return None
        draft = self.prediction[start:start + min(request.max_len,
                                                  self.capabilities.max_len)]
        return Proposal(draft) if draft else None

    def _place(self, tokens: Sequence[int]) -> int | None:
        """Where the prediction continues the committed text (None: nowhere)."""
        candidates = self._after.get(tuple(tokens[-MIN_MATCH:]))
        if not candidates:
            return None
        best, best_len = candidates[-1], MIN_MATCH
        for end in reversed(candidates[-MAX_CANDIDATES:]):  # longest, latest on ties
            n = MIN_MATCH
            while (n < MAX_MATCH and n < end and n < len(tokens)
                   and self.prediction[end - n - 1] == tokens[-n - 1]):
                n += 1
            if n > best_len:
                best, best_len = end, n
        return best

    def observe(self, outcome: Outcome) -> None:
        """Count the prediction's tokens the answer took (usage's accepted ones)."""
        self.accepted += outcome.accepted

    def close(self) -> None:
        """Holds nothing of its own."""


def prediction_factory(env: ProposerEnv) -> PredictionProposer:
    """Entry point ``prediction``. Options: ``tokens`` (the prediction's token ids, set by
    the daemon from the request's ``prediction``), ``max_len``."""
    tokens = env.options.get("tokens", ())
    if not isinstance(tokens, list | tuple) or not all(
            isinstance(t, int) and 0 <= t < env.vocab_size for t in tokens):
        raise ValueError("prediction: 'tokens' must be token ids of this model")
    return PredictionProposer(tokens, max_len=int_option(env.options, "max_len", 16,
                                                         minimum=1))
