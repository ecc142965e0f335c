"""The ``meshd`` command line: serve, demo, generate, bench, bench-e2e, bench-threads,
bench-peer-suite, config, make-test-model.

Exit codes: 0 success, 2 bad usage or request, 3 model/runtime error (``serve`` and
``demo`` document theirs).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from meshd.clients.options import seed_note
from meshd.clients.terminal import Progress, stats_line
from meshd.daemon.commands.checks import check_model_args
from meshd.daemon.config import options as opt
from meshd.daemon.engine.request_errors import PromptTooLong, RequestError
from meshd.daemon.engine.sampling import SamplingParams, with_chosen_seed
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.native.cpus import apply_thread_wait
from meshd.native.errors import NativeError

DESCRIPTION = "A local LLM daemon that makes speculative decoding pay on one machine."
EPILOG = "Run `meshd COMMAND --help` for a command's options and their defaults."


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = opt.subparser(
        sub, "generate", help="run one generation in this process and print it",
        description="Run one generation in this process and print it (text to stdout, "
                    "a stats line to stderr). A model with a chat template gets the prompt "
                    "as a user turn in its template, as chat front-ends do; --raw sends "
                    "the text as it is.",
        parents=[opt.model_options(), opt.speculation_options(), opt.sampling_options(),
                 opt.generation_options(), opt.placement_options()],
    )
    p.add_argument("-p", "--prompt", required=True, metavar="TEXT",
                   help="prompt text ('-' reads it from stdin)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--chat", action="store_true",
                      help="render the prompt with the model's chat template (one without "
                           "gets the one llama-server falls back to, chatml for most; default: "
                           "when its file has one)")
    form.add_argument("--raw", action="store_true",
                      help="send the prompt as raw text, without the chat template")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token ids, finish reason, stats")


def _add_make_test_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = opt.subparser(sub, "make-test-model",
                      help="write a synthetic GGUF model (tiny, or of realistic cost with --size)")
    p.add_argument("kind", choices=["llama", "qwen35", "mimo2"],
                   help="architecture: llama (attention), qwen35 (recurrent + MTP head), "
                        "mimo2 (attention + MTP head)")
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--seed", type=opt.integer, default=0, help="weights seed")
    p.add_argument("--acceptance", type=opt.probability, default=1.0,
                   help="how often the MTP head's draft matches the model")
    from meshd.testing.testmodels import DEFAULT_SIZED_TYPE, QUANT_TYPES, SIZES

    p.add_argument("--size", choices=list(SIZES), default=None,
                   help="a model of realistic cost (default: tiny, F32)")
    p.add_argument("--type", dest="qtype", choices=list(QUANT_TYPES), default=None,
                   help=f"weights of a sized model (default {DEFAULT_SIZED_TYPE})")
    p.add_argument("--no-check", action="store_true",
                   help="skip running a sized model to report its margins")


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from meshd.bench.cli import add_arguments

    add_arguments(opt.subparser(
        sub, "bench",
        help="benchmark arms side by side against llama-cpp-python; --identity gate",
        parents=[opt.model_options(ctx=2048, model=False),
                 opt.speculation_options(proposer=False, fixed_k=False)]))


def _add_bench_rpc(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from meshd.bench.rpc import add_arguments

    add_arguments(opt.subparser(
        sub, "bench-rpc",
        help="a model split over 1, 2, 3 loopback workers: tokens/s and round trips per "
             "verify window, with and without speculation",
        parents=[opt.model_options(ctx=2048)]))


def _add_bench_e2e(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from meshd.bench.e2e import add_arguments

    add_arguments(opt.subparser(
        sub, "bench-e2e",
        help="time meshd serve and llama-server as their users run them, from a "
             "streaming HTTP client: decode rate, TTFT, 1 and N clients, idle CPU"))


def _add_bench_peer_suite(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from meshd.bench.peer_suite import add_arguments

    add_arguments(opt.subparser(
        sub, "bench-peer-suite",
        help="llama.cpp's own server tests run against llama-server and meshd serve on "
             "one model file, compared test by test"))


def _add_bench_threads(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from meshd.bench.threads import add_arguments

    add_arguments(opt.subparser(
        sub, "bench-threads",
        help="llama.cpp's thread wait policies and counts, on a quiet machine and with "
             "competing CPU-bound processes"))


def _add_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from meshd.daemon.config.settings import DEFAULT_CONFIG_PATH

    p = opt.subparser(sub, "config", help="check and print the daemon's configuration")
    actions = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = opt.subparser(
        actions, "check",
        help="print the effective configuration of meshd serve (file, MESHD_<SECTION>_<KEY> "
             "variables, defaults) with each value's source; exit 2 naming the bad key")
    check.add_argument("-C", "--config", metavar="FILE", default=None,
                       help=f"TOML file (default: {DEFAULT_CONFIG_PATH} if it exists)")
    opt.subparser(
        actions, "example",
        help="print the example configuration file (every key with its default; "
             "systemd/meshd.toml is its output)")
    opt.subparser(
        actions, "reference",
        help="print every key as Markdown tables (default, variable, flag, whether SIGHUP "
             "applies it; docs/configuration.md holds its output)")


def cmd_config(args: argparse.Namespace) -> int:
    """``config example`` prints the example file; ``config check`` loads the
    configuration and checks what ``serve`` would check before loading the model."""
    from meshd.daemon.commands.serve_checks import StartupProblem, check_before_start
    from meshd.daemon.config import settings as config
    from meshd.daemon.config.model_specs import model_specs
    from meshd.daemon.config.text import render, render_example, render_models, render_reference

    if args.config_command == "example":
        sys.stdout.write(render_example())
        return 0
    if args.config_command == "reference":
        sys.stdout.write(render_reference(serve_flags()))
        return 0
    try:
        loaded = config.load(args.config)
        models = model_specs(loaded)
    except config.ConfigError as exc:
        print(f"meshd config check: {exc}", file=sys.stderr)
        return 2
    c = loaded.config
    try:  # the daemon may run as another user (meshd), and may be running already
        check_before_start(loaded, bind=c.serve.socket, http=c.serve.http, checking=True)
    except StartupProblem as problem:
        print(f"meshd config check: {problem.key} (from {loaded.sources[problem.key]}): "
              f"{problem.message}", file=sys.stderr)
        return 2
    print(render(loaded))
    print(render_models(models))
    return 0


def serve_flags() -> dict[str, list[str]]:
    """``meshd serve``'s option strings by argparse dest."""
    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    return {a.dest: list(a.option_strings) for a in serve._actions if a.option_strings}


