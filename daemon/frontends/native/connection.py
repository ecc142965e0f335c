"""One client connection: handshake, then many concurrent requests multiplexed by id.

Why this shape: one task reads the socket and dispatches each frame; every ``generate``
(and tokenizer request) gets its own task, so one long generation never delays a
``health`` or ``cancel`` on the same connection. The protocol's rules are kept by a
sans-I/O ``ServerConnection``; this class moves its bytes, runs the requests and applies
the daemon's limits, writing through one ``FrameWriter`` so frames never mix bytes.

Failures: a malformed frame is answered with ``error`` and the connection carries on
(only a bad first frame closes it); a peer that goes away cancels all its requests, but
a half-close still gets its answers (:mod:`.hangup` tells the two apart); a bug in one
request is reported to it as ``internal`` and never takes the daemon down. Resources are
bounded: an idle connection closes after ``idle_timeout_s``, a begun frame must end
within ``frame_timeout_s``, and a reply over the frame limit becomes ``too_large``.
"""

from __future__ import annotations

import math
import socket

import anyio
import anyio.abc
import anyio.lowlevel
import attrs
from structlog.typing import FilteringBoundLogger

from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.daemon.frontends.native.wire_tools import WireTools, calls_of, offered
from meshd.daemon.models.mapping import done_message, token_message
from meshd.daemon.models.scheduler import GenerationRequest
from meshd.daemon.requests.api_errors import ApiError
from meshd.daemon.requests.events import (
    Finished,
    GenerationFailed,
    GenerationHandle,
    TokenEvent,
    finish_reason,
    log_finished,
    receive_batch,
)
from meshd.daemon.requests.service import InFlightGeneration, Service, peer_owner
from meshd.daemon.requests.spec import RequestSpec
from meshd.daemon.system.hangup import POLL_INTERVAL_S, hung_up
from meshd.policy.decision import FinishReason
from meshd.protocol import (
    BadRequest,
    Cancel,
    CancelReply,
    ConnectionEnded,
    Detokenize,
    Done,
    FrameTooLarge,
    FrameWriter,
    Generate,
    Health,
    Hello,
    InternalError,
    Load,
    LocalProtocolError,
    ModelError,
    Models,
    PermissionDenied,
    ProtocolError,
    Rejected,
    Request,
    Response,
    ServerBusy,
    ServerConnection,
    Stats,
    StreamReceiver,
    Tokenize,
    Unload,
    error_message,
)

__all__ = ["Connection"]


