"""Prompt lookup replayed without the noise: ``python -m meshd.bench.replay``.

Why: on a shared machine one run's decode rate moves by 10-20%, and where a greedy text
leaves plain decoding's at a near-tie (with an f16 K cache past 256 tokens of context, or
on an accelerator: docs/identity.md, "Identity and its limits") two live arms decode different
texts, so a cell compares two texts as much as two rules. Prompt lookup
needs no model to draft: given plain decoding's text and the measured cost of a forward
of ``k + 1`` rows, what a rule would have drafted, had accepted and paid is arithmetic.
So each rule is replayed over the same text (the one every rule decodes where
verification is exact, as with the default K cache on the CPU) and priced by the same curve.

For each model and workload: plain decoding's greedy text (speculation off), the cost of
``k + 1`` rows against one decode measured at the workload's mean decode context (as the
bench measures it), then:

* ``meshd``: the n-gram proposer with the daemon's defaults, its draft lengths chosen on
  that curve, its statistics pooled across the workloads of a model as one daemon pools
  them, ``--reps`` passes over the workloads (the last is reported);
* ``ngram-simple``: llama.cpp's rule of that name (``common_ngram_simple_draft``): where
  the last 12 tokens occurred before (the latest occurrence), draft what followed, up
  to 16 or 32 tokens (the better of the two is reported);
* ``foresight``: drafting from the suffix chain's matches with foresight: each step
  drafts, from the candidate that will hold longest, exactly the number of tokens that
  pays best for that step on the curve. A reference for what guessing costs, not a
  strict bound (a step-by-step choice, and llama.cpp's rule may pick an occurrence the
  chain does not offer).
* ``hindsight``: the longest match's continuation, drafted to a fixed length per class
  of match length (the proposer's classes, matches of one token included), each length
  chosen on this very text to pay best there. A rule that keeps one such table for a
  whole text gets no more; one that learns its lengths while it decodes (meshd's) can
  get more only where acceptance changes along the text, or by drafting a shorter
  match instead. So where hindsight is short of a target, setting draft lengths by
  match length and measured acceptance will not reach it on that text.

Speedup is the generated tokens after the first over the summed cost of the steps that
produced them (a plain decode costs 1). ``limit`` is what the bench's "limit at measured
acceptance" makes of meshd's drafts here, on the same curve, and ``reach`` meshd's share
of it: where the live bench finds meshd-auto short of its limit, this tells whether
the rule or the run (forward costs off the measured curve, other load) fell short.
Left out: host time (under 1% of a decode for either rule on this CPU) and the forwards'
own noise. This prints numbers; it never fails on them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.native.calibrate import measure_row_costs
from meshd.plugins.base import Outcome, ProposalRequest
from meshd.plugins.match_stats import CLASS_STARTS, SharedMatchStats, length_class
from meshd.plugins.ngram import NgramProposer
from meshd.plugins.suffix_index import SuffixIndex
from meshd.policy.costs import CostCurve

from .summary import limit_at_acceptance

#: llama.cpp's ngram-simple defaults: the n-gram looked up, and the longest draft.
SIMPLE_N = 12
SIMPLE_M = (16, 32)


@attrs.frozen
class Replay:
    """One rule over one text: its speedup against plain decoding and its drafts, and
    what its acceptance is worth at best (``limit``: the bench's limit at the measured
    acceptance, :func:`~meshd.bench.summary.limit_at_acceptance`, on the same
    curve; None where it drafted nothing)."""

    speedup: float
    drafted: int
    accepted: int
    verifies: int
    limit: float | None = None


#: A rule's draft for one step: (the sequence so far, the most tokens it may draft).
Drafter = Callable[[list[int], int], list[int]]
#: What the rule hears after a step that drafted: (drafted, accepted, committed).
Observer = Callable[[int, int, tuple[int, ...]], None]


def replay_rule(prompt: Sequence[int], text: Sequence[int], curve: CostCurve, k_cap: int,
            draft: Drafter, observe: Observer | None = None) -> Replay:
    """Step through ``text`` (plain decoding's tokens after ``prompt``) as the engine
    does: each step asks ``draft`` for at most ``k_cap`` tokens (fewer where the text or
    the curve ends), commits what matches plus the target's own token, and pays
    ``c(k)``; the first token comes from the prefill and costs nothing here."""
    seq, pos = [*prompt, text[0]], 1
    cost, plain_steps = 0.0, 0
    stats = GenerationStats()  # counted as the engine counts them for the bench
    while pos < len(text):
        k_max = min(k_cap, len(text) - pos - 1, curve.max_k)
        tokens = draft(seq, k_max)[:k_max] if k_max > 0 else []
        a = 0
        while a < len(tokens) and tokens[a] == text[pos + a]:
            a += 1
        committed = tuple(text[pos:pos + a + 1])
        if tokens:
            stats.record_verify(len(tokens), a)
            if observe is not None:
                observe(len(tokens), a, committed)
        else:
            plain_steps += 1
        cost += curve.cost(len(tokens))
        seq += committed
        pos += len(committed)
    found = limit_at_acceptance(curve, stats.accepted_per_position,
                                stats.drafted_per_position, decode_tokens=len(text) - 1,
                                plain_steps=plain_steps)
    return Replay((len(text) - 1) / cost if cost > 0 else 1.0, stats.drafted, stats.accepted,
                  stats.verify_calls, found[1] if found is not None else None)


def replay_ngram(prompt: Sequence[int], text: Sequence[int], curve: CostCurve, *,
                 shared: SharedMatchStats | None = None, draft_max: int = 32,
                 eog: frozenset[int] = frozenset()) -> Replay:
    """The daemon's n-gram proposer over ``text`` (plain decoding's tokens after
    ``prompt``), its lengths chosen on ``curve`` and its outcomes fed back as the
    engine feeds them."""
    prop = NgramProposer(curve=lambda: curve, shared=shared, eog_tokens=eog)

    def draft(seq: list[int], k_max: int) -> list[int]:
        got = prop.propose(ProposalRequest(tokens=seq, n_prompt=len(prompt), max_len=k_max,
                                           deadline=0.0))
        return list(got.tokens) if got is not None else []

    def observe(proposed: int, accepted: int, committed: tuple[int, ...]) -> None:
        prop.observe(Outcome(proposed, accepted, committed))

    try:
        return replay_rule(prompt, text, curve, draft_max, draft, observe)
    finally:
        prop.close()


def replay_simple(prompt: Sequence[int], text: Sequence[int], curve: CostCurve, *,
                  n: int = SIMPLE_N, m: int = SIMPLE_M[0]) -> Replay:
    """llama.cpp's ngram-simple rule: the latest earlier occurrence of the last ``n``
    tokens, and up to ``m`` of the tokens that followed it."""

    def draft(seq: list[int], k_max: int) -> list[int]:
        if len(seq) <= n:
            return []
        pattern = seq[-n:]
        for j in range(len(seq) - n - 1, -1, -1):
            if seq[j:j + n] == pattern:
                return seq[j + n:j + n + k_max]
        return []

    return replay_rule(prompt, text, curve, m, draft)


def held_from(tokens: Sequence[int], end: int, text: Sequence[int], pos: int, limit: int) -> int:
    """How many of at most ``limit`` tokens drafted from the occurrence ending at ``end``
    (repeating periodically where it runs into the end, as the proposer drafts) match
    ``text`` from ``pos`` on."""
    period = len(tokens) - end
    a = 0
    while a < limit and tokens[end + a % period] == text[pos + a]:
        a += 1
    return a


def foresight(prompt: Sequence[int], text: Sequence[int], curve: CostCurve, *,
              draft_max: int = 32) -> float:
    """Drafting with foresight: every step drafts, from the suffix chain's candidate
    that will hold longest, the length that pays best on ``curve`` (module docstring)."""
    index = SuffixIndex()
    index.extend([*prompt, text[0]])
    pos, cost = 1, 0.0
    while pos < len(text):
        k_max = min(draft_max, len(text) - pos - 1, curve.max_k)
        hold = max((held_from(index.tokens, end, text, pos, k_max)
                    for _, end in index.matches()), default=0)
        k = max(range(hold + 1), key=lambda j: ((j + 1) / curve.cost(j), -j))
        cost += curve.cost(k)
        index.extend(text[pos:pos + k + 1])
        pos += k + 1
    return (len(text) - 1) / cost if cost > 0 else 1.0


def hindsight(prompt: Sequence[int], text: Sequence[int], curve: CostCurve, *,
              draft_max: int = 32, sweeps: int = 4) -> float:
    """The best fixed draft length per match-length class, chosen on ``text`` itself
    (module docstring): its speedup over plain decoding.

    Every rule commits plain decoding's text, so the longest earlier match at each
    position, and how far its continuation holds, do not depend on the rule: they are
    found once, and each table of lengths is then priced in one pass. The table is
    improved one class at a time (every length for that class, the others held) until a
    sweep changes nothing.
    """
    index = SuffixIndex()
    index.extend([*prompt, text[0]])
    classes: list[int] = [0]
    holds: list[int] = [0]
    for pos in range(1, len(text)):
        n, end = next(index.matches(), (0, 0))
        limit = min(draft_max, len(text) - pos - 1)
        classes.append(length_class(n) + 1 if n > 0 else 0)  # 0: no match, never drafts
        holds.append(held_from(index.tokens, end, text, pos, limit) if n > 0 else 0)
        index.extend([text[pos]])
    top = min(draft_max, curve.max_k)

    def speedup(table: list[int]) -> float:
        pos, cost = 1, 0.0
        while pos < len(text):
            k = min(table[classes[pos]], len(text) - pos - 1)
            cost += curve.cost(k)
            pos += min(holds[pos], k) + 1
        return (len(text) - 1) / cost if cost > 0 else 1.0

    table = [0] * (len(CLASS_STARTS) + 1)
    best = speedup(table)
    seen = sorted(set(classes) - {0})  # the classes the text has matches in
    for _ in range(sweeps):
        improved = False
        for c in seen:
            keep = table[c]
            for k in range(top + 1):
                table[c] = k
                got = speedup(table)
                if got > best + 1e-12:
                    best, keep, improved = got, k, True
            table[c] = keep
        if not improved:
            break
    return best


def replay_model(name: str, *, workloads: Sequence[str] | None, tokens: int, reps: int,
                 threads: int | None, n_ctx: int, draft_max: int, cost_reps: int,
                 log: Any = print) -> dict[str, Any]:
    """Plain decoding's text and the cost curve of every workload on model ``name``,
    then the rules replayed over them (see the module docstring)."""
    from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig

    from .arms import default_threads, render_prompt, resolve_model
    from .run import workload_cost_context
    from .workloads import load_workloads

    threads = threads or default_threads()
    spec = resolve_model(name, threads=threads)
    chosen = load_workloads(workloads)
    rt = ModelRuntime(RuntimeConfig(model_path=str(spec.path), n_ctx_seq=n_ctx, n_seq_max=1,
                                    threads=threads, prefix_cache_tokens=0, calibrate=False,
                                    draft_max=draft_max))
    try:
        eog = frozenset(rt.model.info.eog_tokens)
        texts: dict[str, tuple[list[int], list[int], CostCurve, bool]] = {}
        for w in chosen:
            prompt, _ = render_prompt(rt, w, room=tokens)
            gen = rt.generation(prompt, max_tokens=tokens, proposer="off")
            for _ in rt.run(gen):
                pass
            at = workload_cost_context(len(prompt), tokens, n_ctx, draft_max)
            log(f"{spec.name}: {w.name}: {len(gen.committed)} tokens; cost of k+1 rows at "
                f"{at} tokens of context")
            curve = CostCurve.sanitized(measure_row_costs(rt.context, draft_max,
                                                          reps=cost_reps, context_tokens=at))
            texts[w.name] = (prompt, list(gen.committed), curve, w.copies)
    finally:
        rt.close()
    shared = SharedMatchStats()
    meshd: dict[str, Replay] = {}
    for _ in range(reps):
        for w_name, (prompt, text, curve, _) in texts.items():
            if len(text) > 1:
                meshd[w_name] = replay_ngram(prompt, text, curve, shared=shared,
                                             draft_max=draft_max, eog=eog)
    rows = []
    for w_name, (prompt, text, curve, copies) in texts.items():
        if len(text) < 2:
            continue
        simple = max((replay_simple(prompt, text, curve, m=m) for m in SIMPLE_M),
                     key=lambda r: r.speedup)
        rows.append({
            "workload": w_name, "copies": copies, "tokens": len(text),
            "meshd": attrs.asdict(meshd[w_name]), "ngram_simple": attrs.asdict(simple),
            "ratio": meshd[w_name].speedup / simple.speedup,
            "foresight": foresight(prompt, text, curve, draft_max=draft_max),
            "hindsight": hindsight(prompt, text, curve, draft_max=draft_max),
        })
    return {"model": spec.name, "threads": threads, "workloads": rows}


def format_table(report: dict[str, Any]) -> str:
    """One model's replay as a table: speedups, meshd over ngram-simple, foresight and
    hindsight."""
    lines = [f"{report['model']} ({report['threads']} threads): speedup over plain decoding "
             "on plain decoding's own text",
             f"  {'workload':<18} {'kind':<7} {'meshd':>6} {'simple':>6} {'ratio':>6} "
             f"{'seer':>6} {'hind':>6} {'limit':>6} {'reach':>6}  meshd accepted/drafted"]
    for r in report["workloads"]:
        m = r["meshd"]
        limit = m.get("limit")
        reach = (f"{limit:6.2f} {m['speedup'] / limit:6.2f}" if limit
                 else f"{'-':>6} {'-':>6}")
        lines.append(f"  {r['workload']:<18} {'copy' if r['copies'] else 'other':<7} "
                     f"{m['speedup']:6.2f} {r['ngram_simple']['speedup']:6.2f} "
                     f"{r['ratio']:6.2f} {r['foresight']:6.2f} {r['hindsight']:6.2f} {reach}  "
                     f"{m['accepted']}/{m['drafted']}")
    return "\n".join(lines)


def add_run_options(p: argparse.ArgumentParser) -> None:
    """The options every replay command shares: where it runs and how the curve is
    measured."""
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--ctx", type=int, default=4096, help="context per sequence")
    p.add_argument("--draft-max", type=int, default=32)
    p.add_argument("--cost-reps", type=int, default=5,
                   help="rounds of the cost measurement (default 5)")
    p.add_argument("--json", metavar="FILE", default=None)


def run_reports(models: Sequence[str], json_path: str | None,
                replay: Callable[..., dict[str, Any]],
                table: Callable[[dict[str, Any]], str]) -> int:
    """Replay each model (``replay(name, log=...)``), print its table as it ends, and
    write every report to ``json_path`` where one is given."""

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    reports = []
    for name in models:
        report = replay(name, log=log)
        print(table(report), flush=True)
        reports.append(report)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(reports, f, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshd.bench.replay",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("-m", "--model", action="append", default=[],
                   help="model name or GGUF path, as for meshd bench (repeatable; "
                        "default: smollm2-q8_0 and smollm2-q4_1)")
    p.add_argument("-w", "--workload", action="append", default=[],
                   help="workload name or FILE.json (repeatable; default: all shipped)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per text (default 128)")
    p.add_argument("--reps", type=int, default=3,
                   help="passes of meshd's proposer over the workloads (default 3)")
    add_run_options(p)
    args = p.parse_args(argv)
    if args.tokens < 2 or args.reps < 1 or args.draft_max < 1:
        p.error("--tokens must be at least 2, --reps and --draft-max at least 1")
    return run_reports(
        args.model or ["smollm2-q8_0", "smollm2-q4_1"], args.json,
        lambda name, log: replay_model(
            name, workloads=args.workload or None, tokens=args.tokens, reps=args.reps,
            threads=args.threads, n_ctx=args.ctx, draft_max=args.draft_max,
            cost_reps=args.cost_reps, log=log),
        format_table)


if __name__ == "__main__":
    sys.exit(main())
