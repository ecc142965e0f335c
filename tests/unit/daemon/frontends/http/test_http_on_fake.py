"""OpenAI-compatible HTTP through the front end to a daemon on the fake runtime: what an
HTTP client sees (bodies, SSE chunks, status codes)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from meshd.testing.fake_runtime import STORY
from tests.unit.daemon.fake_daemon import fake_daemon, fake_model_runtime

pytestmark = pytest.mark.anyio
CHAT = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def client(path: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path),
                             base_url="http://meshd", timeout=10)


async def test_a_chat_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    async with fake_daemon(fake_model_runtime(monkeypatch)) as (_, path), client(path) as h:
        r = await h.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    body = r.json()
    choice = body["choices"][0]
    assert (choice["message"]["role"], choice["message"]["content"]) == ("assistant", STORY)
    assert choice["finish_reason"] == "stop"  # the model's end of generation
    assert body["usage"]["completion_tokens"] == len(STORY) + 1  # + the EOS token


async def test_a_streamed_chat_completion_says_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 12}
    async with fake_daemon(fake_model_runtime(monkeypatch)) as (_, path), client(path) as h, \
            h.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") async for line in r.aiter_lines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks: list[dict[str, Any]] = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or ""
                   for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert text == STORY[:12] and finish[-1] == "length"


async def test_a_text_completion_and_a_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    async with fake_daemon(fake_model_runtime(monkeypatch)) as (_, path), client(path) as h:
        r = await h.post("/v1/completions", json={"prompt": "Once upon", "stop": ["fox"],
                                                  "temperature": 0})
    choice = r.json()["choices"][0]
    answer = STORY[len("Once upon"):]
    assert (choice["text"], choice["finish_reason"]) == (answer[:answer.index("fox")], "stop")


async def test_bad_requests_are_400s_that_name_the_field(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with fake_daemon(fake_model_runtime(monkeypatch)) as (_, path), client(path) as h:
        not_json = await h.post("/v1/chat/completions", content=b"{nope",
                                headers={"content-type": "application/json"})
        too_many = await h.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10**6})
        proposer = await h.post("/v1/completions", json={
            "prompt": "Once upon", "speculative": {"proposer": "no-such"}})
        ok = await h.post("/v1/completions", json={"prompt": "Once upon", "max_tokens": 3,
                                                   "temperature": 0})
    assert not_json.status_code == 400
    assert too_many.status_code == 400 and "max_tokens" in too_many.text
    assert proposer.status_code == 400
    assert proposer.json()["error"]["param"] == "speculative.proposer"
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == " a "
