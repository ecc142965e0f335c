"""Serving one OpenAI completion: the native pipeline, answered in OpenAI's shapes.

Why through ``Service``: the request becomes the same ``generate`` a native client sends
and runs through the same ``prepare`` (limits, chat template, tokenizer) and scheduler,
so the HTTP answer holds exactly the tokens the native protocol would give. The
generation is registered like a native one (shutdown drains it; a disconnect cancels
it at the next step, and its slot goes back through the scheduler).
"""

from __future__ import annotations

from typing import Any, Final

import anyio
import attrs

from meshd.policy.decision import FinishReason
from meshd.protocol import ModelError, ProtocolError

from ..engine import TokenEvent
from ..generation_stats import GenerationStats
from ..logprobs import TokenLogprob
from ..runtime import ModelRuntime
from ..scheduler import Finished, GenerationFailed, GenerationHandle, GenerationRequest
from ..service import InFlightGeneration, Service
from . import sse
from .identity import system_fingerprint
from .logprobs_format import logprobs_block
from .openai_api import (
    JSON,
    ApiError,
    CompletionRequest,
    chunk,
    completion_response,
    error_body,
    json_bytes,
    meshd_block,
    object_name,
    timings,
    tool_answer,
    usage,
)
from .responder import Responder, RouteContext

__all__ = ["serve_completion", "served_name"]

_MAX_EVENTS_PER_WRITE: Final = 256
_SSE: Final = "text/event-stream"


async def serve_completion(routes: RouteContext, req: CompletionRequest, out: Responder) -> None:
    """Run ``req`` and answer it; raises ApiError while nothing has been sent yet."""
    service = routes.service
    rid = req.generate.id
    entry = InFlightGeneration(rid)
    service.register(entry)
    out.on_gone(entry.cancel)
    try:
        ids = req.prompt_ids

        def with_ids(gen: GenerationRequest) -> GenerationRequest:
            assert entry.model is not None and entry.model.runtime is not None and ids
            return _with_prompt_ids(entry.model.runtime, gen, ids)

        try:
            asked = attrs.evolve(req.generate, model=served_name(service, req.model))
            gen = await service.start(asked, entry, adjust=with_ids if ids else None)
        except ModelError as exc:  # (prepare raises it for a prompt over the context only)
            raise _too_long(req, exc.message) from None
        except ProtocolError as exc:
            raise ApiError.from_protocol(exc, max_tokens_param=req.max_tokens_param,
                                         constraint_param=req.constraint_param) from None
        handle = entry.handle
        if handle is None:  # the client left before it reached the scheduler
            return
        assert entry.model is not None
        req = attrs.evolve(req, model=entry.model.name)  # the answers name it
        predicted = (gen.proposer_options or {}).get("tokens")
        if gen.proposer == "prediction" and isinstance(predicted, list):
            req = attrs.evolve(req, predicted=len(predicted))
        if req.n > 1:
            await _choices(routes, req, gen, handle, out, entry)
            return
        prompt_tokens = len(gen.prompt)
        seed = None if gen.sampling.greedy else gen.sampling.seed
        if req.stream:
            await _stream(routes, req, handle, out, prompt_tokens, seed, entry)
        else:
            await _collect(routes, req, handle, out, prompt_tokens, seed, entry)
    finally:
        service.unregister(entry)


def _too_long(req: CompletionRequest, message: str) -> ApiError:
    """OpenAI's answer to a prompt over the context, with meshd's counts."""
    return ApiError(400, message, param="messages" if req.chat else "prompt",
                    code="context_length_exceeded")


def served_name(service: Service, asked: str | None) -> str | None:
    """The model an OpenAI request names (None: the default). A daemon serving one model
    answers any name with it, as llama-server does, so clients that send a fixed name
    keep working; with several, an unknown name is OpenAI's 404."""
    models = service.models.models
    if asked is None or len(models) == 1:
        return None
    if asked in models:
        return asked
    raise ApiError(404, f"The model {asked!r} does not exist; this daemon serves "
                        f"{', '.join(models)}", param="model", code="model_not_found")