class Connection:
    """Serves one accepted stream until the peer leaves or the daemon cancels it."""

    def __init__(self, stream: anyio.abc.ByteStream, service: Service, *, conn_id: int,
                 log: FilteringBoundLogger) -> None:
        self.stream = stream
        self.service = service
        self.config = service.config
        self.conn_id = conn_id
        self.log = log.bind(conn=conn_id)
        self.client_name: str | None = None
        self._receiver = StreamReceiver(stream)
        self._socket: socket.socket | None = stream.extra(
            anyio.abc.SocketAttribute.raw_socket, None
        )
        # The protocol's state (handshake, ids in flight, one final frame per request)
        # is sans-I/O; this class moves its bytes and runs the requests.
        self._conn = ServerConnection(self.config.max_frame_size)
        self._writer = FrameWriter(stream, timeout=self.config.send_timeout_s, shield=False)
        self._lost = False
        self._requests: dict[str, InFlightGeneration] = {}
        self._helpers = 0  # tokenizer requests running
        self._scope: anyio.CancelScope | None = None
        self._last_activity = anyio.current_time()
        self._frame_started: float | None = None  # when the current partial frame began
        self._eof = False  # the peer shut its sending side (or closed)
        self._request_ended = anyio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Handshake, then serve requests until EOF; closes the stream on the way out."""
        self.log.debug("connection_opened")
        try:
            if not await self._admit_peer():
                return
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                try:
                    if await self._handshake():
                        await self._serve(tg)
                        await self._answer_after_half_close()
                finally:
                    # The peer is gone (or we are being stopped): nobody will read the
                    # rest, so every request stops at its next step boundary.
                    self._cancel_all()
                    tg.cancel_scope.cancel()
        finally:
            await self._receiver.aclose()
            self.log.debug("connection_closed", client=self.client_name)

    async def _admit_peer(self) -> bool:
        """Check the peer's credentials against the allow-list; a refused peer gets one
        ``forbidden`` error frame (id null) and the connection closes."""
        if self.service.admits_peer(self._socket, self.log):
            return True
        error = PermissionDenied(
            "this daemon does not serve your user or groups (ask its administrator to add "
            "them to the allowed users or groups)")
        await self._send_bytes(self._conn.refuse(error))
        return False

    def close(self) -> None:
        """Stop serving (from any task of the event loop)."""
        self._cancel_all()
        if self._scope is not None:
            self._scope.cancel()

    def _cancel_all(self) -> None:
        for entry in list(self._requests.values()):
            entry.cancel()

    async def _answer_after_half_close(self) -> None:
        """The stream ended with requests in flight: the client may only have shut its
        sending side, so they run on and are answered, unless it hangs up."""
        if not self._eof or self._lost or not self._in_flight():
            return
        self.log.debug("client_half_closed", in_flight=self._in_flight())
        while self._in_flight() and not self._lost:
            if hung_up(self._socket):
                self.log.info("client_gone", in_flight=self._in_flight())
                return
            self._request_ended = anyio.Event()
            with anyio.move_on_after(POLL_INTERVAL_S):
                await self._request_ended.wait()

    def _ended(self) -> None:
        """A request in flight has ended (for :meth:`_answer_after_half_close`)."""
        self._last_activity = anyio.current_time()
        self._request_ended.set()

    # ------------------------------------------------------------------ reading

    async def _next(self, *, bounded: bool = False) -> Request | Rejected | None:
        """The next request or frame to reject; ``None`` once the peer has gone.

        ``bounded`` (after the handshake) applies the idle and partial-frame timeouts;
        ``None`` is then also returned when one of them closed the connection.
        """
        while (event := self._conn.next_event()) is None:
            with anyio.move_on_after(self._read_timeout() if bounded else math.inf):
                try:
                    data = await self._receiver.receive()
                except anyio.EndOfStream:
                    data = b""
                    self._eof = True
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return None
                self._conn.receive_data(data)
                self._note_received()
                continue
            if await self._timed_out():
                return None
        if isinstance(event, ConnectionEnded):
            return None
        self._last_activity = anyio.current_time()
        return event

    def _note_received(self) -> None:
        if self._conn.buffered == 0:
            self._frame_started = None
        elif self._frame_started is None:
            self._frame_started = anyio.current_time()

    def _in_flight(self) -> int:
        return len(self._requests) + self._helpers

    def _read_timeout(self) -> float:
        """Seconds until the next timeout could fire (re-checked by :meth:`_timed_out`)."""
        now = anyio.current_time()
        if self._frame_started is not None:
            return max(0.0, self._frame_started + self.config.frame_timeout_s - now)
        return max(0.0, self._last_activity + self.config.idle_timeout_s - now)

    async def _timed_out(self) -> bool:
        """Whether a timeout has closed the connection (False: keep reading)."""
        now = anyio.current_time()
        if self._frame_started is not None:
            if now < self._frame_started + self.config.frame_timeout_s:
                return False
            self.log.info("frame_timeout", buffered=self._conn.buffered)
            await self._reject(BadRequest(
                f"frame not completed within {self.config.frame_timeout_s:g} s; "
                "closing the connection"
            ))
            return True
        if self._in_flight():
            # Requests are running: the client waits for answers, that is not idleness.
            self._last_activity = now
            return False
        if now < self._last_activity + self.config.idle_timeout_s:
            return False
        self.log.info("idle_timeout", seconds=self.config.idle_timeout_s)
        return True

    async def _handshake(self) -> bool:
        """The first frame must be a ``hello`` we speak; anything else closes."""
        with anyio.move_on_after(self.config.hello_timeout_s):
            item = await self._next()
            if item is None:
                return False
            if isinstance(item, Rejected):
                # A proposer plugin's first frame is no request: the plugin host may
                # take the connection over.
                if (item.frame is not None and self._socket is not None
                        and await self.service.plugin_ingress(item.frame, self._socket)):
                    self.log.debug("plugin_connection")
                    return False
                await self._reject_frame(item)
                return False
            assert isinstance(item, Hello), "the first request admitted is a hello"
            try:
                welcome = self.service.welcome(item)
            except ProtocolError as exc:
                await self._reject(exc)
                return False
            self.client_name = item.client_name
            self.log.debug("client_hello", client=item.client_name)
            return await self._send(welcome)
        self.log.info("hello_timeout")
        return False

    async def _serve(self, tg: anyio.abc.TaskGroup) -> None:
        while (item := await self._next(bounded=True)) is not None:
            await self._dispatch(item, tg)

    async def _dispatch(self, item: Request | Rejected, tg: anyio.abc.TaskGroup) -> None:
        if isinstance(item, Rejected):
            # Malformed, a second hello, or a generate whose id is in flight.
            await self._reject_frame(item)
        elif isinstance(item, Generate):
            if self._busy():
                await self._reject(self._too_many(item.id))
            else:
                entry = InFlightGeneration(item.id, peer_owner(self._socket))
                self._requests[item.id] = entry
                self.service.register(entry)
                tg.start_soon(self._generate, item, entry)
        elif isinstance(item, Cancel):
            target = self._requests.get(item.id)
            found = target is not None
            if target is not None:
                target.cancel()
            elif self.service.cancel_anywhere(item.id):
                found = True
                self.log.info("request_cancelled_elsewhere", id=item.id)
            if item.ack is not None:
                await self._send(CancelReply(id=item.ack, cancelled=found))
        elif isinstance(item, Health):
            await self._send(self.service.health(item))
        elif isinstance(item, Stats):
            await self._send(self.service.stats(item))
        elif isinstance(item, Models):
            await self._send(self.service.list_models(item))
        elif isinstance(item, Tokenize | Detokenize | Load | Unload):
            if self._busy():
                await self._reject(self._too_many(item.id))
            else:
                self._helpers += 1
                tg.start_soon(self._helper_request, item)
        else:  # pragma: no cover - the connection only yields the request types above
            await self._reject(InternalError(f"unhandled {item.OP}", request_id=item.id))

    def _busy(self) -> bool:
        return self._in_flight() >= self.config.max_requests_per_connection

    def _too_many(self, request_id: str) -> ServerBusy:
        return ServerBusy(
            f"too many requests in flight on this connection "
            f"(limit {self.config.max_requests_per_connection})",
            request_id=request_id,
        )

    # ------------------------------------------------------------------ requests

    async def _helper_request(self, item: Tokenize | Detokenize | Load | Unload) -> None:
        """A request answered off the connection's loop (it may wait for a model)."""
        try:
            reply: Response
            if isinstance(item, Tokenize):
                reply = await self.service.tokenize(item)
            elif isinstance(item, Detokenize):
                reply = await self.service.detokenize(item)
            elif isinstance(item, Load):
                reply = await self.service.load(item)
            else:
                reply = await self.service.unload(item)
        except ProtocolError as exc:
            await self._reject(exc.with_request_id(item.id))
        except ValueError as exc:
            await self._reject(BadRequest(f"{item.OP}: {exc}", request_id=item.id))
        except Exception:
            self.log.exception("request_crashed", id=item.id, op=item.OP)
            await self._reject(InternalError(f"{item.OP} failed", request_id=item.id))
        else:
            await self._send(reply)
        finally:
            self._helpers -= 1
            self._ended()

    async def _generate(self, request: Generate, entry: InFlightGeneration) -> None:
        """Serve one ``generate``: prepare, submit, stream, finish. Never raises."""
        try:
            try:
                request, tools = offered(request)
                spec = RequestSpec.of(request) if tools is None else RequestSpec.of(
                    request, tools=tools.spec, conversation=tools.conversation)
                try:
                    gen = await self.service.start(spec, entry)
                except ApiError as exc:  # (what the model's template refused)
                    raise BadRequest(f"generate.{exc.message}") from None
            except ProtocolError as exc:
                await self._reject(exc.with_request_id(request.id))
                return
            if entry.handle is None:  # cancelled before it reached the scheduler
                await self._finish_early(request.id, gen, entry)
                return
            await self._stream(request.id, gen, entry.handle, entry, tools)
        except Exception:
            self.log.exception("request_crashed", id=request.id, op=request.OP)
            await self._reject(InternalError("generation failed", request_id=request.id))
        finally:
            if self._requests.get(request.id) is entry:
                del self._requests[request.id]
            self.service.unregister(entry)
            self._ended()

    async def _finish_early(self, request_id: str, gen: GenerationRequest,
                            entry: InFlightGeneration) -> None:
        """A request cancelled before it reached the scheduler still ends with ``done``."""
        stats = GenerationStats(prompt_tokens=len(gen.prompt))
        finish = finish_reason(FinishReason.CANCELLED, entry)
        await self._send(done_message(request_id, finish, stats, None,
                                      prompt_tokens=len(gen.prompt), sampling=gen.sampling,
                                      model=_model_name(entry)))
        self._log_finished(request_id, finish.value, stats, None, gen)

    async def _stream(self, request_id: str, gen: GenerationRequest, handle: GenerationHandle,
                      entry: InFlightGeneration, tools: WireTools | None = None) -> None:
        """Forward the scheduler's events as frames, coalescing what is already there;
        with ``tools``, ``done`` carries the calls read from the whole text."""
        frames_sent = 0
        text: list[str] = []
        async with handle.events:
            while True:
                batch = await receive_batch(handle)
                frames: list[bytes] = []
                final: Finished | GenerationFailed | None = None
                for event in batch:
                    if isinstance(event, TokenEvent):
                        frames.append(self._conn.send(token_message(request_id, event)))
                        if tools is not None:
                            text.append(event.text)
                    else:
                        final = event
                if final is not None:
                    done = self._final_message(
                        request_id, gen, handle, final, frames_sent + len(frames) > 0, entry)
                    if tools is not None and isinstance(done, Done):
                        done = attrs.evolve(done, tool_calls=calls_of(
                            tools, "".join(text), done.finish_reason.value))
                    frames.append(self._conn.send(done))
                if not await self._send_bytes(b"".join(frames)):
                    return
                frames_sent += len(frames)
                if final is not None:
                    return

    def _final_message(self, request_id: str, gen: GenerationRequest, handle: GenerationHandle,
                       final: Finished | GenerationFailed, streamed: bool,
                       entry: InFlightGeneration) -> Response:
        """``done`` for a finished generation; for a failed one, ``error`` if nothing was
        streamed yet, else ``done`` with ``finish_reason: error`` (PROTOCOL.md)."""
        if isinstance(final, Finished):
            finish = finish_reason(final.finish, entry)
            self._log_finished(request_id, finish.value, final.stats, final.proposer, gen)
            return done_message(request_id, finish, final.stats, final.proposer,
                                prompt_tokens=len(gen.prompt), sampling=gen.sampling,
                                model=_model_name(entry))
        error: ProtocolError = (
            BadRequest(f"generate: {final.message}", request_id=request_id)
            if final.kind == "request"
            else ModelError(final.message, request_id=request_id)
        )
        self._count_error(error)
        if not streamed:
            self.log.info("request_rejected", id=request_id, code=error.code.value)
            self.log.debug("request_rejected_message", id=request_id, message=error.message)
            return error_message(error)
        stats = final.stats or GenerationStats()
        ran = stats.proposer_that_ran(handle.proposer)
        self._log_finished(request_id, "error", stats, ran, gen)
        return done_message(request_id, FinishReason.ERROR, stats, ran,
                            prompt_tokens=len(gen.prompt),
                            error_message=final.message or "generation failed",
                            sampling=gen.sampling, model=_model_name(entry))

    def _log_finished(self, request_id: str, finish: str, stats: GenerationStats,
                      proposer: str | None, gen: GenerationRequest) -> None:
        log_finished(self.log, request_id, finish, stats, proposer, len(gen.prompt))

    # ------------------------------------------------------------------ writing

    async def _reject(self, error: ProtocolError) -> None:
        """Answer a request in flight (or the connection, id null) with an ``error``."""
        self._log_rejected(error)
        await self._send(error_message(error))

    async def _reject_frame(self, rejected: Rejected) -> None:
        """Answer a frame the connection did not admit with an ``error`` frame."""
        self._log_rejected(rejected.error)
        await self._send_bytes(self._conn.reject(rejected))

    def _log_rejected(self, error: ProtocolError) -> None:
        self._count_error(error)
        field = error.field if isinstance(error, BadRequest) else None
        self.log.info("request_rejected", id=error.request_id, code=error.code.value,
                      field=field)
        # The message may quote a value from the request, so it stays below info.
        self.log.debug("request_rejected_message", id=error.request_id, message=error.message)

    def _count_error(self, error: ProtocolError) -> None:
        self.service.counters[f"errors_{error.code.value}"] += 1

    async def _send(self, message: Response) -> bool:
        """Send one reply; one the peer could not read (above the announced frame limit)
        is replaced by a ``too_large`` error for its request, which ends it just the
        same."""
        try:
            data = self._conn.send(message)
        except LocalProtocolError:
            # A bug on this side (say, a second answer to one request): the peer must
            # not see it, the daemon must not die of it.
            self.log.exception("protocol_violation", id=message.id, op=message.OP)
            return True
        limit = self.config.max_frame_size
        if len(data) - 1 > limit:
            error = FrameTooLarge(
                f"{message.OP} would be {len(data) - 1} bytes, above the frame limit of "
                f"{limit}; send a smaller request", request_id=message.id,
            )
            self._count_error(error)
            self.log.info("reply_too_large", id=message.id, op=message.OP, size=len(data) - 1)
            data = self._conn.encode(error_message(error))
        return await self._send_bytes(data)

    async def _send_bytes(self, data: bytes) -> bool:
        """Write whole frames; on a dead peer, stop the connection and return False."""
        failure = await self._writer.write(data)
        if failure is None:
            return True
        if not self._lost:
            self._lost = True
            self.log.info("connection_lost", reason=type(failure).__name__)
            self.close()
        return False


def _model_name(entry: InFlightGeneration) -> str | None:
    """The name of the model that served the request (``done`` says it)."""
    return entry.model.name if entry.model is not None else None

