"""Whether drafting has paid in company, as measured: the check behind the shared plan.

Why: the shared plan (:mod:`.shared_window`) prices a group's window from the cost
curve and each request's acceptance. Where those prices are wrong (a group forward's
rows, the MTP head's drafting and catch-up, the recurrent snapshots all cost what a
lone request's curve does not show), drafting can lower the group's rate below plain
decoding's, and nothing in the plan would notice. So the steps a group decodes are
timed: tokens committed per second on steps that drafted against steps that did not,
per group size, both decayed. Drafting that measurably earns less than plain steps is
held off for a while, then tried again on fresh evidence; while drafting wins every
plan, a plain step now and then keeps the plain rate known. The two arms are steps of
the same group, interleaved in time, so a machine that slows down slows both. Sans-I/O
and deterministic: the engine hands in each step's tokens and wall time.
"""

from __future__ import annotations

import attrs

from .realised import RealisedRate

#: Weight of an older step in an arm's rate.
DECAY = 0.9
#: Steps each arm needs before the two are compared.
MIN_STEPS = 4
#: While drafting is allowed, after this many drafting steps in a row one decodes
#: plainly (the plain arm's evidence; a plain step the plan chose itself counts too);
#: until the plain arm has MIN_STEPS, every other step does.
PLAIN_EVERY = 16
#: Steps drafting is held off once it measurably earned less than plain steps.
HOLD_STEPS = 64
#: How much faster plain steps must be before drafting is held off (measured rates
#: move by a few percent from step to step).
MARGIN = 1.02


@attrs.define
class _Group:
    drafted: RealisedRate = attrs.field(factory=lambda: RealisedRate(decay=DECAY))
    plain: RealisedRate = attrs.field(factory=lambda: RealisedRate(decay=DECAY))
    since_plain: int = 0
    hold: int = 0


class CompanyCheck:
    """Per group size: whether this step of a shared forward may draft."""

    def __init__(self) -> None:
        self._groups: dict[int, _Group] = {}
        #: Times drafting was held off (for statistics and tests).
        self.holds = 0

    def may_draft(self, n: int) -> bool:
        """Whether a group of ``n`` requests may draft this step (call once per step
        whose plan drafts; False: decode it plainly)."""
        g = self._groups.setdefault(n, _Group())
        if g.hold > 0:
            g.hold -= 1
            return False
        # Until the plain rate is known, every other step is plain.
        if g.since_plain >= (PLAIN_EVERY if g.plain.steps >= MIN_STEPS else 1):
            g.since_plain = 0
            return False
        return True

    def observe(self, n: int, *, drafted: bool, tokens: int, seconds: float) -> None:
        """A shared step of ``n`` requests ended: ``tokens`` committed in ``seconds``."""
        if n < 2 or tokens <= 0 or seconds <= 0.0:
            return
        g = self._groups.setdefault(n, _Group())
        if drafted:
            g.drafted.add(tokens, seconds)
            g.since_plain += 1
        else:
            g.plain.add(tokens, seconds)
            g.since_plain = 0
        if (drafted and g.drafted.steps >= MIN_STEPS and g.plain.steps >= MIN_STEPS
                and g.drafted.ratio * MARGIN < g.plain.ratio):
            g.hold = HOLD_STEPS
            g.drafted = RealisedRate(decay=DECAY)  # judged again on fresh evidence after the hold
            self.holds += 1

    def forget(self) -> None:
        """Forwards cost differently now (the context was rebuilt): measure again."""
        self._groups.clear()
