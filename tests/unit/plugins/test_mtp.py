"""MTP proposer: a thin, honest wrapper over the session's draft head."""

from __future__ import annotations

import pytest

from meshd.plugins.base import DraftHead, Outcome, ProposerEnv, ProposerUnavailable
from meshd.plugins.mtp import MtpProposer, mtp_factory

from .fakes import request


class Head:
    def __init__(self, tokens: list[int], probs: list[float]) -> None:
        self.tokens, self.probs = tokens, probs
        self.asked: list[int] = []
        self.asked_probs: list[bool] = []

    def draft(self, k: int, *, probs: bool = False) -> tuple[list[int], list[float]]:
        self.asked.append(k)
        self.asked_probs.append(probs)
        return self.tokens[:k], self.probs[:k] if probs else []


def test_drafts_up_to_the_smaller_limit() -> None:
    head = Head([5, 6, 7, 8], [0.9, 0.8, 0.3, 0.9])
    assert isinstance(head, DraftHead)
    prop = MtpProposer(head, max_len=3)
    got = prop.propose(request([1], 8))
    assert got is not None and got.tokens == (5, 6, 7)
    assert prop.propose(request([1], 2)).tokens == (5, 6)  # type: ignore[union-attr]
    assert prop.propose(request([1], 0)) is None
    assert head.asked == [3, 2]
    assert head.asked_probs == [False, False]  # no cut: no softmax over the vocabulary
    assert prop.capabilities.needs_mtp_head
    prop.observe(Outcome(2, 1, (5, 9)))
    prop.close()


def test_threshold_cuts_at_the_first_unlikely_token() -> None:
    head = Head([5, 6, 7, 8], [0.9, 0.8, 0.3, 0.9])
    got = MtpProposer(head, min_prob=0.5).propose(request([1]))
    assert got is not None and got.tokens == (5, 6)
    assert head.asked_probs == [True]
    assert MtpProposer(Head([5], [0.1]), min_prob=0.5).propose(request([1])) is None
    assert MtpProposer(Head([], [])).propose(request([1])) is None


def test_factory() -> None:
    with pytest.raises(ProposerUnavailable):
        mtp_factory(ProposerEnv(vocab_size=10, eog_tokens=frozenset()))
    env = ProposerEnv(
        10, frozenset(), mtp=Head([1], [1.0]), options={"max_len": 4, "min_prob": 0.2}
    )
    prop = mtp_factory(env)
    assert prop.capabilities.max_len == 4 and prop.min_prob == 0.2
    with pytest.raises(ValueError):
        mtp_factory(ProposerEnv(10, frozenset(), mtp=Head([], []), options={"min_prob": 2}))
