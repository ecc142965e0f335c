"""One arm's summary in a ``meshd bench`` report: medians, ratios to the reference,
speculation counters and identity, from the runs of :mod:`meshd.bench.arms`."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from meshd.policy.costs import CostCurve, RepairCost, speedup_limit

from .arms import RunResult, first_divergence


def median_of(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def ratio_of(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def conditional_acceptance(accepted: Sequence[int], drafted: Sequence[int]) -> list[float]:
    """``P(position i accepted | 0..i-1 accepted)`` from per-position totals.

    The engine counts, per position ``i``, the windows that drafted it and the windows
    that accepted it (so ``0..i`` were all accepted). Their ratio ``u_i`` is the chance
    that a window of length > i got that far; ``u_i / u_{i-1}`` is the conditional rate
    :func:`meshd.policy.costs.speedup_limit` expects. Positions never drafted end the
    list, and the limit considers no window longer than it.
    """
    out: list[float] = []
    prev = 1.0
    for a, d in zip(accepted, drafted, strict=False):
        if d <= 0:
            break
        u = a / d
        out.append(min(1.0, u / prev) if prev > 0 else 0.0)
        prev = u
    return out


def limit_at_acceptance(curve: CostCurve, accepted: Sequence[int], drafted: Sequence[int],
                        *, decode_tokens: int, plain_steps: int, draft_cost: float = 0.0,
                        repair: RepairCost | None = None) -> tuple[int, float, float] | None:
    """What an arm's measured acceptance is worth at best: ``(k, speedup, speedup of the
    steps that drafted)``, None where nothing was drafted.

    The drafting steps are priced as windows of the best fixed ``k`` at the measured
    per-position acceptance (:func:`conditional_acceptance`), with no window longer than
    any the arm drafted (no acceptance is assumed where none was measured: repeating the
    last conditional rate, often 1.0 after a few positions, made 32-draft windows look
    nearly free). The ``plain_steps`` (a proposer that drafts only where drafts pay)
    are held to plain decoding, not to that acceptance, which they never had.
    """
    cond = conditional_acceptance(accepted, drafted)
    if not cond:
        return None
    k, drafting = speedup_limit(curve, cond, k_max=len(cond), draft_cost=draft_cost,
                                repair=repair)
    spec_tokens = decode_tokens - plain_steps
    speedup = (decode_tokens / (plain_steps + spec_tokens / drafting)
               if spec_tokens > 0 else drafting)
    return k, speedup, drafting


#: The least excess the pre-run curve predicts for an arm's verify windows (their cost
#: beyond one row each, in decodes, summed) from which the curve is fitted to the run:
#: below it a few windows' timing noise would set the whole curve's level.
FIT_MIN_EXCESS = 4.0
#: The fitted curve's excess stays within [1/FIT_SCALE_LIMIT, FIT_SCALE_LIMIT] times the
#: pre-run curve's.
FIT_SCALE_LIMIT = 4.0


def fit_curve_to_run(curve: CostCurve, drafted: Sequence[int], *,
                     verify_decodes: float) -> tuple[CostCurve, float] | None:
    """``curve`` with its excess over one row scaled by ``s`` so that the arm's own
    verify windows cost what its forwards measured: ``(fitted curve, s)``, or None where
    too few windows were verified to tell (:data:`FIT_MIN_EXCESS`) or one is beyond
    the curve.

    Why: the curve is measured once per workload before the runs, over a few
    repetitions; on a shared machine one slow single-row forward among them moves every
    ratio of the curve, and the runs that follow pay what the machine charges then.
    Measured side by side (SmolLM2 Q4_1, 2 threads, 257 tokens of context): a pre-run
    curve put 8 rows at 1.66 decodes and 16 at 2.52, while the run's windows cost 2.6
    decodes at a mean of 10 rows and the same measurement repeated put them at 2.07 and
    3.13. A limit priced on the first curve holds the arm to windows cheaper than any it
    could have had. The fit keeps the curve's shape (what one window length costs
    against another) and takes its level from the run.

    ``drafted[i]``: the windows that drafted position ``i`` (so windows of exactly ``k``
    drafts number ``drafted[k-1] - drafted[k]``); ``verify_decodes``: what the arm's
    verify forwards cost in all, in one-row forwards (:func:`_verify_decodes`).
    """
    windows, excess = 0, 0.0
    for k in range(1, len(drafted) + 1):
        n = int(drafted[k - 1]) - (int(drafted[k]) if k < len(drafted) else 0)
        if n <= 0:
            continue
        if k > curve.max_k:
            return None
        windows += n
        excess += n * (curve.cost(k) - 1.0)
    if excess < FIT_MIN_EXCESS:
        return None
    s = min(FIT_SCALE_LIMIT, max(1.0 / FIT_SCALE_LIMIT, (verify_decodes - windows) / excess))
    return CostCurve((1.0, *(1.0 + s * (c - 1.0) for c in curve.costs[1:]))), s


#: Plain steps an arm needs for its own one-row forwards to be the fit's unit.
FIT_MIN_PLAIN_STEPS = 10


def _verify_decodes(stats: Sequence[Mapping[str, Any]], ref_runs: Sequence[RunResult] | None,
                    fwd_ms: float, plain_steps: int, replays: int) -> float | None:
    """What an arm's verify forwards cost in all, in one-row forwards of the same runs.

    The unit is the arm's own plain steps where it took enough of them and its session
    timed them apart from its verify forwards: one-row forwards in the same runs, so
    load that came and went between arms is on both sides of the ratio. Otherwise the
    reference arm's mean forward, with the arm's plain steps and replays priced at it.
    None: no unit.
    """
    timed = all(isinstance(s.get(key), (int, float))
                for s in stats for key in ("verify_ms", "decode_ms"))
    if timed and replays == 0 and plain_steps >= FIT_MIN_PLAIN_STEPS:
        verify = sum(float(s["verify_ms"]) for s in stats)
        plain = sum(float(s["decode_ms"]) for s in stats) - verify
        if plain > 0.0:
            return verify / (plain / plain_steps)
    unit = forward_ms(ref_runs or [])
    return fwd_ms / unit - plain_steps - replays if unit else None


def _sum_lists(lists: Sequence[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for values in lists:
        for i, v in enumerate(values):
            if i == len(out):
                out.append(0)
            out[i] += int(v)
    return out


def _add_counts(dicts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in dicts:
        for key, v in d.items():
            out[key] = out.get(key, 0) + int(v)
    return out


def forward_ms(runs: Sequence[RunResult]) -> float | None:
    """Milliseconds per decode forward: the median over ``runs`` of each run's mean (one
    run slowed down by other load must not drag the figure the way a pooled mean would)."""
    return median_of([1e3 * r.forward_s / r.decode_forwards for r in runs if r.decode_forwards])


#: A run whose process got less than this fraction of the CPU share its arm got at best
#: on the same workload was slowed down by other load (llama.cpp's OpenMP barriers stall
#: badly when one of their threads is descheduled). Relative, because a tiny model leaves
#: the second thread idle and never reaches a share of 1; per workload, because the share
#: depends on the run's shape (a long prompt's prefill keeps both threads busier than
#: decoding does: compared across workloads, every decode-heavy run looked contended).
CONTENDED_CPU_SHARE = 0.85


def summarize_arm(runs: Sequence[RunResult], ref_runs: Sequence[RunResult] | None,
                  curve: CostCurve | None, *, error: str | None = None,
                  unit_forward_ms: float | None = None, threads: int = 1,
                  repair: RepairCost | None = None) -> dict[str, Any]:
    """Medians, ratios to the reference, speculation counters and identity of one arm.

    Ratios are taken between medians (``median(arm) / median(reference)``), never per run,
    so one noisy repetition moves a ratio no more than it moves a median.
    ``unit_forward_ms`` (a single-row decode forward, e.g. meshd-off's) turns the measured
    drafting time into the cost model's unit for the limit at the measured acceptance.
    The limit charges what the arm's drafting measurably cost: the MTP head's catch-up
    (``head_overhead``, a fraction of every verify forward), each drafted token
    (``draft_cost``, in decodes) and, with ``repair`` (a recurrent model), windows beyond
    its in-place rollback.
    """
    out: dict[str, Any] = {"error": error, "runs": []}
    for i, r in enumerate(runs):
        ref = ref_runs[i].tokens if ref_runs is not None and i < len(ref_runs) else None
        div = first_divergence(ref, r.tokens) if ref is not None else None
        out["runs"].append({
            "tokens": r.n, "wall_s": r.wall_s, "ttft_s": r.ttft_s, "tok_s": r.tok_s,
            "decode_tok_s": r.decode_tok_s, "prefill_s": r.prefill_s,
            "forward_s": r.forward_s, "decode_forwards": r.decode_forwards,
            "identical": None if ref is None else div is None, "first_divergence": div,
            "cpu_share": (r.cpu_s / (r.wall_s * threads)
                          if r.cpu_s is not None and r.wall_s > 0 else None),
        })
    best_share = max((run["cpu_share"] for run in out["runs"]
                      if run["cpu_share"] is not None), default=None)
    out["contended_runs"] = sum(
        1 for run in out["runs"] if run["cpu_share"] is not None and best_share
        and run["cpu_share"] < CONTENDED_CPU_SHARE * best_share)
    tok = median_of([r.tok_s for r in runs])
    dec = median_of([r.decode_tok_s for r in runs])
    ref_tok = median_of([r.tok_s for r in ref_runs]) if ref_runs else None
    ref_dec = median_of([r.decode_tok_s for r in ref_runs]) if ref_runs else None
    out.update(median_tok_s=tok, median_decode_tok_s=dec,
               ratio_vs_plain=ratio_of(tok, ref_tok), decode_ratio_vs_plain=ratio_of(dec, ref_dec))
    n_tokens = sum(r.n for r in runs)
    forwards = sum(r.decode_forwards for r in runs)
    out["forwards_per_token"] = forwards / n_tokens if n_tokens else None
    # The first token comes from the prefill; every later one from a decode forward.
    decode_tokens = sum(max(0, r.n - 1) for r in runs)
    out["forwards_per_decode_token"] = forwards / decode_tokens if decode_tokens else None
    out["forward_ms"] = forward_ms(runs)
    out["forward_cost_vs_plain"] = ratio_of(out["forward_ms"], forward_ms(ref_runs or []))
    out["host_ms_per_token"] = median_of(
        [1e3 * (r.wall_s - r.prefill_s - r.forward_s) / r.n for r in runs if r.n]
    )
    # Identity: every repetition equal to the reference's run of the same repetition.
    idents = [run["identical"] for run in out["runs"]]
    if error is not None:
        out["identical"] = False
    elif idents and all(x is not None for x in idents):
        out["identical"] = all(idents)
    else:
        out["identical"] = None
    divs = [run["first_divergence"] for run in out["runs"]
            if run["first_divergence"] is not None]
    out["first_divergence"] = min(divs) if divs else None
    out["margin"] = None
    stats = [r.stats for r in runs if r.stats is not None]
    out["speculation"] = bool(stats)
    totals = [r.drafts for r in runs if r.drafts is not None]
    if totals and not stats:  # a runner that counts drafts but not per position
        drafted = sum(d for d, _ in totals)
        accepted = sum(a for _, a in totals)
        out.update(speculation=True, drafted=drafted, accepted=accepted,
                   acceptance=accepted / drafted if drafted else None, limit=None)
    if stats:
        drafted = sum(int(s["drafted"]) for s in stats)
        accepted = sum(int(s["accepted"]) for s in stats)
        verify_calls = sum(int(s["verify_calls"]) for s in stats)
        acc_pos = _sum_lists([s["accepted_per_position"] for s in stats])
        dr_pos = _sum_lists([s["drafted_per_position"] for s in stats])
        out.update(
            drafted=drafted, accepted=accepted, verify_calls=verify_calls,
            acceptance=accepted / drafted if drafted else None,
            acceptance_per_position=[a / d for a, d in zip(acc_pos, dr_pos, strict=False)
                                     if d],
            mean_accepted_per_verify=accepted / verify_calls if verify_calls else None,
            mean_window_rows=1 + drafted / forwards if forwards else None,
            checkpoints=median_of([float(s["checkpoints"]) for s in stats]),
            checkpoint_bytes=median_of([float(s["checkpoint_bytes"]) for s in stats]),
            restores=median_of([float(s["restores"]) for s in stats]),
            rollbacks_in_place=median_of([float(s["rollbacks_in_place"]) for s in stats]),
            refusals=_add_counts([s["refusals"] for s in stats]),
            proposer_faults=_add_counts([s["proposer_faults"] for s in stats]),
        )
        # Decode steps that verified no draft, each one plain forward committing one
        # token: every decode forward that was neither a verify window nor the replay
        # after a restore. (Counting refusals instead misses the steps after the MTP
        # head was dropped, which refuse nothing: the request has no proposer then.)
        replays = sum(int(s["restores"]) for s in stats)
        plain_steps = max(0, forwards - verify_calls - replays)
        out["plain_steps"] = plain_steps
        spec_tokens = decode_tokens - plain_steps
        out["forwards_per_speculative_token"] = (
            (forwards - plain_steps) / spec_tokens if spec_tokens > 0 else None)
        # The same without the replays after restores (a repair cost, charged by the
        # limit): what accepted drafts alone predict.
        out["verify_forwards_per_speculative_token"] = (
            verify_calls / spec_tokens if spec_tokens > 0 else None)
        out["replays"] = replays
        propose_ms = sum(float(s["propose_ms"]) for s in stats)
        draft_cost = (propose_ms / drafted / unit_forward_ms
                      if drafted and unit_forward_ms else 0.0)
        out["draft_cost"] = draft_cost
        head_ms = sum(float(s.get("head_ms", 0.0)) for s in stats)
        fwd_ms = sum(1e3 * r.forward_s for r in runs)
        overhead = head_ms / (fwd_ms - head_ms) if 0.0 < head_ms < fwd_ms else 0.0
        decode_wall_ms = sum(1e3 * (r.wall_s - r.ttft_s) for r in runs)
        out.update(
            head_overhead=overhead,
            # Shares of the decode wall time: the head's catch-up forwards, drafting.
            head_share=head_ms / decode_wall_ms if decode_wall_ms > 0 else None,
            draft_share=propose_ms / decode_wall_ms if decode_wall_ms > 0 else None,
        )
        found = fitted = None
        if curve is not None:
            paid = (curve if overhead == 0.0 else CostCurve(
                (1.0, *(c * (1.0 + overhead) for c in curve.costs[1:]))))
            found = limit_at_acceptance(paid, acc_pos, dr_pos, decode_tokens=decode_tokens,
                                        plain_steps=plain_steps, draft_cost=draft_cost,
                                        repair=repair)
            if found is not None and overhead == 0.0 and repair is None:
                # Every decode forward of an attention model without a head is a window
                # of the curve or one row, so the run's forward time prices the curve's
                # level (fit_curve_to_run says why).
                verify = _verify_decodes(stats, ref_runs, fwd_ms, plain_steps, replays)
                fit = (None if verify is None
                       else fit_curve_to_run(paid, dr_pos, verify_decodes=verify))
                refit = None if fit is None else limit_at_acceptance(
                    fit[0], acc_pos, dr_pos, decode_tokens=decode_tokens,
                    plain_steps=plain_steps, draft_cost=draft_cost)
                if fit is not None and refit is not None:
                    fitted = refit, fit[1]
        if found is not None:
            k, speedup, drafting = found
            achieved = ratio_of(dec, ref_dec)
            out["limit"] = {"k": k, "speedup": speedup, "drafting_speedup": drafting,
                            "plain_steps": plain_steps, "curve_scale": None,
                            "curve_speedup": speedup}
            if fitted is not None:
                # The limit on the fitted curve; the pre-run curve's stays beside it.
                (k, speedup, drafting), scale = fitted
                out["limit"].update(k=k, speedup=speedup, drafting_speedup=drafting,
                                    curve_scale=scale)
            out["limit"]["fraction"] = achieved / speedup if achieved is not None else None
        else:
            out["limit"] = None
    return out
