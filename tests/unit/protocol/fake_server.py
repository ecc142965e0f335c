"""A tiny in-test meshd stand-in: speaks the protocol over a real Unix socket.

It only knows canned behaviour, chosen by the prompt, so client tests can exercise
streaming, multiplexing, cancellation and error paths without a model:

* any prompt ``p``: tokens ``p:0``, ``p:1``, ... (``n_tokens`` of them, or ``max_tokens``),
  then ``done`` (stop, or length when ``max_tokens`` cut it short);
* ``"slow"``: endless tokens until cancelled, then ``done`` cancelled;
* ``"error:<code>"``: an ``error`` frame with that code instead of any token;
* ``"fail"``: one token then ``done`` with finish_reason ``error``;
* ``"hangup"``: one token then the server closes the connection;
* ``"garble"``: a malformed ``token`` frame carrying the request's id.

``done.model`` names the model asked for (default: ``fake-model``). ``load`` and
``unload`` answer for any model but ``nosuch`` (``unknown_model``); ``unload`` of
``busy`` answers that it unloads once idle.

``welcome_version`` makes it welcome any hello with that version (a server that ignores
the client's version), to test the client's own check.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

import anyio
import anyio.abc

from meshd.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    Detokenize,
    DetokenizeReply,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    Generate,
    Health,
    HealthReply,
    HealthStatus,
    Hello,
    Load,
    LoadReply,
    ModelInfo,
    Models,
    ModelsReply,
    ProposerStats,
    ProtocolError,
    RequestDecoder,
    Response,
    SpeculationStats,
    Stats,
    StatsReply,
    StreamReceiver,
    Token,
    Tokenize,
    TokenizeReply,
    Unload,
    UnloadReply,
    Usage,
    Welcome,
    encode,
    error_message,
)

MODEL = ModelInfo(name="fake-model", architecture="fake", n_ctx=4096, n_vocab=256)


class FakeServer:
    """Serve the canned protocol; records what it received for assertions."""

    def __init__(
        self,
        *,
        protocol_version: int = PROTOCOL_VERSION,
        n_tokens: int = 3,
        token_delay: float = 0.0,
        max_frame_size: int = 4 * 1024 * 1024,
        after_welcome: bytes = b"",
        stats_error: ErrorCode | None = None,
        welcome_version: int | None = None,
    ) -> None:
        self.protocol_version = protocol_version
        self.n_tokens = n_tokens
        self.token_delay = token_delay
        self.max_frame_size = max_frame_size
        self.after_welcome = after_welcome
        self.stats_error = stats_error
        self.welcome_version = welcome_version
        self.received: list[Any] = []
        self.errors: list[ProtocolError] = []
        self.sent_order: list[str] = []
        self.cancelled: list[str] = []
        self.cancel_event = anyio.Event()
        self.hellos: list[Hello] = []

    async def serve(
        self, path: str, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        listener = await anyio.create_unix_listener(path)
        async with listener:
            task_status.started()
            await listener.serve(self.handle)

    async def handle(self, stream: anyio.abc.ByteStream) -> None:
        lock = anyio.Lock()
        running: dict[str, anyio.CancelScope] = {}

        async def send(msg: Response) -> None:
            # The client may be gone (it hung up, or we did): tolerate that quietly.
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                async with lock:
                    await stream.send(encode(msg))
                self.sent_order.append(msg.id or "")

        decoder = RequestDecoder(self.max_frame_size)
        receiver = StreamReceiver(stream)
        async with stream, anyio.create_task_group() as tg:
            while True:
                try:
                    data = await receiver.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                    break
                decoder.feed(data)
                for item in decoder.drain():
                    if isinstance(item, ProtocolError):
                        self.errors.append(item)
                        await send(error_message(item))
                        continue
                    self.received.append(item)
                    if isinstance(item, Hello):
                        self.hellos.append(item)
                        mismatch = item.protocol_version != self.protocol_version
                        if mismatch and self.welcome_version is None:
                            await send(
                                ErrorMessage(
                                    id=item.id,
                                    code=ErrorCode.UNSUPPORTED_VERSION,
                                    message=f"need protocol {self.protocol_version}",
                                )
                            )
                            tg.cancel_scope.cancel()
                            return
                        await send(self.welcome(item.id))
                        if self.after_welcome:
                            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                                async with lock:
                                    await stream.send(self.after_welcome)
                    elif isinstance(item, Generate):
                        scope = anyio.CancelScope()
                        running[item.id] = scope
                        tg.start_soon(self.generate, item, send, scope, stream, tg.cancel_scope)
                    elif isinstance(item, Cancel):
                        self.cancelled.append(item.id)
                        self.cancel_event.set()
                        if item.id in running:
                            running[item.id].cancel()
                    else:
                        await send(self.reply(item))

    def welcome(self, request_id: str) -> Welcome:
        return Welcome(
            id=request_id,
            protocol_version=self.welcome_version or self.protocol_version,
            server_version="fake-0",
            model=MODEL,
            capabilities=("chat", "speculation"),
            proposers=("ngram", "mtp"),
            max_frame_size=self.max_frame_size,
        )

    def reply(self, item: Any) -> Response:
        if isinstance(item, Stats):
            if self.stats_error is not None:
                return ErrorMessage(id=item.id, code=self.stats_error, message="stats failed")
            return StatsReply(
                id=item.id,
                uptime_s=1.5,
                counters={"requests_total": 3},
                proposers={"ngram": ProposerStats(requests=1, drafted=10, accepted=7)},
            )
        if isinstance(item, Health):
            return HealthReply(
                id=item.id,
                status=HealthStatus.OK,
                uptime_s=1.5,
                active_requests=0,
                queued_requests=0,
            )
        if isinstance(item, Models):
            return ModelsReply(id=item.id, models=(MODEL,))
        if isinstance(item, Tokenize):
            return TokenizeReply(id=item.id, tokens=tuple(ord(c) for c in item.text))
        if isinstance(item, Detokenize):
            return DetokenizeReply(id=item.id, text="".join(chr(t) for t in item.tokens))
        if isinstance(item, Load | Unload) and item.model == "nosuch":
            return ErrorMessage(id=item.id, code=ErrorCode.UNKNOWN_MODEL,
                                message=f"{item.OP}.model: no model 'nosuch'")
        if isinstance(item, Load):
            return LoadReply(id=item.id, model=ModelInfo(
                name=item.model, state="loaded", keep_alive_s=item.keep_alive))
        if isinstance(item, Unload):
            busy = item.model == "busy"
            return UnloadReply(id=item.id, unloaded=not busy, model=ModelInfo(
                name=item.model, loaded=False, state="unloading" if busy else "unloaded"))
        raise AssertionError(f"unexpected {item!r}")

    async def generate(
        self,
        request: Generate,
        send: Callable[[Response], Any],
        scope: anyio.CancelScope,
        stream: anyio.abc.ByteStream,
        connection_scope: anyio.CancelScope,
    ) -> None:
        prompt = request.prompt or request.messages[-1].content  # type: ignore[index]
        if prompt.startswith("error:"):
            code = ErrorCode(prompt.removeprefix("error:"))
            await send(ErrorMessage(id=request.id, code=code, message=f"canned {code}"))
            return
        if prompt == "garble":
            bad = b'{"op":"token","id":"%s","text":1,"token_ids":[]}\n' % request.id.encode()
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(bad)
            return
        endless = prompt == "slow"
        limit = request.max_tokens or self.n_tokens
        count = 0
        finish = FinishReason.STOP
        with scope:
            while endless or count < min(limit, self.n_tokens):
                await send(Token(id=request.id, text=f"{prompt}:{count}", token_ids=(count,)))
                count += 1
                if prompt == "fail":
                    finish = FinishReason.ERROR
                    break
                if prompt == "hangup":
                    await stream.aclose()
                    connection_scope.cancel()
                    return
                await anyio.sleep(self.token_delay if not endless else max(self.token_delay, 0.001))
            else:
                if limit < self.n_tokens:
                    finish = FinishReason.LENGTH
        if scope.cancel_called:
            finish = FinishReason.CANCELLED
        await send(
            Done(
                id=request.id,
                finish_reason=finish,
                usage=Usage(prompt_tokens=len(prompt), completion_tokens=count),
                speculation=SpeculationStats(proposer="ngram", emitted=count, drafted=2),
                error_message="canned failure" if finish is FinishReason.ERROR else None,
                model=request.model or MODEL.name,
            )
        )


@asynccontextmanager
async def running_server(server: FakeServer | None = None) -> AsyncIterator[tuple[FakeServer, str]]:
    """Run ``server`` on a fresh short socket path; yields (server, path)."""
    server = server or FakeServer()
    directory = tempfile.mkdtemp(dir="/tmp", prefix="mp")
    path = os.path.join(directory, "s")
    body_error: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve, path)
            try:
                yield server, path
            except Exception as exc:
                body_error = exc  # re-raised outside the group: clearer test failures
            finally:
                tg.cancel_scope.cancel()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if body_error is not None:
        raise body_error
