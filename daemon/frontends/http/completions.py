"""Serving one OpenAI completion: the native pipeline, answered in OpenAI's shapes.

Why through ``Service``: the request becomes the same ``RequestSpec`` a native
``generate`` becomes and runs through the same ``prepare`` (limits, chat template,
tokenizer) and scheduler, so the HTTP answer holds exactly the tokens the native
protocol would give. The
generation is registered like a native one (shutdown drains it; a disconnect cancels
it at the next step, and its slot goes back through the scheduler).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Final

import anyio
import attrs

from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.daemon.engine.logprobs import TokenLogprob
from meshd.daemon.frontends.http import sse
from meshd.daemon.frontends.http.identity import system_fingerprint
from meshd.daemon.frontends.http.llama.timings_format import live_timings, prompt_progress, timings
from meshd.daemon.frontends.http.logprobs_format import logprobs_block
from meshd.daemon.frontends.http.openai.api import (
    CompletionRequest,
    chunk,
    completion_response,
    meshd_block,
    object_name,
    tool_answer,
    usage,
    with_prompt,
)
from meshd.daemon.frontends.http.openai.prediction import prediction_details
from meshd.daemon.frontends.http.responder import Responder, RouteContext
from meshd.daemon.models.model_set import NoSuchModel
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.models.scheduler import GenerationRequest
from meshd.daemon.requests.api_errors import (
    JSON,
    ApiError,
    context_exceeded,
    error_body,
    json_bytes,
)
from meshd.daemon.requests.events import (
    Finished,
    GenerationFailed,
    GenerationHandle,
    TokenEvent,
    finish_reason,
    log_finished,
    receive_batch,
)
from meshd.daemon.requests.service import InFlightGeneration, Service
from meshd.daemon.requests.spec import RequestSpec
from meshd.protocol import ModelError, ProtocolError

__all__ = ["Started", "finish_reason_of", "generation_failure", "log_request_finished",
           "request_spec", "serve_completion", "served_name", "started"]

_SSE: Final = "text/event-stream"


async def serve_completion(routes: RouteContext, req: CompletionRequest, out: Responder) -> None:
    """Run ``req`` and answer it; raises ApiError while nothing has been sent yet."""
    if req.batch:
        await _batch(routes, req, out)
        return
    async with started(routes, req, out) as run:
        if run is None:  # the client left before it reached the scheduler
            return
        req, gen, handle, entry = run.req, run.gen, run.handle, run.entry
        if req.n > 1:
            await _choices(routes, [run], out)
            return
        prompt_tokens = len(gen.prompt)
        seed = None if gen.sampling.greedy else gen.sampling.seed
        if req.stream:
            await _stream(routes, req, handle, out, prompt_tokens, seed, entry)
        else:
            await _collect(routes, req, handle, out, prompt_tokens, seed, entry)


@attrs.frozen
class Started:
    """A generation admitted to the scheduler: its request (naming the model that serves
    it), the engine request, its event stream and its registration."""

    req: CompletionRequest
    gen: GenerationRequest
    handle: GenerationHandle
    entry: InFlightGeneration


def request_spec(req: CompletionRequest) -> RequestSpec:
    """The one request type an HTTP completion hands the service (what the native
    ``generate`` cannot say included: the conversation the model's template may offer
    the tools in, its variables, ``min_tokens``)."""
    return attrs.evolve(
        req.spec, tools=req.tools,
        conversation=req.template_messages if req.tools is not None else None,
        template_variables=req.template_variables, reasoning_effort=req.reasoning_effort,
        min_tokens=req.min_tokens)


@contextlib.asynccontextmanager
async def started(routes: RouteContext, req: CompletionRequest, out: Responder,
                  spec: RequestSpec | None = None) -> AsyncIterator[Started | None]:
    """The request lifecycle every generating endpoint shares: register ``req`` (a
    disconnect cancels it), prepare and submit it (as ``spec``, by default
    :func:`request_spec`'s), and unregister it when the block ends. Yields None when the
    client left before it reached the scheduler; raises ApiError when it is refused."""
    service = routes.service
    entry = InFlightGeneration(req.spec.id, routes.owner or None)
    service.register(entry)
    out.on_gone(entry.cancel)
    try:
        spec = spec or request_spec(req)
        try:
            spec = attrs.evolve(spec, model=served_name(service, req.model))
            gen = await service.start(spec, entry)
        except ModelError as exc:  # (prepare raises it for a prompt over the context only)
            raise context_exceeded(exc, "messages" if req.chat else "prompt") from None
        except ProtocolError as exc:
            raise ApiError.from_protocol(exc, max_tokens_param=req.max_tokens_param,
                                         constraint_param=req.constraint_param) from None
        handle = entry.handle
        if handle is None:
            yield None
            return
        assert entry.model is not None and entry.model.runtime is not None
        req = attrs.evolve(req, model=entry.model.name)  # the answers name it
        predicted = _drafted_prediction(gen)
        if predicted is None and req.spec.prediction:  # (counted, not drafted from)
            predicted = await anyio.to_thread.run_sync(
                _prediction_tokens, entry.model.runtime, req.spec.prediction)
        if predicted is not None:
            req = attrs.evolve(req, predicted=predicted)
        yield Started(req, gen, handle, entry)
    finally:
        service.unregister(entry)


def _drafted_prediction(gen: GenerationRequest) -> tuple[int, ...] | None:
    """The prediction's tokens the ``prediction`` proposer drafts from (None: it does
    not run for this request)."""
    tokens = (gen.proposer_options or {}).get("tokens")
    if gen.proposer == "prediction" and isinstance(tokens, list):
        return tuple(tokens)
    return None


def _prediction_tokens(rt: ModelRuntime, text: str) -> tuple[int, ...]:
    """A prediction another proposer drafts for, tokenized as the ``prediction``
    proposer's (to count what the answer holds of it); at most the context's worth, as
    there. Blocking."""
    n_ctx = rt.context.config.n_ctx_seq
    try:
        return tuple(rt.model.tokenizer.tokenize(text, add_special=False, max_tokens=n_ctx))
    except ValueError as exc:  # (TooManyTokens)
        raise ApiError(400, f"prediction: {exc}", param="prediction") from None


def served_name(service: Service, asked: str | None) -> str | None:
    """The model an OpenAI request names (None: the default). A daemon serving one model
    answers any name with it, as llama-server does, so clients that send a fixed name
    keep working; with several, an unknown name is OpenAI's 404."""
    models = service.models.models
    if asked is None or len(models) == 1:
        return None
    try:
        return service.models.get(asked).name
    except NoSuchModel:
        pass
    raise ApiError(404, f"The model {asked!r} does not exist; this daemon serves "
                        f"{', '.join(models)}", param="model", code="model_not_found")


