"""``meshctl``: talk to a running meshd over its Unix socket.

::

    meshctl [--socket PATH] generate "Once upon a time" --max-tokens 64 --proposer ngram
    meshctl chat "Rewrite with type hints: def add(a, b): return a + b"
    meshctl health | stats | models [--json]      meshctl cancel REQUEST_ID
    meshctl tokenize "some text" [--no-special]    meshctl detokenize 1 2 3
    meshctl load qwen2.5:1b --keep-alive 10m       meshctl unload qwen2.5:1b
    meshctl generate "Once upon a time" --model qwen2.5:1b --keep-alive -1
    curl --unix-socket "$(meshctl socket)" http://localhost/health

``generate``/``chat`` stream text to stdout and a stats line to stderr (``--json``: one
object instead), greedy by default like ``meshd generate``. The socket is found by
:func:`meshd.clients.socket_path.find_socket`. Exit codes, for scripts: 0 success; 1
other failure; 2 bad usage or an invalid request (a model the daemon does not serve
too); 3 the model failed; 4 busy or shutting down, retry later; 5 no daemon at the
socket; 130 interrupted (the request is cancelled).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, TextIO

from meshd.protocol import (
    KEEP_ALIVE_FOREVER,
    BadRequest,
    ChatMessage,
    ConnectionClosed,
    Constraint,
    Done,
    FinishReason,
    HealthStatus,
    ModelError,
    ModelInfo,
    ProtocolError,
    SamplingParams,
    ServerBusy,
    SyncClient,
    UnknownModel,
    connect_sync,
    converter,
    unstructure,
)

from .argtypes import DURATION_HELP, duration_seconds, integer, non_negative, positive
from .options import (
    HelpFormatter,
    add_version,
    sampling_extras,
    sampling_options,
    seed_note,
    subparser,
)
from .refusals import explain_refusals
from .socket_path import find_socket, socket_candidates
from .terminal import format_count, stats_line, wants_notes
from .tool_options import ToolRequest, add_tool_options, call_lines, read_tools

__all__ = ["main"]

EXIT_OK: Final = 0
EXIT_FAILURE: Final = 1
EXIT_USAGE: Final = 2
EXIT_MODEL: Final = 3
EXIT_BUSY: Final = 4
EXIT_UNAVAILABLE: Final = 5
EXIT_INTERRUPTED: Final = 130
DEFAULT_TIMEOUT_S: Final = 10.0

Command = Callable[[SyncClient, argparse.Namespace], int]


class UsageError(Exception):
    """An option's value cannot be used (a schema file that is not JSON ...)."""


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
    elif "chat" in client.welcome.capabilities and not args.json and wants_notes():
        # An instruct model given raw text often ends at once: say what happened (to a
        # person: a script that chose `generate` needs no reminder on every call).
        print("meshctl: note: sent as raw text without the model's chat template "
              "(`meshctl chat` applies it)", file=sys.stderr)
    tools: ToolRequest = getattr(args, "tool_request", None) or ToolRequest()
    note = seed_note(args.temperature, args.seed)
    if note is not None and not args.json:
        print(f"meshctl: note: {note}", file=sys.stderr)
    stream = client.generate(
        None if chat else text,
        messages=messages,
        max_tokens=args.max_tokens,
        sampling=_sampling(args),
        stop=args.stop,
        proposer=args.proposer,
        draft_max=args.draft_max,
        request_id=args.id,
        constraint=args.constraint,
        model=args.model,
        keep_alive=args.keep_alive,
        tools=tools.tools,
        tool_choice=tools.choice,
        tool_name=tools.name,
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
        if done.tool_calls:
            print(*call_lines(done.tool_calls), sep="\n", file=out)
        print(_stats_line(stream.id, done, elapsed, first - t0 if first else None),
              file=sys.stderr)
        if args.explain and done.speculation.refusals:
            print("refused: steps that decoded without a draft, by reason",
                  *explain_refusals(done.speculation.refusals), sep="\n", file=sys.stderr)
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
    return stats_line(
        finish=done.finish_reason.value, tokens=done.usage.completion_tokens,
        prompt=done.usage.prompt_tokens, wall_ms=sp.wall_ms, proposer=sp.proposer,
        forwards=sp.target_forwards, drafted=sp.drafted, accepted=sp.accepted,
        refusals=sp.refusals,
        extra={"ttft": f"{ttft_s * 1e3:.0f}ms" if ttft_s is not None else "-",
               "total": f"{elapsed_s:.2f}s", "id": request_id,
               **({"model": done.model} if done.model is not None else {}),
               # The seed sampling drew with (the daemon's choice when none was given):
               # `--seed N` with the same prompt and settings replays the text.
               **({"seed": str(done.seed)} if done.seed is not None else {})},
    )


def _cmd_health(client: SyncClient, args: argparse.Namespace) -> int:
    reply = client.health()
    if args.json:
        print(json.dumps(unstructure(reply)))
    else:
        models = "".join(f" {name}={state}" for name, state in reply.models.items()) \
            if len(reply.models) > 1 else ""
        print(f"{reply.status.value} uptime={reply.uptime_s:.1f}s "
              f"active={reply.active_requests} queued={reply.queued_requests}{models}")
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
    print("\n".join(models_table(models)))
    return EXIT_OK


MODEL_COLUMNS: Final = ("NAME", "STATE", "DEFAULT", "SIZE", "N_CTX", "MTP", "PROPOSERS",
                        "KEEP-ALIVE")


def models_table(models: Sequence[ModelInfo]) -> list[str]:
    """``meshctl models``: a header and one row per model, columns aligned, no cell empty
    (``-`` for unknown) so ``awk`` can pick a column."""
    rows = [MODEL_COLUMNS, *(
        (m.name, m.state or ("loaded" if m.loaded else "unloaded"),
         "yes" if m.default else "no",
         f"{format_count(m.size_bytes)}B" if m.size_bytes is not None else "-",
         str(m.n_ctx) if m.n_ctx else "-", "yes" if m.has_mtp else "no",
         ",".join(m.proposers) or "-", format_keep_alive(m.keep_alive_s))
        for m in models)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(MODEL_COLUMNS))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows]


