"""How deep a recurrent model's in-place rollback should be: snapshots only while they pay.

llama.cpp's in-place rollback of a recurrent (or hybrid) state keeps per-token
snapshots of every recurrent layer (``n_rs_seq``). They make a rejected draft cheap to
undo (no checkpoint, no replay), but they are written on every forward, plain decodes
included, and a context's depth is fixed when it is created: a deeper rollback slows
every decode, and without it speculation must checkpoint and replay, which can cost it
all its gain.

So a model keeps its snapshots while requests use speculation, and drops them (the
runtime rebuilds its context, between requests) once :data:`QUIET_REQUESTS` requests in
a row did not (no proposer, or too few accepted drafts to matter), at once after a
request dropped the MTP head on its own evidence, and from the start where the daemon's
default is no speculation.
Without snapshots a request that shows speculation would pay with them (accepted drafts
a good share of its tokens, or the MTP head's measured acceptance beating its catch-up
plus what the snapshots cost) brings them back. Sans-I/O: the runtime reports each
request's outcome and applies :attr:`RollbackDepth.wanted` when no session is open.
"""

from __future__ import annotations

import attrs

#: Requests in a row without worthwhile speculation before the snapshots are dropped.
QUIET_REQUESTS = 3
#: Accepted drafts per committed token from which a request counts as using speculation.
ACTIVE_SHARE = 0.1
#: Drafts a request must have verified with the MTP head before its own acceptance
#: judges whether the head pays with snapshots (a followed head's evidence windows give 16).
OWN_EVIDENCE_DRAFTS = 8.0


@attrs.frozen
class RequestOutcome:
    """What one finished request did with speculation."""

    tokens: int
    """Tokens it committed."""
    accepted: int
    """Of them, drafts the target accepted."""
    dropped_head: bool = False
    """It followed the MTP head and the step gate dropped it."""
    head_pays_with_snapshots: bool = False
    """It followed the MTP head and, judged from the acceptance it measured, the head
    pays where the snapshots are kept (their cost per forward included)."""

    @property
    def speculated(self) -> bool:
        """Whether speculation mattered to this request."""
        if self.head_pays_with_snapshots:
            return True
        if self.dropped_head or self.tokens <= 0:
            return False
        return self.accepted >= ACTIVE_SHARE * self.tokens


class RollbackDepth:
    """One model's in-place rollback depth: ``full`` (as configured) or 0."""

    def __init__(self, full: int, *, quiet_requests: int = QUIET_REQUESTS) -> None:
        if full < 1 or quiet_requests < 1:
            raise ValueError("need full >= 1 and quiet_requests >= 1")
        self.full = full
        self.quiet_requests = quiet_requests
        #: The depth the context has now.
        self.depth = full
        #: Requests in a row (at full depth) that did not use speculation.
        self.quiet = 0
        #: A one-row forward's wall time at each depth, as last measured (seconds).
        self.decode_s: dict[int, float] = {}
        self._bring_back = False
        #: Why the snapshots are (to be) dropped, for the log.
        self.reason = ""
        #: A rebuild did not get the depth it asked for (llama.cpp refused the memory):
        #: the depth stays as it is from then on, as every further try would fail alike
        #: and each drops the cached sessions.
        self.stuck = False

    @property
    def wanted(self) -> int:
        """The depth the next context should have."""
        if self.stuck:
            return self.depth
        if self.depth == self.full:
            return 0 if self.quiet >= self.quiet_requests else self.full
        return self.full if self._bring_back else 0

    def ended(self, outcome: RequestOutcome) -> None:
        """A request on the current context finished."""
        if self.depth == self.full:
            if outcome.speculated:
                self.quiet = 0
            elif outcome.dropped_head:
                # Its own drafts, verified with the snapshots, said the head does not
                # pay: ``auto`` stops following it, so the snapshots serve nothing.
                self.quiet = self.quiet_requests
                self.reason = "a request dropped the MTP head: its drafts did not pay"
            else:
                self.quiet += 1
                self.reason = f"{self.quiet} requests in a row did not speculate"
        elif outcome.speculated:
            self._bring_back = True

    def not_expected(self) -> None:
        """Speculation is not expected (the daemon's default proposer is ``off``): drop
        the snapshots at the next switch; a request that speculates brings them back."""
        if self.depth == self.full:
            self.quiet = self.quiet_requests
            self.reason = "the default proposer is off"

    def switched(self, depth: int, *, decode_s: float | None) -> None:
        """The context was rebuilt at ``depth``; ``decode_s``: the one-row forward time
        measured at the old depth (None: not enough samples)."""
        if decode_s is not None:
            self.decode_s[self.depth] = decode_s
        self.stuck = depth != self.wanted
        self.depth = depth
        self.quiet = 0
        self._bring_back = False

    def describe(self) -> str:
        """What the last switch did, for the log."""
        if self.stuck:
            return (f"could not rebuild the context at another rollback depth (llama.cpp "
                    f"refused the memory): keeping {self.depth} snapshots from now on")
        if self.depth:
            return (f"keeping {self.depth} recurrent-state snapshots for in-place rollback: "
                    "speculation uses them")
        return f"dropped the recurrent-state snapshots (they slow every forward): {self.reason}"

    def snapshot_overhead(self, decode_s_now: float | None) -> float:
        """What the full depth's snapshots add to a forward, as a fraction of a forward
        without them: measured once both depths ran, else 0 (the optimistic guess: a
        wrong one costs a context rebuild and a few requests)."""
        full = self.decode_s.get(self.full)
        zero = decode_s_now if self.depth == 0 else self.decode_s.get(0)
        if full is None or not zero:
            return 0.0
        return max(0.0, full / zero - 1.0)
