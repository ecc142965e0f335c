"""The scheduler batches concurrent requests into one forward without changing any of them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import attrs
import pytest

from meshd.daemon.engine import prefill
from meshd.daemon.models.compute import ComputeThread
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.models.scheduler import (
    Busy,
    Finished,
    GenerationFailed,
    GenerationHandle,
    GenerationRequest,
    Scheduler,
)
from meshd.policy.decision import FinishReason
from meshd.testing import testmodels

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module", params=["llama", "qwen35"])
def runtime(request: pytest.FixtureRequest) -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path(request.param, acceptance=0.8))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=4, draft_max=4,
                                    calibrate=False))
    yield rt
    assert rt.idle_slots == 4
    rt.close()


async def collect(handle: GenerationHandle) -> tuple[list[int], Finished | GenerationFailed]:
    tokens: list[int] = []
    async with handle.events:
        async for ev in handle.events:
            if isinstance(ev, (Finished, GenerationFailed)):
                return tokens, ev
            tokens.extend(ev.tokens)
    raise AssertionError("stream ended without a final event")


def prompts(rt: ModelRuntime, n: int) -> list[tuple[int, ...]]:
    tok = rt.model.tokenizer
    return [tuple(tok.tokenize(f"request number {i} " + "ab" * i)) for i in range(n)]


async def test_concurrent_requests_match_sequential(runtime: ModelRuntime) -> None:
    reqs = [GenerationRequest(p, max_tokens=40 + 7 * i, proposer=["off", "ngram", "auto"][i % 3],
                       draft_max=3)
            for i, p in enumerate(prompts(runtime, 6))]
    sched = Scheduler(runtime)
    alone: list[list[int]] = []
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        for r in reqs:
            toks, fin = await collect(sched.submit(r))
            assert isinstance(fin, Finished)
            alone.append(toks)
        handles = [sched.submit(r) for r in reqs]  # 6 requests, 4 slots: 2 wait
        together = [await collect(h) for h in handles]
        tg.cancel_scope.cancel()
    assert [t for t, _ in together] == alone
    assert sched.statistics().steps > 0
    assert runtime.idle_slots == 4


async def test_cancel_and_busy(runtime: ModelRuntime) -> None:
    sched = Scheduler(runtime, max_queue=2)
    p = prompts(runtime, 1)[0]
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        # Cancelled as soon as its first tokens arrive: steps are already running (a
        # tiny model decodes a token in a fraction of a millisecond), and the next one
        # sees the cancellation.
        h = sched.submit(GenerationRequest(p, max_tokens=480, proposer="ngram"))
        first: list[int] = []
        async for ev in h.events:
            assert not isinstance(ev, (Finished, GenerationFailed))
            first.extend(ev.tokens)
            break
        h.cancel()
        rest, fin = await collect(h)
        assert isinstance(fin, Finished) and fin.finish is FinishReason.CANCELLED
        assert len(first) + len(rest) < 480
        # A full queue answers Busy at once instead of growing without bound.
        with pytest.raises(Busy):
            for _ in range(10):
                sched.submit(GenerationRequest(p, max_tokens=5))
        tg.cancel_scope.cancel()
    assert runtime.idle_slots == 4


async def test_bad_request_fails_cleanly(runtime: ModelRuntime) -> None:
    sched = Scheduler(runtime)
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        _, fin = await collect(sched.submit(GenerationRequest((1,) * 600, max_tokens=5)))
        assert isinstance(fin, GenerationFailed) and fin.kind == "request"
        _, fin = await collect(sched.submit(GenerationRequest((1, 2), max_tokens=5,
                                                              proposer="nope")))
        assert isinstance(fin, GenerationFailed) and "unknown proposer" in fin.message
        toks, fin = await collect(sched.submit(GenerationRequest((1, 2), max_tokens=5)))
        assert isinstance(fin, Finished) and len(toks) == 5
        tg.cancel_scope.cancel()


async def test_every_llama_call_runs_on_the_one_compute_thread(
    runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a generation may load a draft model, evict cached sessions and prefill;
    steps run forwards; closing frees the slot. None of it may run on the event loop,
    which must keep answering meanwhile, and all of it runs on the one thread given to
    the scheduler (each thread calling into ggml would lead an OpenMP team of its own).
    The runtime's own methods run; only the thread they run on is noted."""
    loop_thread = threading.get_ident()
    threads: list[int] = []
    context_class = type(runtime.context)  # the runtime may rebuild its context
    real_generation, real_forward = runtime.generation, context_class.forward

    def noting(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            threads.append(threading.get_ident())
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(runtime, "generation", noting(real_generation))
    monkeypatch.setattr(context_class, "forward", noting(real_forward))
    compute = ComputeThread()
    try:
        sched = Scheduler(runtime, compute=compute)
        async with anyio.create_task_group() as tg:
            await tg.start(sched.run)
            handles = [sched.submit(GenerationRequest(p, max_tokens=6, proposer="ngram"))
                       for p in prompts(runtime, 3)]
            for h in handles:
                toks, fin = await collect(h)
                assert isinstance(fin, Finished) and len(toks) == 6
            tg.cancel_scope.cancel()
        assert len(threads) > 3 and set(threads) == {compute.ident}
        assert loop_thread not in threads
    finally:
        compute.close()


async def test_tokens_stream_while_steps_run_on(runtime: ModelRuntime) -> None:
    """Steps run on without coming back to the event loop, yet the client gets its
    tokens every stream interval, and the counters move, before the request ends."""
    sched = Scheduler(runtime, step_budget_s=0.001)
    deliveries: list[int] = []
    mid_steps: list[int] = []
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        handle = sched.submit(GenerationRequest(prompts(runtime, 1)[0], max_tokens=400,
                                                proposer="off"))
        async with handle.events:
            async for ev in handle.events:
                if isinstance(ev, (Finished, GenerationFailed)):
                    final = ev
                    break
                deliveries.append(len(ev.tokens))
                if sched.active:
                    mid_steps.append(sched.statistics().steps)
        tg.cancel_scope.cancel()
    assert isinstance(final, Finished) and sum(deliveries) == 400
    assert len(deliveries) >= 3, deliveries
    assert max(mid_steps) > 0


async def test_statistics_are_frozen_snapshots(runtime: ModelRuntime) -> None:
    """What ``statistics()`` returns never changes under its reader: a later call sees
    the requests that ran since, an earlier snapshot still says what it said."""
    sched = Scheduler(runtime)
    before = sched.statistics()
    assert before.runtime.idle_slots == 4 and before.active == before.queued == 0
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        for p in prompts(runtime, 2):
            request = GenerationRequest(p, max_tokens=8, proposer="ngram")
            _, fin = await collect(sched.submit(request))
            assert isinstance(fin, Finished)
        tg.cancel_scope.cancel()
    after = sched.statistics()
    assert (before.requests, before.completed, before.tokens) == (0, 0, 0)
    assert before.finish_reasons == {}
    assert before.verify_seconds.count == before.decode_seconds.count == 0
    assert (after.requests, after.completed, after.tokens) == (2, 2, 16)
    assert sum(after.finish_reasons.values()) == 2
    assert after.verify_seconds.count + after.decode_seconds.count == after.steps > 0
    assert after.runtime.idle_slots == 4 and after.runtime.checkpoint_bytes == 0
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        after.tokens = 0  # type: ignore[misc]


async def test_requests_that_arrive_together_are_prefilled_together(
    runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their first tokens come from one shared forward on an attention-only model (a
    recurrent one prefills each prompt on its own, between the decode steps of those
    already started), and each text is still the one it gets alone."""
    reqs = [GenerationRequest(p, max_tokens=5, proposer="off") for p in prompts(runtime, 3)]
    sched = Scheduler(runtime)
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        alone = [(await collect(sched.submit(r)))[0] for r in reqs]
        forwards: list[list[int]] = []  # each prefill forward's rows, by prompt
        real = prefill.prefill_parts

        def counting(items: Any) -> Any:
            forwards.append([len(tokens) for _, tokens, _ in items])
            return real(items)

        monkeypatch.setattr(prefill, "prefill_parts", counting)
        handles = [sched.submit(r) for r in reqs]  # before the loop looks again
        results = [await collect(h) for h in handles]
        tg.cancel_scope.cancel()
    assert [tokens for tokens, _ in results] == alone
    # What each prefilled: its prompt past what the prefix cache held for it.
    suffixes = []
    for r, (_, fin) in zip(reqs, results, strict=True):
        assert isinstance(fin, Finished)
        suffixes.append(len(r.prompt) - fin.stats.reused_prompt_tokens)
    if runtime.context.recurrent:
        assert forwards == [[n] for n in suffixes]
    else:
        assert forwards == [suffixes]
