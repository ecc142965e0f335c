"""A prompt is prefilled once however many sequences need it: ``n`` choices share one
prefill, and a request whose prompt opens with what a running request holds copies that
prefix. Every answer stays the one its request gets alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from meshd.daemon.engine.prefill import MIN_SHARED
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from tests.integration.helpers.daemon import assert_no_leaks, wait_idle
from tests.integration.helpers.http_api import http_daemon

pytestmark = pytest.mark.anyio
SYSTEM = ("You are a careful assistant for a small bakery. Answer questions about bread, "
          "opening hours, allergens and orders. Opening hours are eight to six on weekdays "
          "and nine to one on Saturdays; the shop is closed on Sundays. Every loaf is "
          "baked on the day it is sold. Rye, spelt and wheat flours are used; nuts are "
          "handled in the same kitchen. Orders for more than ten loaves need a day's "
          "notice. Keep answers short and friendly.")


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=4, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


async def _stream(http: Any, body: dict[str, Any]) -> tuple[dict[int, str], list[dict[str, Any]]]:
    """Each choice's text, and each choice's final ``meshd`` block, of a streamed chat."""
    texts: dict[int, str] = {}
    blocks: list[dict[str, Any]] = []
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + (c["delta"].get("content") or "")
            if "meshd" in chunk:
                blocks.append(chunk["meshd"])
    return texts, blocks


async def test_n_choices_share_one_prefill(smol: ModelRuntime) -> None:
    smol.prefix_cache.clear()
    body = {"messages": _chat("When can I buy rye bread on Saturday?"), "max_tokens": 10,
            "temperature": 1.0, "seed": 7, "n": 3}
    async with http_daemon(smol) as (server, _path, http):
        prompt_tokens = (await http.post("/v1/chat/completions", json={
            **body, "n": 1, "max_tokens": 1})).json()["usage"]["prompt_tokens"]
        assert prompt_tokens >= MIN_SHARED + 32
        smol.prefix_cache.clear()  # so that no choice starts from the cache
        texts, blocks = await _stream(http, body)
        prefilled = sum(b["extra"]["prefill_tokens"] for b in blocks)
        assert len(blocks) == 3
        # One prefill of the prompt; any choice admitted later decodes its last token.
        assert prompt_tokens <= prefilled <= prompt_tokens + 2, prefilled
        for i in range(3):
            smol.prefix_cache.clear()
            alone = (await http.post("/v1/chat/completions", json={
                **body, "n": 1, "seed": 7 + i})).json()
            assert texts[i] == alone["choices"][0]["message"]["content"]
        assert len(set(texts.values())) > 1
        await wait_idle(server)
        assert_no_leaks(server)


async def test_a_request_copies_the_prefix_a_running_request_holds(
        smol: ModelRuntime) -> None:
    smol.prefix_cache.clear()
    first = {"messages": _chat("Tell me about your spelt loaves."), "max_tokens": 120,
             "temperature": 0, "stream": True}
    second = {"messages": _chat("Do you open on Sundays?"), "max_tokens": 12,
              "temperature": 0}
    async with http_daemon(smol) as (server, _path, http):
        async with http.stream("POST", "/v1/chat/completions", json=first) as running:
            lines = running.aiter_lines()
            async for line in lines:  # the first request is decoding
                if line.startswith("data: ") and '"content"' in line:
                    break
            shared = (await http.post("/v1/chat/completions", json=second)).json()
            async for _ in lines:
                pass
        prompt_tokens = shared["usage"]["prompt_tokens"]
        cached = shared["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= MIN_SHARED and cached < prompt_tokens
        smol.prefix_cache.clear()
        alone = (await http.post("/v1/chat/completions", json=second)).json()
        assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert shared["choices"][0]["message"]["content"] == \
            alone["choices"][0]["message"]["content"]
        await wait_idle(server)
        assert_no_leaks(server)
