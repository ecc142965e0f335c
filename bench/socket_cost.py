"""What the socket costs: ``python -m meshd.bench.socket_cost [--model PATH]``.

Starts ``meshd serve`` as a child process (as users run it) and loads the same model in
this process, then measures, with speculation off so only the transport differs:

* **socket vs in-process**: tokens/s of one generation sent through the socket (client
  clock: request sent to ``done`` received) against the same generation run directly on
  an in-process runtime (``Generation.run``). Target: ratio >= 0.97.
* **health latency while generating**: ``health`` round trips on a second connection
  while a generation runs (target: median < 50 ms).
* **aggregate tokens/s, 1 vs 4 clients**: total completion tokens / wall time with one
  client, and with four concurrent clients on four connections (continuous batching);
  and the aggregate *decode* rate, the same tokens over the wall time less the prompts'
  prefill forwards (each request's ``prefill_ms``; the model's forwards run one at a
  time, so no decoding overlaps them). The prefill is a fixed cost per request that
  batching cannot share, so it dilutes the end-to-end ratio of short generations;
  speculation off unless ``--proposer`` names one (then the daemon calibrates first).
  Models without a chat template get the prompts as plain text. Every prompt's greedy
  output is compared across all its runs, alone and among 4 clients (they must agree).

Arms are interleaved (ABBA order per round, so drift such as thermal throttling or other
load on the machine hits both sides alike) and each figure is the median over rounds;
ratios are of medians. This is a benchmark, not a test: it prints numbers and never
fails on them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import anyio

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.protocol import Client, ConnectionClosed

PROMPTS = (
    "Write a long essay about the history of lighthouses.",
    "Explain in detail how a steam engine works.",
    "Describe a walk through a busy market in the morning.",
    "Tell a long story about a dragon who learns to cook.",
)


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def _request(i: int, chat: bool) -> dict[str, Any]:
    """The prompt of request ``i``: a user turn, or plain text for a model without a
    chat template (the synthetic test models)."""
    return {"messages": _messages(i)} if chat else {"prompt": PROMPTS[i % len(PROMPTS)]}


def _start_daemon(args: argparse.Namespace, socket_path: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "meshd.daemon.commands.cli", "serve", "--socket", socket_path,
               "--slots", "4", "--ctx", str(args.ctx), "--log-level", "warning"]
    if args.proposer == "off":
        command.append("--fixed-k")  # nothing to calibrate for
    if args.model:
        command += ["--model", args.model]
    if args.threads:
        command += ["--threads", str(args.threads)]
    return subprocess.Popen(command, stdin=subprocess.DEVNULL)


async def _wait_ready(daemon: subprocess.Popen[bytes], path: str) -> None:
    with anyio.fail_after(300):
        while True:
            if daemon.poll() is not None:
                raise SystemExit("socket_cost: the daemon exited during startup")
            try:
                async with Client.connect(path, connect_timeout=5):
                    return
            except ConnectionClosed:
                await anyio.sleep(0.05)


def _in_process(rt: ModelRuntime, i: int, max_tokens: int) -> tuple[int, float]:
    chat = rt.model.chat_template is not None
    text = rt.render_chat(_messages(i)) if chat else PROMPTS[i % len(PROMPTS)]
    prompt = rt.tokenize_prompt(text, chat=chat)
    t0 = time.perf_counter()
    gen = rt.generation(prompt, max_tokens=max_tokens, proposer="off")
    for _ in rt.run(gen):
        pass
    return len(gen.committed), time.perf_counter() - t0


async def _through_socket(client: Client, i: int, max_tokens: int, *,
                          chat: bool) -> tuple[int, float]:
    t0 = time.perf_counter()
    done = await client.generate(**_request(i, chat), max_tokens=max_tokens,
                                 temperature=0.0, proposer="off").collect()
    return len(done.token_ids), time.perf_counter() - t0


async def _clients(path: str, n: int, max_tokens: int, round_no: int, *, chat: bool,
                   proposer: str, outputs: dict[int, set[tuple[int, ...]]] | None = None,
                   ) -> tuple[int, float, float]:
    """n concurrent clients, each on its own connection: (total tokens, wall seconds,
    seconds of the requests' prefill forwards). ``outputs`` collects every distinct
    greedy output per prompt."""
    totals: list[int] = []
    prefill_ms: list[float] = []

    async def one(k: int, client: Client) -> None:
        i = round_no + k
        done = await client.generate(**_request(i, chat), max_tokens=max_tokens,
                                     temperature=0.0, proposer=proposer).collect()
        totals.append(len(done.token_ids))
        prefill_ms.append(done.done.speculation.prefill_ms)
        if outputs is not None:
            outputs.setdefault(i % len(PROMPTS), set()).add(tuple(done.token_ids))

    async with _connections(path, n) as clients:
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for k, client in enumerate(clients):
                tg.start_soon(one, k, client)
        wall = time.perf_counter() - t0
    return sum(totals), wall, sum(prefill_ms) / 1e3


class _connections:
    """``async with _connections(path, n) as clients``: n open connections."""

    def __init__(self, path: str, n: int) -> None:
        self._cms = [Client.connect(path, client_name="bench") for _ in range(n)]

    async def __aenter__(self) -> list[Client]:
        return [await cm.__aenter__() for cm in self._cms]

    async def __aexit__(self, *exc: Any) -> None:
        for cm in reversed(self._cms):
            await cm.__aexit__(None, None, None)


async def _health_latencies(path: str, probes: int, max_tokens: int, *,
                           chat: bool) -> list[float]:
    latencies: list[float] = []
    async with Client.connect(path) as gen_client, Client.connect(path) as probe, \
            gen_client.generate(**_request(0, chat), max_tokens=max_tokens,
                                temperature=0.0, proposer="off") as stream:
        await stream.__anext__()  # generating now
        for _ in range(probes):
            t0 = time.perf_counter()
            reply = await probe.health()
            latencies.append(time.perf_counter() - t0)
            if reply.active_requests == 0:
                break  # the generation ended: later probes would not measure anything
            await anyio.sleep(0.01)
    return latencies


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


async def _bench(args: argparse.Namespace, rt: ModelRuntime, path: str) -> dict[str, Any]:
    inproc: list[float] = []
    socket_rates: list[float] = []
    chat = rt.model.chat_template is not None
    async with Client.connect(path, client_name="bench") as client:
        # Warm-up: first forwards allocate buffers on both sides.
        _in_process(rt, 0, 8)
        await _through_socket(client, 0, 8, chat=chat)
        for r in range(args.rounds):
            order = ("in", "sock") if r % 2 == 0 else ("sock", "in")
            for arm in order:
                if arm == "in":
                    n, s = _in_process(rt, r, args.max_tokens)
                    inproc.append(n / s)
                else:
                    n, s = await _through_socket(client, r, args.max_tokens, chat=chat)
                    socket_rates.append(n / s)
    health = await _health_latencies(path, args.probes, max(args.max_tokens, 256), chat=chat)
    one: list[float] = []
    four: list[float] = []
    one_decode: list[float] = []
    four_decode: list[float] = []
    outputs: dict[int, set[tuple[int, ...]]] = {}
    for r in range(args.rounds):
        for n_clients in (1, 4) if r % 2 == 0 else (4, 1):
            tokens, wall, prefill = await _clients(path, n_clients, args.max_tokens, r,
                                                   chat=chat, proposer=args.proposer,
                                                   outputs=outputs)
            (one if n_clients == 1 else four).append(tokens / wall)
            (one_decode if n_clients == 1 else four_decode).append(tokens / (wall - prefill))
    m_in, m_sock = _median(inproc), _median(socket_rates)
    m_one, m_four = _median(one), _median(four)
    d_one, d_four = _median(one_decode), _median(four_decode)
    return {
        "model": rt.model.info.path,
        "threads": args.threads,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "proposer": args.proposer,
        "in_process_tok_s": m_in,
        "socket_tok_s": m_sock,
        "socket_over_in_process": m_sock / m_in,
        "health_ms_median": _median(health) * 1e3,
        "health_ms_max": max(health) * 1e3 if health else float("nan"),
        "health_probes": len(health),
        "aggregate_tok_s_1_client": m_one,
        "aggregate_tok_s_4_clients": m_four,
        "four_over_one": m_four / m_one,
        "aggregate_decode_tok_s_1_client": d_one,
        "aggregate_decode_tok_s_4_clients": d_four,
        "decode_four_over_one": d_four / d_one,
        # Prompts whose greedy output differed between runs (alone or among 4 clients).
        "outputs_differing": sorted(i for i, seen in outputs.items() if len(seen) > 1),
        "outputs_compared": len(outputs),
        "samples": {"in_process": inproc, "socket": socket_rates, "one": one, "four": four,
                    "one_decode": one_decode, "four_decode": four_decode,
                    "health_s": health},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m meshd.bench.socket_cost",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--probes", type=int, default=30)
    parser.add_argument("--proposer", default="off",
                        help="speculation of the 1- and 4-client requests (default: off)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="meshd-bench-", dir="/tmp")
    path = os.path.join(directory, "s")
    daemon = _start_daemon(args, path)
    try:
        rt = ModelRuntime(RuntimeConfig(model_path=args.model, n_ctx_seq=args.ctx,
                                        n_seq_max=4, calibrate=False, threads=args.threads))
        with rt:
            async def run() -> dict[str, Any]:
                await _wait_ready(daemon, path)
                return await _bench(args, rt, path)

            result = anyio.run(run)
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"model {result['model']}  threads={args.threads or 'default'}  "
          f"rounds={args.rounds}  max_tokens={args.max_tokens}  "
          f"proposer of the aggregate runs: {args.proposer}")
    print(f"socket vs in-process : {result['socket_tok_s']:.1f} vs "
          f"{result['in_process_tok_s']:.1f} tok/s  ratio {result['socket_over_in_process']:.3f}"
          f"  (target >= 0.97)")
    print(f"health while generating: median {result['health_ms_median']:.2f} ms, "
          f"max {result['health_ms_max']:.2f} ms over {result['health_probes']} probes "
          f"(target median < 50 ms)")
    print(f"aggregate tok/s      : 1 client {result['aggregate_tok_s_1_client']:.1f}, "
          f"4 clients {result['aggregate_tok_s_4_clients']:.1f}  "
          f"ratio {result['four_over_one']:.2f}")
    print(f"aggregate decode tok/s (prefill excluded): "
          f"1 client {result['aggregate_decode_tok_s_1_client']:.1f}, "
          f"4 clients {result['aggregate_decode_tok_s_4_clients']:.1f}  "
          f"ratio {result['decode_four_over_one']:.2f}")
    differing = result["outputs_differing"]
    print(f"outputs              : {result['outputs_compared'] - len(differing)} of "
          f"{result['outputs_compared']} prompts identical in every run, alone and among "
          f"4 clients" + (f" (differing: prompts {differing})" if differing else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