def _failure(final: GenerationFailed) -> ApiError:
    """A generation that failed: the request's fault (400) or the model's (500)."""
    if final.kind == "request":
        return ApiError(400, final.message)
    return ApiError(500, final.message or "generation failed", code="model_error",
                    kind="server_error")


async def _collect(routes: RouteContext, req: CompletionRequest, handle: GenerationHandle,
                   out: Responder, prompt_tokens: int, seed: int | None,
                   entry: InFlightGeneration) -> None:
    parts: list[str] = []
    lps: list[TokenLogprob] = []
    async with handle.events:
        async for event in handle.events:
            if isinstance(event, TokenEvent):
                parts.append(event.text)
                lps.extend(event.logprobs)
            elif isinstance(event, GenerationFailed):
                raise _failure(event)
            else:
                finish = _finish_reason(event, entry)
                _log_finished(routes, req, event, finish, prompt_tokens)
                body = completion_response(
                    req, _name(req), system_fingerprint(routes.service, req.model),
                    "".join(parts), finish, event.stats, event.proposer, prompt_tokens, seed,
                    _logprobs(routes, req, lps),
                    prediction=await _prediction_details(routes, req, "".join(parts)))
                if _verbose(routes, req):
                    body["__verbose"] = await _verbose_block(entry, handle, "".join(parts))
                await out.send(200, json_bytes(body), JSON)
                return
    raise ApiError(500, "the generation ended without a result", code="internal",
                   kind="server_error")


def _verbose(routes: RouteContext, req: CompletionRequest) -> bool:
    asked = req.llama.verbose
    return routes.service.config.http.verbose_responses if asked is None else asked


