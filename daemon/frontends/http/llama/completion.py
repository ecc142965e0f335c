"""llama-server's own completion endpoint, ``POST /completion`` (and ``/completions``):
its request fields and answers, served by meshd's pipeline.

Why through :func:`.completions.started`: each prompt becomes the same ``RequestSpec``
the OpenAI endpoints hand the service (limits, the scheduler, cancellation on
disconnect, shutdown), its prompt the token ids (strings tokenized as llama-server
does, special tokens parsed), with what only llama-server says set on it:
``n_predict`` -1 (to the end of the context) and 0, llama-server's ``logit_bias`` forms
(text, a ban written ``false``), ``ignore_eos`` (the end-of-generation tokens banned, as
llama-server does) and the probabilities ``n_probs`` asks for. Fields llama-server
accepts and meshd has no counterpart for are accepted and change nothing
(``docs/http-api.md`` lists them); every value a client controls is bounded (prompts,
``n_probs``, ``logit_bias`` entries).
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import Sequence
from typing import Any, Final

import anyio
import anyio.to_thread
import attrs

from meshd.daemon.engine.logprobs import TokenLogprob
from meshd.daemon.frontends.http import sse
from meshd.daemon.frontends.http.completions import (
    Started,
    finish_reason_of,
    generation_failure,
    log_request_finished,
    request_spec,
    served_name,
    started,
)
from meshd.daemon.frontends.http.llama.completion_format import (
    Outcome,
    Settings,
    final_body,
    partial_body,
    probabilities,
)
from meshd.daemon.frontends.http.llama.completion_request import (
    MAX_CANDIDATES,
    LlamaRequest,
    parse_llama_request,
)
from meshd.daemon.frontends.http.llama.timings_format import live_timings
from meshd.daemon.frontends.http.openai.api import CompletionRequest, json_object
from meshd.daemon.frontends.http.responder import Responder, RouteContext
from meshd.daemon.models.mapping import sampling_params
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.requests.api_errors import (
    JSON,
    ApiError,
    error_body,
    json_bytes,
)
from meshd.daemon.requests.events import (
    Finished,
    GenerationFailed,
    GenerationHandle,
    TokenEvent,
    receive_batch,
)
from meshd.daemon.requests.sampling import PostSampling, SamplingParams
from meshd.daemon.requests.spec import RequestSpec
from meshd.daemon.requests.tokens import bias_ids, mixed_prompt_ids
from meshd.policy.decision import FinishReason

__all__ = ["serve_llama_completion"]

_SSE: Final = "text/event-stream"


# ------------------------------------------------------------------ with the model


@attrs.frozen
class _Resolved:
    """What needs the model's vocabulary: each prompt's token ids and the biases."""

    prompts: tuple[tuple[int, ...], ...]
    logit_bias: tuple[tuple[int, float], ...]


def _resolve(rt: ModelRuntime, req: LlamaRequest) -> _Resolved:
    """Blocking (a worker thread): tokenize the prompts and the biases' text."""
    single = len(req.prompts) == 1
    prompts = tuple(mixed_prompt_ids(rt, p, "prompt" if single else f"prompt[{i}]")
                    for i, p in enumerate(req.prompts))
    return _Resolved(prompts=prompts, logit_bias=bias_ids(rt, req.logit_bias, req.ignore_eos))


@attrs.frozen
class _Job:
    """One generation of the request: a prompt (and which copy of it, for ``n_cmpl``)."""

    index: int
    prompt: tuple[int, ...]
    copy: int


def _completion_request(req: LlamaRequest, job: _Job) -> CompletionRequest:
    """One job's request (its token ids are its prompt; its limit, biases and
    probabilities are set on the service's request by :func:`_spec`)."""
    return CompletionRequest(
        spec=req.spec("cmpl-" + uuid.uuid4().hex[:24], job.prompt), chat=False,
        max_tokens_param="n_predict", tools=None,
        constraint_param=req.constraint_param, stream=req.stream, include_usage=False,
        model=req.model, created=int(time.time()))


def _spec(req: LlamaRequest, bias: tuple[tuple[int, float], ...], job: _Job,
          creq: CompletionRequest) -> RequestSpec:
    """One job as the service's request, with what only llama-server says: the
    limit (-1: the context; 0: one token, evaluated and not shown), the biases by token
    id, the probabilities, and a seed per ``n_cmpl`` copy (the request's plus the copy's
    index)."""
    logprobs = None
    if req.n_probs > 0:
        logprobs = req.n_probs
        if req.post_sampling_probs:  # the sampler chain runs over these tokens
            top_k = sampling_params(req.sampling).top_k
            k = top_k if 0 < top_k <= MAX_CANDIDATES else MAX_CANDIDATES
            logprobs = max(req.n_probs, k)
    return attrs.evolve(request_spec(creq), n_predict=req.n_predict, logit_bias_ids=bias,
                        logprobs=logprobs, seed_offset=job.copy)


