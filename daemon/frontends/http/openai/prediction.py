"""OpenAI's Predicted Outputs counters: which tokens of the prediction the answer holds.

Why not the drafting statistics: OpenAI counts ``accepted_prediction_tokens`` as the
prediction's tokens that appear in the completion and ``rejected_prediction_tokens`` as
the rest, whatever its servers did to produce it, so a client reads the same numbers
whether meshd drafted from the prediction, drafted with another proposer, or decided
(by its cost model) not to draft at all.

"Appear in the answer" is the longest common subsequence of the prediction's tokens and
the answer's (both tokenized alike, from their text): each prediction token is counted
at most once, in order, so an answer that is the prediction verbatim accepts all of it,
an edit in the middle (the use Predicted Outputs has: a file rewritten with a change)
rejects only the tokens it replaced, and a token the answer merely repeats elsewhere is
not counted twice. A longest common subsequence is also the most any aligning drafter
(one that finds its place in the prediction again after a difference, as meshd's
``prediction`` proposer does) could have taken from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["common_subsequence", "prediction_details"]


def common_subsequence(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common subsequence of ``a`` and ``b``.

    The bit-vector algorithm of Crochemore et al. (2001): one word-parallel update per
    token of the longer sequence over a bit per token of the shorter, so it takes
    O(len(a) * len(b) / 64) word operations and O(min(len(a), len(b))) bits; a
    prediction and an answer are each bounded by the context."""
    if len(a) > len(b):
        a, b = b, a
    if not a:
        return 0
    masks: dict[int, int] = {}
    for i, token in enumerate(a):
        masks[token] = masks.get(token, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full  # a zero bit per matched row of the table's last column
    for token in b:
        u = v & masks.get(token, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - v.bit_count()


def prediction_details(predicted: Sequence[int], answer: str,
                       tokenize: Callable[[str], Sequence[int]]) -> dict[str, int]:
    """``usage.completion_tokens_details``'s prediction counters for an answer whose
    text is ``answer``, the prediction being ``predicted`` (its tokens, as ``tokenize``
    gives them). Blocking (tokenizes; see :func:`common_subsequence` for the cost)."""
    accepted = common_subsequence(predicted, tokenize(answer)) if answer else 0
    return {"accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": len(predicted) - accepted}
