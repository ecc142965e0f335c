"""Prompt lookup (n-gram) proposer: draft what followed the longest earlier match.

Why: rewriting, editing and quoting copy long runs of the prompt (and of earlier output);
where the end of the sequence occurred before, what followed it there is a free, often
correct draft. It costs no model work, so it can pay even where a verify row costs nearly
a decode, provided it drafts long only where the text is being copied.

A :class:`~meshd.plugins.suffix_index.SuffixIndex` over prompt + committed tokens gives
the longest earlier match (repeating periodically into a loop unless ``cycle = false``).
The draft length weighs the acceptance measured at that match length
(:class:`~meshd.plugins.match_stats.MatchStats`, corrected by its ``Calibration`` because
estimates of later positions run optimistic) against the verify-cost curve
(:func:`meshd.policy.costs.choose_k`); without a curve it is at most ``per_match`` per
matched token. A step that drafts nothing keeps a shadow draft and scores it against the
next committed tokens, so acceptance is learnt for free (no probes while shadows run).
Each new token is one amortised O(1) automaton extension, and a match that cannot beat
plain decoding costs one estimate, not a draft (:func:`break_even`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from meshd.policy.acceptance import Explorer, probe_interval_floor
from meshd.policy.costs import DEFAULT_MARGIN, CostCurve, expected_committed, ratios

from .base import Capabilities, Outcome, Proposal, ProposalRequest, ProposerEnv
from .match_stats import Calibration, MatchStats, SharedMatchStats
from .registry import bool_option, int_option
from .resources import Need, requires
from .suffix_index import SuffixIndex

DEFAULT_MIN_N = 2
DEFAULT_MAX_LEN = 64
#: Draft tokens allowed per matched token when there is no cost curve (0: no bound).
DEFAULT_PER_MATCH = 2
#: Matches weighed per step, longest first (the longest and its shorter fallbacks).
CANDIDATES = 3

CurveSource = Callable[[], CostCurve | None]


def break_even(curve: CostCurve, margin: float, top: int) -> float:
    """The first-position acceptance below which no draft of 1..``top`` tokens can pay.

    A draft of ``k`` tokens commits at most ``1 + k p0`` tokens in expectation (every
    later position is accepted at most always), against ``c(k)`` decodes; it beats
    plain decoding by ``margin`` only if ``p0 > (margin c(k) - 1) / k`` for some ``k``.
    """
    top = min(top, curve.max_k)
    if top < 1:
        return float("inf")
    return min((margin * curve.cost(k) - 1.0) / k for k in range(1, top + 1))


class NgramProposer:
    """Prompt-lookup proposer for one request (see the module docstring for the rule)."""

    name = "ngram"

    def __init__(
        self,
        *,
        min_n: int = DEFAULT_MIN_N,
        max_len: int = DEFAULT_MAX_LEN,
        cycle: bool = True,
        eog_tokens: frozenset[int] = frozenset(),
        per_match: int = DEFAULT_PER_MATCH,
        curve: CurveSource | None = None,
        shared: SharedMatchStats | None = None,
        margin: float = DEFAULT_MARGIN,
        explorer: Explorer | None = None,
        shadow: bool = True,
    ) -> None:
        if min_n < 1:
            raise ValueError("min_n must be >= 1")
        if max_len < 1:
            raise ValueError("max_len must be >= 1")
        if per_match < 0:
            raise ValueError("per_match must be >= 0")
        self.min_n = min_n
        self.per_match = per_match
        self.max_len = max_len
        self.cycle = cycle
        self.eog_tokens = eog_tokens
        self.curve = curve
        self.margin = margin
        # Without a live curve (a composite's child) its drafts carry the acceptance
        # estimated at their match length, which the composite prices them by.
        self.capabilities = Capabilities(max_len=max_len, decides_length=curve is not None,
                                         estimates=curve is None)
        self.index = SuffixIndex()
        self.stats = MatchStats(shared)
        #: How far this request's drafts lived up to the estimates (see Calibration).
        self.calibration = Calibration()
        #: What the raw estimates expected of the pending real draft (accepted tokens).
        self._pending_expected: float | None = None
        self.explorer = explorer if explorer is not None else Explorer()
        # Tokens [0, _confirmed) of the index were seen in a request; the rest came from
        # observe() and are checked against the next request before being trusted.
        self._confirmed = 0
        #: Match length the pending draft was taken at (None: nothing pending).
        self._pending: int | None = None
        self._probing = False
        self.shadow = shadow
        #: The shadow draft being judged: (match length, where its first token would
        #: have gone, its tokens, positions judged so far, accepted tokens the raw
        #: estimates expected of it, once read); None when there is none.
        self._shadow: tuple[int, int, list[int], int, float | None] | None = None
        #: Times the index had to be rebuilt because a request contradicted it.
        self.rebuilds = 0
        #: The break-even first-position acceptance, for this curve and limit.
        self._floor_curve: CostCurve | None = None
        self._floor_top = 0
        self._floor = 0.0

    # ------------------------------------------------------------------ index

    def _sync(self, tokens: Sequence[int]) -> None:
        """Bring the index up to ``tokens``, touching only what it has not seen."""
        have = self.index.tokens
        n_have = len(have)
        consistent = len(tokens) >= n_have and all(
            tokens[i] == have[i] for i in range(max(0, self._confirmed - 1), n_have)
        )
        if not consistent:
            # Not an extension of what we indexed (the engine rewound or reused us):
            # rare, so rebuild rather than support un-indexing.
            self.rebuilds += 1
            self.index = SuffixIndex()
            self._shadow = None
            n_have = 0
        self.index.extend(tokens[i] for i in range(n_have, len(tokens)))
        self._confirmed = len(tokens)

    def _draft(self, end: int, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the occurrence ending at ``end``."""
        toks = self.index.tokens
        period = len(toks) - end
        if not self.cycle:
            limit = min(limit, period)
        draft: list[int] = []
        for i in range(limit):
            tok = toks[end + i % period]
            draft.append(tok)
            if tok in self.eog_tokens:
                break
        return draft

    # ------------------------------------------------------------------ proposer

    def propose(self, request: ProposalRequest) -> Proposal | None:
        self._sync(request.tokens)
        self._judge_shadow()
        self._pending = None
        self._pending_expected = None
        limit = min(self.max_len, request.max_len)
        if limit <= 0:
            return None
        candidates = [(n, e) for n, e in self.index.matches() if n >= self.min_n]
        if not candidates:
            return None
        curve = self.curve() if self.curve is not None else None
        if curve is None:
            n, e = candidates[0]
            if self.per_match:
                limit = min(limit, self.per_match * n)
            draft = self._draft(e, limit)
            proposal = self._proposal(n, draft)
            if proposal is None:
                return None
            raw = self.stats.acceptances(n, len(draft))
            acc = (raw[0] * self.calibration.factor(n), *raw[1:])
            return attrs.evolve(proposal, acceptances=acc)
        proposal = self._costed(curve, candidates[:CANDIDATES], limit)
        if proposal is not None:
            self._shadow = None  # the real draft's outcome is measured instead
        elif self.shadow and self._shadow is None:
            n, e = candidates[0]
            self.stats.decay()
            self._shadow = (n, len(self.index.tokens), self._draft(e, min(limit, curve.max_k)),
                            0, None)
        return proposal

    def _judge_shadow(self) -> None:
        """Score the shadow draft against the tokens committed since it was taken.

        Why: a step that drafts nothing still learns what a draft would have done, for
        free, once the target's tokens are known (they do not depend on drafting). So
        the acceptance by match length is measured where drafting does not yet pay:
        a copy that begins after a short match, or a text where short matches continue
        (a table's repeated cells), is found without spending a verify on it.
        """
        if self._shadow is None:
            return
        length, start, draft, judged, expected = self._shadow
        if expected is None:  # read when judged, not when a step that cannot pay made it
            k = len(draft)
            expected = expected_committed(self.stats.acceptances(length, k), k) - 1.0
        toks = self.index.tokens
        while judged < len(draft) and start + judged < len(toks):
            hit = toks[start + judged] == draft[judged]
            self.stats.record(length + judged, hit)
            judged += 1
            if not hit:
                self._shadow = None
                self.calibration.observe(length, expected, judged - 1)
                return
        if judged >= len(draft):
            self._shadow = None
            self.calibration.observe(length, expected, judged)
        else:
            self._shadow = (length, start, draft, judged, expected)

    def _costed(self, curve: CostCurve, candidates: list[tuple[int, int]],
                limit: int) -> Proposal | None:
        """The candidate and length with the best expected speedup (or a probe)."""
        top = min(limit, curve.max_k)
        floor = self._break_even(curve, top)
        best: tuple[float, int, list[int], float] | None = None
        for n, e in candidates:
            trust = self.calibration.factor(n)
            if self.stats.p(n) * trust <= floor:
                continue  # not even a draft that is always right after its first token pays
            draft = self._draft(e, top)
            raw = self.stats.acceptances(n, len(draft))
            rs = ratios(curve, [raw[0] * trust, *raw[1:]], len(draft))
            k = max(range(len(rs)), key=lambda j: (rs[j], -j))
            if k > 0 and rs[k] > self.margin and (best is None or rs[k] > best[0]):
                best = (rs[k], n, draft[:k], expected_committed(raw, k) - 1.0)
        if best is not None:
            self._probing = False
            self.explorer.speculated()
            return self._proposal(best[1], best[2], best[3])
        if self.shadow:
            return None  # the shadow draft measures what a probe would, without a verify
        # Nothing pays: probe one token now and then, so the estimates can recover.
        n, e = candidates[0]
        if top >= 1:
            hit = self.stats.p(n)
            probe_cost = curve.cost(1) - 1.0 - hit
            self.explorer.min_interval = probe_interval_floor(probe_cost)
            if self.explorer.idle_step():
                self.explorer.probed()
                self._probing = True
                return self._proposal(n, self._draft(e, 1))
        return None

    def _break_even(self, curve: CostCurve, top: int) -> float:
        """:func:`break_even` for this curve, margin and length limit (kept until the
        curve changes: the live curve is rebuilt every few forwards, not every step)."""
        if self._floor_curve is not curve or self._floor_top != top:
            self._floor_curve, self._floor_top = curve, top
            self._floor = break_even(curve, self.margin, top)
        return self._floor

    def _proposal(self, length: int, draft: list[int],
                  expected: float | None = None) -> Proposal | None:
        """``draft``, taken at match ``length``, as the pending proposal; ``expected``:
        the accepted tokens the raw estimates expect of it (None: not calibrated by it)."""
        if not draft:
            return None
        self._pending = length
        self._pending_expected = expected
        return Proposal(tuple(draft))

    def observe(self, outcome: Outcome) -> None:
        """Learn the acceptance at the pending draft's match length; index the commits
        now (the next request confirms them cheaply)."""
        length, self._pending = self._pending, None
        expected, self._pending_expected = self._pending_expected, None
        if length is not None and outcome.proposed > 0:
            # The commit ends with the target's own token unless it was cut short.
            censored = len(outcome.committed) <= outcome.accepted
            self.stats.update(length, outcome.proposed, outcome.accepted, censored=censored)
            if expected is not None and not censored:
                self.calibration.observe(length, expected, outcome.accepted)
            if self._probing:
                self.explorer.probe_result(outcome.accepted)
        self._probing = False
        self.index.extend(outcome.committed)

    def close(self) -> None:
        self.stats.close()
        self.calibration = Calibration()
        self.index = SuffixIndex()
        self._confirmed = 0
        self._shadow = None