async def serve_llama_completion(routes: RouteContext, raw: bytes, out: Responder) -> None:
    """Answer a ``/completion`` request: one object, or an array for several prompts
    (streamed: each prompt's events in turn, told apart by ``index``)."""
    req = parse_llama_request(json_object(raw), seed=routes.service.config.seed)
    service = routes.service
    async with service.holding(served_name(service, req.model), None) as rt:
        resolved = await anyio.to_thread.run_sync(functools.partial(_resolve, rt, req))
        jobs = [_Job(i * req.n_cmpl + c, ids, c)
                for i, ids in enumerate(resolved.prompts) for c in range(req.n_cmpl)]
        await _Answer(routes, req, resolved.logit_bias, rt, out).run(jobs)


class _Answer:
    """One request's generations and its answer."""

    def __init__(self, routes: RouteContext, req: LlamaRequest,
                 bias: tuple[tuple[int, float], ...], rt: ModelRuntime, out: Responder) -> None:
        self.routes = routes
        self.req = req
        self.bias = bias
        self.rt = rt
        self.out = out
        default = routes.service.config.max_tokens_default  # (None: -1, to the context end)
        self.n_predict = req.n_predict if req.n_predict is not None \
            else default if default is not None else -1
        self.live = True  # the client still reads
        self.streaming = False  # the stream's head has been sent
        self.sampler: PostSampling | None = None  # the running job's (post-sampling probs)
        self.first_at: float | None = None  # when its first tokens came (streamed)

    def piece(self, token: int) -> bytes:
        return self.rt.model.tokenizer.piece(token, special=False)

    def settings(self, sampling: SamplingParams) -> Settings:
        req = self.req
        return Settings(n_predict=self.n_predict, sampling=sampling, stop=req.stop,
                        logit_bias=self.bias, ignore_eos=req.ignore_eos, stream=req.stream,
                        n_probs=req.n_probs, min_keep=req.min_keep, grammar=req.grammar,
                        post_sampling_probs=req.post_sampling_probs,
                        timings_per_token=req.timings_per_token)

    async def run(self, jobs: list[_Job]) -> None:
        """Start every job (so they decode together), then answer them in order."""
        runs: list[tuple[_Job, Started | None]] = []
        async with contextlib.AsyncExitStack() as stack:
            try:
                for job in jobs:
                    if not job.prompt:  # llama-server answers an empty prompt, empty
                        runs.append((job, None))
                        continue
                    creq = _completion_request(self.req, job)
                    run = await stack.enter_async_context(started(
                        self.routes, creq, self.out, _spec(self.req, self.bias, job, creq)))
                    if run is None:  # the client left
                        return
                    runs.append((job, run))
                await self.answer(runs)
            finally:  # (answered, refused, failed or left: none of them runs on)
                for _job, run in runs:
                    if run is not None:
                        run.entry.cancel()
                        run.handle.events.close()

    async def answer(self, runs: list[tuple[_Job, Started | None]]) -> None:
        bodies: list[dict[str, Any]] = []
        for job, run in runs:
            if run is None:
                outcome = Outcome(index=job.index, prompt=job.prompt,
                                  model=self.model_name(), seed=self.req.sampling.seed)
                body = self.final(outcome, self.settings(sampling_params(self.req.sampling)),
                                  None)
                if self.req.stream:
                    await self.write(sse.event(body))
                bodies.append(body)
                continue
            answered = await (self.stream(job, run) if self.req.stream
                              else self.collect(job, run))
            if answered is None:  # the stream ended with an error event
                break
            bodies.append(answered)
        if self.req.stream:
            if self.streaming and self.live:
                await self.out.end()
            return
        payload: Any = bodies[0] if len(bodies) == 1 else bodies
        await self.out.send(200, json_bytes(payload), JSON)

    def model_name(self) -> str:
        name = served_name(self.routes.service, self.req.model)
        return name if name is not None else self.routes.service.models.default.name

    async def write(self, data: bytes) -> None:
        if not self.streaming:
            self.streaming = True
            self.live = await self.out.start(200, _SSE, [("Cache-Control", "no-cache")])
        if self.live and data:
            self.live = await self.out.write(data)

    def outcome(self, job: _Job, run: Started) -> Outcome:
        seed = run.gen.sampling.seed if not run.gen.sampling.greedy \
            else self.req.sampling.seed
        assert run.req.model is not None
        return Outcome(index=job.index, prompt=job.prompt, model=run.req.model, seed=seed,
                       id_slot=_slot(run.handle), hidden=self.req.n_predict == 0)

    def finish(self, outcome: Outcome, run: Started, final: Finished) -> None:
        """The outcome's end: how it stopped, and on which stop string."""
        finish = finish_reason_of(final, run.entry)
        log_request_finished(self.routes, run.req, final, finish, len(outcome.prompt))
        outcome.stats = final.stats
        outcome.id_slot = _slot(run.handle)
        reason = final.finish
        if outcome.hidden or reason is FinishReason.LENGTH:
            outcome.stop_type = "limit"
            outcome.truncated = not outcome.hidden and final.stats.emitted < run.gen.max_tokens
        elif reason is FinishReason.EOG:
            outcome.stop_type = "eos"
        elif reason is FinishReason.STOP:
            outcome.stop_type = "word"
            outcome.stopping_word = self.stopping_word(outcome)

    def stopping_word(self, outcome: Outcome) -> str:
        """The stop string that ended the text: the committed tokens' text goes on from
        the answer's with it."""
        full = b"".join(self.piece(t) for t in outcome.tokens).decode("utf-8", "replace")
        rest = full[len("".join(outcome.text)):]
        for word in self.req.stop:
            if rest.startswith(word):
                return word
        return next((w for w in self.req.stop if w in rest), "")

    def probs(self, outcome: Outcome, lps: Sequence[TokenLogprob], before: int
              ) -> list[dict[str, Any]]:
        """``completion_probabilities`` of ``lps``, the tokens after the first
        ``before`` generated ones."""
        if self.req.n_probs <= 0 or not lps or outcome.hidden:
            return []
        sampler = self.sampler if self.req.post_sampling_probs else None
        history = (*outcome.prompt, *outcome.tokens[:before])
        return probabilities(lps, self.piece, self.req.n_probs, post_sampling=sampler,
                             history=history, n_vocab=self.rt.model.info.n_vocab)

    def final(self, outcome: Outcome, settings: Settings,
              probs: list[dict[str, Any]] | None) -> dict[str, Any]:
        prompt_text = self.rt.model.tokenizer.detokenize(outcome.prompt, special=True)
        return final_body(outcome, settings, prompt_text, stream=self.req.stream,
                          return_tokens=self.req.return_tokens, probs=probs,
                          fields=self.req.response_fields)

    async def collect(self, job: _Job, run: Started) -> dict[str, Any]:
        outcome = self.outcome(job, run)
        self.sampler = PostSampling(run.gen.sampling)
        async with run.handle.events:
            async for event in run.handle.events:
                if isinstance(event, TokenEvent):
                    outcome.text.append(event.text)
                    outcome.tokens += event.tokens
                    outcome.logprobs += event.logprobs
                elif isinstance(event, GenerationFailed):
                    raise generation_failure(event)
                else:
                    self.finish(outcome, run, event)
                    return self.final(outcome, self.settings(run.gen.sampling),
                                      self.probs(outcome, outcome.logprobs, 0))
        raise ApiError(500, "the generation ended without a result", code="internal",
                       kind="server_error")

    async def stream(self, job: _Job, run: Started) -> dict[str, Any] | None:
        """SSE: an event per generated token (its text, its id, its probabilities), then
        the final object (``stop`` true). No ``[DONE]``, as llama-server sends none."""
        outcome = self.outcome(job, run)
        self.sampler = PostSampling(run.gen.sampling)
        self.first_at = None
        async with run.handle.events:
            while True:
                batch = await receive_batch(run.handle)
                final = batch[-1] if isinstance(batch[-1], Finished | GenerationFailed) \
                    else None
                if isinstance(final, GenerationFailed) and not self.streaming:
                    raise generation_failure(final)
                outcome.id_slot = _slot(run.handle)
                data = b"".join(self.partials(outcome, batch, run.handle))
                if isinstance(final, Finished):
                    self.finish(outcome, run, final)
                    body = self.final(outcome, self.settings(run.gen.sampling), None)
                    await self.write(data + sse.event(body))
                    return body
                if isinstance(final, GenerationFailed):
                    await self.write(data + sse.event(error_body(generation_failure(final))))
                    return None
                await self.write(data)

    def partials(self, outcome: Outcome, batch: list[Any], handle: GenerationHandle
                 ) -> list[bytes]:
        """The events of a batch: one per token; text released without a token (the
        end of a held stop-string prefix) goes with the token before it. With
        ``timings_per_token`` each carries the ``timings`` so far."""
        if self.first_at is None and any(isinstance(e, TokenEvent) for e in batch):
            self.first_at = time.monotonic()
        bodies: list[dict[str, Any]] = []
        for event in batch:
            if not isinstance(event, TokenEvent):
                continue
            before = len(outcome.tokens)
            outcome.text.append(event.text)
            outcome.tokens += event.tokens
            if outcome.hidden:
                continue
            if not event.tokens and bodies:
                bodies[-1]["content"] += event.text
                continue
            if not event.tokens and not event.text:
                continue
            bodies.append(partial_body(
                outcome.index, event.text, event.tokens, id_slot=outcome.id_slot,
                predicted=len(outcome.tokens), evaluated=len(outcome.prompt),
                probs=self.probs(outcome, event.logprobs, before)))
        gen = handle.generation
        if self.req.timings_per_token and gen is not None and self.first_at is not None:
            cached = gen.stats.reused_prompt_tokens
            now = time.monotonic()
            for body in bodies:
                body["timings"] = live_timings(
                    prompt_n=len(outcome.prompt) - cached, cache_n=cached,
                    prompt_ms=(self.first_at - handle.submitted) * 1e3,
                    predicted_n=body["tokens_predicted"],
                    predicted_ms=(now - self.first_at) * 1e3)
        return [sse.event(b) for b in bodies]


def _slot(handle: GenerationHandle) -> int:
    """The session slot the generation ran in (llama-server's ``id_slot``)."""
    gen = handle.generation
    return gen.session.seq_id if gen is not None else -1
