"""The HTTP endpoints: which path and method does what.

``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (OpenAI's
API, streamed or not), ``GET /v1/models`` and ``GET /v1/models/{id}``; llama-server's
un-prefixed ``/chat/completions`` and ``/models`` (aliases), its own ``/completion`` and
``/completions`` (its native shape), its input-token counts and its extras
(``/tokenize``, ``/detokenize``, ``/apply-template``, ``GET /props``, ``GET /slots``) and
resumable streams (``GET`` / ``DELETE /v1/stream``, ``POST /v1/streams/lookup``);
``GET /health`` and ``GET /metrics`` (Prometheus). ``HEAD`` is served wherever ``GET`` is
(and on every error), as HTTP says: the same status and headers, no body. Every error
is OpenAI's error object with a 4xx/5xx status, counted by code like the native
protocol's errors; the connection stays usable.
"""

from __future__ import annotations

import functools
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Final

import attrs
from structlog.typing import FilteringBoundLogger

from meshd.daemon.frontends.http.completions import serve_completion, served_name
from meshd.daemon.frontends.http.input_tokens import chat_input_tokens, responses_input_tokens
from meshd.daemon.frontends.http.llama import extras as llama_extras
from meshd.daemon.frontends.http.llama.completion import serve_llama_completion
from meshd.daemon.frontends.http.llama.slots import slots
from meshd.daemon.frontends.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from meshd.daemon.frontends.http.metrics import render_metrics
from meshd.daemon.frontends.http.ollama import routes as ollama
from meshd.daemon.frontends.http.ollama.answers import error_object
from meshd.daemon.frontends.http.openai.api import parse_request
from meshd.daemon.frontends.http.openai.responses import serve_response
from meshd.daemon.frontends.http.responder import Responder
from meshd.daemon.frontends.http.stream_routes import delete_stream, follow_stream, lookup_streams
from meshd.daemon.frontends.http.stream_sessions import (
    MAX_ID_LENGTH,
    RecordingResponder,
    StreamSessions,
)
from meshd.daemon.models.model_set import NoSuchModel, ServedModel
from meshd.daemon.requests.api_errors import JSON, ApiError, error_body, json_bytes
from meshd.daemon.requests.service import Service
from meshd.protocol import Health, ProtocolError

__all__ = ["Routes"]

_Handler = Callable[["Routes", bytes, Responder], Awaitable[None]]


