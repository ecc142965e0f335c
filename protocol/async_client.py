"""The async client for the meshd socket (anyio; the blocking one is in sync_client.py).

Why this shape: one connection carries many concurrent requests, so exactly one task
reads the socket and hands each frame to the request with that ``id``. That reader runs
in a task group owned by whoever owns the connection (:meth:`Client.connect`, or
``await tg.start(client.run)``), so nothing is left running when the owner exits::

    async with Client.connect("/run/meshd.sock") as client:
        async with client.generate("Once upon a time", max_tokens=32) as stream:
            async for token in stream:
                print(token.text, end="")

Leaving a stream before ``done`` sends ``cancel``. Server errors arrive as
:class:`~meshd.protocol.errors.ProtocolError` subclasses. The protocol's state is a
sans-I/O :class:`~meshd.protocol.connection.ClientConnection`; this module moves bytes.
"""

from __future__ import annotations

import itertools
import math
import os
import types
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Final, Self, TypeAlias, TypeVar

import anyio
import anyio.abc
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .builders import build, chat_messages, sampling_params
from .connection import ClientConnection, ClientEvent, Failed, Reply, State, Stray
from .errors import BadRequest, ConnectionClosed, InternalError, ProtocolError
from .messages import (
    DEFAULT_MAX_FRAME_SIZE,
    PROTOCOL_VERSION,
    Cancel,
    CancelReply,
    ChatMessage,
    Constraint,
    Detokenize,
    DetokenizeReply,
    Done,
    ErrorMessage,
    Generate,
    Health,
    HealthReply,
    Hello,
    Request,
    Response,
    SamplingParams,
    SpeculativeOverrides,
    Stats,
    StatsReply,
    Token,
    Tokenize,
    TokenizeReply,
    TokenLogprob,
    ToolFunction,
    Welcome,
    error_from_message,
)
from .model_messages import Load, LoadReply, ModelInfo, Models, ModelsReply, Unload, UnloadReply
from .transport import TRANSPORT_ERRORS, FrameWriter, StreamReceiver

__all__ = ["DEFAULT_CLIENT_NAME", "Client", "Completion", "GenerationStream", "connect_unix"]

DEFAULT_CLIENT_NAME: Final = "meshd.protocol"
SEND_TIMEOUT: Final = 30.0
"""Longest a single frame write may take before the connection is declared broken."""

R = TypeVar("R", bound=Response)
_Item: TypeAlias = Response | ProtocolError

#: Connections this process opened (each client's request ids carry its number).
_CONNECTIONS = itertools.count(1)


@attrs.frozen
class Completion:
    """A whole generation, as returned by :meth:`GenerationStream.collect`."""

    text: str
    token_ids: tuple[int, ...]
    done: Done
    #: One per token, when the request asked for ``logprobs``.
    logprobs: tuple[TokenLogprob, ...] = ()


