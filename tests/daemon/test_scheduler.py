"""The scheduler batches concurrent requests into one forward without changing any of them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from meshd.daemon.engine import Generation
from meshd.daemon.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.scheduler import Busy, Failed, Finished, GenRequest, RequestHandle, Scheduler
from meshd.native import testmodels
from meshd.policy.decision import FinishReason

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


async def collect(handle: RequestHandle) -> tuple[list[int], Finished | Failed]:
    tokens: list[int] = []
    async with handle.events:
        async for ev in handle.events:
            if isinstance(ev, (Finished, Failed)):
                return tokens, ev
            tokens.extend(ev.tokens)
    raise AssertionError("stream ended without a final event")


def prompts(rt: ModelRuntime, n: int) -> list[tuple[int, ...]]:
    tok = rt.model.tokenizer
    return [tuple(tok.tokenize(f"request number {i} " + "ab" * i)) for i in range(n)]


async def test_concurrent_requests_match_sequential(runtime: ModelRuntime) -> None:
    reqs = [GenRequest(p, max_tokens=40 + 7 * i, proposer=["off", "ngram", "auto"][i % 3],
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
    assert sched.stats.steps > 0
    assert runtime.idle_slots == 4


async def test_cancel_and_busy(runtime: ModelRuntime) -> None:
    sched = Scheduler(runtime, max_queue=2)
    p = prompts(runtime, 1)[0]
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        h = sched.submit(GenRequest(p, max_tokens=400, proposer="ngram"))
        first: list[int] = []
        async for ev in h.events:
            assert not isinstance(ev, (Finished, Failed))
            first.extend(ev.tokens)
            if len(first) >= 5:
                break
        h.cancel()
        rest, fin = await collect(h)
        assert isinstance(fin, Finished) and fin.finish is FinishReason.CANCELLED
        assert len(first) + len(rest) < 400
        # A full queue answers Busy at once instead of growing without bound.
        with pytest.raises(Busy):
            for _ in range(10):
                sched.submit(GenRequest(p, max_tokens=5))
        tg.cancel_scope.cancel()
    assert runtime.idle_slots == 4


async def test_bad_request_fails_cleanly(runtime: ModelRuntime) -> None:
    sched = Scheduler(runtime)
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        _, fin = await collect(sched.submit(GenRequest((1,) * 600, max_tokens=5)))
        assert isinstance(fin, Failed) and fin.kind == "request"
        _, fin = await collect(sched.submit(GenRequest((1, 2), max_tokens=5, proposer="nope")))
        assert isinstance(fin, Failed) and "unknown proposer" in fin.message
        toks, fin = await collect(sched.submit(GenRequest((1, 2), max_tokens=5)))
        assert isinstance(fin, Finished) and len(toks) == 5
        tg.cancel_scope.cancel()


async def test_admission_runs_on_the_worker_thread(
    runtime: ModelRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a generation may load a draft model, evict cached sessions and prefill:
    none of it may run on the event loop, which must keep answering meanwhile. The
    runtime's own ``generation`` runs; only the thread it runs on is noted."""
    loop_thread = threading.get_ident()
    threads: list[int] = []
    real = runtime.generation

    def noting(*args: Any, **kwargs: Any) -> Generation:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime, "generation", noting)
    sched = Scheduler(runtime)
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        handles = [sched.submit(GenRequest(p, max_tokens=6, proposer="ngram"))
                   for p in prompts(runtime, 3)]
        for h in handles:
            toks, fin = await collect(h)
            assert isinstance(fin, Finished) and len(toks) == 6
        tg.cancel_scope.cancel()
    assert len(threads) == 3 and loop_thread not in threads
