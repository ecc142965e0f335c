"""Concurrent requests on the hybrid qwen35 model with its MTP head each get exactly the
tokens they get alone (and with speculation off).

Why it needs its own test: every session's recurrent state, rollback snapshots and MTP
hidden rows are per sequence in llama.cpp, and a mistake in keeping them apart changes
tokens only when several hybrid sessions are served at once, verifying and repairing
(in place, or by restoring a checkpoint and replaying) between each other's forwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from meshd.daemon.engine.sampling import GREEDY, SamplingParams
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.protocol import Client, Completion
from meshd.testing import testmodels
from tests.integration.helpers.daemon import reference, running_daemon, wait_idle

pytestmark = pytest.mark.anyio

SLOTS = 4


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=["rollback", "checkpoint"])
def qwen35(request: pytest.FixtureRequest) -> Iterator[ModelRuntime]:
    """Hybrid model + MTP head; windows undone in place, or (with in-place rollback off)
    by restoring a checkpoint and replaying, which decodes between two steps."""
    path = str(testmodels.test_model_path("qwen35", acceptance=0.74))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=SLOTS,
                                    draft_max=6, calibrate=False, threads=1,
                                    in_place_rollback=request.param == "rollback"))
    yield rt
    assert rt.idle_slots == SLOTS
    rt.close()


#: (prompt, max_tokens, sampling, draft_max): different prompts, lengths, draft lengths,
#: greedy and seeded sampling.
REQUESTS = [
    ("The quick brown fox", 70, GREEDY, 3),
    ("abc def ghi jkl", 61, SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7), 3),
    ("hello world, hello", 80, GREEDY, 2),
    ("x", 55, SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=12345), 6),
    ("request number five", 66, GREEDY, 1),
    ("mtp mtp mtp", 48, SamplingParams(temperature=0.5, top_k=40, top_p=0.95, seed=99), 4),
]


async def _generate(client: Client, i: int) -> Completion:
    prompt, max_tokens, sp, k = REQUESTS[i]
    return await client.generate(
        prompt, max_tokens=max_tokens, temperature=sp.temperature, top_k=sp.top_k,
        top_p=sp.top_p, seed=sp.seed, proposer="mtp", draft_max=k).collect()


async def test_concurrent_mtp_requests_equal_single_client_runs(qwen35: ModelRuntime) -> None:
    off = [reference(qwen35, qwen35.tokenize_prompt(p, chat=False), max_tokens=n,
                     sampling=sp)[0] for p, n, sp, _ in REQUESTS]
    async with running_daemon(qwen35) as (server, path):
        alone: list[Completion] = []
        async with Client.connect(path) as client:
            for i in range(len(REQUESTS)):
                alone.append(await _generate(client, i))
        assert [list(c.token_ids) for c in alone] == off  # speculation changes nothing
        for c in alone:
            assert c.done.speculation.proposer == "mtp" and c.done.speculation.drafted > 0

        together: dict[int, Completion] = {}

        async def one(i: int) -> None:
            async with Client.connect(path) as client:
                together[i] = await _generate(client, i)

        async with anyio.create_task_group() as tg:  # 6 requests on 4 slots: 2 wait
            for i in range(len(REQUESTS)):
                tg.start_soon(one, i)
        await wait_idle(server)
    assert [list(together[i].token_ids) for i in range(len(REQUESTS))] == \
        [list(c.token_ids) for c in alone]



#: Four requests drafting the same window length (so their windows can share forwards).
SAME_K = [
    ("The quick brown fox", 64, GREEDY),
    ("abc def ghi jkl", 60, SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)),
    ("hello world, hello", 72, GREEDY),
    ("mtp mtp mtp", 56, SamplingParams(temperature=0.5, top_k=40, top_p=0.95, seed=99)),
]


async def test_concurrent_mtp_requests_share_forwards(qwen35: ModelRuntime) -> None:
    """4 concurrent qwen35+MTP requests on 4 slots get their single-client tokens while
    their windows share forwards: the context runs fewer forwards than the requests
    count between them (each request counts every forward that held its rows)."""

    async def generate(client: Client, i: int) -> Completion:
        prompt, max_tokens, sp = SAME_K[i]
        return await client.generate(
            prompt, max_tokens=max_tokens, temperature=sp.temperature, top_k=sp.top_k,
            top_p=sp.top_p, seed=sp.seed, proposer="mtp", draft_max=3).collect()

    async with running_daemon(qwen35) as (server, path):
        async with Client.connect(path) as client:
            alone = [await generate(client, i) for i in range(len(SAME_K))]
        await wait_idle(server)
        together: dict[int, Completion] = {}

        async def one(i: int) -> None:
            async with Client.connect(path) as client:
                together[i] = await generate(client, i)

        forwards_before = qwen35.context.forward_id
        async with anyio.create_task_group() as tg:
            for i in range(len(SAME_K)):
                tg.start_soon(one, i)
        await wait_idle(server)
        forwards = qwen35.context.forward_id - forwards_before
    assert [list(together[i].token_ids) for i in range(len(SAME_K))] == \
        [list(c.token_ids) for c in alone]
    counted = sum(together[i].done.speculation.target_forwards for i in range(len(SAME_K)))
    assert all(c.done.speculation.drafted > 0 for c in together.values())
    # Prefills run alone: the sharing is in the decode steps.
    assert forwards < 0.75 * counted, (forwards, counted)
