"""What one generation did: its own figures, and its session's counters over its life.

Why the session's counters are embedded rather than copied: the sequence session already
counts forwards, repairs, checkpoints and their times; a request's share of them is one
difference of two snapshots (``SessionCounters.since``), kept whole here (``session``),
and read from there by the ``done`` frame, the HTTP answers and ``meshd generate --json``.
"""

from __future__ import annotations

import attrs

from meshd.native.records import SessionCounters
from meshd.policy.gate import Refusal

__all__ = ["GenerationStats"]


@attrs.define
class GenerationStats:
    """What one request did; the ``done`` frame and ``meshd generate --json`` carry it.

    Every figure describes this request alone, also when its session came from the
    prefix cache (the session's own counters run over its whole life). The session's
    forwards include the prefill's (``prefill_forwards`` of them); every report gives
    :attr:`decode_forwards`, those after it. ``decode_ms`` is the forward time after
    the prefill (plain decodes and verify windows), ``verify_ms`` the part of it spent in
    forwards over a draft (``verify_calls`` of them). Written by the engine while the
    request runs; read by others only once it has finished.
    """

    emitted: int = 0
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    verify_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = attrs.field(factory=list)
    drafted_per_position: list[int] = attrs.field(factory=list)
    state_bytes: int = 0  # KV + recurrent state of the session when it finished
    wall_ms: float = 0.0
    propose_ms: float = 0.0
    proposals: int = 0  # times the proposer was asked for a draft
    refusals: dict[str, int] = attrs.field(factory=dict)
    proposer_faults: dict[str, int] = attrs.field(factory=dict)
    session: SessionCounters = attrs.field(factory=SessionCounters)
    """The session's counters over this request alone (set when the request ends)."""
    forced_drafted: int = 0
    """Drafted tokens that the request's constraint forced (part of ``drafted``)."""
    forced_accepted: int = 0
    copy_drafted: int = 0
    """Drafted tokens copied from the prompt into a JSON string value (part of
    ``drafted``)."""
    copy_accepted: int = 0
    grammar_cut: int = 0
    """Draft tokens the constraint forbade, cut before they were verified."""
    grammar_ms: float = 0.0
    """Time choosing tokens under the constraint (masks included)."""
    grammar_masks: int = 0
    """Rows that needed the full vocabulary mask (the others took the allowed argmax)."""
    source_drafted: dict[str, int] = attrs.field(factory=dict)
    """The proposer's drafted tokens by source (a composite's children: ``mtp``,
    ``ngram``, ``history``...; else the proposer's own name); forced and copied drafts
    are not in it."""
    source_accepted: dict[str, int] = attrs.field(factory=dict)
    source_windows: dict[str, int] = attrs.field(factory=dict)
    """Verify windows that carried a draft of each source."""

    @property
    def decode_forwards(self) -> int:
        """Target forwards after the prefill: the one count of a request's forwards that
        the ``done`` frame, the stats lines and the ``request_finished`` log all give
        (the prefill's are ``session.prefill_forwards``)."""
        return max(0, self.session.target_forwards - self.session.prefill_forwards)

    @property
    def decode_ms(self) -> float:
        """Forward time after the prefill: plain decodes and verify windows."""
        return self.session.decode_ms + self.session.verify_ms

    def record_verify(self, drafted: int, accepted: int) -> None:
        """One verify window of ``drafted`` drafts whose first ``accepted`` were taken:
        the totals and the per-position counts (position ``i`` drafted, and accepted
        together with every position before it) that the bench's limit is built from."""
        self.verify_calls += 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.drafted_per_position) < drafted:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def record_source(self, source: str, drafted: int, accepted: int) -> None:
        """``drafted`` tokens of ``source`` verified, ``accepted`` of them taken."""
        self.source_drafted[source] = self.source_drafted.get(source, 0) + drafted
        self.source_accepted[source] = self.source_accepted.get(source, 0) + accepted
        self.source_windows[source] = self.source_windows.get(source, 0) + 1

    def refuse(self, reason: Refusal) -> None:
        """One step decoded plainly for ``reason`` (a member, so every reason counted is
        one the docs and ``meshctl generate --explain`` explain)."""
        self.refusals[reason.value] = self.refusals.get(reason.value, 0) + 1

    def fault(self, kind: str) -> None:
        self.proposer_faults[kind] = self.proposer_faults.get(kind, 0) + 1

    def as_dict(self) -> dict[str, object]:
        """The flat record ``meshd generate --json`` prints (one key per figure)."""
        return {
            "emitted": self.emitted,
            "prompt_tokens": self.prompt_tokens,
            "reused_prompt_tokens": self.reused_prompt_tokens,
            "target_forwards": self.decode_forwards,
            "prefill_forwards": self.session.prefill_forwards,
            "verify_calls": self.verify_calls,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "rollbacks_in_place": self.session.rollbacks_in_place,
            "trims": self.session.trims,
            "checkpoints": self.session.checkpoints,
            "checkpoint_bytes": self.session.checkpoint_bytes,
            "restores": self.session.restores,
            "state_bytes": self.state_bytes,
            "wall_ms": self.wall_ms,
            "prefill_ms": self.session.prefill_ms,
            "decode_ms": self.decode_ms,
            "verify_ms": self.session.verify_ms,
            "propose_ms": self.propose_ms,
            "proposals": self.proposals,
            "refusals": dict(self.refusals),
            "proposer_faults": dict(self.proposer_faults),
            "forced_drafted": self.forced_drafted,
            "forced_accepted": self.forced_accepted,
            "copy_drafted": self.copy_drafted,
            "copy_accepted": self.copy_accepted,
            "grammar_cut": self.grammar_cut,
            "grammar_ms": self.grammar_ms,
            "grammar_masks": self.grammar_masks,
            "source_drafted": dict(self.source_drafted),
            "source_accepted": dict(self.source_accepted),
        }

    def proposer_that_ran(self, proposer: str | None) -> str | None:
        """``proposer`` if it was asked for at least one draft, else ``None``.

        Why: a request whose every step was refused speculation (unseeded sampling, the
        cost model, no room) decoded plainly; reporting the proposer it was configured
        with would claim speculation ran. ``refusals`` says why it did not.
        """
        return proposer if self.proposals > 0 else None
