"""``meshd bench-rpc``: a model split over 1, 2, 3... loopback workers, with and without
speculation.

Why: across machines every forward pays network round trips on top of compute, once per
worker per forward whatever the number of rows. One verify window of k+1 rows therefore
costs the round trips of one decode, not k+1 decodes' worth, so speculation saves more
here than on one machine. This measures it: tokens/s, round trips per forward (verify
window) and per generated token, for each worker count and arm (``off``: plain decoding;
``ngram``: prompt lookup with fixed draft length), arms interleaved, medians over reps.
Workers run here as ``meshd worker`` subprocesses on loopback with ``--threads 1``, so
the numbers show round-trip counts and their local cost, not a real network's latency.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from meshd.native.errors import WorkerUnreachable
from meshd.native.rpc import hello, parse_endpoint

from ..runtime import ModelRuntime, RuntimeConfig
from .workloads import load_workloads

__all__ = ["add_arguments", "cmd_bench_rpc"]

ARMS = ("off", "ngram")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="1,2,3", metavar="N[,N...]",
                   help="worker counts to split the model over")
    p.add_argument("--workload", default="json-reformat", help="shipped workload name")
    p.add_argument("--tokens", type=int, default=96, help="tokens generated per run")
    p.add_argument("--reps", type=int, default=3, help="runs per arm and worker count")
    p.add_argument("--draft-k", type=int, default=8, help="draft length of the ngram arm")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_worker(address: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshd.daemon.cli", "worker", "--listen", address,
         "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 60
    while True:
        try:
            hello(parse_endpoint(address), timeout=5)
            return proc
        except WorkerUnreachable:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.1)


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
        gen.close()
    st = gen.stats
    forwards = max(1, st.session.target_forwards - st.session.prefill_forwards)
    return {"tok_s": st.emitted / wall if wall else 0.0,
            "tokens": st.emitted, "forwards": forwards,
            "rows_per_forward": (forwards + st.drafted) / forwards,
            "acceptance": st.accepted / st.drafted if st.drafted else 0.0,
            "round_trips_per_forward": trips / forwards,
            "round_trips_per_token": trips / max(1, st.emitted - 1)}


def _measure(rt: ModelRuntime, prompt: list[int], args: argparse.Namespace,
             ) -> dict[str, dict[str, float]]:
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    for _ in range(args.reps):  # interleaved: off ngram off ngram ...
        for arm in ARMS:
            runs[arm].append(_run(rt, prompt, arm, args.tokens))
    return {arm: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
            for arm, rs in runs.items()}


def cmd_bench_rpc(args: argparse.Namespace) -> int:
    counts = sorted({int(n) for n in args.workers.split(",")})
    (workload,) = load_workloads([args.workload])
    addresses = [f"127.0.0.1:{_free_port()}" for _ in range(max(counts))]
    procs = [_start_worker(a) for a in addresses]
    results: dict[str, Any] = {}
    try:
        for n in [0, *counts]:
            config = RuntimeConfig(
                model_path=args.model, n_ctx_seq=args.ctx, threads=args.threads or 1,
                calibrate=False, draft_max=args.draft_k,
                rpc_workers=tuple(addresses[:n]))
            with ModelRuntime(config) as rt:
                prompt = rt.tokenize_prompt(rt.render_chat(
                    [{"role": r, "content": c} for r, c in workload.messages]), chat=True)
                for arm in ARMS:  # warm-up: llama.cpp caches allocation sizes per shape
                    _run(rt, prompt, arm, args.tokens)  # (asked of a worker once each)
                results["local" if n == 0 else f"{n} workers"] = _measure(rt, prompt, args)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    _print(results, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _print(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"workload {args.workload}, {args.tokens} tokens, medians of {args.reps} "
          f"interleaved runs, ngram draft length {args.draft_k}, loopback workers "
          "(--threads 1)")
    print(f"{'split':<10} {'arm':<6} {'tok/s':>7} {'x off':>6} {'rows/fwd':>9} "
          f"{'accepted':>9} {'trips/fwd':>10} {'trips/token':>12}")
    print("trips = blocking round trips to the workers (one per worker per forward, "
          "whatever the rows); x off = tok/s against plain decoding on the same split")
    for split, arms in results.items():
        base = arms["off"]["tok_s"] or 1.0
        for arm, r in arms.items():
            print(f"{split:<10} {arm:<6} {r['tok_s']:7.1f} {r['tok_s'] / base:6.2f} "
                  f"{r['rows_per_forward']:9.2f} {r['acceptance']:9.2f} "
                  f"{r['round_trips_per_forward']:10.2f} "
                  f"{r['round_trips_per_token']:12.2f}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="meshd bench-rpc", description=__doc__)
    add_arguments(p)
    return cmd_bench_rpc(p.parse_args(argv))