def _with_prompt_ids(rt: ModelRuntime, gen: GenerationRequest, ids: tuple[int, ...]
                     ) -> GenerationRequest:
    """``gen`` (checked by ``prepare`` on a placeholder prompt) with the request's token
    ids as its prompt, once they are known to be in the vocabulary and fit the context."""
    n_vocab = rt.model.info.n_vocab
    for i, token in enumerate(ids):
        if token >= n_vocab:
            raise ApiError(400, f"prompt[{i}]: must be a token id below the vocabulary "
                                f"size {n_vocab} (got {token})", param="prompt")
    if len(ids) + 1 > rt.context.config.n_ctx_seq:
        raise ModelError(rt.prompt_too_long(len(ids)))
    return attrs.evolve(gen, prompt=ids)


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
                    _logprobs(routes, req, lps))
                await out.send(200, json_bytes(body), JSON)
                return
    raise ApiError(500, "the generation ended without a result", code="internal",
                   kind="server_error")


async def _stream(routes: RouteContext, req: CompletionRequest, handle: GenerationHandle,
                  out: Responder, prompt_tokens: int, seed: int | None,
                  entry: InFlightGeneration) -> None:
    """SSE: a chunk per batch of committed text, the finish chunk (with ``timings`` and
    ``meshd``), the usage chunk if asked, then ``data: [DONE]``."""
    model = _name(req)
    fp = system_fingerprint(routes.service, req.model)
    started = False
    live = True  # the client still reads
    offset = 0  # characters streamed so far (completions' logprobs.text_offset)
    held: list[str] = []  # the text of a request that offered tools
    async with handle.events:
        while True:
            try:
                batch = [await handle.events.receive()]
            except anyio.EndOfStream:
                batch = [GenerationFailed("model", "the generation ended without a result")]
            while not isinstance(batch[-1], Finished | GenerationFailed) \
                    and len(batch) < _MAX_EVENTS_PER_WRITE:
                try:
                    batch.append(handle.events.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            final = batch[-1] if isinstance(batch[-1], Finished | GenerationFailed) else None
            if isinstance(final, GenerationFailed) and not started:
                raise _failure(final)
            text = "".join(e.text for e in batch if isinstance(e, TokenEvent))
            if req.tools is not None:  # calls are known at the end: hold the text till then
                held.append(text)
                text = "" if final is None else _release_held(req, held, final)
            data = b""
            if not started:
                started = True
                live = await out.start(200, _SSE, [("Cache-Control", "no-cache")])
                if req.chat:
                    data += sse.event(chunk(req, model, fp, role=True, text=""))
            lps = [lp for e in batch if isinstance(e, TokenEvent) for lp in e.logprobs]
            if text or lps:
                data += sse.event(chunk(req, model, fp, text=text,
                                        logprobs=_logprobs(routes, req, lps, offset)))
                offset += len(text)
            if isinstance(final, Finished):
                finish = _finish_reason(final, entry)
                _log_finished(routes, req, final, finish, prompt_tokens)
                calls = tool_answer(req, "".join(held), finish)[1] if held else []
                if calls:
                    finish = "tool_calls"
                    data += sse.event(chunk(req, model, fp, tool_calls=calls))
                data += _closing(req, model, fp, finish, final.stats, final.proposer,
                                 prompt_tokens, seed)
            elif isinstance(final, GenerationFailed):
                data += sse.event(error_body(_failure(final)))
                data += sse.DONE
            if live and data:
                live = await out.write(data)
            if final is not None:
                if live:
                    await out.end()
                return


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
             seed: int | None) -> bytes:
    last = chunk(req, model, fp, finish=finish)
    last["timings"] = timings(stats)
    last["meshd"] = meshd_block(stats, proposer, seed)
    return sse.event(last) + _usage_chunk(req, model, fp, usage(prompt_tokens, stats,
                                                                 req.predicted)) + sse.DONE


def _usage_chunk(req: CompletionRequest, model: str, fp: str, counts: dict[str, Any]
                 ) -> bytes:
    """The stream's usage chunk (no choices), when the request asked for it."""
    if not req.include_usage:
        return b""
    return sse.event({"id": req.generate.id, "object": object_name(req, stream=True),
                      "created": req.created, "model": model, "system_fingerprint": fp,
                      "choices": [], "usage": counts})


def _finish_reason(final: Finished, entry: InFlightGeneration) -> str:
    """As the native ``done`` says it: a cancellation by the daemon's shutdown is
    ``shutdown``."""
    if final.finish is FinishReason.CANCELLED and entry.shutdown:
        return "shutdown"
    return final.finish.value


