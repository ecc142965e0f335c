"""``meshd bench``'s options and command (the subparser is made by
``meshd.daemon.commands.cli``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from meshd.clients.argtypes import positive
from meshd.native.errors import NativeError

from .arms import ARMS, REFERENCE_ARM
from .format import format_report
from .llama_server import NGRAM_MODES
from .plot import check_plot_available, write_plot
from .run import DEFAULT_MODELS, BenchConfig, run_bench
from .workloads import BenchError


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``meshd bench`` options (the subparser is created by ``meshd.daemon.commands.cli``, with the
    shared ``--ctx``, ``--threads`` and ``--draft-max`` of ``meshd.daemon.config.options``)."""
    p.add_argument("-m", "--model", action="append", default=[], metavar="NAME",
                   help="smollm2-q4_1, smollm2-q8_0, qwen35-0.74, llama, mimo2-0.9, or a "
                        "GGUF path (repeatable; default: SmolLM2 Q4_1 + Q8_0, qwen35 at "
                        "0.5/0.74/0.9; --identity: llama, qwen35, mimo2, smollm2)")
    p.add_argument("--workload", action="append", default=[], metavar="NAME",
                   help="workload name (repeatable; default: all)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME",
                   help=f"arm (repeatable; '{REFERENCE_ARM}' always runs; default: all of "
                        f"{', '.join(a.name for a in ARMS)}). With --llama-server its arms "
                        "run too unless some --arm names one of them (then only those)")
    p.add_argument("--reps", type=positive, default=3, help="repetitions (default 3)")
    p.add_argument("--tokens", type=positive, default=None,
                   help="tokens per generation (default 128; --identity: 32)")
    p.add_argument("--draft-model", metavar="NAME|PATH",
                   help="meshd-draft's draft model (default: the shipped Q4_1 for a "
                        "requantized SmolLM2, the synthetic llama for synthetic MTP models)")
    p.add_argument("--pld-tokens", type=positive, default=None,
                   help="anchor-pld's num_pred_tokens (default 10, LlamaPromptLookupDecoding's)")
    p.add_argument("--llama-flash-attn", choices=["on", "off"], default="on",
                   help="flash attention in the Llama arms (default on, as meshd's context "
                        "gets; 'off' is Llama's own default: its numerics differ, so "
                        "outputs part from meshd at near-ties)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up generations")
    p.add_argument("--cost-reps", type=positive, default=5,
                   help="repetitions of the cost-curve measurement")
    p.add_argument("--json", metavar="FILE", help="write the full report as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw decode tokens/s by arm and workload (needs matplotlib)")
    p.add_argument("--llama-server", metavar="PATH",
                   help="llama.cpp's llama-server binary: extra arms running it on loopback "
                        "(plain, each n-gram --spec-type, draft-mtp on MTP models)")
    p.add_argument("--llama-server-mode", action="append", default=[], metavar="TYPE",
                   help=f"llama-server --spec-type to run (repeatable; default: "
                        f"{', '.join(NGRAM_MODES)}); draft-mtp-N runs draft-mtp with "
                        f"--spec-draft-n-max N (N = 1..4)")
    p.add_argument("--identity", action="store_true",
                   help="the identity gate: meshd-off vs every proposer; exits 1 on a "
                        "divergence on a synthetic model, or on a real one with the "
                        "default K cache on the CPU (its attention kernel pinned)")
    p.add_argument("--prompts", type=positive, default=2, help="--identity: prompts per model")
    p.add_argument("--k", action="append", type=positive, default=[], metavar="K",
                   help="--identity: fixed draft lengths (repeatable; default 1, 3, 8)")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run ``meshd bench``; exit 0 (targets are printed, not enforced), 2 on bad usage,
    3 on a model/runtime error; ``--identity`` exits 1 on a divergence on a gated model."""
    try:
        if args.plot:
            check_plot_available()
        if args.identity:
            from .identity import IdentityConfig, format_identity, run_identity

            icfg = IdentityConfig(
                models=tuple(args.model) or IdentityConfig().models,
                prompts=args.prompts, max_tokens=args.tokens or 32,
                ks=tuple(args.k) or IdentityConfig().ks, n_ctx=args.ctx,
                threads=args.threads, cache_type_k=args.cache_type_k,
            )
            ireport = run_identity(icfg)
            print(format_identity(ireport))
            if args.json:
                Path(args.json).write_text(json.dumps(ireport, indent=2) + "\n")
            return 1 if ireport["gated_divergences"] else 0
        config = BenchConfig(
            models=tuple(args.model) or DEFAULT_MODELS,
            workloads=tuple(args.workload) or None, arms=tuple(args.arm) or None,
            reps=args.reps, max_tokens=args.tokens or 128, n_ctx=args.ctx,
            threads=args.threads, draft_max=args.draft_max, pld_tokens=args.pld_tokens,
            llama_flash_attn=args.llama_flash_attn == "on", warmup=not args.no_warmup,
            cost_reps=args.cost_reps, llama_server=args.llama_server,
            draft_model=args.draft_model,
            llama_server_modes=tuple(args.llama_server_mode) or NGRAM_MODES,
            cache_type_k=args.cache_type_k,
        )
        report = run_bench(config)
        print(format_report(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        if args.plot:
            write_plot(report, Path(args.plot))
    except BenchError as exc:
        print(f"meshd bench: {exc}", file=sys.stderr)
        return 2
    except NativeError as exc:
        print(f"meshd bench: {exc}", file=sys.stderr)
        return 3
    return 0
