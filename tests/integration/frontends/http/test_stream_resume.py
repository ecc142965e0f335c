"""Resumable streams, as llama-server keeps them: a streamed answer sent with an
``X-Conversation-Id`` is replayed by ``GET /v1/stream`` from any byte offset, runs on when
its client goes, and stops only on ``DELETE /v1/stream``. A stream is its creator's: another
peer (another uid on the socket, another API key over TCP) gets 404s, and reusing a live
id is a 409 that leaves the first stream running."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator

import anyio
import attrs
import httpx
import pytest

from meshd.daemon.commands.server import serving
from meshd.daemon.config.http import HttpConfig
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from tests.integration.helpers.daemon import assert_no_leaks, short_tempdir, wait_idle
from tests.integration.helpers.http_api import http_daemon

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


async def _started(http: httpx.AsyncClient, conversation: str) -> None:
    """Start a long resumable completion (it counts on to its ``max_tokens``) and leave
    once it streams: the generation runs on without its client."""
    async with http.stream("POST", "/v1/completions",
                           headers={"X-Conversation-Id": conversation},
                           json={"prompt": "1, 2, 3, 4, 5,", "max_tokens": 200,
                                 "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        async for _ in r.aiter_bytes():
            break


async def _assert_unseen(http: httpx.AsyncClient) -> None:
    """Read, list and delete all answer as for an id never used."""
    for r in (await http.get(f"/v1/stream?{QS}&from=0"), await http.delete(f"/v1/stream?{QS}")):
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert r.json()["error"]["message"] == "stream not found or expired"
    found = await http.post("/v1/streams/lookup", json={"conversation_ids": ["conv-1"]})
    assert found.status_code == 200 and found.json() == []


async def test_a_stream_is_its_creators_and_a_live_id_is_not_taken_over(
        smol: ModelRuntime) -> None:
    """Owners: the Unix socket's uid, and each API key over TCP (a rotated key is
    another owner). Others get 404s and cannot stop it; its creator reusing the live id
    gets a 409 naming it, and the first stream still completes."""
    path = f"{short_tempdir()}/s"
    config = ServerConfig(http=HttpConfig(api_key="key-one"))
    async with serving(smol, path, config, http="tcp:127.0.0.1:0") as server:
        assert server.http_listener is not None
        base = f"http://127.0.0.1:{server.http_listener.address.rpartition(':')[2]}"
        unix = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path),
                                 base_url="http://meshd", timeout=60)
        one = httpx.AsyncClient(base_url=base, timeout=60,
                                headers={"Authorization": "Bearer key-one"})
        async with unix, one:
            await _started(unix, CONV)
            await _assert_unseen(one)  # the socket's stream, asked for over TCP
            again = await unix.post("/v1/completions", headers={"X-Conversation-Id": CONV},
                                    json={"prompt": "Hi", "max_tokens": 4, "stream": True})
            assert again.status_code == 409, again.text
            err = again.json()["error"]
            assert err["code"] == "conflict" and CONV in err["message"]
            replay = await unix.get(f"/v1/stream?{QS}&from=0")  # the first one runs on
            assert replay.status_code == 200 and replay.content.endswith(b"data: [DONE]\n\n")
            assert _finish(replay.content) == "length"
            # Over TCP the same id is the key's own stream; another key does not see it.
            await _started(one, CONV)
            server.reconfigure(attrs.evolve(config, http=HttpConfig(api_key="key-two")))
            async with httpx.AsyncClient(base_url=base, timeout=60, headers={
                    "Authorization": "Bearer key-two"}) as two:
                await _assert_unseen(two)
            server.reconfigure(config)
            async with httpx.AsyncClient(base_url=base, timeout=60, headers={
                    "Authorization": "Bearer key-one"}) as one_again:
                found = (await one_again.post("/v1/streams/lookup", json={
                    "conversation_ids": ["conv-1"]})).json()
                assert [s["conversation_id"] for s in found] == [CONV]
                replay = await one_again.get(f"/v1/stream?{QS}&from=0")
                assert _finish(replay.content) == "length"
                assert (await one_again.delete(f"/v1/stream?{QS}")).status_code == 204
            assert (await unix.get(f"/v1/stream?{QS}&from=0")).status_code == 200
            await wait_idle(server)
            assert_no_leaks(server)


_OTHER_UID = 65534  # nobody
_AS_OTHER = """
import json, sys, httpx
conv, qs = sys.argv[1], sys.argv[2]
with httpx.Client(transport=httpx.HTTPTransport(uds=sys.argv[3]), base_url="http://meshd",
                  timeout=60) as http:
    got = [http.get(f"/v1/stream?{qs}&from=0").status_code,
           http.delete(f"/v1/stream?{qs}").status_code,
           http.post("/v1/streams/lookup", json={"conversation_ids": ["conv-1"]}).json()]
    with http.stream("POST", "/v1/completions", headers={"X-Conversation-Id": conv},
                     json={"prompt": "Hi", "max_tokens": 3, "stream": True}) as r:
        got.append(r.status_code)
        r.read()
    got.append(http.get(f"/v1/stream?{qs}&from=0").status_code)
print(json.dumps(got))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
async def test_another_uid_on_the_socket_neither_sees_nor_stops_the_stream(
        smol: ModelRuntime) -> None:
    """Two real peers on the Unix socket (root and nobody, told apart by SO_PEERCRED):
    nobody's read, delete and lookup of root's live stream answer as for no stream, and
    nobody's own stream of the same id is its own; root's runs on to its end."""
    async with http_daemon(smol) as (server, path, http):
        os.chmod(os.path.dirname(path), 0o755)
        os.chmod(path, 0o666)
        await _started(http, CONV)
        done = await anyio.to_thread.run_sync(functools.partial(
            subprocess.run, [sys.executable, "-c", _AS_OTHER, CONV, QS, path],
            user=_OTHER_UID, capture_output=True, text=True, timeout=120, check=False))
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == [404, 404, [], 200, 200]
        replay = await http.get(f"/v1/stream?{QS}&from=0")
        assert replay.status_code == 200 and _finish(replay.content) == "length"
        await wait_idle(server)
        assert_no_leaks(server)
