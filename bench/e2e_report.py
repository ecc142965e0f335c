"""The printed ``meshd bench-e2e`` report: a table per model, workload and client count,
meshd's ratios to every other arm, each server's time to ready and idle CPU. A workload
with an output constraint gets two more columns: what the grammar forced and what it
cost, per token. A scene (``long-prompt``, ``multi-turn``) gets its own table of waits."""

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
    if cfg.get("busy"):
        lines.append(f"busy machine: {cfg['busy']} 'python -c \"while True: pass\"' "
                     "process(es) ran beside the servers throughout (started before them)")
    for model in report["models"]:
        lines.append("")
        lines.append(
            f"== {model['name']} ({model['note'] or model['path']}): "
            f"{'chat template' if model['chat'] else 'no chat template'}, requests to "
            f"{model['endpoint']}; MTP head: {'yes' if model['has_mtp'] else 'no'}")
        for block in model["blocks"]:
            for table in block["workloads"]:
                lines += _table(table, block["clients"])
            if block.get("scene"):
                lines += _scene(block["scene"])
            lines += _ready(block)
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
    answered = ", ".join(f"{name} {s['answered_tok_s']:.1f}"
                         for name, s in table["arms"].items()
                         if s.get("answered_tok_s") is not None)
    if clients > 1 and answered:
        best_answered = table.get("best_peer_answered")
        out.append("  answered tok/s (the answers' tokens over the time their clients "
                   f"waited, prompts included): {answered}" + (
                       f"; meshd / best peer "
                       f"{_ratio(table['meshd_over_best_peer_answered'])} ({best_answered})"
                       if best_answered else ""))
    if GENERATE_ARM in table["arms"]:
        out.append("  serve over HTTP / in-process (meshd / meshd-generate): "
                   f"{_ratio(table['serve_over_generate'])}")
    gaps = [f"{name} {s['host_ms_per_step']:.3f} ms" + (
        f" ({s['host_ms_per_token']:.3f} ms/token)"
        if s.get("host_ms_per_token") is not None else "")
        for name, s in table["arms"].items() if s.get("host_ms_per_step") is not None]
    if gaps:
        out.append("  host gap per decode step (compute thread outside verify forwards; "
                   "MTP drafting counts; per generated token): " + ", ".join(gaps))
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


def _who(block: Mapping[str, Any]) -> str:
    """Which servers a block's closing lines are about."""
    scene = block.get("scene")
    if scene:
        return f"{scene['scene']} servers ({block['clients']} slot(s), context {block['ctx']})"
    return f"{block['clients']} client(s)"


def _idle(block: Mapping[str, Any]) -> list[str]:
    """The servers' CPU use while idle (every unavailable arm is in each table)."""
    cells = [f"{name} {_num(info['idle_cpu_pct'], '.1f')}%"
             for name, info in block["servers"].items()
             if info.get("idle_cpu_pct") is not None]
    if not cells:
        return []
    return [f"-- idle CPU, {_who(block)}: % of one core over "
            f"{block['idle_seconds']:g} s, 2 s after the last request: " + ", ".join(cells)]


def _ready(block: Mapping[str, Any]) -> list[str]:
    """Each server's time from its process's start to ``/health`` answering 200."""
    cells = [f"{name} {info['ready_s']:.2f} s" for name, info in block["servers"].items()
             if info.get("ready_s") is not None]
    if not cells:
        return []
    ratios = [f"{name} / llama-server {_ratio(r)}"
              for name, r in (block.get("ready_over_llama_server") or {}).items()]
    return [f"-- time to ready (process start to /health 200), {_who(block)}: "
            + ", ".join(cells) + ("; " + ", ".join(ratios) if ratios else "")]


# --------------------------------------------------------------------------- scenes


def _ms(seconds: float | None) -> str:
    return _num(None if seconds is None else 1e3 * seconds, ".0f")