def format_keep_alive(seconds: float | None) -> str:
    """A keep-alive as ``--keep-alive`` takes it back: ``forever``, ``5m``, ``90s``."""
    if seconds is None:
        return "-"
    if seconds == KEEP_ALIVE_FOREVER:
        return "forever"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _cmd_load(client: SyncClient, args: argparse.Namespace) -> int:
    model = client.load(args.name, keep_alive=args.keep_alive)
    if args.json:
        print(json.dumps(converter.unstructure(model)))
    else:
        print(f"loaded {model.name} (keep-alive {format_keep_alive(model.keep_alive_s)})",
              file=sys.stderr)
    return EXIT_OK


def _cmd_unload(client: SyncClient, args: argparse.Namespace) -> int:
    reply = client.unload(args.name)
    if args.json:
        print(json.dumps({"unloaded": reply.unloaded,
                          "model": converter.unstructure(reply.model)}))
    elif reply.unloaded:
        print(f"unloaded {reply.model.name}", file=sys.stderr)
    else:
        print(f"unloading {reply.model.name}: it is unloaded once its running requests "
              "end", file=sys.stderr)
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
    if not client.cancel_confirmed(args.request_id):
        print(f"meshctl: no request {args.request_id!r} is running (unknown or already "
              "finished)", file=sys.stderr)
        return EXIT_FAILURE
    print(f"cancelled {args.request_id}", file=sys.stderr)
    return EXIT_OK


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.3f}"


def _constraint(args: argparse.Namespace) -> Constraint | None:
    """The output constraint the options ask for (``--json-schema FILE`` ...), or None;
    a file that cannot be read (or a schema that is not JSON) is a usage error."""
    if args.json_object:
        return Constraint(kind="json_object")
    if args.regex is not None:
        return Constraint(kind="regex", grammar=args.regex)
    for option, kind in (("json_schema", "json_schema"), ("grammar", "gbnf"),
                         ("lark", "lark")):
        path = getattr(args, option)
        if path is None:
            continue
        flag = "--" + option.replace("_", "-")
        try:
            text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"{flag} {path}: {exc}") from None
        if kind != "json_schema":
            return Constraint(kind=kind, grammar=text)
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{flag} {path}: not JSON ({exc})") from None
        if not isinstance(schema, dict):
            raise UsageError(f"{flag} {path}: a JSON schema must be an object")
        return Constraint(kind="json_schema", schema=schema)
    return None


