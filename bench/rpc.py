"""``meshd bench-rpc``: a model split over 1, 2, 3... loopback workers, with and without
speculation.

Why: across machines every forward pays network round trips on top of compute, once per
worker per forward whatever the number of rows. One verify window of k+1 rows therefore
costs the round trips of one decode, not k+1 decodes' worth, so speculation saves more
here than on one machine. This measures it: tokens/s, round trips per forward (verify
window) and per generated token, for each worker count and arm (``off``: plain decoding;
``ngram``: prompt lookup with fixed draft length; ``mtp``: the model's own MTP head, when
it has one), arms interleaved, medians over reps. For a model with an MTP head it also
counts the round trips of one MTP draft of ``--draft-k`` tokens on its own (the head and
the output layer stay on this machine, so the expected count is 0).
Workers run here as ``meshd worker`` subprocesses on loopback with ``--threads 1``, so
the numbers show round-trip counts and their local cost, not a real network's latency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.native.primitives import resolve_cache_type_k
from meshd.native.session import SequenceSession
from meshd.testing.loopback import LoopbackWorkers

from .arms import render_prompt
from .workloads import load_workloads

__all__ = ["add_arguments", "cmd_bench_rpc"]

ARMS = ("off", "ngram")
#: MTP drafts per count of their round trips (they are deterministic; a few suffice).
DRAFT_PROBES = 4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="1,2,3", metavar="N[,N...]",
                   help="worker counts to split the model over")
    p.add_argument("--workload", default="json-reformat", help="shipped workload name")
    p.add_argument("--tokens", type=int, default=96, help="tokens generated per run")
    p.add_argument("--reps", type=int, default=3, help="runs per arm and worker count")
    p.add_argument("--draft-k", type=int, default=8,
                   help="draft length of the ngram and mtp arms")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def _trips(rt: ModelRuntime) -> int:
    return rt.remote.stats().round_trips if rt.remote is not None else 0


def _run(rt: ModelRuntime, prompt: list[int], arm: str, tokens: int) -> dict[str, float]:
    """One generation; round trips are counted after the prefill (decode steps only)."""
    gen = rt.generation(prompt, max_tokens=tokens, proposer=arm, adaptive=False)
    try:
        t0 = time.perf_counter()
        gen.start()
        before = _trips(rt)
        while not gen.done:
            gen.step()
        wall = time.perf_counter() - t0
        trips = _trips(rt) - before
    finally:
        rt.finish(gen)
    st = gen.stats
    forwards = max(1, st.session.target_forwards - st.session.prefill_forwards)
    return {"tok_s": st.emitted / wall if wall else 0.0,
            "tokens": st.emitted, "forwards": forwards,
            "rows_per_forward": (forwards + st.drafted) / forwards,
            "acceptance": st.accepted / st.drafted if st.drafted else 0.0,
            "round_trips_per_forward": trips / forwards,
            "round_trips_per_token": trips / max(1, st.emitted - 1)}


def _draft_trips(rt: ModelRuntime, prompt: list[int], k: int) -> float:
    """Round trips of one MTP draft of ``k`` tokens after ``prompt`` (mean of a few;
    a draft drops its own MTP cache entries, so each starts from the same state)."""
    rt.prefix_cache.clear()  # hands back the slot a finished generation kept
    session = SequenceSession.open(rt.context, reserve=len(prompt) + k + 1)
    try:
        last = int(np.argmax(session.prefill(prompt)))
        assert session.mtp is not None
        before = _trips(rt)
        for _ in range(DRAFT_PROBES):
            session.mtp.draft(last, len(prompt), k)
        return (_trips(rt) - before) / DRAFT_PROBES
    finally:
        session.close()


def _measure(rt: ModelRuntime, prompt: list[int], args: argparse.Namespace,
             ) -> dict[str, dict[str, float]]:
    arms = _arms(rt)
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for _ in range(args.reps):  # interleaved: off ngram off ngram ...
        for arm in arms:
            runs[arm].append(_run(rt, prompt, arm, args.tokens))
    out = {arm: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
           for arm, rs in runs.items()}
    if "mtp" in out:
        out["mtp"]["round_trips_per_draft"] = _draft_trips(rt, prompt, args.draft_k)
    return out


def _arms(rt: ModelRuntime) -> tuple[str, ...]:
    return (*ARMS, "mtp") if rt.context.mtp is not None else ARMS


def cmd_bench_rpc(args: argparse.Namespace) -> int:
    counts = sorted({int(n) for n in args.workers.split(",")})
    (workload,) = load_workloads([args.workload])
    results: dict[str, Any] = {}
    # The loopback workers compute on this machine's CPU, so every row gets the cache
    # "auto" gives a model run wholly on the CPU (else, on a runtime without meshd's
    # patch, the local row would get bf16 and the split rows f16: two kernels, and maybe
    # two texts, in one table).
    cache_type_k = resolve_cache_type_k(args.cache_type_k, all_on_cpu=True)
    with LoopbackWorkers(max(counts)) as workers:
        for n in [0, *counts]:
            config = RuntimeConfig(
                model_path=args.model, n_ctx_seq=args.ctx, threads=args.threads or 1,
                calibrate=False, draft_max=args.draft_k, cache_type_k=cache_type_k,
                rpc_workers=tuple(workers.first(n)))
            with ModelRuntime(config) as rt:
                # (the chat template when the model has one; a synthetic model's small
                # context gets the prompt's tail)
                prompt, _ = render_prompt(rt, workload, room=args.tokens + args.draft_k + 1)
                for arm in _arms(rt):  # warm-up: llama.cpp caches allocation sizes per
                    _run(rt, prompt, arm, args.tokens)  # shape (asked of a worker once)
                results["local" if n == 0 else f"{n} workers"] = _measure(rt, prompt, args)
    _print(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _print(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"workload {args.workload}, {args.tokens} tokens, medians of {args.reps} "
          f"interleaved runs, draft length {args.draft_k}, loopback workers "
          "(--threads 1)")
    print(f"{'split':<10} {'arm':<6} {'tok/s':>7} {'x off':>6} {'rows/fwd':>9} "
          f"{'accepted':>9} {'trips/fwd':>10} {'trips/token':>12} {'trips/draft':>12}")
    print("trips = blocking round trips to the workers (one per worker per forward - a "
          "verify window or a decode - whatever the rows); trips/draft = one MTP draft "
          "of the draft length; x off = tok/s against plain decoding on the same split")
    for split, arms in results.items():
        base = arms["off"]["tok_s"] or 1.0
        for arm, r in arms.items():
            draft = r.get("round_trips_per_draft")
            print(f"{split:<10} {arm:<6} {r['tok_s']:7.1f} {r['tok_s'] / base:6.2f} "
                  f"{r['rows_per_forward']:9.2f} {r['acceptance']:9.2f} "
                  f"{r['round_trips_per_forward']:10.2f} "
                  f"{r['round_trips_per_token']:12.2f} "
                  f"{'-' if draft is None else f'{draft:.2f}':>12}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="meshd bench-rpc", description=__doc__)
    add_arguments(p)
    return cmd_bench_rpc(p.parse_args(argv))