def _scene(scene: Mapping[str, Any]) -> list[str]:
    out = (_long_prompt(scene) if scene["scene"] == "long-prompt" else _multi_turn(scene))
    for name, why in scene["not_run"].items():
        out.append(f"  {name:<28} not run: {_first_line(why)}")
    for name, s in scene["arms"].items():
        if s.get("error"):
            out.append(f"  {name:<28} stopped: {_first_line(s['error'])}")
    return out


def _long_prompt(scene: Mapping[str, Any]) -> list[str]:
    n = scene["bystanders"]
    out = [f"-- long-prompt: a {scene['document_tokens']}-token document, alone and beside "
           f"{n} streaming bystander(s) (short prompt, long answer), {scene['reps']} reps, "
           f"{scene['tokens']} tokens; medians over reps",
           "   waits: between two arrivals of a bystander's text, those overlapping the "
           "long prompt's prefill (sent to first text)",
           f"  {'arm':<28} {'prompt':>6} {'TTFT alone ms':>13} {'TTFT beside ms':>14} "
           f"{'bystander':>9} {'longest wait ms':>15} {'median wait ms':>14}"]
    for name, s in scene["arms"].items():
        for i, b in enumerate(s["bystanders"]):
            head = (f"  {name:<28} {_num(s['prompt_tokens'], '.0f'):>6} "
                    f"{_ms(s['ttft_alone_s']):>13} {_ms(s['ttft_beside_s']):>14}"
                    if i == 0 else f"  {'':<28} {'':>6} {'':>13} {'':>14}")
            row = (f"{head} {i + 1:>9} {_ms(b['max_gap_s']):>15} "
                   f"{_ms(b['median_gap_s']):>14}")
            if not b["covered"]:
                row += "  (ended before the long prompt's first text)"
            if b["errors"]:
                row += f"  ({len(b['errors'])} failed: {_first_line(b['errors'][0])})"
            out.append(row)
        if s["failed_runs"]:
            out.append(f"  {name:<28} ({s['failed_runs']} failed run(s))")
        if not s["quiet_after"]:
            out.append(f"  {name:<28} (still busy after a run: the next one overlapped)")
    for arm, r in scene["meshd_over"].items():
        cells = [f"TTFT alone {_ratio(r.get('ttft_alone_s'))}",
                 f"TTFT beside {_ratio(r.get('ttft_beside_s'))}"]
        for i in range(n):
            cells.append(f"bystander {i + 1} longest wait "
                         f"{_ratio(r.get(f'bystanders.{i}.max_gap_s'))}, median wait "
                         f"{_ratio(r.get(f'bystanders.{i}.median_gap_s'))}")
        out.append(f"  meshd / {arm} (times: below 1.00x meshd's is shorter): "
                   + "; ".join(cells))
    return out


def _multi_turn(scene: Mapping[str, Any]) -> list[str]:
    turns = range(1, scene["turns"] + 1)
    out = [f"-- multi-turn: {scene['chats']} chats interleaved, {scene['turns']} turns each "
           f"resending its history, a {scene['system_tokens']}-token system prompt, "
           f"{scene['tokens']} tokens per answer, {scene['reps']} reps; TTFT ms per turn "
           "(median over chats and reps), prompt tokens",
           f"  {'arm':<28} " + " ".join(f"{f'turn {t}':>8}" for t in turns)
           + f" {'prompt':>14}"]
    for name, s in scene["arms"].items():
        ttfts = " ".join(f"{_ms(t['ttft_s']):>8}" for t in s["turns"])
        prompts = "/".join(_num(t["prompt_tokens"], ".0f") for t in s["turns"])
        row = f"  {name:<28} {ttfts} {prompts:>14}"
        failed = sum(t["failed"] for t in s["turns"])
        if failed:
            row += f"  ({failed} failed request(s))"
        out.append(row)
    for arm, r in scene["meshd_over"].items():
        out.append(f"  {'meshd / ' + arm:<28} "
                   + " ".join(f"{_ratio(r.get(f'turns.{t - 1}.ttft_s')):>8}" for t in turns)
                   + "  (times: below 1.00x meshd's is shorter)")
    return out
