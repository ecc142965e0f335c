"""A long prompt beside a request that speculates: while the prompt waits for its
prefill, the other request's windows are cut to a few decodes' cost, so its drafting
cannot take the prompt's time; before and after, it drafts as long as it likes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from meshd.daemon.engine import step_runs
from meshd.daemon.engine.forwards import ForwardTiming
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.models.scheduler import (
    Finished,
    GenerationFailed,
    GenerationHandle,
    GenerationRequest,
    Scheduler,
)
from meshd.native.prefill_chunks import prefill_chunk_rows
from meshd.policy.costs import CostCurve
from meshd.testing import testmodels, testrule

pytestmark = pytest.mark.anyio

DRAFT_MAX = 12


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def llama() -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=2048, n_seq_max=2,
                                    draft_max=DRAFT_MAX, calibrate=False))
    yield rt
    rt.close()


def _prompt(rt: ModelRuntime, tokens: int, salt: int) -> tuple[int, ...]:
    tok = rt.model.tokenizer
    text = " ".join(f"row {i + salt} holds {'abcdefgh'[i % 8] * (i % 5 + 1)}"
                    for i in range(tokens))
    return tuple(tok.tokenize(text)[:tokens])


async def _drain(handle: GenerationHandle) -> list[int]:
    tokens: list[int] = []
    async with handle.events:
        async for ev in handle.events:
            if isinstance(ev, Finished):
                return tokens
            assert not isinstance(ev, GenerationFailed), ev
            tokens.extend(ev.tokens)
    raise AssertionError("no final event")


@pytest.mark.parametrize("long_prompt", [True, False])
async def test_a_speculating_bystander_drafts_little_while_a_long_prompt_prefills(
        llama: ModelRuntime, monkeypatch: pytest.MonkeyPatch, long_prompt: bool) -> None:
    rt = llama
    # A cost curve where each drafted row costs a quarter of a decode (kept as set), so
    # two decodes' worth is 4 drafts; the bystander's prediction is its exact answer, so
    # its drafts are all accepted and it would draft DRAFT_MAX a step if let.
    rt.curve = CostCurve.sanitized([1.0 + 0.25 * k for k in range(DRAFT_MAX + 1)])
    assert rt.costs is not None
    monkeypatch.setattr(rt.costs, "record", lambda *a, **k: None)
    # the synthetic model prefills its prompt in well under a second: what counts as long
    # is set (a short prompt's prefill does not cut anyone's drafts)
    monkeypatch.setattr(step_runs, "LONG_PREFILL_S", 0.0 if long_prompt else 1e9)
    cap = rt.costs.curve().longest_within(step_runs.PREFILL_STEP_DECODES)
    assert cap == 4
    seen: list[tuple[bool, ForwardTiming]] = []
    real = step_runs.step_many

    def spy(live: Any, *, on_forward: Any = None, max_draft: int | None = None) -> Any:
        def hear(f: ForwardTiming) -> None:
            seen.append((max_draft is not None, f))
            if on_forward is not None:
                on_forward(f)
        return real(live, on_forward=hear, max_draft=max_draft)

    monkeypatch.setattr(step_runs, "step_many", spy)
    short = _prompt(rt, 24, 0)
    answer = testrule.reference_continuation(short, 1500)
    rows = prefill_chunk_rows(rt.context)
    long = _prompt(rt, 6 * rows, 1000)
    sched = Scheduler(rt, step_budget_s=0.05)
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        rt.prefix_cache.clear()
        alone = await _drain(sched.submit(GenerationRequest(long, max_tokens=8, proposer="off")))
        rt.prefix_cache.clear()
        bystander = sched.submit(GenerationRequest(
            short, max_tokens=1500, proposer="prediction",
            proposer_options={"tokens": list(answer)}))
        got: list[int] = []

        async def follow() -> None:
            got.extend(await _drain(bystander))

        tg.start_soon(follow)
        with anyio.fail_after(60):
            while not any(f.rows > 1 for _, f in seen):
                await anyio.sleep(0.001)
        beside = await _drain(sched.submit(GenerationRequest(long, max_tokens=8,
                                                             proposer="off")))
        with anyio.fail_after(60):
            while sum(not during for during, _ in seen[-3:]) < 3:
                await anyio.sleep(0.001)
        bystander.cancel()
        tg.cancel_scope.cancel()
    assert beside == alone
    during = [f.rows for cut, f in seen if cut]
    free = [f.rows for cut, f in seen if not cut]
    assert max(free) > 1 + cap, free  # alone it drafts past the cut, before and after
    if long_prompt:
        assert during and max(during) <= 1 + cap, during
    else:
        assert not during
