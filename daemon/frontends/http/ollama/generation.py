"""Serving Ollama's ``/api/chat`` and ``/api/generate``: the OpenAI pipeline, answered
in Ollama's NDJSON.

Why through :func:`~..completions.started`: the request becomes the same OpenAI request
(:mod:`.wire`), so it shares the one request lifecycle (limits, the scheduler,
cancellation on disconnect, shutdown, keep-alive) and gives the tokens the OpenAI and
native endpoints give. The model is held first, as Ollama loads it first: its load
time is the answer's ``load_duration``, its context bounds ``num_ctx`` and
``num_predict``, and its chat template decides how ``/api/generate`` renders the prompt.
An empty prompt (or chat) only loads the model, or with ``keep_alive`` 0 unloads it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs

from meshd.daemon.engine.logprobs import TokenLogprob
from meshd.daemon.frontends.http.completions import (
    Started,
    finish_reason_of,
    generation_failure,
    log_request_finished,
    started,
)
from meshd.daemon.frontends.http.json_body import json_object
from meshd.daemon.frontends.http.logprobs_format import logprobs_block
from meshd.daemon.frontends.http.ollama import answers
from meshd.daemon.frontends.http.ollama.models import resolve
from meshd.daemon.frontends.http.ollama.wire import (
    OllamaRequest,
    chat_request,
    generate_request,
    openai_body,
    renamed,
)
from meshd.daemon.frontends.http.openai.api import CompletionRequest, parse_request, tool_answer
from meshd.daemon.frontends.http.responder import Responder, RouteContext
from meshd.daemon.models.model_set import ServedModel
from meshd.daemon.requests.api_errors import JSON, ApiError, bad_field, json_bytes
from meshd.daemon.requests.events import Finished, GenerationFailed, receive_batch

__all__ = ["serve_chat", "serve_generate"]


async def serve_chat(routes: RouteContext, raw: bytes, out: Responder) -> None:
    """``POST /api/chat``."""
    await _serve(routes, chat_request(json_object(raw)), out)


async def serve_generate(routes: RouteContext, raw: bytes, out: Responder) -> None:
    """``POST /api/generate``."""
    await _serve(routes, generate_request(json_object(raw)), out)


@contextlib.asynccontextmanager
async def _holding(routes: RouteContext, req: OllamaRequest) -> AsyncIterator[ServedModel]:
    """The request's model, held (loaded first if need be) for the block, then left to
    the request's ``keep_alive``."""
    service = routes.service
    served = await service.hold(resolve(service, req.model), None)
    try:
        yield served
    finally:
        service.models.release(served, req.keep_alive)


async def _serve(routes: RouteContext, req: OllamaRequest, out: Responder) -> None:
    t0 = time.perf_counter()
    try:
        async with _holding(routes, req) as served:
            load_s = time.perf_counter() - t0
            model = req.model or answers.ollama_name(served.name)
            if req.load_only:
                reason = "unload" if req.keep_alive == 0 else "load"
                body = answers.chunk(req.endpoint, model, "", done=True)
                body["done_reason"] = reason
                await out.send(200, json_bytes(body), JSON)
                return
            creq = _openai_request(routes, req, served)
            async with started(routes, creq, out) as run:
                if run is None:  # the client left before it reached the scheduler
                    return
                answer = _Answer(routes, req, run, model, out, t0, load_s)
                await (answer.stream() if req.stream else answer.collect())
    except ApiError as exc:
        raise renamed(exc) from None


def _openai_request(routes: RouteContext, req: OllamaRequest, served: ServedModel
                    ) -> CompletionRequest:
    """The OpenAI request serving ``req`` on ``served`` (loaded and held)."""
    service = routes.service
    rt = served.runtime
    assert rt is not None
    n_ctx = rt.context.config.n_ctx_seq
    if req.num_ctx is not None and req.num_ctx > n_ctx:
        raise bad_field("options.num_ctx", f"meshd serves {served.name!r} with a context "
                                           f"of {n_ctx} tokens (its operator sets it: --ctx); "
                                           f"ask for at most that (got {req.num_ctx})")
    max_tokens = None if req.num_predict is None \
        else min(req.num_predict, service.max_tokens_limit(rt))  # (Ollama caps, never refuses)
    body, chat = openai_body(req, model=served.name, max_tokens=max_tokens,
                             chat_template=rt.model.info.has_chat_template)
    creq = parse_request(json_bytes(body), chat=chat)
    constraint = "format" if creq.constraint_param == "response_format" \
        else creq.constraint_param
    return attrs.evolve(creq, max_tokens_param="options.num_predict",
                        constraint_param=constraint)