class Routes:
    """Dispatches one complete request to its endpoint."""

    def __init__(self, service: Service, log: FilteringBoundLogger,
                 streams: StreamSessions | None = None) -> None:
        self.service = service
        self.log = log
        #: The daemon's resumable streams (:mod:`.stream_sessions`).
        self.streams = streams if streams is not None else StreamSessions()
        #: Who owns the streams the current request makes or asks for
        #: (:func:`.stream_sessions.stream_owner`; set by :meth:`handle`).
        self.owner = ""

    async def handle(self, method: str, target: str, body: bytes, out: Responder, *,
                     conversation: str | None = None, owner: str = "") -> None:
        """Answer one request of ``owner`` (:func:`.stream_sessions.stream_owner`: the
        peer whose streams it may see); ``conversation`` (its ``X-Conversation-Id``)
        makes a streamed answer resumable."""
        self.owner = owner
        path, _, query = target.partition("?")
        t0 = time.perf_counter()
        status = 200
        allowed: str | None = None
        recording: RecordingResponder | None = None
        ollama_api = path.startswith(ollama.PREFIX)  # (its errors in Ollama's shape)
        if conversation and len(conversation) <= MAX_ID_LENGTH and method == "POST":
            refuse = functools.partial(self.error, out, ollama_api=ollama_api)
            out = recording = RecordingResponder(out, self.streams, conversation,
                                                 owner=owner, refuse=refuse)
        try:
            route = _route(path, query, method)
            if route is None:
                raise ApiError(404, f"no endpoint {path}; see /v1/completions, "
                                    "/v1/chat/completions, /v1/responses, /v1/models, "
                                    "/completion, /tokenize, /detokenize, /apply-template, "
                                    "/props, /slots, "
                                    "/health, /metrics", code="not_found")
            allowed, handler = route
            if allowed == "GET":  # HEAD: the GET's answer (the connection drops its body)
                allowed = "GET, HEAD"
            if method not in allowed.split(", "):
                raise ApiError(405, f"{path} accepts {allowed}, not {method}",
                               code="method_not_allowed")
            try:
                await handler(self, body, out)
            finally:
                if recording is not None:
                    recording.close()
                    if recording.refused is not None:
                        status = recording.refused.status
        except ApiError as exc:
            status = exc.status
            await self.error(out, exc, allow=allowed if status == 405 else None,
                             ollama_api=ollama_api)
        except ProtocolError as exc:  # a model that could not be held (llama-server's extras)
            api = ApiError.from_protocol(exc)
            status = api.status
            await self.error(out, api, ollama_api=ollama_api)
        except Exception:
            # A bug must cost this request only; once a stream has begun the error
            # cannot be sent and the connection closes instead.
            self.log.exception("request_crashed", path=path)
            status = 500
            await self.error(out, ApiError(500, "internal error", code="internal",
                                           kind="server_error"), ollama_api=ollama_api)
        self.log.info("http_request", method=method, path=path, status=status,
                      ms=round((time.perf_counter() - t0) * 1e3, 2))

    async def error(self, out: Responder, exc: ApiError, *, allow: str | None = None,
                    ollama_api: bool = False) -> None:
        """Answer with OpenAI's error object (Ollama's on its ``/api/`` paths); counted
        like native protocol errors."""
        code = _COUNTED_AS.get(exc.code, exc.code)
        code = code if code in _PROTOCOL_CODES else "bad_request"
        self.service.counters[f"errors_{code}"] += 1
        self.log.info("request_rejected", code=exc.code, status=exc.status, field=exc.param)
        self.log.debug("request_rejected_message", message=exc.message)
        headers = [("Allow", allow)] if allow else []
        body = error_object(exc.message) if ollama_api else error_body(exc)
        await out.send(exc.status, json_bytes(body), JSON, headers)

    async def _completions(self, body: bytes, out: Responder) -> None:
        await serve_completion(self, parse_request(body, chat=False), out)

    async def _chat(self, body: bytes, out: Responder) -> None:
        req = parse_request(body, chat=True)
        # Known once the model has been loaded (else its template is checked as it renders).
        info = self.service.models.get(served_name(self.service, req.model)).info
        if info is not None and not info.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions",
                           param="messages")
        await serve_completion(self, req, out)

    async def _responses(self, body: bytes, out: Responder) -> None:
        await serve_response(self, body, out)

    def _model_object(self, served: ServedModel) -> dict[str, object]:
        info = self.service.info(served)
        names = dict.fromkeys((info.name, *served.plan.aliases))  # every name it answers to
        return {"id": info.name, "object": "model", "created": int(self.service.started_at),
                "owned_by": "meshd", "aliases": list(names), "tags": list(served.plan.tags),
                "meta": attrs.asdict(info)}

    async def _models(self, _body: bytes, out: Responder) -> None:
        data = [self._model_object(m) for m in self.service.models]
        await out.send(200, json_bytes({"object": "list", "data": data}), JSON)

    async def _model(self, _body: bytes, out: Responder, *, model_id: str) -> None:
        """``GET /v1/models/{id}``: a served model, or OpenAI's 404 for another id."""
        try:
            served = self.service.models.get(model_id)
        except NoSuchModel:
            raise ApiError(404, f"The model {model_id!r} does not exist; this daemon serves "
                                f"{', '.join(map(repr, self.service.models.models))}",
                           param="model", code="model_not_found") from None
        await out.send(200, json_bytes(self._model_object(served)), JSON)

    async def _tokenize(self, body: bytes, out: Responder) -> None:
        await llama_extras.tokenize(self.service, body, out)

    async def _detokenize(self, body: bytes, out: Responder) -> None:
        await llama_extras.detokenize(self.service, body, out)

    async def _apply_template(self, body: bytes, out: Responder) -> None:
        await llama_extras.apply_template(self.service, body, out)

    async def _props(self, body: bytes, out: Responder) -> None:
        await llama_extras.props(self.service, body, out)

    async def _lookup_streams(self, body: bytes, out: Responder) -> None:
        await lookup_streams(self.streams, self.owner, body, out)

    async def _health(self, _body: bytes, out: Responder) -> None:
        svc = self.service
        health = svc.health(Health(id="http"))
        await out.send(503 if svc.draining else 200, json_bytes({
            "status": health.status.value, "uptime_s": health.uptime_s,
            "active_requests": health.active_requests,
            "queued_requests": health.queued_requests,
            "models": health.models,
        }), JSON)

    async def _metrics(self, _body: bytes, out: Responder) -> None:
        await out.send(200, render_metrics(self.service), METRICS_CONTENT_TYPE)


