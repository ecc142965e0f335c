"""``n`` choices (up to 8) through the official client: each choice is the answer its
own seed (the request's plus its index) gives alone, streamed or not; usage counts the
prompt once and every choice's tokens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from tests.integration.helpers.daemon import assert_no_leaks, wait_idle
from tests.integration.helpers.http_api import http_daemon, openai_client

pytestmark = pytest.mark.anyio
ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=4, draft_max=6,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


async def test_each_choice_is_its_seeds_answer(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        got = await api.chat.completions.create(model="m", messages=ASK, max_tokens=12,
                                                temperature=1.0, seed=100, n=3)
        assert [c.index for c in got.choices] == [0, 1, 2]
        assert (got.model_extra or {})["meshd"]["seeds"] == [100, 101, 102]
        texts, emitted = [], 0
        for i, choice in enumerate(got.choices):
            alone = await api.chat.completions.create(model="m", messages=ASK, max_tokens=12,
                                                      temperature=1.0, seed=100 + i)
            assert choice.message.content == alone.choices[0].message.content
            texts.append(choice.message.content)
            emitted += alone.usage.completion_tokens
        assert len(set(texts)) > 1  # different seeds, different samples
        assert got.usage.completion_tokens == emitted
        assert got.usage.prompt_tokens == alone.usage.prompt_tokens
        stream = await api.chat.completions.create(model="m", messages=ASK, max_tokens=12,
                                                   temperature=1.0, seed=100, n=3,
                                                   stream=True)
        parts: dict[int, str] = {}
        finished: set[int] = set()
        async for ch in stream:
            for c in ch.choices:
                parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
                if c.finish_reason:
                    finished.add(c.index)
        assert finished == {0, 1, 2}
        assert [parts[i] for i in range(3)] == texts
        r = await http.post("/v1/chat/completions", json={"messages": ASK, "n": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        await wait_idle(server)
        assert_no_leaks(server)
