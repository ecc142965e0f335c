"""The protocol's statistics: a generation's token accounting (``Usage``), what
speculative decoding did for it (``SpeculationStats``, in ``done``) and a proposer's
daemon-wide figures (``ProposerStats``, in ``stats_reply``). Re-exported by
``messages``."""

from __future__ import annotations

import attrs

from . import validators as check

__all__ = ["ProposerStats", "SpeculationStats", "Usage"]


@attrs.frozen
class Usage:
    """Token accounting for one generation."""

    prompt_tokens: int = attrs.field(default=0, validator=check.integer(0))
    completion_tokens: int = attrs.field(default=0, validator=check.integer(0))

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.define
class SpeculationStats:
    """What speculative decoding did for one generation (sent in ``done``).

    Mutable, with every field defaulted, so the server can create one per request and
    bump counters as it goes. Counters it does not know about yet go in ``extra`` rather
    than requiring a protocol bump.
    """

    proposer: str | None = attrs.field(default=None, validator=check.optional_non_empty_string)
    """The proposer actually used (``None`` if speculation was off)."""
    emitted: int = attrs.field(default=0, validator=check.integer(0))
    """Tokens committed to the output."""
    target_forwards: int = attrs.field(default=0, validator=check.integer(0))
    """Forward passes of the target model (prefill excluded)."""
    verify_calls: int = attrs.field(default=0, validator=check.integer(0))
    drafted: int = attrs.field(default=0, validator=check.integer(0))
    accepted: int = attrs.field(default=0, validator=check.integer(0))
    accepted_per_position: list[int] = attrs.field(factory=list, validator=check.int_items(0))
    """``accepted_per_position[i]``: how often draft position ``i`` was accepted."""
    rollbacks_in_place: int = attrs.field(default=0, validator=check.integer(0))
    checkpoints: int = attrs.field(default=0, validator=check.integer(0))
    checkpoint_bytes: int = attrs.field(default=0, validator=check.integer(0))
    restores: int = attrs.field(default=0, validator=check.integer(0))
    wall_ms: float = attrs.field(default=0.0, validator=check.non_negative_number)
    prefill_ms: float = attrs.field(default=0.0, validator=check.non_negative_number)
    decode_ms: float = attrs.field(default=0.0, validator=check.non_negative_number)
    verify_ms: float = attrs.field(default=0.0, validator=check.non_negative_number)
    refusals: dict[str, int] = attrs.field(factory=dict, validator=check.counters)
    """Why drafting was skipped, by reason, e.g. ``{"deadline": 2}``."""
    extra: dict[str, float] = attrs.field(factory=dict, validator=check.counters)
    """Further counters not (yet) named above."""

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted, or ``None`` if nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_forward(self) -> float | None:
        """Emitted tokens per target forward: the speed-up speculation bought."""
        return self.emitted / self.target_forwards if self.target_forwards else None


@attrs.frozen
class ProposerStats:
    """Daemon-wide acceptance figures of one proposer (in ``stats_reply``)."""

    requests: int = attrs.field(default=0, validator=check.integer(0))
    drafted: int = attrs.field(default=0, validator=check.integer(0))
    accepted: int = attrs.field(default=0, validator=check.integer(0))
    accepted_per_position: tuple[int, ...] = attrs.field(default=(), validator=check.int_items(0))

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None
