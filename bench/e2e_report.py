"""The printed ``meshd bench-e2e`` report: a table per model, workload and client count,
meshd's ratios to every other arm, and each server's idle CPU. A workload with an output
constraint gets two more columns: what the grammar forced and what it cost, per token."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .e2e_arms import GENERATE_ARM, MAIN_ARM

__all__ = ["format_e2e"]


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else text


def format_e2e(report: Mapping[str, Any]) -> str:
    """The whole report as text."""
    cfg = report["config"]
    ls = report["llama_server"]
    peer = (ls["version"] or "") if ls["binary"] else f"unavailable: {ls['unavailable']}"
    lines = [
        f"meshd bench-e2e: {cfg['reps']} reps x {cfg['tokens']} tokens, {cfg['threads']} "
        f"threads, context {cfg['ctx']} per session; arms interleaved, medians",
        "decode tok/s: 1 client: (tokens - 1) / (last text - first text) of the request; "
        "N clients: sum(tokens_i - 1) / (last text of any - first text of any); tokens "
        "from the stream's usage; TTFT: request sent to first text",
        f"meshd: {report['meshd']}",
        f"llama-server: {ls['binary'] + ' ' if ls['binary'] else ''}{peer}",
    ]
    for model in report["models"]:
        lines.append("")
        lines.append(
            f"== {model['name']} ({model['note'] or model['path']}): "
            f"{'chat template' if model['chat'] else 'no chat template'}, requests to "
            f"{model['endpoint']}; MTP head: {'yes' if model['has_mtp'] else 'no'}")
        for block in model["blocks"]:
            for table in block["workloads"]:
                lines += _table(table, block["clients"])
            lines += _idle(block)
    return "\n".join(lines)


def _table(table: Mapping[str, Any], clients: int) -> list[str]:
    who = "1 client" if clients == 1 else f"{clients} clients (aggregate)"
    constrained = _constrained(table)
    out = [f"-- {table['workload']}, {who}",
           f"  {'arm':<28} {'decode tok/s':>12} {'TTFT ms':>8} {'tokens':>6} "
           f"{'prompt':>6} {'text = meshd':>12} {'meshd / arm':>11}"
           + (f" {'forced acc':>10} {'copy acc':>8} {'grammar ms/tok':>14}" if constrained
              else "")]
    over = table["meshd_over"]
    for name, s in table["arms"].items():
        ttft = None if s["ttft_s"] is None else 1e3 * s["ttft_s"]
        ratio = "-" if name == MAIN_ARM else _ratio(over.get(name))
        row = (f"  {name:<28} {_num(s['decode_tok_s'], '.1f'):>12} {_num(ttft, '.0f'):>8} "
               f"{_num(s['completion_tokens'], '.0f'):>6} {_num(s['prompt_tokens'], '.0f'):>6} "
               f"{_same(s.get('same_text_as_meshd')):>12} {ratio:>11}")
        if constrained:
            row += _grammar_cells(s)
        if s["failed_runs"]:
            row += f"  ({s['failed_runs']} failed run(s))"
        if s.get("error"):
            row += f"  stopped: {_first_line(s['error'])}"
        out.append(row)
    for name, why in table["not_run"].items():
        out.append(f"  {name:<28} not run: {_first_line(why)}")
    best = table["best_peer"]
    out.append(f"  meshd / best peer: {_ratio(table['meshd_over_best_peer'])}"
               + (f" ({best})" if best else " (no llama-server arm ran)"))
    if GENERATE_ARM in table["arms"]:
        out.append("  serve over HTTP / in-process (meshd / meshd-generate): "
                   f"{_ratio(table['serve_over_generate'])}")
    gaps = [f"{name} {s['host_ms_per_step']:.3f} ms" for name, s in table["arms"].items()
            if s.get("host_ms_per_step") is not None]
    if gaps:
        out.append("  host gap per decode step (compute thread outside verify forwards; "
                   "MTP drafting counts): " + ", ".join(gaps))
    return out


def _constrained(table: Mapping[str, Any]) -> bool:
    """Whether the workload held its answers to a schema (``text`` holds nothing)."""
    fmt = table.get("response_format")
    return isinstance(fmt, Mapping) and fmt.get("type") != "text"


def _grammar_cells(s: Mapping[str, Any]) -> str:
    """``forced acc``: % of emitted tokens the grammar forced and meshd accepted;
    ``copy acc``: % meshd copied from the prompt into string values and accepted;
    ``grammar ms/tok``: meshd's time choosing under the constraint per token ("-" where
    the answers carried no counters: not meshd)."""
    forced, copied = (_num(s.get(key), ".1%")
                      for key in ("forced_accepted_share", "copy_accepted_share"))
    return f" {forced:>10} {copied:>8} {_num(s.get('grammar_ms_per_token'), '.3f'):>14}"


def _same(flags: list[bool] | None) -> str:
    """``k/n``: of n requests compared, k wrote meshd's text."""
    return "-" if not flags else f"{sum(flags)}/{len(flags)}"


def _idle(block: Mapping[str, Any]) -> list[str]:
    """The servers' CPU use while idle (every unavailable arm is in each table)."""
    cells = [f"{name} {_num(info['idle_cpu_pct'], '.1f')}%"
             for name, info in block["servers"].items()
             if info.get("idle_cpu_pct") is not None]
    if not cells:
        return []
    return [f"-- idle CPU, {block['clients']} client(s): % of one core over "
            f"{block['idle_seconds']:g} s, 2 s after the last request: " + ", ".join(cells)]
