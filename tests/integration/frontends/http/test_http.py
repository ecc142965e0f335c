"""The daemon's HTTP side on SmolLM2: the official openai client over the Unix socket,
output identical to the native protocol's, /metrics parsed by prometheus_client, and
malformed HTTP answered with a 4xx or a close while the daemon keeps serving."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator

import anyio
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshd.daemon.config.http import HttpConfig
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.daemon.system.peercred import PeerPolicy
from meshd.protocol import Client, StreamReceiver
from tests.integration.helpers.daemon import (
    assert_no_leaks,
    assert_serves,
    running_daemon,
    wait_idle,
)
from tests.integration.helpers.http_api import http_daemon, openai_client, raw_exchange, status_of

pytestmark = pytest.mark.anyio

PROMPT = "The three primary colours are"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # httpx (and so the openai client) runs on asyncio here


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    assert rt.idle_slots == 2
    rt.close()


def metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus text exposition, by name and labels."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_openai_completion_equals_native_output(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, path, http):
        api = openai_client(http)
        got = await api.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24,
                                           temperature=0)
        async with Client.connect(path) as native:
            ref = await native.generate(PROMPT, max_tokens=24, temperature=0.0).collect()
        assert got.choices[0].text == ref.text
        assert got.usage is not None
        assert got.usage.completion_tokens == len(ref.token_ids)
        assert got.usage.prompt_tokens == ref.done.usage.prompt_tokens
        assert got.choices[0].finish_reason == ref.done.finish_reason.value == "length"
        extra = got.model_extra or {}
        assert extra["timings"]["predicted_n"] == len(ref.token_ids)
        assert extra["timings"]["draft_n"] == extra["meshd"]["drafted"]
        assert extra["meshd"]["emitted"] == len(ref.token_ids)
        # Speculation off over HTTP gives the same text as the native request with it on.
        off = await api.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=24, temperature=0,
            extra_body={"speculative": {"enabled": False}})
        assert off.choices[0].text == ref.text
        assert (off.model_extra or {})["meshd"]["proposer"] is None
        # Seeded sampling: the same draws as the native request with the same parameters.
        sampled = await api.completions.create(model="smollm2", prompt=PROMPT, max_tokens=24,
                                               temperature=0.9, top_p=0.95, seed=1234)
        async with Client.connect(path) as native:
            ref_sampled = await native.generate(PROMPT, max_tokens=24, temperature=0.9,
                                                top_k=0, top_p=0.95, seed=1234).collect()
        assert sampled.choices[0].text == ref_sampled.text
        assert (sampled.model_extra or {})["meshd"]["seed"] == 1234
        assert extra["meshd"]["seed"] is None  # greedy
        # Unseeded sampling reports the seed the daemon chose; sending it back repeats.
        first = await api.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12,
                                             temperature=1.0)
        chosen = (first.model_extra or {})["meshd"]["seed"]
        again = await api.completions.create(model="smollm2", prompt=PROMPT, max_tokens=12,
                                             temperature=1.0, seed=chosen)
        assert isinstance(chosen, int) and again.choices[0].text == first.choices[0].text
        await wait_idle(server)
        assert_no_leaks(server)


async def test_openai_streamed_chat_equals_native_chat(smol: ModelRuntime) -> None:
    messages = [{"role": "user", "content": "Say hello in French."}]
    async with http_daemon(smol) as (server, path, http):
        api = openai_client(http)
        stream = await api.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"speculative": {
                "proposer": "ngram", "draft_max": 3}})
        pieces: list[str] = []
        finish = None
        usage = None
        roles = []
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.role:
                    roles.append(choice.delta.role)
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        async with Client.connect(path) as native:
            ref = await native.generate(messages=messages, max_tokens=20,
                                        temperature=0.0).collect()
        assert "".join(pieces) == ref.text
        assert roles == ["assistant"]
        assert finish == ("stop" if ref.done.finish_reason.value in ("stop", "eog")
                          else ref.done.finish_reason.value)
        assert usage is not None and usage.completion_tokens == len(ref.token_ids)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_raw_sse_ends_with_done(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (_server, _path, http):
        async with http.stream("POST", "/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line async for line in r.aiter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert all(e["object"] == "text_completion" for e in events)
        final = events[-1]
        assert final["choices"][0]["finish_reason"] == "length"
        assert final["timings"]["predicted_n"] == 5
        assert "".join(e["choices"][0]["text"] for e in events)


async def test_openai_bad_requests_get_400_in_openai_shape(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, path, http):
        api = openai_client(http)
        with pytest.raises(openai.BadRequestError) as caught:
            await api.completions.create(model="smollm2", prompt=PROMPT, temperature=7)
        assert caught.value.status_code == 400
        body = caught.value.body
        assert isinstance(body, dict) and body["param"] == "temperature"
        assert body["type"] == "invalid_request_error" and "temperature" in body["message"]
        with pytest.raises(openai.BadRequestError, match="from 1 to 8"):
            await api.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "hi"}], n=9)
        with pytest.raises(openai.BadRequestError, match="unknown proposer"):
            await api.completions.create(model="smollm2", prompt=PROMPT, extra_body={
                "speculative": {"proposer": "nonsense"}})
        r = await http.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        r = await http.post("/v1/completions", json={"prompt": "x" * 20000,
                                                     "max_tokens": 4})
        assert r.status_code == 400 and "does not fit the context" in r.json()["error"][
            "message"]
        r = await http.get("/v1/nothing")
        assert r.status_code == 404
        r = await http.get("/v1/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        await assert_serves(path)
        assert_no_leaks(server)


async def test_health_and_models(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        r = await http.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        models = await openai_client(http).models.list()
        assert [m.id for m in models.data] == [server.service.model.name]


async def test_metrics_parse_and_move_and_agree_with_stats(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, path, http):
        before = metrics((await http.get("/metrics")).text)
        r = await http.post("/v1/completions", json={
            "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3,",
            "max_tokens": 16, "temperature": 0, "speculative": {"proposer": "ngram"}})
        assert r.status_code == 200
        await http.post("/v1/completions", json={"prompt": PROMPT, "n": 30})  # a 400
        resp = await http.get("/metrics")
        assert resp.headers["content-type"].startswith("text/plain")
        after = metrics(resp.text)
        model = server.service.model.name  # every figure of a model carries its name

        def delta(name: str, **labels: str) -> float:
            if not name.startswith("meshd_protocol_errors"):
                labels["model"] = model
            key = (name, tuple(sorted(labels.items())))
            return after.get(key, 0.0) - before.get(key, 0.0)

        assert delta("meshd_requests_total", finish_reason="length") == 1
        assert delta("meshd_protocol_errors_total", code="bad_request") == 1
        assert delta("meshd_target_forwards_total") >= 1
        assert delta("meshd_generation_tokens_total") == 16
        assert delta("meshd_time_to_first_token_seconds_count") == 1
        assert delta("meshd_inter_token_latency_seconds_count") == 15
        assert delta("meshd_verify_seconds_count") >= 1
        drafts = delta("meshd_spec_decode_num_drafts_total", proposer="ngram")
        drafted = delta("meshd_spec_decode_num_draft_tokens_total", proposer="ngram")
        accepted = delta("meshd_spec_decode_num_accepted_tokens_total", proposer="ngram")
        timings = r.json()["timings"]
        assert drafted == timings["draft_n"] and accepted == timings["draft_n_accepted"]
        assert drafts >= 1 and drafted >= drafts and accepted >= 1
        per_pos = delta("meshd_spec_decode_num_accepted_tokens_per_pos_total",
                        proposer="ngram", position="0")
        assert 1 <= per_pos <= drafts
        for gauge in ("meshd_requests_active", "meshd_requests_queued",
                      "meshd_prefix_cache_tokens", "meshd_checkpoint_bytes"):
            assert (gauge, (("model", model),)) in after
        assert after[("meshd_model_state", (("model", model), ("state", "loaded")))] == 1
        # One source of truth: the stats op reports the same numbers.
        async with Client.connect(path) as native:
            stats = await native.stats()
        final = metrics((await http.get("/metrics")).text)
        m = ("model", model)
        assert final[("meshd_target_forwards_total", (m,))] == stats.counters["forwards"]
        assert final[("meshd_requests_total", (("finish_reason", "length"), m))] == \
            stats.counters["finish_length"]
        assert final[("meshd_spec_decode_num_draft_tokens_total", (m, ("proposer", "ngram")))] \
            == stats.proposers["ngram"].drafted
        assert final[("meshd_time_to_first_token_seconds_count", (m,))] == \
            stats.counters["time_to_first_token_seconds_count"]
        assert final[("meshd_protocol_errors_total", (("code", "bad_request"),))] == \
            stats.counters["errors_bad_request"]
        assert_no_leaks(server)


async def test_keep_alive_and_pipelining(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (_server, path, _http):
        got = await raw_exchange(path, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                                       b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
                                       b"Connection: close\r\n\r\n")
        assert got.count(b"HTTP/1.1 200 ") == 2
        assert b'"object": "list"' in got


@pytest.mark.parametrize("request_bytes, statuses", [
    pytest.param(b"BREW /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", {405},
                 id="bad-method"),
    pytest.param(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Pad: " + b"a" * (1 << 20)
                 + b"\r\n\r\n", {431}, id="1MB-headers"),
    pytest.param(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                 b"\r\nzz\r\nnot hex at all\r\n", {400}, id="chunked-garbage"),
    pytest.param(b"GET /" + b"a" * 200_000, {0, 400, 414, 431}, id="unterminated-line"),
    pytest.param(b"GET / HTTP/9.9\r\n\r\n", {400, 505}, id="bad-version"),
    pytest.param(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n"
                 b"\r\n", {413}, id="huge-body"),
])
async def test_malformed_http_gets_4xx_or_close_and_daemon_serves(
        smol: ModelRuntime, request_bytes: bytes, statuses: set[int]) -> None:
    async with http_daemon(smol, HttpConfig(request_timeout_s=2.0)) as (server, path, http):
        got = await raw_exchange(path, request_bytes, timeout=20)
        assert status_of(got) in statuses, got[:200]
        if status_of(got):
            assert b'"error"' in got
        await assert_serves(path)
        assert (await http.get("/health")).status_code == 200
        assert_no_leaks(server)


async def test_slowloris_is_closed_after_the_request_timeout(smol: ModelRuntime) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"s" * 400
    async with http_daemon(smol, HttpConfig(request_timeout_s=0.5)) as (_s, path, http):
        stream = await anyio.connect_unix(path)
        receiver = StreamReceiver(stream)
        sent = 0
        closed = False
        try:
            async with anyio.create_task_group() as tg:
                async def wait_for_close() -> None:
                    nonlocal closed
                    try:
                        while await receiver.receive():
                            pass
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        closed = True
                    tg.cancel_scope.cancel()

                tg.start_soon(wait_for_close)
                with anyio.fail_after(30):
                    for i in range(len(request)):  # ~20 s if never cut off
                        try:
                            await stream.send(request[i:i + 1])
                        except (anyio.BrokenResourceError, OSError):
                            break
                        sent += 1
                        await anyio.sleep(0.05)
        finally:
            await receiver.aclose()
        assert closed and sent < len(request)
        assert (await http.get("/health")).status_code == 200
        await assert_serves(path)


async def test_client_disconnect_cancels_its_generation(smol: ModelRuntime) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                       "stream": True, "speculative": {"proposer": "ngram"}}).encode()
    async with http_daemon(smol) as (server, path, _http):
        cancelled = server.scheduler.statistics().cancelled
        for stream_it in (True, False):
            data = body if stream_it else body.replace(b'"stream": true', b'"stream": false')
            stream = await anyio.connect_unix(path)
            receiver = StreamReceiver(stream)
            await stream.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\nContent-Length: "
                              + str(len(data)).encode() + b"\r\n\r\n" + data)
            with anyio.fail_after(30):
                if stream_it:  # the first token is out
                    assert (await receiver.receive()).startswith(b"HTTP/1.1 200")
                else:  # the generation is decoding
                    while server.scheduler.active == 0:
                        await anyio.sleep(0.01)
            await receiver.aclose()
            await wait_idle(server, timeout=30)
        assert server.scheduler.statistics().cancelled == cancelled + 2
        assert_no_leaks(server)
        await assert_serves(path)


async def test_curl_over_the_unix_socket(smol: ModelRuntime) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed (.ci/run installs it)")
    async with http_daemon(smol) as (_server, path, _http):
        done = await anyio.run_process([
            curl, "-sS", "--unix-socket", path, "http://localhost/v1/chat/completions",
            "-H", "Content-Type: application/json", "-d", json.dumps({
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                "temperature": 0})])
        answer = json.loads(done.stdout)
        assert answer["object"] == "chat.completion"
        assert answer["usage"]["completion_tokens"] <= 4
        assert answer["choices"][0]["message"]["role"] == "assistant"
        metrics_text = (await anyio.run_process(
            [curl, "-sS", "--unix-socket", path, "http://localhost/metrics"])).stdout.decode()
        assert "meshd_spec_decode_num_drafts_total" in metrics_text or \
            "meshd_spec_decode_num_drafts" in metrics_text


async def test_expect_100_continue(smol: ModelRuntime) -> None:
    body = json.dumps({"prompt": "word " * 400, "max_tokens": 2, "temperature": 0}).encode()
    async with http_daemon(smol) as (server, path, _http):
        stream = await anyio.connect_unix(path)
        receiver = StreamReceiver(stream)
        try:
            await stream.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Expect: 100-continue\r\nConnection: close\r\n"
                              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            with anyio.fail_after(30):
                interim = await receiver.receive()
                assert interim.startswith(b"HTTP/1.1 100 ")
                await stream.send(body)
                got = bytearray()
                while True:
                    try:
                        got += await receiver.receive()
                    except anyio.EndOfStream:
                        break
        finally:
            await receiver.aclose()
        assert status_of(bytes(got)) == 200
        assert json.loads(bytes(got).partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 2
        assert_no_leaks(server)


async def test_the_socket_allow_list_applies_to_http(smol: ModelRuntime) -> None:
    """A user the allow-list does not name gets 403 ``forbidden`` over HTTP, as the
    native protocol refuses them; an allowed group is served."""
    curl = shutil.which("curl", path="/usr/bin:/bin")
    if os.getuid() != 0 or curl is None:
        pytest.skip("needs root (to connect as another user) and curl")
    config = ServerConfig(peers=PeerPolicy(gids=frozenset({12345})))
    async with running_daemon(smol, config) as (server, path):
        os.chmod(os.path.dirname(path), 0o755)
        os.chmod(path, 0o666)

        def as_nobody(*groups: int) -> str:
            done = subprocess.run(
                [curl, "-sS", "--unix-socket", path, "http://localhost/health"],
                user=65534, group=65534, extra_groups=list(groups), capture_output=True,
                text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
            return done.stdout

        denied = json.loads(await anyio.to_thread.run_sync(as_nobody))
        allowed = json.loads(await anyio.to_thread.run_sync(as_nobody, 12345))
        assert denied["error"]["code"] == "forbidden"
        assert allowed["status"] == "ok"
        assert server.service.counters["connections_denied"] == 1


async def test_shutdown_ends_a_stream_with_finish_reason_shutdown(smol: ModelRuntime) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1000, "temperature": 0,
                       "stream": True}).encode()
    config = ServerConfig(shutdown_grace_s=0.0)
    async with running_daemon(smol, config) as (server, path):
        stream = await anyio.connect_unix(path)
        receiver = StreamReceiver(stream)
        got = bytearray()
        try:
            await stream.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                              + str(len(body)).encode() + b"\r\n\r\n" + body)
            with anyio.fail_after(60):
                got += await receiver.receive()
                server.shutdown()
                while True:
                    try:
                        got += await receiver.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break
        finally:
            await receiver.aclose()
    events = [json.loads(line.removeprefix(b"data: ")) for line in bytes(got).split(b"\n")
              if line.startswith(b"data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "shutdown"
    assert b"data: [DONE]" in got
    assert 0 < events[-1]["timings"]["predicted_n"] < 1000