class _Answer:
    """One generation's answer: collected into one object, or streamed as NDJSON."""

    def __init__(self, routes: RouteContext, req: OllamaRequest, run: Started, model: str,
                 out: Responder, t0: float, load_s: float) -> None:
        self.routes = routes
        self.req = req
        self.run = run
        self.model = model
        self.out = out
        self.t0 = t0
        self.load_s = load_s

    def logprobs(self, lps: list[TokenLogprob]) -> list[dict[str, Any]] | None:
        """Ollama's ``logprobs`` of these tokens (OpenAI chat's entries; an end-of-
        generation token, whose text the answer does not show, left out)."""
        if self.req.top_logprobs is None or not lps:
            return None
        rt = self.run.entry.model.runtime if self.run.entry.model is not None else None
        assert rt is not None
        model = rt.model
        eog = model.info.eog_tokens
        shown = [lp for lp in lps if lp.token not in eog]
        block = logprobs_block(shown, lambda t: model.tokenizer.piece(t, special=True),
                               chat=True)
        return block["content"] or None

    def ending(self, final: Finished, text: str) -> tuple[str, str, list[dict[str, Any]]]:
        """The finish (logged as the OpenAI endpoints log it), the content and the calls."""
        run = self.run
        finish = finish_reason_of(final, run.entry)
        log_request_finished(self.routes, run.req, final, finish, len(run.gen.prompt))
        content, calls = tool_answer(run.req, text, finish)
        return finish, content or "", answers.ollama_calls(calls)

    def last(self, final: Finished, finish: str, text: str, calls: list[dict[str, Any]],
             logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
        counts = answers.metrics(final.stats, prompt_tokens=len(self.run.gen.prompt),
                                 total_s=time.perf_counter() - self.t0, load_s=self.load_s)
        return answers.final(self.req.endpoint, self.model, text,
                             answers.done_reason(finish), counts, calls=calls,
                             logprobs=logprobs)

    async def collect(self) -> None:
        parts: list[str] = []
        lps: list[TokenLogprob] = []
        handle = self.run.handle
        async with handle.events:
            async for event in handle.events:
                if isinstance(event, GenerationFailed):
                    raise generation_failure(event)
                if isinstance(event, Finished):
                    finish, content, calls = self.ending(event, "".join(parts))
                    body = self.last(event, finish, content, calls, self.logprobs(lps))
                    await self.out.send(200, json_bytes(body), JSON)
                    return
                parts.append(event.text)
                lps.extend(event.logprobs)
        raise ApiError(500, "the generation ended without a result", code="internal",
                       kind="server_error")

    async def stream(self) -> None:
        """NDJSON: an object per batch of committed text, then (with tools) one with the
        calls, then the final one (``done`` true, empty text, the statistics). Text of a
        request that offered tools is held until the end (calls are known there). A
        failure after the first line is a last ``{"error": ...}`` line."""
        req, handle = self.req, self.run.handle
        tools = self.run.req.tools is not None
        live = True
        begun = False
        held: list[str] = []
        async with handle.events:
            while True:
                batch = await receive_batch(handle)
                final = batch[-1] if isinstance(batch[-1], Finished | GenerationFailed) \
                    else None
                if isinstance(final, GenerationFailed) and not begun:
                    raise generation_failure(final)
                if not begun:
                    begun = True
                    live = await self.out.start(200, answers.NDJSON,
                                                [("Cache-Control", "no-cache")])
                tokens = [e for e in batch if not isinstance(e, Finished | GenerationFailed)]
                text = "".join(e.text for e in tokens)
                lps = self.logprobs([lp for e in tokens for lp in e.logprobs])
                lines: list[dict[str, Any]] = []
                if tools:
                    held.append(text)
                    text = ""
                if text or lps:
                    lines.append(answers.chunk(req.endpoint, self.model, text, logprobs=lps))
                if isinstance(final, Finished):
                    finish, content, calls = self.ending(final, "".join(held))
                    if content or calls:
                        lines.append(answers.chunk(req.endpoint, self.model, content,
                                                   calls=calls))
                    lines.append(self.last(final, finish, "", [], None))
                elif isinstance(final, GenerationFailed):
                    lines.append(answers.error_object(generation_failure(final).message))
                data = b"".join(json_bytes(line) + b"\n" for line in lines)
                if live and data:
                    live = await self.out.write(data)
                if final is not None:
                    if live:
                        await self.out.end()
                    return