_PROTOCOL_CODES: Final = frozenset(
    {"bad_request", "unsupported_version", "too_large", "busy", "model_error", "cancelled",
     "internal", "unknown_model"})

_COUNTED_AS: Final = {"context_length_exceeded": "model_error",
                      "model_not_found": "unknown_model"}
"""OpenAI's codes that the native protocol names otherwise (for the error counters)."""

_ROUTES: Final[dict[str, tuple[str, _Handler]]] = {
    "/v1/completions": ("POST", Routes._completions),
    "/v1/chat/completions": ("POST", Routes._chat),
    "/v1/responses": ("POST", Routes._responses),
    "/v1/models": ("GET", Routes._models),
    # llama-server's un-prefixed aliases
    "/completions": ("POST", serve_llama_completion),  # llama-server's own, not OpenAI's
    "/completion": ("POST", serve_llama_completion),
    "/chat/completions": ("POST", Routes._chat),
    "/responses": ("POST", Routes._responses),
    "/models": ("GET", Routes._models),
    # llama-server's extras
    "/tokenize": ("POST", Routes._tokenize),
    "/detokenize": ("POST", Routes._detokenize),
    "/apply-template": ("POST", Routes._apply_template),
    "/props": ("GET", Routes._props),
    "/v1/chat/completions/input_tokens": ("POST", chat_input_tokens),
    "/chat/completions/input_tokens": ("POST", chat_input_tokens),
    "/v1/responses/input_tokens": ("POST", responses_input_tokens),
    "/responses/input_tokens": ("POST", responses_input_tokens),
    "/v1/streams/lookup": ("POST", Routes._lookup_streams),
    "/health": ("GET", Routes._health),
    "/metrics": ("GET", Routes._metrics),
}
_MODEL_PREFIXES: Final = ("/v1/models/", "/models/")


def _route(path: str, query: str, method: str) -> tuple[str, _Handler] | None:
    """The method and handler of ``path``; ``/v1/models/{id}`` carries its (URL-encoded)
    id to the handler, ``/slots`` and ``/v1/stream`` their query; Ollama's ``/api/``
    paths are :mod:`.ollama.routes`'."""
    if path.startswith(ollama.PREFIX):
        return ollama.route(path, method)
    route = _ROUTES.get(path)
    if route is not None:
        return route
    if path == "/v1/stream":
        if method == "DELETE":
            return "DELETE", lambda r, _b, out: delete_stream(r.streams, r.owner, query, out)
        return "GET", lambda r, _b, out: follow_stream(r.streams, r.owner, query, out)
    if path == "/slots":
        return "GET", functools.partial(slots, query=query)
    for prefix in _MODEL_PREFIXES:
        if path.startswith(prefix) and len(path) > len(prefix):
            model_id = urllib.parse.unquote(path.removeprefix(prefix))
            return "GET", functools.partial(Routes._model, model_id=model_id)
    return None
