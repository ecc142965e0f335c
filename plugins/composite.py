"""Composite proposer: several sources, one verify; the draft that pays best wins.

Why not "first non-empty": proposers differ in how often they are right and the verify
cost grows with the draft length, so a long draft from a usually-wrong proposer can be
worth less than a short good one, or than none. Each step, for every child's draft and
every prefix length ``k``, this computes the expected speedup ``r(child, k)`` of
:mod:`meshd.policy.costs` from that child's own acceptance tracker, drafting cost and the
machine's cost curve, and proposes the best ``(child, k)``, or nothing when no ``r``
beats ``margin``. So it is also the adaptive draft-length policy. A child whose drafts
carry their own per-position estimates (``Capabilities.estimates``: prompt lookup and
history lookup, by match length) is asked every step and priced by them instead of its
tracker: a flat rate cannot tell a 3-token match from a copied paragraph. A child that cannot
beat the current best even at its longest draft is not asked (saving e.g. an MTP head
forward); after ``probe_every`` idle steps one child is probed
(:class:`meshd.policy.acceptance.Explorer`). ``observe`` feeds the used child's tracker,
and tells every other child what was committed, so text-following indexes stay current.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from meshd.policy.acceptance import AcceptanceTracker, Explorer
from meshd.policy.costs import DEFAULT_MARGIN, CostCurve, ratios

from .base import (
    Capabilities,
    Outcome,
    Proposal,
    ProposalRequest,
    Proposer,
    ProposerEnv,
    ProposerUnavailable,
)
from .registry import default_registry, float_option, int_option
from .resources import Need, requires

DEFAULT_CHILDREN = ("mtp", "ngram", "history")


@attrs.frozen
class Choice:
    """What the composite proposed last step (for ``observe`` and diagnostics)."""

    child: int
    name: str
    k: int
    ratio: float
    probe: bool


class CompositeProposer:
    """Picks, per step, the child draft (and its length) with the best expected speedup."""

    name = "composite"

    def __init__(
        self,
        children: Sequence[Proposer],
        curve: CostCurve,
        *,
        trackers: Sequence[AcceptanceTracker] | None = None,
        draft_costs: Sequence[float] | None = None,
        margin: float = DEFAULT_MARGIN,
        explorer: Explorer | None = None,
    ) -> None:
        if not children:
            raise ValueError("a composite needs at least one child")
        n = len(children)
        self.children = list(children)
        self.curve = curve
        self.trackers = (
            list(trackers) if trackers is not None else [AcceptanceTracker() for _ in range(n)]
        )
        self.draft_costs = list(draft_costs) if draft_costs is not None else [0.0] * n
        if len(self.trackers) != n or len(self.draft_costs) != n:
            raise ValueError("need one tracker and one draft cost per child")
        self.margin = margin
        self.explorer = explorer if explorer is not None else Explorer()
        caps = [c.capabilities for c in self.children]
        self.capabilities = Capabilities(
            decides_length=True,
            needs_mtp_head=any(c.needs_mtp_head for c in caps),
            max_len=min(curve.max_k, max(c.max_len for c in caps)),
        )
        #: The last step's decision (None: nothing proposed).
        self.last_choice: Choice | None = None
        #: How many drafts of each child were used (probes included), by child name.
        self.used: dict[str, int] = {c.name: 0 for c in self.children}
        self._probe_next = 0

    def _limit(self, child: int, request: ProposalRequest) -> int:
        caps = self.children[child].capabilities
        return max(0, min(request.max_len, caps.max_len, self.curve.max_k))

    def _ratios(self, child: int, limit: int) -> list[float]:
        acc = self.trackers[child].acceptances(max(1, limit))
        return ratios(self.curve, acc, limit, draft_cost=self.draft_costs[child])

    def propose(self, request: ProposalRequest) -> Proposal | None:
        self.last_choice = None
        limits = [self._limit(i, request) for i in range(len(self.children))]
        if max(limits) == 0:
            return None
        curves = [self._ratios(i, limits[i]) for i in range(len(self.children))]
        bounds = [max(rs[1:], default=0.0) for rs in curves]
        for i, child in enumerate(self.children):
            if child.capabilities.estimates and limits[i] > 0:
                bounds[i] = float("inf")  # priced by its own estimates once asked
        asked: dict[int, Proposal | None] = {}

        def ask(i: int) -> Proposal | None:
            if i not in asked:
                sub = attrs.evolve(request, max_len=limits[i])
                prop = self.children[i].propose(sub)
                asked[i] = prop if prop is not None and prop.tokens else None
            return asked[i]

        best: tuple[float, int, int] | None = None  # (ratio, k, child)
        for i in sorted(range(len(self.children)), key=lambda i: (-bounds[i], i)):
            if bounds[i] <= self.margin or (best is not None and bounds[i] <= best[0]):
                break  # sorted by bound: nobody later can do better
            prop = ask(i)
            if prop is None:
                continue
            rs = curves[i]
            if prop.acceptances:
                rs = ratios(self.curve, prop.acceptances, limits[i],
                            draft_cost=self.draft_costs[i])
            top = min(len(prop.tokens), limits[i])
            k = max(range(1, top + 1), key=lambda k: (rs[k], -k))
            if rs[k] > self.margin and (best is None or rs[k] > best[0]):
                best = (rs[k], k, i)
        if best is not None:
            ratio, k, i = best
            self.explorer.speculated()
            return self._use(i, k, ratio, probe=False, prop=asked[i])
        if not self.explorer.idle_step():
            return None
        n = len(self.children)
        for step in range(n):
            i = (self._probe_next + step) % n
            if limits[i] == 0:
                continue
            prop = ask(i)
            if prop is not None:
                self._probe_next = (i + 1) % n
                self.explorer.probed()
                return self._use(i, 1, curves[i][1], probe=True, prop=prop)
        return None  # nobody had anything: the probe stays due

    def _use(self, i: int, k: int, ratio: float, *, probe: bool, prop: Proposal | None) -> Proposal:
        assert prop is not None
        child = self.children[i]
        self.last_choice = Choice(i, child.name, k, ratio, probe)
        self.used[child.name] += 1
        return Proposal(prop.tokens[:k], source=child.name)

    def observe(self, outcome: Outcome) -> None:
        choice = self.last_choice
        self.last_choice = None
        idle = Outcome(proposed=0, accepted=0, committed=outcome.committed)
        for i, child in enumerate(self.children):
            if choice is None or i != choice.child:
                child.observe(idle)
                continue
            child.observe(outcome)
            censored = len(outcome.committed) <= outcome.accepted
            self.trackers[i].update(outcome.proposed, outcome.accepted, censored=censored)
            if choice.probe:
                if outcome.proposed > 0:
                    self.explorer.probe_result(outcome.accepted)
                else:  # the engine did not verify it after all: keep the probe due
                    self.explorer.rearm()

    def close(self) -> None:
        for child in self.children:
            child.close()


def _curve_from(env: ProposerEnv) -> CostCurve | None:
    """The measured curve (resource), else the ``cost_curve`` option, else None."""
    curve = env.resources.cost_curve
    if isinstance(curve, CostCurve):
        return curve
    raw = env.options.get("cost_curve")
    if isinstance(raw, Sequence) and not isinstance(raw, str | bytes):
        return CostCurve.sanitized([float(x) for x in raw])
    return None


def fixed_k_curve(children: Sequence[Proposer]) -> CostCurve:
    """The curve of ``--fixed-k`` (nothing measured, every draft length taken): each
    window costs one decode, so the composite proposes the longest draft of the child
    with the best acceptance so far that has one."""
    return CostCurve((1.0,) * (1 + max(c.capabilities.max_len for c in children)))


def _per_child(options: Mapping[str, object], key: str) -> Mapping[str, object]:
    value = options.get(key, {})
    if not isinstance(value, Mapping):
        raise ValueError(f"option {key!r} must map child names to values")
    return value


@requires(Need.COST_CURVE, Need.REGISTRY, Need.MATCH_STATS, Need.HISTORY)
def composite_factory(env: ProposerEnv) -> CompositeProposer:
    """Entry point ``composite``.

    Options: ``proposers`` (child names, default ``["mtp", "ngram", "history"]``;
    children that are unavailable for this request, e.g. ``mtp`` without a head or
    ``history`` for a request whose owner is unknown, are skipped), one
    mapping per child name with that child's own options, ``priors`` / ``draft_costs``
    (mappings child name -> number), ``prior_weight``, ``decay``, ``margin``,
    ``probe_every``, ``probe_max_every``, ``cost_curve``. Declared resources: the cost
    curve (preferred over the option), the registry (default: the entry-point one) and
    the pooled match statistics and the owner's history, which its children share;
    children get no live curve
    (the composite chooses the lengths). Without a curve (``--fixed-k``: no calibration)
    it drafts by :func:`fixed_k_curve`, as every proposer does there.
    """
    opts = env.options
    curve = _curve_from(env)
    names_opt = opts.get("proposers", DEFAULT_CHILDREN)
    if isinstance(names_opt, str) or not isinstance(names_opt, Sequence):
        raise ValueError("option 'proposers' must be a list of proposer names")
    names = [str(n) for n in names_opt]
    if "composite" in names:
        raise ValueError("a composite cannot contain a composite")
    registry = env.resources.registry or default_registry()
    priors, costs = _per_child(opts, "priors"), _per_child(opts, "draft_costs")
    prior_weight = float_option(opts, "prior_weight", 2.0, minimum=1e-9)
    decay = float_option(opts, "decay", 0.98, minimum=1e-9, maximum=1.0)

    children: list[Proposer] = []
    trackers: list[AcceptanceTracker] = []
    draft_costs: list[float] = []
    skipped: list[str] = []
    for name in names:
        if "proposers" not in opts and name not in registry.names():
            skipped.append(f"{name}: not installed")  # a default child: go on without it
            continue
        child_opts = opts.get(name, {})
        if not isinstance(child_opts, Mapping):
            raise ValueError(f"option {name!r} must be a mapping of that proposer's options")
        child_env = attrs.evolve(env, options=child_opts)
        built_in = getattr(registry, "built_in", None)
        if env.resources.history is not None and not (callable(built_in) and built_in(name)):
            # The history holds every owner's answers: meshd's own proposers only.
            child_env = attrs.evolve(child_env, resources=attrs.evolve(env.resources,
                                                                       history=None))
        try:
            children.append(registry.create(name, child_env))
        except ProposerUnavailable as exc:
            skipped.append(f"{name}: {exc}")
            continue
        trackers.append(
            AcceptanceTracker(
                prior=float_option(priors, name, 0.5, minimum=1e-6, maximum=1 - 1e-6),
                prior_weight=prior_weight,
                decay=decay,
            )
        )
        draft_costs.append(float_option(costs, name, 0.0, minimum=0.0))
    if not children:
        raise ProposerUnavailable("composite: no child available (" + "; ".join(skipped) + ")")
    every = int_option(opts, "probe_every", 16, minimum=0)
    return CompositeProposer(
        children,
        curve if curve is not None else fixed_k_curve(children),
        trackers=trackers,
        draft_costs=draft_costs,
        margin=float_option(opts, "margin", DEFAULT_MARGIN, minimum=1.0),
        explorer=Explorer(every, int_option(opts, "probe_max_every", max(256, every))),
    )
