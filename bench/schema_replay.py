"""Structured outputs replayed: ``python -m meshd.bench.schema_replay``.

Why: under a JSON schema what speculation can gain is set by three things, none of them
the daemon's timing: how much of the answer the grammar dictates, how much of the rest a
lookup can copy from the prompt or the answer so far, and what a window of rows costs on
this machine. Given plain constrained decoding's answer and the measured cost of a
forward of ``k + 1`` rows, each drafting rule is arithmetic, as in :mod:`.replay`: what it
would have drafted, had accepted and paid. So the live bench's ratio can be read against
what any rule of that kind could reach on the same answer and the same curve.

For each constrained workload (the shipped ``schema-*`` ones by default): the answer
plain decoding gives under the workload's schema (speculation off, greedy), the cost
curve at the workload's mean decode context, then:

* ``forced``: each step drafts the tokens the grammar forces next (llguidance's
  ``compute_ff_tokens``), as the daemon's grammar proposer does, and decodes plainly
  where the grammar leaves a choice;
* ``+lookup``: the same, and where nothing is forced, the daemon's n-gram proposer over
  the prompt and the answer so far, its draft cut at the first token the grammar
  forbids (meshd-auto's rule on a model without an MTP head);
* ``meshd``: the engine's rule on a JSON document: as ``+lookup``, with a copy of the
  string value being written out of the prompt (the value-copy proposer, its lengths by
  the cost model at its measured acceptance) tried before the n-gram proposer;
* ``seer``: drafting with foresight: each step drafts, from the forced run or the
  suffix chain's match that will hold longest, exactly the number of tokens that pays
  best for that step on the curve. A reference for what drafting from the grammar and
  from copies can reach, not a strict bound (a step-by-step choice).

``forced share`` is the share of the answer's tokens the grammar forced where they
stand (one allowed continuation, which the model took). Speedups are the tokens after
the first over the summed cost of the steps that produced them; host time and the
forwards' noise are left out. This prints numbers; it never fails on them.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from llguidance import LLTokenizer

from meshd.daemon.engine.constraint import GrammarState
from meshd.native.calibrate import measure_row_costs
from meshd.native.tokenizer import Tokenizer
from meshd.plugins.base import Outcome, ProposalRequest
from meshd.plugins.ngram import NgramProposer
from meshd.plugins.suffix_index import SuffixIndex
from meshd.plugins.value_copy import COPY_PRIOR, ValueCopyProposer
from meshd.policy.acceptance import AcceptanceTracker
from meshd.policy.costs import CostCurve
from meshd.policy.draft_length import AdaptiveK

from .replay import Replay, add_run_options, held_from, replay_rule, run_reports

#: Builds a fresh grammar state for the answer's grammar (one per rule).
Grammars = Callable[[], GrammarState]
#: Builds a fresh value-copy proposer for the answer's prompt.
Copiers = Callable[[], ValueCopyProposer]


@attrs.frozen
class SchemaReplay:
    """The rules over one constrained answer (speedups over plain decoding)."""

    tokens: int
    forced_share: float
    forced: Replay
    lookup: Replay
    seer: float
    #: The engine's rule (forced, value copy, lookup); None without a tokenizer to copy.
    meshd: Replay | None = None


class _Follower:
    """The engine's grammar state kept at the answer's position: the replay hands over
    the whole sequence each step, and only the answer's new tokens are consumed."""

    def __init__(self, state: GrammarState, n_prompt: int) -> None:
        self.state = state
        self._at = n_prompt

    def sync(self, seq: Sequence[int]) -> GrammarState:
        if len(seq) > self._at:
            self.state.settle(seq[self._at:])
            self._at = len(seq)
        return self.state

    def forced(self, seq: Sequence[int]) -> list[int]:
        return self.sync(seq).forced()


def forced_share(prompt: Sequence[int], text: Sequence[int], grammars: Grammars) -> float:
    """The share of ``text``'s tokens that the grammar forced where they stand."""
    follow = _Follower(grammars(), len(prompt))
    seq, hits = list(prompt), 0
    for token in text:
        forced = follow.forced(seq)
        hits += bool(forced) and forced[0] == token
        seq.append(token)
    return hits / len(text) if text else 0.0


def replay_forced(prompt: Sequence[int], text: Sequence[int], curve: CostCurve,
                  grammars: Grammars, *, draft_max: int = 32) -> Replay:
    """Only the grammar's forced tokens drafted (the daemon's grammar proposer)."""
    follow = _Follower(grammars(), len(prompt))
    return replay_rule(prompt, text, curve, draft_max, lambda seq, k: follow.forced(seq)[:k])


