"""``meshd soak``: a daemon under load and bad input, checked for what must never happen.

Why: a daemon that runs for weeks fails in ways a unit test does not reach: a request
that never ends, a frame after ``done``, a slot or a descriptor that is never given back,
memory that creeps. The soak starts ``meshd serve`` as a child process (so its RSS and
descriptors are its own), records single-client reference outputs for a pool of
requests, then lets concurrent clients mix generate and chat (off, ngram, mtp, auto and
composite proposers, the last drafting from earlier answers too; greedy, seeded and
unseeded sampling; draft lengths that make the hybrid model's repairs checkpoint and
restore), cancels (the ``cancel`` op and dropped
connections), tokenize/detokenize, stats/health/models, garbage frames, replies too
large for a frame, stalled partial frames and idle connections. Every generation's
frames are checked (:mod:`.probe`), every finished output is compared with its
reference, and at the end nothing may still be held. See :mod:`.report`.

The default model is the synthetic hybrid qwen35 with an MTP head (attention + recurrent
layers: long drafts checkpoint and restore its state; clear logit margins, so outputs
must be identical under any batching). Its file has no chat template, so its chat
requests are rendered with the chatml fallback (a model whose chats are refused with
``bad_request`` is accepted too); ``--model`` runs on another model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import anyio

from meshd.clients.argtypes import integer, positive
from meshd.daemon.config.options import subparser

from .load import ACTIONS, Soak, SoakConfig
from .report import SoakReport, sample_process

__all__ = ["SoakConfig", "add_parser", "run", "run_soak"]


# ---------------------------------------------------------------------- running


def _default_models() -> tuple[str, tuple[str, ...]]:
    """The synthetic hybrid qwen35 target and two synthetic llama draft models: one that
    follows the target (long windows accepted: checkpoints) and one that does not (long
    windows rejected: a restore and replay on every step)."""
    from meshd.testing import testmodels

    target = str(testmodels.test_model_path("qwen35", acceptance=0.74))
    drafts = tuple(str(testmodels.test_model_path("llama", seed=seed)) for seed in (0, 1))
    return target, drafts


def _start_daemon(config: SoakConfig, model: str, drafts: Sequence[str], path: str,
                  log: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    argv = [
        sys.executable, "-m", "meshd.daemon.commands.cli", "serve", "--socket", path,
        "--model", model,
        "--slots", str(config.slots), "--threads", str(config.threads),
        "--max-queue", str(config.max_queue), "--draft-max", str(config.draft_max),
        "--fixed-k", "--ctx", "1024",
        "--frame-timeout", str(config.frame_timeout_s),
        "--idle-timeout", str(config.idle_timeout_s),
        "--log-format", "json", "--log-level", "warning",
        *(arg for d in drafts for arg in ("--draft-model", d)),
    ]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)


async def _wait_ready(path: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    with anyio.fail_after(timeout):
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {proc.returncode} while starting")
            with contextlib.suppress(OSError):
                stream = await anyio.connect_unix(path)
                await stream.aclose()
                return
            await anyio.sleep(0.1)


async def run_soak(config: SoakConfig, *, log_dir: str | None = None) -> SoakReport:
    """Run one soak (the daemon a child process) and return its report."""
    if config.model is None:
        model, drafts = _default_models()
    else:
        model, drafts = config.model, ()
    directory = tempfile.mkdtemp(dir="/tmp", prefix="meshd-soak")
    path = os.path.join(directory, "s")
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    log = os.path.join(log_dir or directory, "daemon.log")
    proc = _start_daemon(config, model, drafts, path, log)
    try:
        await _wait_ready(path, proc, 300)
        soak = Soak(config, path, proc.pid, os.path.basename(model), drafts)
        await soak.references()
        async with soak.probe("monitor") as monitor:
            await soak.settle(monitor)
            soak.report.fd_baseline = sample_process(proc.pid, 0).fds
            soak.t0 = time.monotonic()
            await soak.load(monitor)
            soak.report.seconds = time.monotonic() - soak.t0
            stats = await soak.settle(monitor)
            fd_end = sample_process(proc.pid, 0).fds
            soak.check_leaks(stats, fd_end)
        await soak.still_serves()
        report = soak.report
        report.daemon_exit = await _stop(proc)  # SIGTERM: a clean shutdown exits 0
        report.unexpected_errors.extend(_logged_errors(log))
    finally:
        await _stop(proc)
        shutil.rmtree(directory, ignore_errors=True)
    return report


async def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                await anyio.to_thread.run_sync(proc.wait)
    return proc.returncode


def _logged_errors(log: str) -> list[str]:
    """Errors the daemon logged (a crashed request or connection is a bug)."""
    found: list[str] = []
    with contextlib.suppress(OSError), open(log, encoding="utf-8", errors="replace") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict) and entry.get("level") in ("error", "critical"):
                    found.append(f"daemon log: {entry.get('event')}")
    return found


# ---------------------------------------------------------------------- command line


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``meshd soak``."""
    p = subparser(
        sub, "soak", help="run the daemon under mixed load and bad input and judge it",
        description="Start meshd serve as a child process, record single-client reference "
                    "outputs, then run concurrent clients (generate, chat, cancels, dropped "
                    "connections, tokenize, stats, garbage frames, stalled and idle "
                    "connections) and report errors by kind, protocol violations, outputs "
                    "unequal to the references, leaks, and RSS and fd counts over time. "
                    "Exit 0 when nothing was found, 1 otherwise.",
    )
    when = p.add_mutually_exclusive_group()
    when.add_argument("--minutes", type=float, default=None, metavar="N",
                      help="load duration in minutes")
    when.add_argument("--seconds", type=float, default=None, metavar="S",
                      help="load duration in seconds (default: 60)")
    p.add_argument("--clients", type=positive, default=8, metavar="N",
                   help="concurrent clients")
    p.add_argument("--skip", action="append", default=[], choices=sorted(ACTIONS),
                   metavar="ACTION",
                   help="leave out an action kind (repeatable): " + ", ".join(sorted(ACTIONS)))
    p.add_argument("--model", default=None, metavar="PATH",
                   help="GGUF file (default: the synthetic hybrid qwen35 with an MTP head, "
                        "and two synthetic draft models)")
    p.add_argument("--slots", type=positive, default=4, metavar="N",
                   help="the daemon's --slots")
    p.add_argument("--threads", type=positive, default=1, metavar="N",
                   help="the daemon's --threads")
    p.add_argument("--seed", type=integer, default=0, metavar="S",
                   help="seed of the clients' random choices")
    p.add_argument("--sample-interval", type=float, default=None, metavar="S",
                   help="seconds between RSS/fd samples (default: duration / 60, at least 1)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="keep the daemon's log (daemon.log) in this directory (default: "
                        "a temporary one, removed)")


def run(args: argparse.Namespace) -> int:
    """``meshd soak``: exit 0 when the run passes, 1 when it does not."""
    seconds = args.minutes * 60 if args.minutes is not None else (args.seconds or 60.0)
    interval = args.sample_interval or max(1.0, seconds / 60)
    config = SoakConfig(seconds=seconds, clients=args.clients, skip=tuple(args.skip),
                        model=args.model,
                        slots=args.slots, threads=args.threads, seed=args.seed,
                        sample_interval_s=interval)
    report = anyio.run(lambda: run_soak(config, log_dir=args.log_dir))
    print(report.format())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.as_dict(), f, indent=1)
    return 0 if report.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshd")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(argv))