def cmd_generate(args: argparse.Namespace) -> int:
    # Like the daemon: sampling without --seed gets a chosen seed (printed), so it can
    # be replayed and speculation verifies it exactly.
    sampling = with_chosen_seed(
        SamplingParams(args.temperature, args.top_k, args.top_p, args.seed,
                       **opt.sampling_extras(args)))
    note = seed_note(args.temperature, args.seed)
    if note is not None:
        _note("seed_ignored", note)
    config = RuntimeConfig(
        model_path=args.model, n_ctx_seq=args.ctx, draft_max=args.draft_max,
        threads=args.threads, calibrate=not args.fixed_k,
        rpc_workers=args.rpc or (), tensor_split=args.tensor_split or (),
        gpu_layers=args.gpu_layers, cache_type_k=args.cache_type_k,
        chat_template_file=args.chat_template_file, chat_template=args.chat_template,
        reasoning=args.reasoning,
    )
    prompt_text = sys.stdin.read() if args.prompt == "-" else args.prompt
    try:
        check_model_args(args.model, args.proposer)
        with ModelRuntime(config, notes=_note, progress=Progress) as rt:
            chat = args.chat or (not args.raw and rt.chat_template_fallback is None)
            text = rt.render_chat([{"role": "user", "content": prompt_text}]) if chat \
                else prompt_text
            prompt = rt.tokenize_prompt(text, chat=chat)
            gen = rt.generation(
                prompt, max_tokens=args.max_tokens, sampling=sampling, stop=args.stop,
                proposer=args.proposer, adaptive=not args.fixed_k,
            )
            for ev in rt.run(gen):
                if not args.json and ev.text:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
            assert gen.finish is not None
            proposer_name = gen.stats.proposer_that_ran(gen.proposer_name)
            if args.json:
                print(json.dumps({
                    "text": gen.text,
                    "tokens": gen.committed,
                    "finish_reason": gen.finish.value,
                    "proposer": proposer_name or "off",
                    "chat": chat,
                    "model": rt.model.info.path,
                    "seed": None if sampling.greedy else sampling.seed,
                    "stats": gen.stats.as_dict(),
                }))
            else:
                if gen.text and not gen.text.endswith("\n"):
                    sys.stdout.write("\n")
                st = gen.stats
                print(stats_line(
                    finish=gen.finish.value, tokens=st.emitted, prompt=st.prompt_tokens,
                    wall_ms=st.wall_ms, proposer=proposer_name, forwards=st.decode_forwards,
                    drafted=st.drafted, accepted=st.accepted,
                    refusals=st.refusals, extra={"chat": "yes" if chat else "no",
                           **({} if sampling.greedy else {"seed": str(sampling.seed)})},
                ), file=sys.stderr)
    except PromptTooLong as exc:  # meshctl exits 3 for it too (the daemon's model_error)
        print(f"meshd generate: {exc}", file=sys.stderr)
        return 3
    except (RequestError, ValueError) as exc:  # ValueError: --tensor-split vs devices
        print(f"meshd generate: {exc}", file=sys.stderr)
        return 2
    except NativeError as exc:
        print(f"meshd generate: {exc}", file=sys.stderr)
        return 3
    return 0


