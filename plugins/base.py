"""The one proposer interface: every source of draft tokens speaks it.

Why one interface: the engine has exactly one path from "draft" to "committed" (the
verify-commit-repair state machine in ``meshd.policy.decision``). Whether the draft
came from the model's own MTP head, prompt lookup, a draft model or a third-party plugin
must not matter to it, so all of them answer the same question in the same shape.

A proposer is created per request (one instance per session) by a factory registered in
``meshd.plugins.registry``. Per decode step the engine calls ``propose``; after the
verify it calls ``observe`` with what was accepted; when the request ends, ``close``.
Proposers never touch the runtime's state: what they may use from it (the native MTP
head, a draft-model runtime) is handed to them as narrow interfaces in ``ProposerEnv``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from .resources import Resources


@attrs.frozen
class Capabilities:
    """What a proposer needs and offers; the engine checks these before using it."""

    needs_mtp_head: bool = False
    max_len: int = 16
    #: The proposer chooses its own draft length from the cost curve (e.g. composite):
    #: the engine then asks for up to ``draft_max`` and does not gate it a second time.
    decides_length: bool = False
    #: The proposer's drafts carry their own per-position acceptance estimates
    #: (``Proposal.acceptances``) and asking costs no model work: a composite asks it
    #: every step and prices its draft by them rather than by a flat tracker.
    estimates: bool = False


@attrs.frozen
class ProposalRequest:
    """One decode step's question: continue ``tokens`` with up to ``max_len`` tokens.

    ``tokens`` is the prompt followed by every committed token (read-only; do not keep a
    reference past the call). ``deadline`` is a ``time.monotonic()`` instant after which
    an answer is useless.
    """

    tokens: Sequence[int]
    n_prompt: int
    max_len: int
    deadline: float


@attrs.frozen
class Proposal:
    """Draft tokens, in order.

    Only the tokens matter: verification decides what is committed (exact match
    against the target's own choice), so a proposer's confidence would change nothing.
    """

    tokens: tuple[int, ...]
    #: Which source drafted them, for the per-source counts (None: the proposer itself;
    #: a composite names the child it chose).
    source: str | None = attrs.field(default=None, eq=False)
    #: Estimated conditional acceptance of each position (empty: none given); like the
    #: source, not part of what makes two proposals equal (the same draft).
    acceptances: tuple[float, ...] = attrs.field(default=(), eq=False)


@attrs.frozen
class Outcome:
    """What became of the last proposal after verification.

    ``accepted`` drafted tokens were committed, followed by the target's own token
    unless the commit was cut short; ``committed`` holds every token committed this step
    (so a proposer that keeps an index can extend it).
    """

    proposed: int
    accepted: int
    committed: tuple[int, ...]


@runtime_checkable
class DraftHead(Protocol):
    """A drafting head bound to one session (the native MTP context satisfies it)."""

    def draft(self, k: int, *, probs: bool = False) -> tuple[list[int], list[float]]:
        """Up to ``k`` greedy draft tokens continuing the committed sequence, and with
        ``probs`` the head's probability of each (else an empty list: computing them is
        a softmax over the vocabulary per token)."""
        ...


@attrs.frozen
class ModelDescription:
    """The target model, as a proposer may know it (no native objects)."""

    name: str = ""
    n_vocab: int = 0
    n_ctx_train: int = 0
    has_mtp: bool = False
    bos_token: int | None = None
    eos_token: int | None = None


@attrs.frozen
class ProposerEnv:
    """What the engine hands a proposer factory for one request.

    ``mtp`` is the session's native MTP head when the model has one; ``resources``
    holds what the factory declared it needs (:mod:`meshd.plugins.resources`), filled
    the same way for built-ins and third-party plugins. ``options`` are the proposer's
    own settings: its ``[speculation.plugins.NAME]`` config table overlaid with the
    request's options. ``model`` describes the target.
    """

    vocab_size: int
    eog_tokens: frozenset[int]
    mtp: DraftHead | None = None
    resources: Resources = attrs.field(factory=lambda: Resources())
    options: Mapping[str, object] = attrs.field(factory=dict)
    model: ModelDescription = attrs.field(factory=ModelDescription)


class Proposer(Protocol):
    """One request's proposer.

    Calls are never concurrent: built-ins are called on the model's compute thread, a
    third-party in-process plugin's (every request's instance) on one worker thread of
    its own, under its deadline (:mod:`meshd.plugins.guard`).
    """

    name: str
    capabilities: Capabilities

    def propose(self, request: ProposalRequest) -> Proposal | None:
        """Draft tokens continuing ``request.tokens``, or None for "nothing to offer"."""
        ...

    def observe(self, outcome: Outcome) -> None:
        """Learn what was accepted (trim internal state past the accepted prefix)."""
        ...

    def close(self) -> None:
        """The request ended; release whatever this proposer holds."""
        ...


ProposerFactory = Callable[[ProposerEnv], Proposer]


class ProposerUnavailable(Exception):
    """A factory cannot serve this request (e.g. ``mtp`` on a model without an MTP head)."""
