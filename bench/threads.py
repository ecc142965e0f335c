"""``meshd bench-threads``: llama.cpp's thread settings on a quiet and on a shared machine.

Why a benchmark and not a test: llama.cpp's CPU threads meet at a barrier after every
operation (OpenMP). How they wait there decides what happens when another process wants
the cores: spinning threads are fastest alone but, when one of them is descheduled, the
others spin through their whole time slice waiting for it, and a decode can become 10-50x
slower. Which setting is the right default is a measured trade-off, so this prints the
numbers side by side: decode speed of each arm with the machine to itself, and with a
competing CPU-bound process per core.

Each run is a fresh ``meshd generate`` process (OpenMP reads its settings when the
library loads); arms are interleaved, medians reported, ratios to the default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Final

import attrs

__all__ = ["ARMS", "add_arguments", "cmd_bench_threads"]


@attrs.frozen
class Arm:
    name: str
    env: Mapping[str, str]
    threads: int | None
    what: str


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2


ARMS: Final = (
    Arm("default", {}, None,
        "meshd's defaults, --thread-wait spin (libgomp's own: spin a while, then sleep)"),
    Arm("active", {"OMP_WAIT_POLICY": "active"}, None, "threads spin at every barrier"),
    Arm("sleep", {"OMP_WAIT_POLICY": "passive"}, None,
        "--thread-wait sleep: threads sleep at every barrier"),
    Arm("threads-1", {}, 1, "one thread (no barriers)"),
)

_GENERATE_SCRIPT = (
    "import sys\n"
    "from meshd.daemon.commands.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH",
                   help="GGUF model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tokens", type=int, default=48, metavar="N", help="tokens per run")
    p.add_argument("--reps", type=int, default=3, metavar="N", help="runs per arm and load")
    p.add_argument("--competitors", type=int, default=None, metavar="N",
                   help="CPU-bound processes in the 'shared' condition (default: one per "
                        "CPU this process may use)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME",
                   help=f"arms to run (default: all of {', '.join(a.name for a in ARMS)})")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="give up on one run after this long (reported as a timeout)")


@contextmanager
def _competing(n: int) -> Iterator[None]:
    """``n`` CPU-bound processes (busy Python loops) for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                              stdin=subprocess.DEVNULL) for _ in range(n)]
    try:
        time.sleep(0.2)
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _run(arm: Arm, args: argparse.Namespace) -> float | None:
    """Decode tokens/s of one fresh ``meshd generate`` (None: timed out or failed)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    env.update(arm.env)
    command = [sys.executable, "-c", _GENERATE_SCRIPT, "generate", "--prompt",
               "1, 2, 3, 4, 5, 6, 7, 8,", "--max-tokens", str(args.tokens),
               "--proposer", "off", "--fixed-k", "--json"]
    if args.model:
        command += ["--model", args.model]
    if arm.threads is not None:
        command += ["--threads", str(arm.threads)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.timeout, check=False)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        return None
    stats = json.loads(done.stdout.strip().splitlines()[-1])["stats"]
    return float(stats["emitted"] / (stats["wall_ms"] / 1e3))


def cmd_bench_threads(args: argparse.Namespace) -> int:
    arms = [a for a in ARMS if not args.arm or a.name in args.arm]
    competitors = args.competitors if args.competitors is not None else _cpus()
    print(f"bench-threads: {_cpus()} CPUs usable, {args.tokens} tokens, {args.reps} reps, "
          f"shared = {competitors} competing CPU-bound process(es)", flush=True)
    results: dict[tuple[str, str], list[float | None]] = {}
    for load in ("quiet", "shared"):
        with _competing(competitors) if load == "shared" else _nothing():
            for rep in range(args.reps):
                order = arms if rep % 2 == 0 else list(reversed(arms))
                for arm in order:
                    rate = _run(arm, args)
                    results.setdefault((arm.name, load), []).append(rate)
                    shown = f"{rate:.1f} tok/s" if rate is not None else "timeout/failed"
                    print(f"  {load:6} {arm.name:10} rep {rep + 1}: {shown}", flush=True)
    _report(arms, results)
    return 0


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def _median(values: Sequence[float | None]) -> float | None:
    good = [v for v in values if v is not None]
    return statistics.median(good) if good else None


def _report(arms: Sequence[Arm], results: Mapping[tuple[str, str], Sequence[float | None]],
            ) -> None:
    base = {load: _median(results.get(("default", load), [])) for load in ("quiet", "shared")}
    print(f"\n{'arm':10} {'quiet tok/s':>12} {'x default':>10} {'shared tok/s':>13} "
          f"{'x default':>10} {'shared/quiet':>13}  what")
    for arm in arms:
        q = _median(results[(arm.name, "quiet")])
        s = _median(results[(arm.name, "shared")])
        cells = []
        for value, load in ((q, "quiet"), (s, "shared")):
            b = base[load]
            cells.append(f"{value:.1f}" if value is not None else "-")
            cells.append(f"{value / b:.2f}x" if value is not None and b else "-")
        kept = f"{s / q:.2f}" if q and s is not None else "-"
        print(f"{arm.name:10} {cells[0]:>12} {cells[1]:>10} {cells[2]:>13} {cells[3]:>10} "
              f"{kept:>13}  {arm.what}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshd bench-threads", description=__doc__)
    add_arguments(parser)
    return cmd_bench_threads(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
