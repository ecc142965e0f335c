"""``meshctl``: talk to a running meshd over its Unix socket.

::

    meshctl [--socket PATH] generate "Once upon a time" --max-tokens 64 --proposer ngram
    meshctl chat "Rewrite with type hints: def add(a, b): return a + b"
    meshctl health | stats | models [--json]
    meshctl tokenize "some text" [--no-special]      meshctl detokenize 1 2 3
    meshctl cancel REQUEST_ID

``generate``/``chat`` stream the text to stdout and print a stats line to stderr
(``--json`` prints one object with the text, the token ids and the ``done`` frame
instead). Sampling defaults to greedy, as ``meshd generate`` does, so both print the same
text. The socket is ``--socket``, else ``$MESHD_SOCKET``, else meshd's default path.

Exit codes (scripts branch on them): 0 success; 1 other failure (including an unhealthy
``health`` and a generation cancelled from elsewhere); 2 bad usage or a request the
daemon rejected as invalid; 3 the model failed; 4 the daemon is busy or shutting down,
retry later; 5 no daemon reachable at the socket; 130 interrupted (the running request
is cancelled on the way out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Final, TextIO

from meshd.protocol import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    BadRequest,
    ChatMessage,
    ConnectionClosed,
    Done,
    FinishReason,
    HealthStatus,
    ModelError,
    ProtocolError,
    ServerBusy,
    SyncClient,
    connect_sync,
    converter,
    unstructure,
)

from .listener import default_socket_path

__all__ = ["main"]

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_MODEL: Final = 3
EXIT_BUSY: Final = 4
EXIT_UNAVAILABLE: Final = 5
EXIT_INTERRUPTED: Final = 130

Command = Callable[[SyncClient, argparse.Namespace], int]


def socket_path(explicit: str | None) -> str:
    """The socket meshctl talks to: ``--socket``, ``$MESHD_SOCKET``, or the default."""
    path = explicit or os.environ.get("MESHD_SOCKET") or default_socket_path()
    return path.removeprefix("unix:")


# ---------------------------------------------------------------------- commands


def _cmd_generate(client: SyncClient, args: argparse.Namespace) -> int:
    text = _read_prompt(args.prompt)
    chat = args.command == "chat"
    messages: list[ChatMessage] | None = None
    if chat:
        messages = []
        if args.system:
            messages.append(ChatMessage(role="system", content=args.system))
        messages.append(ChatMessage(role="user", content=text))
    stream = client.generate(
        None if chat else text,
        messages=messages,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        proposer=args.proposer,
        draft_max=args.draft_max,
        request_id=args.id,
    )
    out: TextIO = sys.stdout
    t0 = time.perf_counter()
    first: float | None = None
    with stream:
        for token in stream:
            if first is None:
                first = time.perf_counter()
            if not args.json and token.text:
                out.write(token.text)
                out.flush()
    elapsed = time.perf_counter() - t0
    done = stream.done
    assert done is not None  # the stream only ends normally with done
    if args.json:
        print(json.dumps({"id": stream.id, "text": stream.text,
                          "token_ids": list(stream.token_ids), "done": unstructure(done)}))
    else:
        if stream.text and not stream.text.endswith("\n"):
            out.write("\n")
        print(_stats_line(stream.id, done, elapsed, first - t0 if first else None),
              file=sys.stderr)
    if done.finish_reason is FinishReason.ERROR:
        print(f"meshctl: the generation failed: {done.error_message}", file=sys.stderr)
        return EXIT_MODEL
    if done.finish_reason is FinishReason.CANCELLED:
        print("meshctl: the generation was cancelled (by `meshctl cancel` or a daemon "
              "shutdown)", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


def _stats_line(request_id: str, done: Done, elapsed_s: float, ttft_s: float | None) -> str:
    sp = done.speculation
    rate = sp.emitted / (sp.wall_ms / 1e3) if sp.wall_ms > 0 else 0.0
    accepted = f"{sp.accepted}/{sp.drafted}" if sp.drafted else "0/0"
    ttft = f"{ttft_s * 1e3:.0f}ms" if ttft_s is not None else "-"
    return (
        f"--\nfinish={done.finish_reason.value} tokens={done.usage.completion_tokens} "
        f"prompt={done.usage.prompt_tokens} tok/s={rate:.1f} proposer={sp.proposer or 'off'} "
        f"forwards={sp.target_forwards} accepted={accepted} refusals={sp.refusals} "
        f"ttft={ttft} total={elapsed_s:.2f}s id={request_id}"
    )


def _cmd_health(client: SyncClient, args: argparse.Namespace) -> int:
    reply = client.health()
    if args.json:
        print(json.dumps(unstructure(reply)))
    else:
        print(f"{reply.status.value} uptime={reply.uptime_s:.1f}s "
              f"active={reply.active_requests} queued={reply.queued_requests}")
    return EXIT_OK if reply.status is HealthStatus.OK else EXIT_FAILURE


def _cmd_stats(client: SyncClient, args: argparse.Namespace) -> int:
    reply = client.stats()
    if args.json:
        print(json.dumps(unstructure(reply)))
        return EXIT_OK
    print(f"uptime {reply.uptime_s:.1f}s")
    for key, value in reply.counters.items():
        print(f"  {key:24} {_number(value)}")
    for name, st in reply.proposers.items():
        rate = f"{st.acceptance_rate:.0%}" if st.acceptance_rate is not None else "-"
        print(f"proposer {name}: requests={st.requests} drafted={st.drafted} "
              f"accepted={st.accepted} ({rate}) per-position={list(st.accepted_per_position)}")
    return EXIT_OK


def _cmd_models(client: SyncClient, args: argparse.Namespace) -> int:
    models = client.models()
    if args.json:
        print(json.dumps([converter.unstructure(m) for m in models]))
        return EXIT_OK
    for m in models:
        flags = [f for f, on in (("mtp", m.has_mtp), ("chat", m.has_chat_template)) if on]
        print(f"{m.name} arch={m.architecture or '-'} n_ctx={m.n_ctx} n_vocab={m.n_vocab} "
              f"params={m.n_params or '-'} {' '.join(flags)}".rstrip())
    return EXIT_OK


def _cmd_tokenize(client: SyncClient, args: argparse.Namespace) -> int:
    tokens = client.tokenize(_read_prompt(args.text), add_special=not args.no_special)
    print(json.dumps(list(tokens)) if args.json else " ".join(map(str, tokens)))
    return EXIT_OK


def _cmd_detokenize(client: SyncClient, args: argparse.Namespace) -> int:
    text = client.detokenize(args.tokens)
    print(json.dumps(text) if args.json else text)
    return EXIT_OK


def _cmd_cancel(client: SyncClient, args: argparse.Namespace) -> int:
    client.cancel(args.request_id)
    # ``cancel`` has no reply; a round trip afterwards shows the daemon has processed it
    # (frames of one connection are handled in order) before we hang up.
    client.health()
    print(f"cancel sent for {args.request_id}", file=sys.stderr)
    return EXIT_OK


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3f}"


def _read_prompt(text: str) -> str:
    """``-`` reads the text from stdin (for long prompts and pipes)."""
    return sys.stdin.read() if text == "-" else text


# ---------------------------------------------------------------------- parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return value


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=_positive, default=None,
                   help="most tokens to generate (default: the daemon's)")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"0 = greedy (default {DEFAULT_TEMPERATURE:g})")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                   help=f"0 disables the filter (default {DEFAULT_TOP_K})")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P,
                   help=f"1 disables the filter (default {DEFAULT_TOP_P:g})")
    p.add_argument("--stop", action="append", default=[], metavar="S",
                   help="stop string (repeatable); not included in the output")
    p.add_argument("--proposer", default=None,
                   help="off | auto | mtp | ngram | ... (default: the daemon's)")
    p.add_argument("--draft-max", type=_positive, default=None)
    p.add_argument("--id", default=None, help="request id (for meshctl cancel)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token ids and the done frame")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshctl", description="Talk to a running meshd daemon over its socket.",
        epilog="exit codes: 0 ok, 1 failure, 2 bad request, 3 model error, 4 busy, "
               "5 no daemon, 130 interrupted",
    )
    parser.add_argument("--socket", default=None, metavar="PATH",
                        help=f"daemon socket (default: $MESHD_SOCKET or {default_socket_path()})")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for the connection and handshake")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("generate", help="generate from a raw prompt, streaming the text")
    p.add_argument("prompt", help="prompt text ('-' reads stdin)")
    _add_generation_options(p)
    p = sub.add_parser("chat", help="send one user message with the model's chat template")
    p.add_argument("prompt", help="the user message ('-' reads stdin)")
    p.add_argument("--system", default=None, help="a system message before it")
    _add_generation_options(p)
    for name, help_text in (("health", "status and load (exit 1 unless ok)"),
                            ("stats", "daemon-wide counters and proposer acceptance"),
                            ("models", "the loaded model")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--json", action="store_true")
    p = sub.add_parser("tokenize", help="token ids of a text under the daemon's model")
    p.add_argument("text", help="text ('-' reads stdin)")
    p.add_argument("--no-special", action="store_true", help="do not add BOS etc.")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("detokenize", help="text of token ids")
    p.add_argument("tokens", type=int, nargs="+")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("cancel", help="cancel a running generate by its request id")
    p.add_argument("request_id")
    return parser


COMMANDS: Final[dict[str, Command]] = {
    "generate": _cmd_generate,
    "chat": _cmd_generate,
    "health": _cmd_health,
    "stats": _cmd_stats,
    "models": _cmd_models,
    "tokenize": _cmd_tokenize,
    "detokenize": _cmd_detokenize,
    "cancel": _cmd_cancel,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run meshctl; returns the exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    path = socket_path(args.socket)
    try:
        with connect_sync(path, client_name="meshctl", connect_timeout=args.timeout) as client:
            return COMMANDS[args.command](client, args)
    except KeyboardInterrupt:
        print("\nmeshctl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConnectionClosed as exc:
        return _unavailable(path, str(exc))
    except TimeoutError:
        return _unavailable(path, f"no answer within {args.timeout:g}s")
    except ProtocolError as exc:
        print(f"meshctl: {exc.code.value}: {exc.message}", file=sys.stderr)
        if isinstance(exc, BadRequest):
            return EXIT_USAGE
        if isinstance(exc, ModelError):
            return EXIT_MODEL
        if isinstance(exc, ServerBusy):
            return EXIT_BUSY
        return EXIT_FAILURE
    except BrokenPipeError:  # stdout closed (``meshctl generate ... | head``)
        return EXIT_OK


def _unavailable(path: str, detail: str) -> int:
    if not os.path.exists(path):
        print(f"meshctl: no daemon at {path} (the socket does not exist; "
              f"start one with `meshd serve`)", file=sys.stderr)
    else:
        print(f"meshctl: cannot talk to the daemon at {path}: {detail}", file=sys.stderr)
    return EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
