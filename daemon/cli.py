"""The ``meshd`` command line: ``generate`` (one request in-process), ``make-test-model``.

Exit codes: 0 success, 2 bad usage or request, 3 model/runtime error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from meshd.native.context import DEFAULT_DRAFT_MAX
from meshd.native.errors import NativeError

from .argtypes import non_negative, positive
from .runtime import ModelRuntime, RequestError, RuntimeConfig
from .sampling import SamplingParams


def _add_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="run one generation in-process and print it")
    p.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt as a user turn with the model's chat template")
    p.add_argument("--max-tokens", type=positive, default=128)
    p.add_argument("--stop", action="append", default=[], metavar="S",
                   help="stop string (repeatable); not included in the output")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--top-k", type=non_negative, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--proposer", default="auto",
                   help="off | auto | mtp | ngram | composite | any installed plugin")
    p.add_argument("--draft-max", type=non_negative, default=DEFAULT_DRAFT_MAX,
                   help=f"longest draft per step (k; default {DEFAULT_DRAFT_MAX})")
    p.add_argument("--fixed-k", action="store_true",
                   help="always draft --draft-max tokens (no cost model)")
    p.add_argument("--ctx", type=positive, default=4096, help="context length")
    p.add_argument("--threads", type=positive, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_make_test_model(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("make-test-model", help="write a small synthetic GGUF model")
    p.add_argument("kind", choices=["llama", "qwen35", "mimo2"])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--acceptance", type=float, default=1.0)


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .bench import add_arguments

    add_arguments(sub.add_parser(
        "bench", help="benchmark arms side by side against llama-cpp-python; --identity gate"))


def cmd_generate(args: argparse.Namespace) -> int:
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as exc:
        print(f"meshd generate: {exc}", file=sys.stderr)
        return 2
    config = RuntimeConfig(
        model_path=args.model, n_ctx_seq=args.ctx, draft_max=args.draft_max,
        threads=args.threads, calibrate=not args.fixed_k,
    )
    try:
        with ModelRuntime(config) as rt:
            text = rt.render_chat([{"role": "user", "content": args.prompt}]) if args.chat \
                else args.prompt
            prompt = rt.tokenize_prompt(text, chat=args.chat)
            gen = rt.generation(
                prompt, max_tokens=args.max_tokens, sampling=sampling, stop=args.stop,
                proposer=args.proposer, adaptive=not args.fixed_k,
            )
            proposer_name = rt.resolve_proposer(args.proposer)
            for ev in gen.run():
                if not args.json and ev.text:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
            assert gen.finish is not None
            if args.json:
                print(json.dumps({
                    "text": gen.text,
                    "tokens": gen.committed,
                    "finish_reason": gen.finish.value,
                    "proposer": proposer_name or "off",
                    "model": rt.model.info.path,
                    "stats": gen.stats.as_dict(),
                }))
            else:
                st = gen.stats
                rate = st.emitted / (st.wall_ms / 1e3) if st.wall_ms else 0.0
                acc = f"{st.accepted}/{st.drafted}" if st.drafted else "0/0"
                print(
                    f"\n--\nfinish={gen.finish.value} tokens={st.emitted} "
                    f"tok/s={rate:.1f} proposer={proposer_name or 'off'} "
                    f"forwards={st.target_forwards} accepted={acc} "
                    f"refusals={st.refusals}",
                    file=sys.stderr,
                )
    except RequestError as exc:
        print(f"meshd generate: {exc}", file=sys.stderr)
        return 2
    except NativeError as exc:
        print(f"meshd generate: {exc}", file=sys.stderr)
        return 3
    return 0


def cmd_make_test_model(args: argparse.Namespace) -> int:
    from meshd.native.testmodels import write_test_model

    path = write_test_model(args.kind, args.out, seed=args.seed, acceptance=args.acceptance)
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_make_test_model(sub)
    _add_bench(sub)
    from . import demo, plugins_cmd, serve

    serve.add_parser(sub)
    demo.add_parser(sub)
    plugins_cmd.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "plugins":
        return plugins_cmd.run(args)
    if args.command == "serve":
        return serve.run(args)
    if args.command == "demo":
        return demo.run(args)
    if args.command == "generate":
        return cmd_generate(args)
    if args.command == "bench":
        from .bench import cmd_bench

        return cmd_bench(args)
    return cmd_make_test_model(args)


if __name__ == "__main__":
    sys.exit(main())