def _sampling(args: argparse.Namespace) -> SamplingParams:
    """The request's sampling: the basic options and the penalties and filters given."""
    extras = sampling_extras(args)
    if "logit_bias" in extras:
        extras["logit_bias"] = {str(token): bias for token, bias in extras["logit_bias"]}
    return SamplingParams(temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, **extras)


def _read_prompt(text: str) -> str:
    """``-`` reads the text from stdin (for long prompts and pipes)."""
    return sys.stdin.read() if text == "-" else text


# ---------------------------------------------------------------------- parser


def _add_generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive, default=None, metavar="N",
                   help="most tokens to generate (default: until the model stops or the "
                        "context ends, or the daemon's --max-tokens)")
    p.add_argument("--stop", action="append", default=[], metavar="S",
                   help="stop string (repeatable); not included in the output")
    p.add_argument("--proposer", default=None, metavar="NAME",
                   help="off | auto | mtp | ngram | ... (default: the daemon's --proposer)")
    p.add_argument("--draft-max", type=non_negative, default=None, metavar="K",
                   help="longest draft per step, at most the daemon's (default: the "
                        "daemon's --draft-max)")
    p.add_argument("--id", default=None, help="request id (for meshctl cancel; default: "
                                              "one chosen by meshctl)")
    p.add_argument("--model", default=None, metavar="NAME",
                   help="the model to use (`meshctl models` lists them; default: the "
                        "daemon's default model)")
    _add_keep_alive(p, "the model's current setting")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object: text, token ids and the done frame")
    p.add_argument("--explain", action="store_true",
                   help="after the stats line, say what each refusal reason in "
                        "refused=... means")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE",
                       help="the output is JSON that validates against this schema")
    shape.add_argument("--json-object", action="store_true",
                       help="the output is a JSON object")
    shape.add_argument("--grammar", metavar="FILE", help="the output matches this GBNF "
                                                         "grammar (llama.cpp's format)")
    shape.add_argument("--lark", metavar="FILE", help="the output matches this Lark grammar")
    shape.add_argument("--regex", metavar="PATTERN",
                       help="the output matches this regular expression")


def _add_keep_alive(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--keep-alive", type=duration_seconds, default=None, metavar="DURATION",
                   help=f"how long the model stays loaded once idle: {DURATION_HELP} "
                        f"(default: {default})")