class GenerationStream:
    """The token events of one ``generate``; ends after ``done``.

    Use it as ``async with client.generate(...) as stream: async for token in stream``.
    The request is sent on ``__aenter__`` (or the first ``__anext__``); leaving early,
    or calling :meth:`aclose`, sends ``cancel`` and stops listening. ``done`` holds the
    final frame once the stream has ended normally.
    """

    def __init__(self, client: Client, request: Generate) -> None:
        self._client = client
        self.request = request
        self.done: Done | None = None
        self._receive: MemoryObjectReceiveStream[_Item] | None = None
        self._finished = False
        self._pieces: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def text(self) -> str:
        """The text received so far."""
        return "".join(self._pieces)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The token ids received so far."""
        return tuple(self._token_ids)

    async def start(self) -> None:
        """Send the request (idempotent; iterating starts it implicitly)."""
        if self._receive is not None or self._finished:
            return
        self._receive = self._client._register(self.id)
        try:
            await self._client._send(self.request)
        except BaseException:
            self._finish()
            raise

    def _finish(self) -> None:
        self._finished = True
        if self._receive is not None:
            self._client._unregister(self.id)
            self._receive.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Token:
        if self._finished:
            raise StopAsyncIteration
        await self.start()
        assert self._receive is not None
        try:
            item = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._finish()
            raise self._client._closed_error(self.id) from None
        if isinstance(item, Token):
            self._pieces.append(item.text)
            self._token_ids.extend(item.token_ids)
            self._logprobs.extend(item.logprobs or ())
            return item
        self._finish()
        if isinstance(item, Done):
            self.done = item
            raise StopAsyncIteration
        if isinstance(item, ProtocolError):
            raise item
        if isinstance(item, ErrorMessage):
            raise error_from_message(item)
        raise InternalError(f"unexpected {item.OP} frame for generate request", request_id=self.id)

    async def cancel(self) -> None:
        """Ask the server to stop; keep iterating to receive the ``cancelled`` done."""
        if self._receive is not None and not self._finished:
            await self._client.cancel(self.id)

    async def aclose(self) -> None:
        """Stop listening; if the generation is still running, send ``cancel``."""
        if self._finished:
            return
        was_started = self._receive is not None
        self._finish()
        if was_started:
            # Shielded: aclose often runs because the caller is being cancelled, and the
            # server should still hear that nobody wants the rest.
            # If the connection is gone there is nothing left to cancel.
            with anyio.CancelScope(shield=True), suppress(ProtocolError):
                await self._client.cancel(self.id)

    async def collect(self) -> Completion:
        """Consume the stream and return the whole generation."""
        async with self:
            async for _ in self:
                pass
        if self.done is None:  # pragma: no cover - the loop only ends on done or raises
            raise InternalError("generation ended without done", request_id=self.id)
        return Completion(text=self.text, token_ids=self.token_ids, done=self.done,
                          logprobs=tuple(self._logprobs))


class Client:
    """An async connection to meshd, multiplexing concurrent requests by ``id``.

    Construct it with :meth:`connect` (recommended), or wrap an already-connected
    ``anyio`` byte stream and run it in your own task group::

        client = Client(stream)
        welcome = await tg.start(client.run)

    ``run`` does the ``hello``/``welcome`` exchange, then reads frames until the
    connection ends; it closes the stream when it returns.
    """

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        *,
        client_name: str = DEFAULT_CLIENT_NAME,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        protocol_version: int = PROTOCOL_VERSION,
        send_timeout: float = SEND_TIMEOUT,
    ) -> None:
        self._stream = stream
        self._client_name = client_name
        self._protocol_version = protocol_version
        self._conn = ClientConnection(max_frame_size)
        # Writes are shielded (a cancelled caller cannot cut a frame in half, the stream
        # would be garbage from then on) and bounded (a peer that stops reading cannot
        # hang us); reads go through StreamReceiver, free of anyio's asyncio
        # cancellation race, which also wakes the reader when the stream is closed.
        self._writer = FrameWriter(stream, timeout=send_timeout, shield=True)
        self._receiver = StreamReceiver(stream)
        self._pending: dict[str, MemoryObjectSendStream[_Item]] = {}
        """Who waits for each request's frames (a subset of the ids in flight)."""
        self._ids = itertools.count(1)
        # Unique per connection, not only per process: the daemon looks an id that is
        # not in flight on the cancelling connection up on the others, so two clients of
        # one process sharing ids could cancel each other's requests.
        self._id_prefix = f"c{os.getpid():x}.{next(_CONNECTIONS)}-"
        self._fatal: ProtocolError | None = None

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        client_name: str = DEFAULT_CLIENT_NAME,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        protocol_version: int = PROTOCOL_VERSION,
        connect_timeout: float | None = 10.0,
    ) -> AsyncIterator[Client]:
        """Connect to the Unix socket at ``path``, handshake, and serve until exit.

        Raises UnsupportedVersion if the server does not speak ``protocol_version``,
        ConnectionClosed if the socket cannot be reached or closes during the handshake.
        """
        with anyio.fail_after(connect_timeout):
            try:
                stream = await anyio.connect_unix(path)
            except OSError as exc:
                raise ConnectionClosed(f"cannot connect to {os.fspath(path)}: {exc}") from exc
        client = cls(
            stream,
            client_name=client_name,
            max_frame_size=max_frame_size,
            protocol_version=protocol_version,
        )
        body_error: Exception | None = None
        try:
            async with anyio.create_task_group() as tg:
                with anyio.fail_after(connect_timeout):
                    await tg.start(client.run)
                try:
                    yield client
                except Exception as exc:
                    # Re-raised below, outside the task group, so callers see their own
                    # exception rather than an ExceptionGroup wrapping it.
                    body_error = exc
                finally:
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Only the handshake can fail inside the group (the reader never raises);
            # unwrap a lone exception for the same reason.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
        if body_error is not None:
            raise body_error

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[Welcome] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Handshake, report the ``welcome`` as started, then read until disconnected."""
        try:
            welcome = await self._handshake()
            task_status.started(welcome)
            await self._read_loop()
        finally:
            if self._fatal is None:
                self._fatal = ConnectionClosed("client closed")
            self._fail_all(self._fatal)
            await self._close_stream()

    async def aclose(self) -> None:
        """Close the connection; pending requests fail with ConnectionClosed."""
        if self._fatal is None:
            self._fatal = ConnectionClosed("client closed")
        self._fail_all(self._fatal)
        await self._close_stream()

    @property
    def welcome(self) -> Welcome:
        """The server's ``welcome`` (model info, capabilities, limits)."""
        if self._conn.welcome is None:
            raise RuntimeError("the client has not completed its handshake")
        return self._conn.welcome

    # ----------------------------------------------------------------- requests

    def new_id(self) -> str:
        """A fresh request id, unique within this connection."""
        return f"{self._id_prefix}{next(self._ids)}"

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        proposer: str | None = None,
        draft_max: int | None = None,
        request_id: str | None = None,
        constraint: Constraint | None = None,
        logprobs: int | None = None,
        model: str | None = None,
        keep_alive: float | None = None,
        tools: Sequence[ToolFunction] | None = None,
        tool_choice: str = "auto",
        tool_name: str | None = None,
    ) -> GenerationStream:
        """Start a generation; returns the stream of its tokens (not yet sent).

        Pass ``prompt`` or chat ``messages`` (dicts with ``role``/``content`` are fine).
        Sampling keywords override ``sampling`` (default: SamplingParams()); ``stop`` is
        a list of strings (a lone string counts as one); ``proposer`` (a name, or
        ``"off"``) and ``draft_max`` override speculative decoding; ``constraint`` holds
        the text to a JSON schema or a grammar; ``model`` names the model (default: the
        daemon's), ``keep_alive`` how long it stays loaded after (seconds; -1: until
        unloaded); ``tools`` the functions chat ``messages`` may call (``done.tool_calls``).
        Invalid values raise BadRequest here, before anything is sent."""
        # Errors name the field's path as the server's do: generate.sampling.top_p: ...
        try:
            params = sampling_params(sampling, temperature, top_k, top_p, seed)
        except BadRequest as exc:
            raise exc.under("generate.sampling") from None
        try:
            speculative = SpeculativeOverrides(proposer=proposer, draft_max=draft_max)
        except BadRequest as exc:
            raise exc.under("generate.speculative") from None
        try:
            request = Generate(
                id=request_id or self.new_id(),
                prompt=prompt,
                messages=chat_messages(messages),
                max_tokens=max_tokens,
                sampling=params,
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
                speculative=speculative,
                constraint=constraint,
                logprobs=logprobs,
                model=model,
                keep_alive=keep_alive,
                tools=tuple(tools) if tools else None, tool_choice=tool_choice,
                tool_name=tool_name,
            )
        except BadRequest as exc:
            raise exc.under("generate") from None
        return GenerationStream(self, request)

    async def cancel(self, request_id: str) -> None:
        """Ask the server to cancel a running request (its stream ends ``cancelled``)."""
        await self._send(build(Cancel, id=request_id))

    async def cancel_confirmed(self, request_id: str) -> bool:
        """Cancel and wait for the server's answer: whether a request with that id was in
        flight (on any connection) and is now told to stop."""
        request = build(Cancel, id=request_id, ack=self.new_id())
        assert request.ack is not None
        return (await self._call(request, CancelReply, reply_id=request.ack)).cancelled

    async def stats(self) -> StatsReply:
        """Daemon-wide counters and per-proposer acceptance."""
        return await self._call(Stats(id=self.new_id()), StatsReply)

    async def health(self) -> HealthReply:
        """Status, uptime and load."""
        return await self._call(Health(id=self.new_id()), HealthReply)

    async def models(self) -> tuple[ModelInfo, ...]:
        """The models the daemon serves, loaded or not."""
        return (await self._call(Models(id=self.new_id()), ModelsReply)).models

    async def load(self, name: str, *, keep_alive: float | None = None) -> ModelInfo:
        """Load model ``name`` (or set how long it stays loaded); returns it once loaded."""
        request = build(Load, id=self.new_id(), model=name, keep_alive=keep_alive)
        return (await self._call(request, LoadReply)).model

    async def unload(self, name: str) -> UnloadReply:
        """Unload model ``name``: at once if idle, else once its requests end."""
        return await self._call(build(Unload, id=self.new_id(), model=name), UnloadReply)

    async def tokenize(self, text: str, *, add_special: bool = True) -> tuple[int, ...]:
        """Token ids of ``text`` under the server's model."""
        request = build(Tokenize, id=self.new_id(), text=text, add_special=add_special)
        return (await self._call(request, TokenizeReply)).tokens

    async def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` under the server's model."""
        request = build(Detokenize, id=self.new_id(), tokens=tuple(tokens))
        return (await self._call(request, DetokenizeReply)).text

    async def _call(self, request: Request, reply_type: type[R],
                    reply_id: str | None = None) -> R:
        """Send a single-reply request and wait for its reply (or error); the reply
        carries ``reply_id`` (default: the request's id)."""
        key = reply_id or request.id
        receive = self._register(key)
        try:
            await self._send(request)
            try:
                item = await receive.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                raise self._closed_error(key) from None
        finally:
            self._unregister(key)
            receive.close()
        if isinstance(item, reply_type):
            return item
        if isinstance(item, ProtocolError):
            raise item
        if isinstance(item, ErrorMessage):
            raise error_from_message(item)
        raise InternalError(
            f"unexpected {item.OP} frame in reply to {request.OP}", request_id=request.id
        )

    # ------------------------------------------------------------------ plumbing

    def _closed_error(self, request_id: str | None) -> ProtocolError:
        fatal = self._fatal or ConnectionClosed("connection closed")
        return fatal.with_request_id(request_id)

    def _register(self, request_id: str) -> MemoryObjectReceiveStream[_Item]:
        if self._fatal is not None:
            raise self._closed_error(request_id)
        if request_id in self._pending or self._conn.in_flight(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        send, receive = anyio.create_memory_object_stream[_Item](math.inf)
        self._pending[request_id] = send
        return receive

    def _unregister(self, request_id: str) -> None:
        send = self._pending.pop(request_id, None)
        if send is not None:
            send.close()

    def _fail_all(self, error: ProtocolError) -> None:
        pending, self._pending = self._pending, {}
        for request_id, send in pending.items():
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                send.send_nowait(error.with_request_id(request_id))
            send.close()

    async def _send(self, msg: Request) -> None:
        """Write one frame (whole, or not at all; see FrameWriter)."""
        if self._fatal is not None:
            raise self._closed_error(msg.id)
        failure = await self._writer.write(self._conn.send(msg))
        if failure is None:
            return
        if isinstance(failure, TimeoutError):
            self._fatal = ConnectionClosed("timed out writing to the server")
            self._fail_all(self._fatal)
            await self._close_stream()
            raise self._closed_error(msg.id)
        self._fatal = self._fatal or ConnectionClosed(f"connection lost: {failure}")
        raise self._closed_error(msg.id) from failure

    async def _next_event(self) -> ClientEvent:
        """The connection's next event, reading the stream as needed."""
        while (event := self._conn.next_event()) is None:
            if self._conn.state is State.CLOSED:
                return Failed(self._conn.error or ConnectionClosed("connection closed"))
            try:
                data = await self._receiver.receive()
            except anyio.EndOfStream:
                data = b""
            self._conn.receive_data(data)
        return event

    async def _close_stream(self) -> None:
        await self._receiver.aclose()

    async def _handshake(self) -> Welcome:
        hello = Hello(
            id=self.new_id(),
            protocol_version=self._protocol_version,
            client_name=self._client_name,
        )
        sent: BaseException | None = None
        try:
            await self._send(hello)
        except TRANSPORT_ERRORS as exc:
            # A server that refuses the connection (too many connections) answers and
            # closes at once, maybe before our hello is written: its answer says why.
            sent = exc
        try:
            event = await self._next_event()
            while isinstance(event, Stray):  # a malformed frame naming another id
                event = await self._next_event()
        except TRANSPORT_ERRORS as exc:
            raise ConnectionClosed(f"connection lost during handshake: {sent or exc}") from exc
        if sent is not None and (
            isinstance(event, Reply) or isinstance(event.error, ConnectionClosed)
        ):
            raise ConnectionClosed(f"connection lost during handshake: {sent}") from sent
        if isinstance(event, Failed):
            raise event.error
        assert isinstance(event, Reply) and isinstance(event.item, Welcome)
        return event.item

    def _deliver(self, request_id: str, item: _Item) -> bool:
        send = self._pending.get(request_id)
        if send is None:
            return False
        try:
            send.send_nowait(item)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True

    async def _read_loop(self) -> None:
        try:
            while True:
                event = await self._next_event()
                if isinstance(event, Failed):
                    # The end of the stream, or an error frame without an id (the
                    # server could not tell which request failed, so none of them can
                    # be trusted to complete): everything pending fails with it.
                    self._fatal = event.error
                    return
                if isinstance(event, Reply):
                    self._deliver(event.request_id, event.item)
                # A Stray answers nothing in flight: dropped. Frames for a request
                # nobody listens to any more (late tokens after a cancel) are dropped
                # by _deliver.
        except TRANSPORT_ERRORS as exc:
            self._fatal = self._fatal or ConnectionClosed(f"connection lost: {exc}")


@asynccontextmanager
async def connect_unix(
    path: str | os.PathLike[str],
    *,
    client_name: str = DEFAULT_CLIENT_NAME,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    protocol_version: int = PROTOCOL_VERSION,
    connect_timeout: float | None = 10.0,
) -> AsyncIterator[Client]:
    """Same as :meth:`Client.connect`: ``async with connect_unix(path) as client``."""
    async with Client.connect(
        path,
        client_name=client_name,
        max_frame_size=max_frame_size,
        protocol_version=protocol_version,
        connect_timeout=connect_timeout,
    ) as client:
        yield client