def _log_finished(routes: RouteContext, req: CompletionRequest, final: Finished, finish: str,
                  prompt_tokens: int) -> None:
    st = final.stats
    routes.log.info(
        "request_finished", id=req.generate.id, finish_reason=finish,
        prompt_tokens=prompt_tokens, completion_tokens=st.emitted,
        proposer=final.proposer or "off", drafted=st.drafted, accepted=st.accepted,
        target_forwards=st.decode_forwards,
        prefill_forwards=st.session.prefill_forwards, wall_ms=round(st.wall_ms, 2),
    )


# --------------------------------------------------------------------- n > 1 choices


@attrs.define
class _Choice:
    """One choice's generation while it runs, and what it came to."""

    index: int
    seed: int | None
    handle: GenerationHandle
    parts: list[str] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    final: Finished | None = None


async def _choices(routes: RouteContext, req: CompletionRequest, gen: GenerationRequest,
                   first: GenerationHandle, out: Responder, entry: InFlightGeneration) -> None:
    """``n`` > 1: the same request ``n`` times, decoded together (the scheduler batches
    them; a prompt already prefilled comes from the prefix cache), choice ``i`` sampled
    with the request's seed plus ``i`` (greedy choices are equal)."""
    service = routes.service
    seed = None if gen.sampling.greedy else gen.sampling.seed
    choices = [_Choice(0, seed, first)]
    extras: list[InFlightGeneration] = []
    try:
        await _run_choices(routes, req, gen, choices, extras, out, entry)
    finally:
        for extra in extras:
            service.unregister(extra)


async def _run_choices(routes: RouteContext, req: CompletionRequest, gen: GenerationRequest,
                       choices: list[_Choice], extras: list[InFlightGeneration],
                       out: Responder, entry: InFlightGeneration) -> None:
    """Submit choices 1..n-1 (each tracked in ``extras``) and answer all of them."""
    service = routes.service
    seed = choices[0].seed
    for i in range(1, req.n):
        sampling = gen.sampling if seed is None else attrs.evolve(
            gen.sampling, seed=(seed + i) % (1 << 64))
        try:
            handle = service.submit(attrs.evolve(gen, sampling=sampling), entry,
                                    req.generate.id)
        except ProtocolError as exc:  # (the queue is full): none of the choices runs
            for running in (entry, *extras):
                running.cancel()
            raise ApiError.from_protocol(exc) from None
        extra = InFlightGeneration(req.generate.id)
        service.register(extra)
        extras.append(extra)
        extra.attach(handle)
        out.on_gone(extra.cancel)
        choices.append(_Choice(i, sampling.seed if seed is not None else None, handle))
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
            await _answer_choices(routes, req, choices, receive, out, len(gen.prompt))


async def _answer_choices(routes: RouteContext, req: CompletionRequest,
                          choices: list[_Choice], receive: Any, out: Responder,
                          prompt_tokens: int) -> None:
    """Collect (or stream, chunk by chunk with each choice's ``index``) the choices."""
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
            _log_finished(routes, req, event, event.finish.value, prompt_tokens)
            if req.stream:
                last = _indexed(chunk(req, model, fp, finish=event.finish.value), choice.index)
                last["meshd"] = meshd_block(event.stats, event.proposer, choice.seed)
                data = sse.event(last)
        if data and live:
            live = await out.write(data)
    done = [c for c in choices if c.final is not None]
    total = _usage_of(prompt_tokens, done)
    if req.stream:
        if live and await out.write(_usage_chunk(req, model, fp, total) + sse.DONE):
            await out.end()
        return
    if not done:  # every choice ended without a result (the client left): nothing to send
        return
    first = done[0]
    assert first.final is not None
    body = completion_response(req, model, fp, "".join(first.parts), first.final.finish.value,
                               first.final.stats, first.final.proposer, prompt_tokens,
                               first.seed)
    body["choices"] = [_indexed(completion_response(
        req, model, fp, "".join(c.parts), c.final.finish.value, c.final.stats,
        c.final.proposer, prompt_tokens, c.seed, _logprobs(routes, req, c.logprobs),
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
    """The prompt once, every choice's completion tokens (as OpenAI counts ``n``)."""
    emitted = sum(c.final.stats.emitted for c in done if c.final is not None)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": emitted,
            "total_tokens": prompt_tokens + emitted}

