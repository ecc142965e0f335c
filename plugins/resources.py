"""Typed resource declarations: what a proposer factory asks the daemon for.

Why declarations instead of a bag of named objects: a factory that wants a draft model,
the model's tokenizer or the prompt's text says so once, on the factory, and the runtime
hands over exactly that, and nothing else, the same way for the built-in ``draft``
proposer and for a stranger's plugin. A resource that was not declared is ``None`` in
:class:`Resources`; ``prompt_text`` is given only to plugins whose config allows it
(``allow_prompt_text = true``): by default a plugin sees token ids only.

Declare with the :func:`requires` decorator::

    @requires(Need.TOKENIZER)
    def my_factory(env: ProposerEnv) -> MyProposer:
        tokens = env.resources.tokenizer.tokenize("def main():")
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs

from meshd.policy.costs import CostCurve

from .match_stats import SharedMatchStats


class Need(enum.Enum):
    """A resource a factory may declare (the names are used in ``meshd plugins list``)."""

    #: A loaded draft model sharing the target's vocabulary (:class:`DraftModelLike`).
    #: Which file: the request's ``NAME:PATH`` suffix or the ``draft_model`` option,
    #: one of the daemon's ``--draft-model`` files.
    DRAFT_MODEL = "draft_model"
    #: The target's tokenizer (:class:`TokenizerLike`).
    TOKENIZER = "tokenizer"
    #: The request's prompt as text (chat prompts rendered), when the config allows.
    PROMPT_TEXT = "prompt_text"
    #: The machine's measured verify-cost curve (:class:`CostCurve`).
    COST_CURVE = "cost_curve"
    #: The proposer registry, to build other proposers (composites).
    REGISTRY = "registry"
    #: A callable returning the current cost curve (kept current online), given only
    #: when the request lets the cost model choose draft lengths.
    LIVE_COST_CURVE = "cost_curve_now"
    #: Acceptance by match length pooled across requests (:class:`SharedMatchStats`).
    MATCH_STATS = "match_stats"
    #: The model's earlier answers as the request's owner may see them
    #: (:class:`~meshd.plugins.history.HistoryView`; None: history off, owner unknown).
    HISTORY = "history"


class DraftSequenceLike(Protocol):
    """One request's sequence in a shared draft model."""

    def draft(self, tokens: Sequence[int], k: int, *, probs: bool = False,
              ) -> tuple[list[int], list[float]]: ...

    def close(self) -> None: ...


@runtime_checkable
class DraftModelLike(Protocol):
    """A draft model loaded once by the daemon and shared by every request."""

    def open_sequence(self) -> DraftSequenceLike: ...


@runtime_checkable
class TokenizerLike(Protocol):
    """The target model's tokenizer (thread-safe, read-only)."""

    def tokenize(self, text: str, *, add_special: bool = True,
                 parse_special: bool = False) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str: ...


@runtime_checkable
class ProposerSource(Protocol):
    """What a composite needs from the registry: make a proposer by name."""

    def names(self) -> list[str]: ...

    def create(self, name: str, env: Any) -> Any: ...


@attrs.frozen
class Resources:
    """The declared resources, filled by the runtime (``None``: not declared/available)."""

    draft_model: DraftModelLike | None = None
    tokenizer: TokenizerLike | None = None
    prompt_text: str | None = None
    cost_curve: CostCurve | None = None
    registry: ProposerSource | None = None
    cost_curve_now: Callable[[], CostCurve | None] | None = None
    match_stats: SharedMatchStats | None = None
    #: A :class:`~meshd.plugins.history.HistoryView` (typed loosely: that module
    #: builds on this one).
    history: object | None = None


F = TypeVar("F", bound=Callable[..., Any])


def requires(*needs: Need) -> Callable[[F], F]:
    """Mark a factory as needing ``needs`` (stored as its ``needs`` attribute)."""
    for need in needs:
        if not isinstance(need, Need):
            raise TypeError(f"requires() takes Need members, got {need!r}")

    def mark(factory: F) -> F:
        factory.needs = frozenset(needs)  # type: ignore[attr-defined]
        return factory

    return mark


def needs_of(factory: object) -> frozenset[Need]:
    """The resources ``factory`` declared (none if it declared nothing valid)."""
    declared: object = getattr(factory, "needs", frozenset())
    if not isinstance(declared, frozenset | set | tuple | list):
        return frozenset()
    return frozenset(n for n in declared if isinstance(n, Need))