def _note(_event: str, message: str) -> None:
    print(f"meshd: note: {message}", file=sys.stderr)


def cmd_make_test_model(args: argparse.Namespace) -> int:
    from meshd.testing.testmodels import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshd", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=opt.HelpFormatter)
    opt.add_version(parser, "meshd")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")
    from meshd.bench.soak import run as soak
    from meshd.daemon.commands import demo, serve, worker
    from meshd.daemon.commands import plugins as plugins_cmd

    serve.add_parser(sub)
    demo.add_parser(sub)
    worker.add_parser(sub)
    plugins_cmd.add_parser(sub)
    _add_generate(sub)
    soak.add_parser(sub)
    _add_bench(sub)
    _add_bench_rpc(sub)
    _add_bench_e2e(sub)
    _add_bench_threads(sub)
    _add_bench_peer_suite(sub)
    _add_config(sub)
    _add_make_test_model(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``meshd``; returns the exit code (2 for bad usage, before anything starts)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, a usage error: argparse has printed it
        return exc.code if isinstance(exc.code, int) else 2
    if getattr(args, "thread_wait", None) is not None:  # serve reads its config first
        apply_thread_wait(args.thread_wait)
    if args.command == "plugins":
        from meshd.daemon.commands import plugins as plugins_cmd

        return plugins_cmd.run(args)
    if args.command == "serve":
        from meshd.daemon.commands import serve

        return serve.run(args)
    if args.command == "demo":
        from meshd.daemon.commands import demo

        return demo.run(args)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "worker":
        from meshd.daemon.commands import worker

        return worker.run(args)
    if args.command == "soak":
        from meshd.bench.soak import run as soak

        return soak.run(args)
    if args.command == "bench-rpc":
        from meshd.bench.rpc import cmd_bench_rpc

        return cmd_bench_rpc(args)
    if args.command == "bench":
        from meshd.bench.cli import cmd_bench

        return cmd_bench(args)
    if args.command == "config":
        return cmd_config(args)
    if args.command == "bench-e2e":
        from meshd.bench.e2e import cmd_bench_e2e

        return cmd_bench_e2e(args)
    if args.command == "bench-peer-suite":
        from meshd.bench.peer_suite import cmd_bench_peer_suite

        return cmd_bench_peer_suite(args)
    if args.command == "bench-threads":
        from meshd.bench.threads import cmd_bench_threads

        return cmd_bench_threads(args)
    return cmd_make_test_model(args)


if __name__ == "__main__":
    sys.exit(main())
