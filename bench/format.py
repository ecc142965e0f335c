"""The human-readable ``meshd bench`` report: the table, limits and target lines."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from meshd.native.calibrate import CALIBRATION_CONTEXT

from .arms import REFERENCE_ARM
from .summary import CONTENDED_CPU_SHARE


def _fmt(value: float | None, spec: str, none: str = "-") -> str:
    return none if value is None or (isinstance(value, float) and math.isnan(value)) \
        else format(value, spec)


def _curve_note(limit: Mapping[str, Any]) -> str:
    """How the limit's curve was fitted to the run, and the pre-run curve's limit."""
    scale = limit.get("curve_scale")
    if scale is None:
        return ""
    return (f"; curve fitted to the run's forwards: x{scale:.2f} its excess, "
            f"pre-run curve's limit {limit['curve_speedup']:.2f}x")


def _identity_cell(s: Mapping[str, Any], is_ref: bool, prompt_tokens: int) -> str:
    if is_ref:
        return "ref"
    if s.get("error"):
        return "no (failed)"
    ident = s.get("identical")
    if ident is None:
        return "-"
    if ident:
        return "yes"
    at = s.get("first_divergence")
    cell = f"no @{at}"
    notes = []
    margin = s.get("margin")
    if isinstance(margin, Mapping) and "margin" in margin:
        notes.append(f"margin {margin['margin']:.3f}")
    if isinstance(at, int):
        notes.append(f"context {prompt_tokens + at}")
    return cell + (f" ({', '.join(notes)})" if notes else "")


def format_report(report: Mapping[str, Any]) -> str:
    """The human-readable table, limits and target lines."""
    lines: list[str] = []
    cfg = report["config"]
    lines.append(
        f"meshd bench: {cfg['reps']} reps x {cfg['max_tokens']} tokens, "
        f"{report['machine']['threads']} threads, arms interleaved; medians; "
        f"ratios are to '{REFERENCE_ARM}' (decode = after the first token)"
    )
    head = (f"  {'arm':<26} {'tok/s':>7} {'x':>5} {'dec t/s':>8} {'x':>5} "
            f"{'fwd/tok':>7} {'acc':>5} {'acc by position':<20} {'fwd ms':>6} {'x':>5} "
            f"{'host':>5} {'ckpt KB':>7}  identical")
    for m in report["models"]:
        lines.append("")
        lines.append(f"== {m['name']}  ({m['path']}{'; ' + m['note'] if m['note'] else ''})")
        if m.get("cache_type_k"):
            lines.append(f"   K cache {m['cache_type_k']} in every arm (llama.cpp's arms "
                         "included)")
        curve = m.get("cost_curve")
        if curve:
            costs = " ".join(f"k={k}:{c:.2f}" for k, c in enumerate(curve) if k)
            lim = m["limit"]
            lines.append(f"   cost of k+1 rows vs 1 ({CALIBRATION_CONTEXT} tokens of context): "
                         f"{costs}")
            lines.append(f"   physical limit (acceptance 1): {lim['speedup']:.2f}x at "
                         f"k={lim['k']}")
            snap = m.get("snapshot_cost")
            if snap is not None:
                lines.append(f"   a one-row forward keeping rollback snapshots costs {snap:.2f} "
                             "plain decodes; costs above are in plain decodes")
        for arm, why in m.get("unavailable", {}).items():
            lines.append(f"   {arm}: not run ({why})")
        contended = sum(s.get("contended_runs", 0) for w in m["workloads"]
                        for s in w["arms"].values())
        total = sum(len(s["runs"]) for w in m["workloads"] for s in w["arms"].values())
        if contended:
            lines.append(f"   warning: {contended} of {total} runs got under "
                         f"{CONTENDED_CPU_SHARE:.0%} of the CPU time their arm got at best on "
                         "the same workload (other load on the machine); their speeds are "
                         "unreliable")
        for w in m["workloads"]:
            cut = ", cut from the left to fit the context" if w["truncated"] else ""
            lines.append(f"-- {w['name']}: {w['prompt_tokens']} prompt tokens{cut}")
            wcurve = w.get("cost_curve")
            if wcurve:
                picks = [k for k in (1, 3, 7, 15, 31) if k < len(wcurve)]
                lines.append(f"   cost of k+1 rows vs 1 at {w['cost_context']} tokens of "
                             "context (the limits below use it): "
                             + " ".join(f"k={k}:{wcurve[k]:.2f}" for k in picks))
            lines.append(head)
            for arm, s in w["arms"].items():
                per_pos = s.get("acceptance_per_position") or []
                pos = " ".join(f"{a:.2f}" for a in per_pos[:4])
                ckpt = s.get("checkpoint_bytes")
                lines.append(
                    f"  {arm:<26} {_fmt(s['median_tok_s'], '7.1f'):>7} "
                    f"{_fmt(s['ratio_vs_plain'], '5.2f'):>5} "
                    f"{_fmt(s['median_decode_tok_s'], '8.1f'):>8} "
                    f"{_fmt(s['decode_ratio_vs_plain'], '5.2f'):>5} "
                    f"{_fmt(s['forwards_per_token'], '7.3f'):>7} "
                    f"{_fmt(s.get('acceptance'), '5.2f'):>5} {pos:<20} "
                    f"{_fmt(s['forward_ms'], '6.2f'):>6} "
                    f"{_fmt(s['forward_cost_vs_plain'], '5.2f'):>5} "
                    f"{_fmt(s['host_ms_per_token'], '5.2f'):>5} "
                    f"{_fmt(None if ckpt is None else ckpt / 1024, '7.1f'):>7}  "
                    f"{_identity_cell(s, arm == m['reference'], w['prompt_tokens'])}"
                )
                lim = s.get("limit")
                if lim:
                    lines.append(f"  {'':<26} limit at measured acceptance: "
                                 f"{lim['speedup']:.2f}x (k={lim['k']} where it drafted: "
                                 f"{lim['drafting_speedup']:.2f}x; "
                                 f"{lim['plain_steps']} plain steps{_curve_note(lim)}), "
                                 f"reached {_fmt(lim['fraction'], '.0%')}")
                if s.get("head_share"):
                    fpt = s.get("forwards_per_decode_token")
                    lines.append(f"  {'':<26} MTP head: catch-up "
                                 f"{_fmt(s['head_share'], '.1%')} of decode time "
                                 f"(+{_fmt(s.get('head_overhead'), '.1%')} per forward), "
                                 f"drafting {_fmt(s.get('draft_share'), '.1%')} "
                                 f"({_fmt(s.get('draft_cost'), '.3f')} decodes per token); "
                                 f"forwards/token {_fmt(fpt, '.3f')}")
                if s.get("error"):
                    lines.append(f"  {'':<26} error: {s['error']}")
    lines.append("")
    lines.append("columns: tok/s end-to-end, dec t/s after the first token, x = ratio to "
                 "plain; fwd/tok = decode forwards per token; acc = accepted/drafted; "
                 "fwd ms = mean forward (x plain's decode); host = ms/token outside "
                 "llama.cpp forwards; identical: 'no @i' = first differing token, the "
                 "reference's top-2 logit margin there and the context length (with "
                 "an f16 K cache, past 256 tokens one-token and wider forwards round "
                 "differently, so near-ties may flip: docs/identity.md)")
    lines.append(f"llama-server arms: {report.get('llama_server', 'not run')}")
    lines.append("")
    lines.append("targets (decode-rate ratios):")
    for t in report["targets"]:
        where = f"{t['model']}/{t['workload']}" if t["workload"] else t["model"]
        value = _fmt(t["value"], ".3f")
        lines.append(f"  {t['status']:<4} {t['target']:<58} {where:<32} {value:>6}"
                     f"{'  ' + t['detail'] if t['detail'] else ''}")
    return "\n".join(lines)
