"""``meshd demo``: the whole product in one command, for the README and for CI.

This half is the ``meshd`` subcommand: it takes the same model, speculation and
sampling options as ``serve``, checks them before anything starts, and builds the
``meshd serve`` command line for a private temporary socket. The client half,
:mod:`meshd.clients.demo`, runs that daemon as a child process, sends one request
through its socket with meshctl and stops it (see there for why and for the exit codes).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Final

from meshd.clients.argtypes import positive_seconds
from meshd.clients.demo import START_TIMEOUT_S, run_demo
from meshd.daemon.commands.checks import check_model_args
from meshd.daemon.config import options as opt
from meshd.daemon.engine.sampling import SamplingParams
from meshd.native.errors import NativeError

__all__ = ["add_parser", "run"]

DEFAULT_PROMPT: Final = "Rewrite with type hints: def add(a, b): return a + b"
DEMO_LOG_LEVEL: Final = "warning"
"""The demo shows the generated text; the daemon's info events would bury it."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``demo`` on the ``meshd`` command line."""
    p = opt.subparser(
        sub, "demo",
        help="start the daemon, send one chat request with meshctl, stop the daemon",
        parents=[opt.model_options(), opt.speculation_options(), opt.sampling_options(),
                 opt.generation_options(), opt.daemon_options(log_level=DEMO_LOG_LEVEL)],
    )
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT,
                   help="the user message ('-' reads it from stdin)")
    p.add_argument("--raw", action="store_true",
                   help="send the prompt as raw text instead of a chat message")
    p.add_argument("--start-timeout", type=positive_seconds, default=START_TIMEOUT_S,
                   metavar="S", help="seconds to wait for the daemon to listen; meanwhile "
                                     f"its progress is shown (default: {START_TIMEOUT_S:g})")


def run(args: argparse.Namespace) -> int:
    # Everything that can be checked is checked before the daemon starts.
    try:
        check_model_args(args.model, args.proposer)
    except NativeError as exc:
        print(f"meshd demo: {exc}", file=sys.stderr)
        return 3
    try:
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
        SamplingParams(args.temperature, args.top_k, args.top_p, args.seed,
                       **opt.sampling_extras(args))
    except ValueError as exc:
        print(f"meshd demo: {exc}", file=sys.stderr)
        return 2
    directory = tempfile.mkdtemp(prefix="meshd-demo-", dir="/tmp")
    socket_path = os.path.join(directory, "meshd.sock")
    command = [
        sys.executable, "-m", "meshd.daemon.commands.cli", "serve", "--socket", socket_path,
        "--backend", args.backend, "--slots", "1", "--ctx", str(args.ctx),
        "--log-level", args.log_level, "--llama-log-level", args.llama_log_level,
        "--draft-max", str(args.draft_max),
        "--max-tokens", str(args.max_tokens),
    ]
    if args.model:
        command += ["--model", args.model]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if args.cache_type_k != "auto":
        command += ["--cache-type-k", args.cache_type_k]
    if args.fixed_k:
        command += ["--fixed-k"]
    if args.proposer.startswith("draft:"):  # the demo's own request may name its draft
        command += ["--draft-model", args.proposer.partition(":")[2]]
    request: list[str] = [
        "generate" if args.raw else "chat",
        "--max-tokens", str(args.max_tokens), "--proposer", args.proposer,
        "--temperature", repr(args.temperature), "--top-k", str(args.top_k),
        "--top-p", repr(args.top_p),
    ]
    if args.seed is not None:
        request += ["--seed", str(args.seed)]
    request += opt.sampling_argv(args)
    for stop in args.stop:
        request += ["--stop", stop]
    request += ["--", prompt]  # a prompt may start with '-'
    try:
        return run_demo(command, socket_path, request, start_timeout=args.start_timeout)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