@requires(Need.LIVE_COST_CURVE, Need.MATCH_STATS)
def ngram_factory(env: ProposerEnv) -> NgramProposer:
    """Entry point ``ngram``. Options: ``min_n``, ``max_len``, ``cycle``, ``per_match``,
    ``shadow`` (default true: steps that draft nothing score their shadow draft),
    ``adaptive`` (default true: choose the draft length from the cost curve when the
    daemon hands one over). Declared resources: the live cost curve (without it, e.g.
    inside a composite that chooses lengths itself, drafts follow the fixed rule and
    carry the acceptance estimated at their match length, which the composite prices) and
    the match statistics pooled across requests."""
    opts = env.options
    curve: CurveSource | None = None
    live = env.resources.cost_curve_now
    if bool_option(opts, "adaptive", True) and callable(live):
        def curve() -> CostCurve | None:
            value = live()
            return value if isinstance(value, CostCurve) else None
    shared = env.resources.match_stats
    return NgramProposer(
        min_n=int_option(opts, "min_n", DEFAULT_MIN_N, minimum=1),
        max_len=int_option(opts, "max_len", DEFAULT_MAX_LEN, minimum=1),
        cycle=bool_option(opts, "cycle", True),
        eog_tokens=env.eog_tokens,
        per_match=int_option(opts, "per_match", DEFAULT_PER_MATCH, minimum=0),
        curve=curve,
        shared=shared if isinstance(shared, SharedMatchStats) else None,
        shadow=bool_option(opts, "shadow", True),
    )
