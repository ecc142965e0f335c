"""Resumable streams, as llama-server keeps them: a streamed answer sent with an
``X-Conversation-Id`` is replayed by ``GET /v1/stream`` from any byte offset, runs on when
its client goes, and stops only on ``DELETE /v1/stream``."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator

import anyio
import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig

from .daemon_helpers import assert_no_leaks, wait_idle
from .test_http import http_daemon

pytestmark = pytest.mark.anyio
CONV = "conv-1::org/model:Q8_0"  # (slashes and colons travel in the query string)
QS = "conv_id=" + urllib.parse.quote(CONV, safe="")
ASK = {"messages": [{"role": "user", "content": "Count to twenty."}], "temperature": 0,
       "stream": True}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=2, calibrate=False, threads=1))
    yield rt
    rt.close()


def _finish(sse: bytes) -> str | None:
    """The finish reason a chat stream's bytes end with."""
    reasons = [c["finish_reason"] for line in sse.decode().splitlines()
               if line.startswith("data: {")
               for c in json.loads(line[6:]).get("choices", []) if c.get("finish_reason")]
    return reasons[-1] if reasons else None


async def test_a_stream_is_replayed_from_any_offset_then_stopped(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        headers = {"X-Conversation-Id": CONV}
        got = b""
        async with http.stream("POST", "/v1/chat/completions", headers=headers,
                               json={**ASK, "max_tokens": 12}) as r:
            async for part in r.aiter_bytes():
                got += part
        assert got.endswith(b"data: [DONE]\n\n")
        replay = await http.get(f"/v1/stream?{QS}&from=0")
        assert replay.status_code == 200 and replay.content == got
        tail = await http.get(f"/v1/stream?{QS}&from=25")
        assert tail.content == got[25:]
        found = (await http.post("/v1/streams/lookup", json={
            "conversation_ids": ["conv-1", "other"]})).json()
        assert [(s["conversation_id"], s["is_done"], s["total_bytes"]) for s in found] == \
            [(CONV, True, len(got))]
        assert (await http.get("/v1/stream?from=0")).status_code == 400
        assert (await http.get(f"/v1/stream?{QS}&from=x")).status_code == 400
        stop = await http.delete(f"/v1/stream?{QS}")
        assert stop.status_code == 204
        assert (await http.get(f"/v1/stream?{QS}&from=0")).status_code == 404
        await wait_idle(server)
        assert_no_leaks(server)


async def test_the_answer_runs_on_when_its_client_goes_and_the_replay_follows_it(
        smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        async with http.stream("POST", "/v1/chat/completions",
                               headers={"X-Conversation-Id": CONV},
                               json={**ASK, "max_tokens": 60}) as r:
            async for _ in r.aiter_bytes():
                break  # the page reloads: the client is gone after its first bytes
        replay = await http.get(f"/v1/stream?{QS}&from=0")  # follows it to the end
        assert replay.status_code == 200 and replay.content.endswith(b"data: [DONE]\n\n")
        assert _finish(replay.content) in ("stop", "length")
        answered = "".join(
            c["delta"].get("content") or "" for line in replay.text.splitlines()
            if line.startswith("data: {") for c in json.loads(line[6:]).get("choices", []))
        plain = (await http.post("/v1/chat/completions", json={
            **ASK, "stream": False, "max_tokens": 60})).json()
        assert answered == plain["choices"][0]["message"]["content"]
        await wait_idle(server)
        assert_no_leaks(server)


async def test_delete_stops_the_generation(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        got = b""
        async with http.stream("POST", "/v1/chat/completions",
                               headers={"X-Conversation-Id": CONV},
                               json={**ASK, "max_tokens": 400}) as r:
            async for part in r.aiter_bytes():
                got += part
                if b"\"content\"" in got and b"DELETE" not in got:
                    with anyio.fail_after(5):
                        assert (await http.delete(f"/v1/stream?{QS}")).status_code == 204
                    got += b"DELETE"
        assert _finish(got.replace(b"DELETE", b"")) == "cancelled"
        assert (await http.get(f"/v1/stream?{QS}&from=0")).status_code == 404
        await wait_idle(server)
        assert_no_leaks(server)
