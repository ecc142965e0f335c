"""``POST /v1/responses``: OpenAI's Responses API, served as a chat completion.

Why a re-shaping responder rather than a second pipeline: the request becomes the chat
request that asks the same (:mod:`.responses_format`), and :func:`.completions.serve_completion`
runs it exactly as it runs ``/v1/chat/completions`` (the held model, the scheduler,
tool-call parsing, cancellation when the client disconnects, the request log). Only the
answer differs, so it passes through :class:`_Reshaper`, which turns the chat answer
(or each batch of its stream) into the response object (or its typed events) on its way
to the client. meshd stores nothing: every response is as with ``store: false``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshd.daemon.frontends.http.completions import serve_completion, served_name
from meshd.daemon.frontends.http.openai.responses_format import (
    ResponsesRequest,
    call_item,
    event,
    message_item,
    new_id,
    outcome,
    parse_responses_request,
    response_object,
    response_usage,
    text_part,
    whole_response,
)
from meshd.daemon.frontends.http.responder import Responder, RouteContext
from meshd.daemon.requests.api_errors import JSON, ApiError, json_bytes

__all__ = ["ResponseEvents", "serve_response"]


async def serve_response(routes: RouteContext, body: bytes, out: Responder) -> None:
    """Answer a Responses API request; raises ApiError while nothing has been sent."""
    req = parse_responses_request(body)
    service = routes.service
    info = service.models.get(served_name(service, req.completion.model)).info
    if info is not None and not info.has_chat_template:
        raise ApiError(400, "this model has no chat template; use /v1/completions",
                       param="input")
    try:
        await serve_completion(routes, req.completion, _Reshaper(out, req))
    except ApiError as exc:
        raise req.renamed(exc) from None


class _Reshaper:
    """The responder the chat pipeline answers through: the chat completion (or each
    write of its stream) goes on to ``out`` as the Responses API's."""

    def __init__(self, out: Responder, req: ResponsesRequest) -> None:
        self._out = out
        self._req = req
        self._events = ResponseEvents(req.echo)
        self._live = True

    async def send(self, status: int, body: bytes, content_type: str,
                   headers: Sequence[tuple[str, str]] = ()) -> bool:
        if status == 200 and content_type == JSON:
            body = json_bytes(whole_response(json.loads(body), self._req.echo))
        return await self._out.send(status, body, content_type, headers)

    async def start(self, status: int, content_type: str,
                    headers: Sequence[tuple[str, str]] = ()) -> bool:
        self._live = await self._out.start(status, content_type, headers)
        return self._live

    async def write(self, data: bytes) -> bool:
        # (JSON has no raw newlines: a blank line ends each record)
        shaped = b"".join(self._events.feed(record) for record in data.split(b"\n\n")
                          if record)
        if shaped:
            self._live = await self._out.write(shaped)
        return self._live

    async def end(self) -> bool:
        return await self._out.end()

    def on_gone(self, callback: Callable[[], None]) -> None:
        self._out.on_gone(callback)