async def _verbose_block(entry: InFlightGeneration, handle: GenerationHandle, text: str
                         ) -> dict[str, Any]:
    """llama-server's ``__verbose``: the prompt as the model read it (the chat template's
    output, special tokens written out) and the text, for debugging templates."""
    assert entry.model is not None and entry.model.runtime is not None
    tokenizer = entry.model.runtime.model.tokenizer
    prompt = list(handle.request.prompt)
    shown = await anyio.to_thread.run_sync(
        functools.partial(tokenizer.detokenize, prompt, special=True))
    return {"prompt": shown, "content": text, "tokens_evaluated": len(prompt)}


async def _stream(routes: RouteContext, req: CompletionRequest, handle: GenerationHandle,
                  out: Responder, prompt_tokens: int, seed: int | None,
                  entry: InFlightGeneration) -> None:
    """SSE: a chunk per batch of committed text, the finish chunk (with ``timings`` and
    ``meshd``), the usage chunk if asked (with ``timings`` too), then ``data: [DONE]``.
    A chat stream opens with the role chunk (``content`` null). llama-server's extras:
    with ``return_progress`` the first chunks carry ``prompt_progress``, with
    ``timings_per_token`` every later chunk with text or calls carries ``timings``."""
    model = _name(req)
    fp = system_fingerprint(routes.service, req.model)
    clock = _StreamClock(handle, prompt_tokens)
    started = False
    live = True  # the client still reads
    offset = 0  # characters streamed so far (completions' logprobs.text_offset)
    held: list[str] = []  # the text of a request that offered tools
    answer: list[str] = []  # the text of a request with a prediction (its counters)
    async with handle.events:
        while True:
            batch = await receive_batch(handle)
            final = batch[-1] if isinstance(batch[-1], Finished | GenerationFailed) else None
            if isinstance(final, GenerationFailed) and not started:
                raise _failure(final)
            text = "".join(e.text for e in batch if isinstance(e, TokenEvent))
            clock.received(sum(len(e.tokens) for e in batch if isinstance(e, TokenEvent)))
            if req.predicted is not None:
                answer.append(text)
            if req.tools is not None:  # calls are known at the end: hold the text till then
                held.append(text)
                text = "" if final is None else _release_held(req, held, final)
            data = b""
            if not started:
                started = True
                live = await out.start(200, _SSE, [("Cache-Control", "no-cache")])
                data += _opening(req, model, fp, clock)
            lps = [lp for e in batch if isinstance(e, TokenEvent) for lp in e.logprobs]
            if text or lps:
                data += sse.event(clock.timed(req, chunk(
                    req, model, fp, text=text, logprobs=_logprobs(routes, req, lps, offset))))
                offset += len(text)
            if isinstance(final, Finished):
                finish = _finish_reason(final, entry)
                _log_finished(routes, req, final, finish, prompt_tokens)
                calls = tool_answer(req, "".join(held), finish)[1] if held else []
                if calls:
                    if finish in ("eog", "stop"):  # (a cut keeps ``length``)
                        finish = "tool_calls"
                    data += sse.event(clock.timed(req, chunk(req, model, fp,
                                                             tool_calls=calls)))
                prediction = (await _prediction_details(routes, req, "".join(answer))
                              if req.include_usage else None)
                data += _closing(req, model, fp, finish, final.stats, final.proposer,
                                 prompt_tokens, seed, prediction)
            elif isinstance(final, GenerationFailed):
                data += sse.event(error_body(_failure(final)))
                data += sse.DONE
            if live and data:
                live = await out.write(data)
            if final is not None:
                if live:
                    await out.end()
                return