def replay_lookup(prompt: Sequence[int], text: Sequence[int], curve: CostCurve,
                  grammars: Grammars, *, copier: Copiers | None = None, draft_max: int = 32,
                  copy_prior: float = COPY_PRIOR, eog: frozenset[int] = frozenset(),
                  ) -> Replay:
    """Forced tokens first; else, with ``copier``, a copy of the string value being
    written out of the prompt (lengths by the cost model at its measured acceptance, as
    the engine's copy gate chooses them); else the n-gram proposer. Every draft is cut
    where the grammar forbids. Without ``copier`` this is the engine's rule with prompt
    lookup alone; with it, the engine's rule on a JSON document."""
    follow = _Follower(grammars(), len(prompt))
    copy = copier() if copier is not None else None
    gate = AdaptiveK(curve, AcceptanceTracker(prior=copy_prior), k_max=draft_max)
    prop = NgramProposer(curve=lambda: curve, eog_tokens=eog)
    kind = [""]

    def draft(seq: list[int], k_max: int) -> list[int]:
        forced = follow.forced(seq)[:k_max]
        kind[0] = "forced"
        if forced:
            return forced
        valid = follow.state.valid_prefix
        copied = list(copy.draft(seq)) if copy is not None else []
        if copied:
            copied = copied[:gate.next_k(k_max)]
            copied = copied[:valid(copied)]
            if copied:
                kind[0] = "copy"
                return copied
        kind[0] = "lookup"
        got = prop.propose(ProposalRequest(tokens=seq, n_prompt=len(prompt), max_len=k_max,
                                           deadline=0.0))
        tokens = list(got.tokens) if got is not None else []
        return tokens[:valid(tokens)]

    def observe(proposed: int, accepted: int, committed: tuple[int, ...]) -> None:
        if kind[0] == "copy":
            gate.observe(proposed, accepted)
        elif kind[0] == "lookup":
            prop.observe(Outcome(proposed, accepted, committed))

    try:
        return replay_rule(prompt, text, curve, draft_max, draft, observe)
    finally:
        prop.close()


def seer(prompt: Sequence[int], text: Sequence[int], curve: CostCurve, grammars: Grammars,
         *, draft_max: int = 32) -> float:
    """Foresight over the forced run and the suffix chain's matches (module docstring)."""
    follow = _Follower(grammars(), len(prompt))
    index = SuffixIndex()
    index.extend([*prompt, text[0]])
    pos, cost = 1, 0.0
    while pos < len(text):
        k_max = min(draft_max, len(text) - pos - 1, curve.max_k)
        forced = follow.forced(index.tokens)[:k_max]
        held = 0
        while held < len(forced) and forced[held] == text[pos + held]:
            held += 1
        hold = max((held_from(index.tokens, end, text, pos, k_max)
                    for _, end in index.matches()), default=0)
        hold = max(hold, held)
        k = max(range(hold + 1), key=lambda j: ((j + 1) / curve.cost(j), -j))
        cost += curve.cost(k)
        index.extend(text[pos:pos + k + 1])
        pos += k + 1
    return (len(text) - 1) / cost if cost > 0 else 1.0


def replay_answer(prompt: Sequence[int], text: Sequence[int], curve: CostCurve,
                  grammars: Grammars, *, copier: Copiers | None = None,
                  draft_max: int = 32, eog: frozenset[int] = frozenset()) -> SchemaReplay:
    """Every rule over one answer (``text``: plain constrained decoding's tokens);
    the engine's own with ``copier`` (a fresh value-copy proposer for ``prompt``)."""
    return SchemaReplay(
        len(text), forced_share(prompt, text, grammars),
        replay_forced(prompt, text, curve, grammars, draft_max=draft_max),
        replay_lookup(prompt, text, curve, grammars, draft_max=draft_max, eog=eog),
        seer(prompt, text, curve, grammars, draft_max=draft_max),
        None if copier is None else replay_lookup(prompt, text, curve, grammars,
                                                  copier=copier, draft_max=draft_max,
                                                  eog=eog))