class ResponseEvents:
    """The chat stream's records (``data: {chunk}``, ``data: [DONE]``) as the Responses
    API's events: ``response.created`` and ``response.in_progress`` with the first (one
    more ``response.in_progress`` per later chunk with ``prompt_progress``); the
    message item and its text part opened with the first text, each text chunk a
    ``response.output_text.delta`` (with the chunk's ``timings``, if any); at ``[DONE]``
    the text, part and item closed, a ``function_call`` item per tool call, then
    ``response.completed`` (``incomplete``, or ``failed`` after an ``error`` event), with
    ``timings`` beside the response."""

    def __init__(self, echo: Mapping[str, Any]) -> None:
        self._echo = echo
        self._seq = 0
        self._rid = ""
        self._created = 0
        self._model = ""
        self._message: str | None = None  # the message item's id, once opened
        self._text: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self._extras: dict[str, Any] = {}
        self._error: dict[str, Any] | None = None
        self._output: list[dict[str, Any]] = []  # the items closed so far

    def feed(self, record: bytes) -> bytes:
        """The events for one record of the chat stream."""
        data = record.removeprefix(b"data: ")
        if data == b"[DONE]":
            return self._close()
        chunk = json.loads(data)
        if "error" in chunk:
            self._error = chunk["error"]
            return b""
        out = b""
        # llama-server's extras ride on events as on its own Responses streams:
        # ``prompt_progress`` on a ``response.in_progress``, ``timings`` on the text delta
        progress = {"prompt_progress": chunk["prompt_progress"]} \
            if "prompt_progress" in chunk else {}
        if not self._rid:
            self._rid, self._created, self._model = chunk["id"], chunk["created"], chunk["model"]
            out += self._emit("response.created", response=self._response("in_progress"))
            out += self._emit("response.in_progress", response=self._response("in_progress"),
                              **progress)
        elif progress:
            out += self._emit("response.in_progress", response=self._response("in_progress"),
                              **progress)
        if not chunk["choices"]:  # the usage chunk
            self._usage = chunk.get("usage")
            return out
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text:
            out += self._open_message()
            self._text.append(text)
            timed = {"timings": chunk["timings"]} if "timings" in chunk else {}
            out += self._emit("response.output_text.delta", item_id=self._message,
                              output_index=0, content_index=0, delta=text, logprobs=[],
                              **timed)
        self._calls += delta.get("tool_calls") or []
        if choice.get("finish_reason"):
            self._finish = choice["finish_reason"]
            self._extras = {k: chunk[k] for k in ("timings", "meshd") if k in chunk}
        return out

    def _emit(self, kind: str, **fields: Any) -> bytes:
        self._seq += 1
        return event(kind, self._seq - 1, **fields)

    def _response(self, status: str, **fields: Any) -> dict[str, Any]:
        return response_object(self._rid, self._created, self._model, status, self._echo,
                               list(self._output), **fields)

    def _open_message(self) -> bytes:
        if self._message is not None:
            return b""
        self._message = new_id("msg")
        return (self._emit("response.output_item.added", output_index=0,
                           item=message_item(self._message, "in_progress", []))
                + self._emit("response.content_part.added", item_id=self._message,
                             output_index=0, content_index=0, part=text_part("")))

    def _close(self) -> bytes:
        if self._error is not None or self._finish is None:
            failure = self._error or {"message": "the generation ended without a result",
                                      "code": "model_error", "param": None}
            message = failure.get("message")
            return (self._emit("error", code=failure.get("code"), message=message,
                               param=failure.get("param"))
                    + self._emit("response.failed", response=self._response(
                        "failed", error={"code": "server_error", "message": message})))
        status, incomplete, error = outcome(self._finish)
        out = b""
        if self._message is not None or not self._calls:
            out += self._open_message()
            text = "".join(self._text)
            item = message_item(self._message or "", "completed" if status == "completed"
                                else "incomplete", [text_part(text)])
            out += (self._emit("response.output_text.done", item_id=self._message,
                               output_index=0, content_index=0, text=text, logprobs=[])
                    + self._emit("response.content_part.done", item_id=self._message,
                                 output_index=0, content_index=0, part=text_part(text))
                    + self._emit("response.output_item.done", output_index=0, item=item))
            self._output.append(item)
        for call in self._calls:
            index = len(self._output)
            item = call_item(call)
            added = call_item(call, "in_progress", item_id=item["id"], arguments="")
            out += (self._emit("response.output_item.added", output_index=index, item=added)
                    + self._emit("response.function_call_arguments.delta", item_id=item["id"],
                                 output_index=index, delta=item["arguments"])
                    + self._emit("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=index, arguments=item["arguments"])
                    + self._emit("response.output_item.done", output_index=index, item=item))
            self._output.append(item)
        usage = response_usage(self._usage) if self._usage is not None else None
        # (the timings beside the response too, where llama-server's last event has them)
        timed = {"timings": self._extras["timings"]} if "timings" in self._extras else {}
        return out + self._emit(f"response.{status}", response=self._response(
            status, usage=usage, incomplete=incomplete, error=error, extras=self._extras),
            **timed)