class _StreamClock:
    """What a stream knows of its request's progress, for llama-server's
    ``timings_per_token`` and ``return_progress``: the prompt, the part of it the prefix
    cache served, when the first tokens arrived and how many have arrived since."""

    def __init__(self, handle: GenerationHandle, prompt_tokens: int) -> None:
        self._handle = handle
        self.prompt_tokens = prompt_tokens
        self._first_at: float | None = None
        self._emitted = 0

    def received(self, tokens: int) -> None:
        if tokens and self._first_at is None:
            self._first_at = time.monotonic()
        self._emitted += tokens

    @property
    def cached(self) -> int | None:
        """The prompt tokens the prefix cache served (None before admission). The engine
        writes them once, at admission, before it delivers the first tokens."""
        gen = self._handle.generation
        return None if gen is None else gen.stats.reused_prompt_tokens

    def prompt_ms(self) -> float:
        """From the request's submission to its first tokens (queue wait included)."""
        first = self._first_at if self._first_at is not None else time.monotonic()
        return (first - self._handle.submitted) * 1e3

    def timed(self, req: CompletionRequest, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` (a chunk after the first) with the ``timings`` so far, if asked."""
        cached = self.cached
        if req.llama.timings_per_token and cached is not None and self._first_at is not None:
            body["timings"] = live_timings(
                prompt_n=self.prompt_tokens - cached, cache_n=cached,
                prompt_ms=self.prompt_ms(), predicted_n=self._emitted,
                predicted_ms=(time.monotonic() - self._first_at) * 1e3)
        return body

    def progress(self) -> list[dict[str, float | int]]:
        """The prompt's progress: before its prefill (the cached tokens only) and after
        it. meshd's prefill is one engine call that ends with the first token, so both
        are known, and sent, together."""
        cached = self.cached
        if cached is None:
            return []
        total = self.prompt_tokens
        return [prompt_progress(total=total, cache=cached, processed=cached, time_ms=0.0),
                prompt_progress(total=total, cache=cached, processed=total,
                                time_ms=self.prompt_ms())]


def _opening(req: CompletionRequest, model: str, fp: str, clock: _StreamClock) -> bytes:
    """The stream's first chunks: chat's role chunk (``content`` null, no ``timings``),
    and with ``return_progress`` the prompt's progress (on the role chunk, then on a
    chunk of its own; a completion's on empty-text chunks)."""
    reports: list[dict[str, Any] | None] = list(clock.progress()) if req.llama.return_progress \
        else []
    if req.chat and not reports:
        reports = [None]
    data = b""
    for i, report in enumerate(reports):
        body = chunk(req, model, fp, role=req.chat and i == 0)
        if report is not None:
            body["prompt_progress"] = report
        data += sse.event(body)
    return data


def _release_held(req: CompletionRequest, held: list[str], final: Finished | GenerationFailed
                  ) -> str:
    """At the end of a tools request: the content to stream (the text less whole calls)."""
    text = "".join(held)
    if not isinstance(final, Finished):
        return text
    content, _calls = tool_answer(req, text, final.finish.value)
    return content or ""


def _logprobs(routes: RouteContext, req: CompletionRequest, lps: list[TokenLogprob],
              offset: int = 0) -> dict[str, Any] | None:
    """The choice's ``logprobs`` for these tokens (None when the request did not ask);
    an end-of-generation token, whose text the answer does not show, is left out too."""
    if req.logprobs is None:
        return None
    runtime = routes.service.models.get(req.model).runtime
    assert runtime is not None  # (held by the request)
    model = runtime.model
    eog = model.info.eog_tokens
    return logprobs_block([lp for lp in lps if lp.token not in eog],
                          lambda t: model.tokenizer.piece(t, special=True), chat=req.chat,
                          offset=offset)


def _closing(req: CompletionRequest, model: str, fp: str, finish: str,
             stats: GenerationStats, proposer: str | None, prompt_tokens: int,
             seed: int | None, prediction: dict[str, int] | None = None) -> bytes:
    last = chunk(req, model, fp, finish=finish)
    last["timings"] = timings(stats)
    last["meshd"] = meshd_block(stats, proposer, seed, req.ignored)
    return sse.event(last) + _usage_chunk(req, model, fp, usage(prompt_tokens, stats,
                                                                 prediction),
                                          last["timings"]) + sse.DONE


async def _prediction_details(routes: RouteContext, req: CompletionRequest, text: str
                              ) -> dict[str, int] | None:
    """The prediction counters of an answer whose text is ``text`` (None: the request
    sent no prediction), computed on a worker thread."""
    if req.predicted is None:
        return None
    runtime = routes.service.models.get(req.model).runtime
    assert runtime is not None  # (held by the request)
    tokenizer = runtime.model.tokenizer
    return await anyio.to_thread.run_sync(functools.partial(
        prediction_details, req.predicted, text,
        lambda answer: tokenizer.tokenize(answer, add_special=False)))


def _usage_chunk(req: CompletionRequest, model: str, fp: str, counts: dict[str, Any],
                 final_timings: dict[str, Any] | None = None) -> bytes:
    """The stream's usage chunk (no choices), when the request asked for it; the last
    chunk, it carries the ``timings`` too (as llama-server's last chunk does)."""
    if not req.include_usage:
        return b""
    body = {"id": req.spec.id, "object": object_name(req, stream=True),
            "created": req.created, "model": model, "system_fingerprint": fp,
            "choices": [], "usage": counts}
    if final_timings is not None:
        body["timings"] = final_timings
    return sse.event(body)


def _finish_reason(final: Finished, entry: InFlightGeneration) -> str:
    """As the native ``done`` says it (a cancellation by the shutdown: ``shutdown``)."""
    return finish_reason(final.finish, entry).value


def _log_finished(routes: RouteContext, req: CompletionRequest, final: Finished, finish: str,
                  prompt_tokens: int) -> None:
    log_finished(routes.log, req.spec.id, finish, final.stats, final.proposer, prompt_tokens,
                 **({"ignored_fields": list(req.ignored)} if req.ignored else {}))


# --------------------------------------------------------------------- n > 1 choices


@attrs.define
class _Choice:
    """One choice's generation while it runs, and what it came to."""

    index: int
    seed: int | None
    handle: GenerationHandle
    prompt_tokens: int
    parts: list[str] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    final: Finished | None = None


async def _batch(routes: RouteContext, req: CompletionRequest, out: Responder) -> None:
    """``/v1/completions`` with several prompts: each started in turn (the first ones
    decode while the next are tokenized; all share the scheduler's forwards), then all
    answered as choices, ``n`` per prompt. A prompt refused refuses the request, and
    none of its generations runs on."""
    runs: list[Started] = []
    async with contextlib.AsyncExitStack() as stack:
        try:
            for prompt in req.batch:
                one = attrs.evolve(req, spec=with_prompt(req.spec, prompt), batch=())
                run = await stack.enter_async_context(started(routes, one, out))
                if run is None:  # the client left
                    return
                runs.append(run)
            await _choices(routes, runs, out)
        finally:  # (answered, refused, failed or left)
            for run in runs:
                run.entry.cancel()
                run.handle.events.close()


async def _choices(routes: RouteContext, runs: Sequence[Started], out: Responder) -> None:
    """Several choices: ``n`` of one prompt, or of each prompt of a batch (each started
    in ``runs``). Choice ``j`` of prompt ``i`` is ``index`` ``i * n + j``, as OpenAI
    numbers them; all decode together (the scheduler batches them; a prompt already
    prefilled comes from the prefix cache), choice ``j`` sampled with its prompt's seed
    plus ``j`` (greedy choices of a prompt are equal)."""
    service = routes.service
    req = runs[0].req
    choices: list[_Choice] = []
    extras: list[InFlightGeneration] = []
    try:
        for i, run in enumerate(runs):
            seed = None if run.gen.sampling.greedy else run.gen.sampling.seed
            choices.append(_Choice(i * req.n, seed, run.handle, len(run.gen.prompt)))
            _submit_copies(routes, req, run, choices, extras, out, runs)
        await _run_choices(routes, req, choices, out, sum(len(r.gen.prompt) for r in runs))
    finally:
        for extra in extras:
            service.unregister(extra)


def _submit_copies(routes: RouteContext, req: CompletionRequest, run: Started,
                   choices: list[_Choice], extras: list[InFlightGeneration], out: Responder,
                   runs: Sequence[Started]) -> None:
    """Submit choices 1..n-1 of ``run``'s prompt (the last of ``choices`` is its first),
    each tracked in ``extras``; when one cannot be queued, none of the choices runs."""
    service = routes.service
    first = choices[-1]
    seed = first.seed
    for j in range(1, req.n):
        sampling = run.gen.sampling if seed is None else attrs.evolve(
            run.gen.sampling, seed=(seed + j) % (1 << 64))
        extra = InFlightGeneration(req.spec.id)
        try:
            handle = service.submit(attrs.evolve(run.gen, sampling=sampling), run.entry,
                                    req.spec.id, copy=extra)
        except ProtocolError as exc:  # (the queue is full): none of the choices runs
            for running in (*(r.entry for r in runs), *extras):
                running.cancel()
            raise ApiError.from_protocol(exc) from None
        service.register(extra)
        extras.append(extra)
        extra.attach(handle)
        out.on_gone(extra.cancel)
        choices.append(_Choice(first.index + j, sampling.seed if seed is not None else None,
                               handle, first.prompt_tokens))


async def _run_choices(routes: RouteContext, req: CompletionRequest, choices: list[_Choice],
                       out: Responder, prompt_tokens: int) -> None:
    """Answer every choice as its events come (``prompt_tokens``: every prompt's)."""
    send, receive = anyio.create_memory_object_stream[tuple[_Choice, object]](1024)

    async def pump(choice: _Choice, sender: Any) -> None:
        async with sender, choice.handle.events:
            async for event in choice.handle.events:
                await sender.send((choice, event))

    async with anyio.create_task_group() as tg:
        with send:
            for choice in choices:
                tg.start_soon(pump, choice, send.clone())
        async with receive:
            await _answer_choices(routes, req, choices, receive, out, prompt_tokens)


async def _answer_choices(routes: RouteContext, req: CompletionRequest,
                          choices: list[_Choice], receive: Any, out: Responder,
                          prompt_tokens: int) -> None:
    """Collect (or stream, chunk by chunk with each choice's ``index``) the choices;
    ``prompt_tokens`` counts each prompt once (OpenAI's usage)."""
    model, fp = _name(req), system_fingerprint(routes.service, req.model)
    live = await out.start(200, _SSE, [("Cache-Control", "no-cache")]) if req.stream else True
    async for choice, event in receive:
        data = b""
        if isinstance(event, TokenEvent):
            choice.parts.append(event.text)
            choice.logprobs.extend(event.logprobs)
            if req.stream and (event.text or event.logprobs):
                data = sse.event(_indexed(chunk(req, model, fp, text=event.text, logprobs=(
                    _logprobs(routes, req, list(event.logprobs)))), choice.index))
        elif isinstance(event, GenerationFailed):
            if not req.stream:
                for other in choices:
                    other.handle.cancel()
                raise _failure(event)
            data = sse.event(error_body(_failure(event)))
        elif isinstance(event, Finished):
            choice.final = event
            _log_finished(routes, req, event, event.finish.value, choice.prompt_tokens)
            if req.stream:
                last = _indexed(chunk(req, model, fp, finish=event.finish.value), choice.index)
                last["meshd"] = meshd_block(event.stats, event.proposer, choice.seed,
                                            req.ignored)
                data = sse.event(last)
        if data and live:
            live = await out.write(data)
    done = sorted((c for c in choices if c.final is not None), key=lambda c: c.index)
    total = _usage_of(prompt_tokens, done)
    if req.predicted is not None:  # (each choice's counters, summed)
        counts = [await _prediction_details(routes, req, "".join(c.parts)) for c in done]
        total["completion_tokens_details"] = {
            key: sum(c[key] for c in counts if c is not None)
            for key in ("accepted_prediction_tokens", "rejected_prediction_tokens")}
    if req.stream:
        if live and await out.write(_usage_chunk(req, model, fp, total) + sse.DONE):
            await out.end()
        return
    if not done:  # every choice ended without a result (the client left): nothing to send
        return
    first = done[0]
    assert first.final is not None
    body = completion_response(req, model, fp, "".join(first.parts), first.final.finish.value,
                               first.final.stats, first.final.proposer, first.prompt_tokens,
                               first.seed)
    body["choices"] = [_indexed(completion_response(
        req, model, fp, "".join(c.parts), c.final.finish.value, c.final.stats,
        c.final.proposer, c.prompt_tokens, c.seed, _logprobs(routes, req, c.logprobs),
    ), c.index)["choices"][0] for c in done if c.final is not None]
    body["usage"] = total
    body["meshd"]["seeds"] = [c.seed for c in done]
    await out.send(200, json_bytes(body), JSON)


def _name(req: CompletionRequest) -> str:
    """The name of the model serving ``req`` (set once ``prepare`` chose it)."""
    assert req.model is not None
    return req.model


def _indexed(body: dict[str, Any], index: int) -> dict[str, Any]:
    """``body`` (an answer or chunk of one choice) as choice ``index``'s."""
    body["choices"][0]["index"] = index
    return body


def _usage_of(prompt_tokens: int, done: list[_Choice]) -> dict[str, Any]:
    """Each prompt once, every choice's completion tokens (as OpenAI counts ``n`` and
    batches)."""
    emitted = sum(c.final.stats.emitted for c in done if c.final is not None)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": emitted,
            "total_tokens": prompt_tokens + emitted}


# What llama-server's native endpoint (:mod:`.llama_completion`) shares with these answers.
generation_failure = _failure
finish_reason_of = _finish_reason
log_request_finished = _log_finished
