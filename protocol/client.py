"""Clients for the meshd socket: an async one (anyio) and a blocking wrapper.

Why this shape: one connection carries many concurrent requests, so exactly one task
reads the socket and hands each frame to the request with that ``id`` (through an
in-memory stream per request). In keeping with structured concurrency that reader runs
in a task group owned by whoever owns the connection: :meth:`Client.connect` (an async
context manager) or, for code that manages its own task group, ``await tg.start(client.run)``.
Nothing is left running when the owner exits.

Usage::

    async with Client.connect("/run/meshd.sock") as client:
        async with client.generate("Once upon a time", max_tokens=32) as stream:
            async for token in stream:
                print(token.text, end="")
        print(stream.done.finish_reason)

Leaving the ``async with`` of a stream before ``done`` sends ``cancel``. Errors the
server reports arrive as the matching :class:`~meshd.protocol.errors.ProtocolError`
subclass; a lost connection as :class:`~meshd.protocol.errors.ConnectionClosed`.

:class:`SyncClient` runs the same client on an event loop in a helper thread (an anyio
blocking portal) for scripts and ``meshctl``.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import sys
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager, suppress
from typing import Any, Final, Self, TypeAlias, TypeVar

import anyio
import anyio.abc
import anyio.from_thread
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .codec import ResponseDecoder, encode
from .errors import (
    BadRequest,
    ConnectionClosed,
    InternalError,
    ProtocolError,
    UnsupportedVersion,
)
from .messages import (
    DEFAULT_MAX_FRAME_SIZE,
    PROTOCOL_VERSION,
    Cancel,
    CancelReply,
    ChatMessage,
    Detokenize,
    DetokenizeReply,
    Done,
    ErrorMessage,
    Generate,
    Health,
    HealthReply,
    Hello,
    ModelInfo,
    Models,
    ModelsReply,
    Request,
    Response,
    SamplingParams,
    SpeculativeOverrides,
    Stats,
    StatsReply,
    Token,
    Tokenize,
    TokenizeReply,
    Welcome,
    error_from_message,
)
from .transport import StreamReceiver

__all__ = [
    "Client",
    "Completion",
    "GenerationStream",
    "SyncClient",
    "SyncGenerationStream",
    "connect_sync",
    "connect_unix",
]

DEFAULT_CLIENT_NAME: Final = "meshd.protocol"
SEND_TIMEOUT: Final = 30.0
"""Longest a single frame write may take before the connection is declared broken."""

R = TypeVar("R", bound=Response)
_Item: TypeAlias = Response | ProtocolError

_TRANSPORT_ERRORS: Final = (
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
    OSError,
)


def _sampling(
    base: SamplingParams | None,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    seed: int | None,
) -> SamplingParams:
    """Merge individual keyword overrides into a SamplingParams."""
    params = base or SamplingParams()
    changes: dict[str, Any] = {}
    if temperature is not None:
        changes["temperature"] = temperature
    if top_k is not None:
        changes["top_k"] = top_k
    if top_p is not None:
        changes["top_p"] = top_p
    if seed is not None:
        changes["seed"] = seed
    return attrs.evolve(params, **changes) if changes else params


M = TypeVar("M")


def _build(cls: Callable[..., M], **fields: Any) -> M:
    """A request message; a bad value raises BadRequest with the field's full path
    (``detokenize.tokens[0]: ...``), as the server would write it."""
    try:
        return cls(**fields)
    except BadRequest as exc:
        raise exc.under(getattr(cls, "OP", "request")) from None


def _chat(
    messages: Sequence[ChatMessage | Mapping[str, str]] | None,
) -> tuple[ChatMessage, ...] | None:
    if messages is None:
        return None
    out = []
    for i, m in enumerate(messages):
        try:
            out.append(m if isinstance(m, ChatMessage)
                       else ChatMessage(role=m["role"], content=m["content"]))
        except BadRequest as exc:
            raise exc.under(f"messages[{i}]") from None
    return tuple(out)


@attrs.frozen
class Completion:
    """A whole generation, as returned by :meth:`GenerationStream.collect`."""

    text: str
    token_ids: tuple[int, ...]
    done: Done


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
        return Completion(text=self.text, token_ids=self.token_ids, done=self.done)


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
        self._send_timeout = send_timeout
        self._decoder = ResponseDecoder(max_frame_size)
        self._send_lock = anyio.Lock()
        self._pending: dict[str, MemoryObjectSendStream[_Item]] = {}
        self._ids = itertools.count(1)
        self._id_prefix = f"c{os.getpid():x}-"
        self._fatal: ProtocolError | None = None
        self._welcome: Welcome | None = None
        self._peer_max_frame_size = DEFAULT_MAX_FRAME_SIZE
        # Reads go through StreamReceiver to avoid anyio's asyncio cancellation race
        # (see transport.py); it also wakes the reader when the stream is closed.
        self._receiver = StreamReceiver(stream)

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
        if self._welcome is None:
            raise RuntimeError("the client has not completed its handshake")
        return self._welcome

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
    ) -> GenerationStream:
        """Start a generation; returns the stream of its tokens (not yet sent).

        Pass ``prompt`` or chat ``messages`` (dicts with ``role``/``content`` are fine).
        Sampling keywords override ``sampling`` (default: SamplingParams()); ``stop`` is
        a list of strings (a lone string counts as one); ``proposer`` (a name, or
        ``"off"``) and ``draft_max`` override speculative decoding.
        Invalid values raise BadRequest here, before anything is sent.
        """
        # Errors name the field's path as the server's do: generate.sampling.top_p: ...
        try:
            params = _sampling(sampling, temperature, top_k, top_p, seed)
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
                messages=_chat(messages),
                max_tokens=max_tokens,
                sampling=params,
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
                speculative=speculative,
            )
        except BadRequest as exc:
            raise exc.under("generate") from None
        return GenerationStream(self, request)

    async def cancel(self, request_id: str) -> None:
        """Ask the server to cancel a running request (its stream ends ``cancelled``)."""
        await self._send(_build(Cancel, id=request_id))

    async def cancel_confirmed(self, request_id: str) -> bool:
        """Cancel and wait for the server's answer: whether a request with that id was in
        flight (on any connection) and is now told to stop."""
        request = _build(Cancel, id=request_id, ack=self.new_id())
        assert request.ack is not None
        return (await self._call(request, CancelReply, reply_id=request.ack)).cancelled

    async def stats(self) -> StatsReply:
        """Daemon-wide counters and per-proposer acceptance."""
        return await self._call(Stats(id=self.new_id()), StatsReply)

    async def health(self) -> HealthReply:
        """Status, uptime and load."""
        return await self._call(Health(id=self.new_id()), HealthReply)

    async def models(self) -> tuple[ModelInfo, ...]:
        """The loaded models."""
        return (await self._call(Models(id=self.new_id()), ModelsReply)).models

    async def tokenize(self, text: str, *, add_special: bool = True) -> tuple[int, ...]:
        """Token ids of ``text`` under the server's model."""
        request = _build(Tokenize, id=self.new_id(), text=text, add_special=add_special)
        return (await self._call(request, TokenizeReply)).tokens

    async def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` under the server's model."""
        request = _build(Detokenize, id=self.new_id(), tokens=tuple(tokens))
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
        if request_id in self._pending:
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
        """Write one frame. Serialised by a lock; never leaves half a frame behind."""
        if self._fatal is not None:
            raise self._closed_error(msg.id)
        data = encode(msg, max_frame_size=self._peer_max_frame_size)
        async with self._send_lock:
            if self._fatal is not None:
                raise self._closed_error(msg.id)
            # Shielded so a cancellation cannot cut a frame in half (the stream would be
            # garbage from then on); bounded so a peer that stops reading cannot hang us.
            with anyio.CancelScope(shield=True) as scope:
                scope.deadline = anyio.current_time() + self._send_timeout
                try:
                    await self._stream.send(data)
                except _TRANSPORT_ERRORS as exc:
                    self._fatal = self._fatal or ConnectionClosed(f"connection lost: {exc}")
                    raise self._closed_error(msg.id) from exc
            if scope.cancelled_caught:
                self._fatal = ConnectionClosed("timed out writing to the server")
                self._fail_all(self._fatal)
                await self._close_stream()
                raise self._closed_error(msg.id)

    async def _receive_one(self) -> Response | None:
        """The next well-formed response, or None at end of stream.

        A malformed frame that names a request fails just that request; one that does
        not is fatal (raised), since we cannot tell whose answer went missing.
        """
        eof = False
        while True:
            try:
                msg = self._decoder.next_message()
            except ProtocolError as exc:
                error = InternalError(
                    f"server sent an invalid frame: {exc.message}", request_id=exc.request_id
                )
                if exc.request_id is None:
                    raise error from exc
                self._deliver(exc.request_id, error)
                continue
            if msg is not None:
                return msg
            if eof:
                return None
            try:
                data = await self._receiver.receive()
            except anyio.EndOfStream:
                self._decoder.feed_eof()
                eof = True
                continue
            self._decoder.feed(data)

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
        except _TRANSPORT_ERRORS as exc:
            # A server that refuses the connection (too many connections) answers and
            # closes at once, maybe before our hello is written: its answer says why.
            sent = exc
        try:
            reply = await self._receive_one()
        except _TRANSPORT_ERRORS as exc:
            raise ConnectionClosed(f"connection lost during handshake: {sent or exc}") from exc
        if sent is not None and not isinstance(reply, ErrorMessage):
            raise ConnectionClosed(f"connection lost during handshake: {sent}") from sent
        if reply is None:
            raise ConnectionClosed("server closed the connection during the handshake")
        if isinstance(reply, ErrorMessage):
            raise error_from_message(reply)
        if not isinstance(reply, Welcome) or reply.id != hello.id:
            raise InternalError(f"expected welcome for {hello.id!r}, got {reply.OP}")
        if reply.protocol_version != self._protocol_version:
            raise UnsupportedVersion(
                f"server speaks protocol {reply.protocol_version}, "
                f"client speaks {self._protocol_version}",
                request_id=hello.id,
            )
        self._welcome = reply
        self._peer_max_frame_size = reply.max_frame_size
        return reply

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
                msg = await self._receive_one()
                if msg is None:
                    self._fatal = ConnectionClosed("server closed the connection")
                    return
                if msg.id is None:
                    # Only error frames may lack an id: the server could not tell which
                    # request failed, so none of them can be trusted to complete.
                    assert isinstance(msg, ErrorMessage)
                    self._fatal = error_from_message(msg)
                    return
                # Frames for ids nobody waits on (late tokens after a cancel) are dropped.
                self._deliver(msg.id, msg)
        except ProtocolError as exc:
            self._fatal = exc
        except _TRANSPORT_ERRORS as exc:
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


# ------------------------------------------------------------------------ blocking


T = TypeVar("T")


class SyncGenerationStream:
    """Blocking iterator over a generation's tokens (see :class:`GenerationStream`).

    Use ``with``: leaving it early sends ``cancel``.
    """

    def __init__(self, portal: anyio.from_thread.BlockingPortal, stream: GenerationStream):
        self._portal = portal
        self._stream = stream

    @property
    def id(self) -> str:
        return self._stream.id

    @property
    def done(self) -> Done | None:
        return self._stream.done

    @property
    def text(self) -> str:
        return self._stream.text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self._stream.token_ids

    def __enter__(self) -> Self:
        self._portal.call(self._stream.start)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Token:
        token = self._portal.call(_next_or_none, self._stream)
        if token is None:
            raise StopIteration
        return token

    def cancel(self) -> None:
        """Ask the server to stop; keep iterating to receive the ``cancelled`` done."""
        self._portal.call(self._stream.cancel)

    def close(self) -> None:
        """Stop listening; send ``cancel`` if the generation is still running."""
        self._portal.call(self._stream.aclose)

    def collect(self) -> Completion:
        """Consume the stream and return the whole generation."""
        return self._portal.call(self._stream.collect)


async def _next_or_none(stream: GenerationStream) -> Token | None:
    # StopAsyncIteration is turned into None so it never has to cross the portal.
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


class SyncClient:
    """Blocking client: the async :class:`Client` on an event loop in a helper thread.

    ::

        with SyncClient.connect("/run/meshd.sock") as client:
            for token in client.generate("Hello", max_tokens=16):
                print(token.text, end="")
            print(client.health().status)
    """

    def __init__(
        self,
        portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal],
        portal: anyio.from_thread.BlockingPortal,
        client_cm: AbstractContextManager[Client],
        client: Client,
    ) -> None:
        self._portal_cm = portal_cm
        self._portal = portal
        self._client_cm = client_cm
        self._client = client
        self._closed = False

    @classmethod
    def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        client_name: str = DEFAULT_CLIENT_NAME,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        protocol_version: int = PROTOCOL_VERSION,
        connect_timeout: float | None = 10.0,
        backend: str = "asyncio",
    ) -> SyncClient:
        """Connect and handshake; ``backend`` is the anyio backend of the helper loop."""
        portal_cm = anyio.from_thread.start_blocking_portal(backend)
        portal = portal_cm.__enter__()
        try:
            client_cm = portal.wrap_async_context_manager(
                Client.connect(
                    path,
                    client_name=client_name,
                    max_frame_size=max_frame_size,
                    protocol_version=protocol_version,
                    connect_timeout=connect_timeout,
                )
            )
            client = client_cm.__enter__()
        except BaseException:
            portal_cm.__exit__(*sys.exc_info())
            raise
        return cls(portal_cm, portal, client_cm, client)

    def close(self) -> None:
        """Close the connection and stop the helper thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._client_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()

    @property
    def welcome(self) -> Welcome:
        return self._client.welcome

    def _call(self, func: Callable[..., Awaitable[T]], *args: object) -> T:
        """Run ``func(*args)`` on the client's loop thread and wait for its result."""
        if self._closed:
            raise ConnectionClosed("client closed")
        return self._portal.call(func, *args)

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
    ) -> SyncGenerationStream:
        """Like :meth:`Client.generate`; returns a blocking iterator of tokens."""
        if self._closed:
            raise ConnectionClosed("client closed")
        stream = self._client.generate(
            prompt,
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            sampling=sampling,
            stop=stop,
            proposer=proposer,
            draft_max=draft_max,
            request_id=request_id,
        )
        return SyncGenerationStream(self._portal, stream)

    def cancel(self, request_id: str) -> None:
        """Ask the server to cancel a running request."""
        self._call(self._client.cancel, request_id)

    def cancel_confirmed(self, request_id: str) -> bool:
        """Cancel and return whether a request with that id was in flight."""
        return self._call(self._client.cancel_confirmed, request_id)

    def stats(self) -> StatsReply:
        """Daemon-wide counters and per-proposer acceptance."""
        return self._call(self._client.stats)

    def health(self) -> HealthReply:
        """Status, uptime and load."""
        return self._call(self._client.health)

    def models(self) -> tuple[ModelInfo, ...]:
        """The loaded models."""
        return self._call(self._client.models)

    def tokenize(self, text: str, *, add_special: bool = True) -> tuple[int, ...]:
        """Token ids of ``text`` under the server's model."""
        return self._call(functools.partial(self._client.tokenize, add_special=add_special), text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` under the server's model."""
        return self._call(self._client.detokenize, tokens)


@contextmanager
def connect_sync(
    path: str | os.PathLike[str],
    *,
    client_name: str = DEFAULT_CLIENT_NAME,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    protocol_version: int = PROTOCOL_VERSION,
    connect_timeout: float | None = 10.0,
    backend: str = "asyncio",
) -> Iterator[SyncClient]:
    """``with connect_sync(path) as client``: a SyncClient closed on exit."""
    client = SyncClient.connect(
        path,
        client_name=client_name,
        max_frame_size=max_frame_size,
        protocol_version=protocol_version,
        connect_timeout=connect_timeout,
        backend=backend,
    )
    try:
        yield client
    finally:
        client.close()
