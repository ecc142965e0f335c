"""llama-server's ``GET /slots`` on SmolLM2 with two slots: busy while a request decodes,
idle once it ends or its client leaves, ``fail_on_no_slot`` when all are busy, no prompt
text, and 501 when turned off."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest

from meshd.daemon.config.http import HttpConfig
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from tests.integration.helpers.daemon import assert_no_leaks, wait_idle
from tests.integration.helpers.http_api import http_daemon

pytestmark = pytest.mark.anyio

PROMPT = "Once upon a time, in a quiet village by the sea,"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


@contextlib.asynccontextmanager
async def streaming(http: httpx.AsyncClient, max_tokens: int) -> AsyncIterator[None]:
    """A streamed completion that has sent its first tokens; the client leaves on exit."""
    body = {"prompt": PROMPT, "n_predict": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with http.stream("POST", "/completion", json=body) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()  # held: a collected iterator would close the response
        async for line in lines:
            if line.startswith("data: {"):
                break
        yield


async def slots_now(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    r = await http.get("/slots")
    assert r.status_code == 200
    body: list[dict[str, Any]] = r.json()
    return body


async def test_a_decoding_request_holds_a_slot_until_it_ends(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        idle = await slots_now(http)
        assert [s["id"] for s in idle] == [0, 1]
        assert all(s["n_ctx"] == 512 and s["is_processing"] is False for s in idle)
        assert all(s["next_token"][0]["n_remain"] == -1 for s in idle)
        async with streaming(http, 400):
            busy = await slots_now(http)
            working = [s for s in busy if s["is_processing"]]
            assert len(working) == 1
            token = working[0]["next_token"][0]
            assert token["n_decoded"] >= 1 and token["n_remain"] == 400 - token["n_decoded"]
            # Nothing of the request's text is shown.
            assert PROMPT not in json.dumps(busy) and "params" not in working[0]
        # The client left: the slot is free again within a step or two.
        with anyio.fail_after(30):
            while any(s["is_processing"] for s in await slots_now(http)):
                await anyio.sleep(0.05)
        r = await http.post("/completion", json={"prompt": PROMPT, "n_predict": 4})
        assert r.status_code == 200
        after = await slots_now(http)
        assert all(not s["is_processing"] and s["next_token"][0]["n_decoded"] == 0
                   for s in after)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_fail_on_no_slot_when_every_slot_is_busy(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        assert (await http.get("/slots?fail_on_no_slot=1")).status_code == 200
        async with streaming(http, 400), streaming(http, 400):
            r = await http.get("/slots?fail_on_no_slot=1")
            assert r.status_code == 503
            assert r.json()["error"]["message"] == "no slot available"
        await wait_idle(server)
        assert_no_leaks(server)


async def test_slots_can_be_turned_off(smol: ModelRuntime) -> None:
    async with http_daemon(smol, HttpConfig(slots_endpoint=False)) as (_server, _path, http):
        r = await http.get("/slots")
        assert r.status_code == 501
        assert r.json()["error"]["type"] == "not_supported_error"
        assert (await http.post("/slots")).status_code == 405