def replay_schema_model(name: str, *, workloads: Sequence[str] | None, tokens: int,
                        threads: int | None, n_ctx: int, draft_max: int, cost_reps: int,
                        log: Any = print) -> dict[str, Any]:
    """Plain constrained decoding's answer and the cost curve of every constrained
    workload on model ``name``, then the rules replayed over them."""
    from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig

    from .arms import default_threads, render_prompt, resolve_model
    from .run import workload_cost_context
    from .workloads import WORKLOAD_DIR, BenchError, load_workloads

    threads = threads or default_threads()
    spec = resolve_model(name, threads=threads)
    chosen = load_workloads(list(workloads or ()) or [
        p.stem for p in sorted(WORKLOAD_DIR.glob("schema-*.json"))])
    free = [w.name for w in chosen if w.schema is None]
    if free:
        raise BenchError(f"not held to a schema, nothing to replay: {', '.join(free)}")
    rt = ModelRuntime(RuntimeConfig(model_path=str(spec.path), n_ctx_seq=n_ctx, n_seq_max=1,
                                    threads=threads, prefix_cache_tokens=0, calibrate=False,
                                    draft_max=draft_max))
    rows = []
    try:
        eog = frozenset(rt.model.info.eog_tokens)
        vocab: LLTokenizer = rt.grammar_vocab.tokenizer()
        n_vocab = rt.model.info.n_vocab
        for w in chosen:
            grammar = rt.compile_constraint("json_schema", w.schema)
            prompt, _ = render_prompt(rt, w, room=tokens)
            gen = rt.generation(prompt, max_tokens=tokens, proposer="off", grammar=grammar)
            for _ in rt.run(gen):
                pass
            text = list(gen.committed)
            at = workload_cost_context(len(prompt), tokens, n_ctx, draft_max)
            log(f"{spec.name}: {w.name}: {len(text)} tokens; cost of k+1 rows at {at} "
                "tokens of context")
            curve = CostCurve.sanitized(measure_row_costs(rt.context, draft_max,
                                                          reps=cost_reps, context_tokens=at))
            if len(text) < 2:
                continue
            got = replay_answer(prompt, text, curve,
                                grammar_states(vocab, grammar, n_vocab=n_vocab, eog=eog),
                                copier=copiers(rt.model.tokenizer, prompt),
                                draft_max=draft_max, eog=eog)
            rows.append({"workload": w.name, **attrs.asdict(got),
                         "costs": list(curve.costs[:9])})
    finally:
        rt.close()
    return {"model": spec.name, "threads": threads, "workloads": rows}


def grammar_states(vocab: LLTokenizer, grammar: str, *, n_vocab: int,
                   eog: frozenset[int]) -> Grammars:
    """Fresh grammar states for ``grammar``, as the engine makes one per request."""
    return lambda: GrammarState(vocab, grammar, n_vocab=n_vocab, eog=eog)


def copiers(tokenizer: Tokenizer, prompt: Sequence[int]) -> Copiers:
    """Fresh value-copy proposers for ``prompt``, as the engine makes one per request."""
    return lambda: ValueCopyProposer(prompt, tokenizer.piece,
                                     lambda text: tokenizer.tokenize(text, add_special=False))


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else 1.0


def format_table(report: dict[str, Any]) -> str:
    """One model's replay as a table, with the geometric mean of every rule."""
    lines = [f"{report['model']} ({report['threads']} threads): speedup over plain "
             "constrained decoding, on its own answer",
             f"  {'workload':<18} {'tokens':>6} {'forced share':>12} {'forced':>7} "
             f"{'+lookup':>7} {'meshd':>6} {'seer':>6}  c(1) c(3) c(7)"]
    rows = report["workloads"]
    for r in rows:
        c = r["costs"]
        lines.append(f"  {r['workload']:<18} {r['tokens']:>6} {r['forced_share']:>11.1%} "
                     f"{r['forced']['speedup']:>7.2f} {r['lookup']['speedup']:>7.2f} "
                     f"{r['meshd']['speedup']:>6.2f} {r['seer']:>6.2f}  "
                     f"{c[1]:.2f} {c[3]:.2f} {c[7]:.2f}")
    if rows:
        lines.append(f"  {'geometric mean':<18} {'':>6} {'':>12} "
                     f"{geomean([r['forced']['speedup'] for r in rows]):>7.2f} "
                     f"{geomean([r['lookup']['speedup'] for r in rows]):>7.2f} "
                     f"{geomean([r['meshd']['speedup'] for r in rows]):>6.2f} "
                     f"{geomean([r['seer'] for r in rows]):>6.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshd.bench.schema_replay",
                                description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("-m", "--model", action="append", default=[],
                   help="model name or GGUF path, as for meshd bench (repeatable; "
                        "default: smollm2-q8_0)")
    p.add_argument("-w", "--workload", action="append", default=[],
                   help="constrained workload name or FILE.json (repeatable; default: the "
                        "shipped schema-* workloads)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per answer (default 256)")
    add_run_options(p)
    args = p.parse_args(argv)
    if args.tokens < 2 or args.draft_max < 1:
        p.error("--tokens must be at least 2, --draft-max at least 1")
    return run_reports(
        args.model or ["smollm2-q8_0"], args.json,
        lambda name, log: replay_schema_model(
            name, workloads=args.workload, tokens=args.tokens, threads=args.threads,
            n_ctx=args.ctx, draft_max=args.draft_max, cost_reps=args.cost_reps, log=log),
        format_table)


if __name__ == "__main__":
    sys.exit(main())
