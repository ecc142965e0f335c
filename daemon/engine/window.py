"""A verify window, its judgement, and the MTP head as the engine hands it to a proposer.

Apart from :mod:`meshd.daemon.engine.generation` so that what plans windows together
(:mod:`meshd.daemon.engine.window_sharing`) can use them without importing the engine.
"""

from __future__ import annotations

import attrs

from meshd.native.session import SequenceSession
from meshd.policy.decision import Decision
from meshd.protocol.messages import TokenLogprob


@attrs.frozen
class Window:
    """One planned verify window: ``[last, *draft]`` at positions ``base..``."""

    last: int
    base: int
    draft: tuple[int, ...]
    #: How many of ``draft`` the proposer made (None: all); the rest is filler that lets
    #: the window share a forward (:mod:`meshd.daemon.engine.window_sharing`). Filler is
    #: verified like any draft but left out of the acceptance statistics.
    real: int | None = None
    #: The draft is the tokens the request's constraint forces (the grammar proposer's).
    forced: bool = False
    #: The draft copies the JSON value being written out of the prompt (value copy).
    copied: bool = False

    @property
    def drafted(self) -> int:
        """The proposer's drafts in this window."""
        return len(self.draft) if self.real is None else self.real


@attrs.frozen
class Judged:
    """A verified window's decision, with the text and log-probabilities of the tokens it
    commits: all that applying it needs (``Generation.apply``)."""

    decision: Decision
    #: The text each committed token releases (an end-of-generation token has none).
    texts: tuple[str, ...] = ()
    #: Each committed token's log-probability, when the request asked for them.
    logprobs: tuple[TokenLogprob, ...] = ()


class MtpHead:
    """The session's MTP context bound to the engine's current ``last`` token.

    Created unbound, before the session is chosen: whether a session follows the MTP head
    (an MTP forward after every target forward) depends on whether the proposer, made
    first, needs the head; :meth:`bind` attaches the session then.
    """

    def __init__(self) -> None:
        self._session: SequenceSession | None = None
        self.last = -1
        #: Whether the proposer drafted from the head at its last proposal (a shared
        #: step drafts ahead only for heads in use).
        self.in_use = True
        #: Drafts made ahead for this step, with several sequences' in one MTP forward
        #: per position (:meth:`set_ahead`): (last, position, tokens, seconds).
        self._ahead: tuple[int, int, list[int], float] | None = None

    def bind(self, session: SequenceSession) -> None:
        if session.mtp is None:
            raise ValueError("the session does not follow the MTP head")
        self._session = session

    @property
    def session(self) -> SequenceSession | None:
        return self._session

    def set_ahead(self, last: int, pos: int, tokens: list[int], seconds: float) -> None:
        """Drafts the engine made ahead for the coming proposal (see :meth:`draft`)."""
        self._ahead = (last, pos, tokens, seconds)

    def take_ahead_seconds(self) -> float:
        """This head's share of the drafting done ahead, once (its proposer's time)."""
        ahead, self._ahead = self._ahead, None
        return ahead[3] if ahead is not None else 0.0

    def draft(self, k: int, *, probs: bool = False) -> tuple[list[int], list[float]]:
        session = self._session
        if session is None or session.mtp is None:
            raise RuntimeError("the MTP head was used by a proposer that does not declare "
                               "needs_mtp_head")
        self.in_use = True
        ahead = self._ahead
        if (ahead is not None and not probs and ahead[0] == self.last
                and ahead[1] == session.n_past and k <= len(ahead[2])):
            return ahead[2][:k], []  # the same greedy drafts, made with other sequences'
        return session.mtp.draft(self.last, session.n_past, k, probs=probs)