def _connection_options(*, suppress: bool) -> argparse.ArgumentParser:
    """``--socket`` and ``--timeout``, accepted before and after the subcommand.

    On the subcommands their defaults are SUPPRESS, so a value given after the
    subcommand overrides one given before it, and none given leaves the top level's.
    """
    p = argparse.ArgumentParser(add_help=False, formatter_class=HelpFormatter)
    g = p.add_argument_group("connection")
    g.add_argument("-s", "--socket", metavar="PATH",
                   default=argparse.SUPPRESS if suppress else None,
                   help="daemon socket (default: $MESHD_SOCKET, else the first that "
                        f"exists of {', '.join(socket_candidates())})")
    g.add_argument("--timeout", type=positive_seconds, metavar="S",
                   default=argparse.SUPPRESS if suppress else DEFAULT_TIMEOUT_S,
                   help="seconds to wait for the connection and handshake"
                        + ("" if suppress else f" (default: {DEFAULT_TIMEOUT_S:g})"))
    return p


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshctl", description="Talk to a running meshd daemon over its socket.",
        epilog="exit codes: 0 ok, 1 failure, 2 bad request, 3 model error, 4 busy, "
               "5 no daemon, 130 interrupted",
        parents=[_connection_options(suppress=False)], formatter_class=HelpFormatter,
    )
    add_version(parser, "meshctl")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                title="commands")

    def command(name: str, help_text: str,
                parents: list[argparse.ArgumentParser] | None = None) -> argparse.ArgumentParser:
        return subparser(sub, name, help=help_text,
                         parents=[_connection_options(suppress=True), *(parents or [])])

    p = command("generate", "generate from raw text (no chat template: use `chat` for "
                            "instruct models), streaming the text",
                [sampling_options()])
    p.add_argument("prompt", help="prompt text ('-' reads stdin)")
    _add_generation_options(p)
    p = command("chat", "send one user message with the model's chat template",
                [sampling_options()])
    p.add_argument("prompt", help="the user message ('-' reads stdin)")
    p.add_argument("--system", default=None, help="a system message before it")
    add_tool_options(p)
    _add_generation_options(p)
    for name, help_text in (("health", "status, load and the proposers offered (exit 1 "
                                       "unless ok)"),
                            ("stats", "daemon-wide counters and proposer acceptance"),
                            ("models", "the models the daemon serves, loaded or not")):
        p = command(name, help_text)
        p.add_argument("--json", action="store_true", help="print the reply as JSON")
    p = command("tokenize", "token ids of a text under the daemon's model")
    p.add_argument("text", help="text ('-' reads stdin)")
    p.add_argument("--no-special", action="store_true", help="do not add BOS etc.")
    p.add_argument("--json", action="store_true", help="print a JSON array")
    p = command("detokenize", "text of token ids")
    p.add_argument("tokens", type=integer, nargs="+", help="token ids")
    p.add_argument("--json", action="store_true", help="print a JSON string")
    p = command("load", "load a model (or set how long it stays loaded)")
    p.add_argument("name", help="the model's name, as `meshctl models` lists it")
    _add_keep_alive(p, "the daemon's setting for the model")
    p.add_argument("--json", action="store_true", help="print the loaded model as JSON")
    p = command("unload", "unload a model (once its running requests end)")
    p.add_argument("name", help="the model's name, as `meshctl models` lists it")
    p.add_argument("--json", action="store_true", help="print the reply as JSON")
    command("socket", "print the socket path meshctl talks to (for curl --unix-socket "
                      "and other HTTP clients; exit 5 when no daemon listens there)")
    p = command("cancel", "cancel a running generate by its request id")
    p.add_argument("request_id", help="the id shown by generate/chat (id=...) or given "
                                      "with --id")
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
    "load": _cmd_load,
    "unload": _cmd_unload,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run meshctl; returns the exit code (see the module docstring)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, a usage error: argparse has printed it
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    path = find_socket(args.socket)
    if args.command == "socket":
        return _cmd_socket(path, args.timeout)
    try:
        # Read before connecting: a bad option is refused before anything is sent.
        args.constraint = _constraint(args) if hasattr(args, "json_schema") else None
        args.tool_request = read_tools(args) if hasattr(args, "tools") else None
    except (UsageError, ValueError) as exc:
        print(f"meshctl: {exc}", file=sys.stderr)
        return EXIT_USAGE
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
        if isinstance(exc, BadRequest | UnknownModel):
            return EXIT_USAGE
        if isinstance(exc, ModelError):
            return EXIT_MODEL
        if isinstance(exc, ServerBusy):
            return EXIT_BUSY
        return EXIT_FAILURE
    except BrokenPipeError:  # stdout closed (``meshctl generate ... | head``)
        return EXIT_OK


def _cmd_socket(path: str, timeout: float) -> int:
    """Print the path, whether or not a daemon listens there (``$(meshctl socket)``
    always names the place), and say on stderr when none does."""
    print(path)
    if not _listening(path, timeout):
        return _unavailable(path, "nothing listens on it")
    return EXIT_OK


def _listening(path: str, timeout: float) -> bool:
    """Whether a server accepts connections on the Unix socket ``path`` (no handshake:
    the HTTP clients this path is printed for speak none)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(timeout)
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _unavailable(path: str, detail: str) -> int:
    if not os.path.exists(path):
        searched = ("" if path not in socket_candidates()
                    else f"; looked at {', '.join(socket_candidates())}")
        print(f"meshctl: no daemon at {path} (the socket does not exist{searched}; "
              f"start one with `meshd serve`, or name its socket with --socket)",
              file=sys.stderr)
    else:
        print(f"meshctl: cannot talk to the daemon at {path}: {detail}", file=sys.stderr)
    return EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
