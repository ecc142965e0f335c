"""HTTP on both event loops (asyncio and trio), over the loopback TCP listener and the
Unix socket, and chat templates that need the Jinja extras, served end to end."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from meshd.daemon.commands.server import serving
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.protocol import BadRequest, Client
from tests.integration.helpers import DATA
from tests.integration.helpers.daemon import assert_no_leaks, short_tempdir, wait_idle
from tests.integration.helpers.http_api import raw_exchange, status_of

pytestmark = pytest.mark.anyio



@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


def _post(path: str, body: dict[str, object]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


async def _tcp_exchange(port: int, data: bytes) -> bytes:
    got = bytearray()
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(data)
        with anyio.fail_after(60):
            while True:
                try:
                    got += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
    return bytes(got)


async def test_streamed_completion_over_tcp_and_unix(smol: ModelRuntime) -> None:
    path = f"{short_tempdir()}/s"
    request = _post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6,
                                        "temperature": 0, "stream": True})
    async with serving(smol, path, http="tcp:127.0.0.1:0") as server:
        assert server.http_listener is not None
        port = int(server.http_listener.address.rpartition(":")[2])
        over_tcp = await _tcp_exchange(port, request)
        over_unix = await raw_exchange(path, request, timeout=60)
        for got in (over_tcp, over_unix):
            assert status_of(got) == 200
            assert b"transfer-encoding: chunked" in got.lower()
            assert got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # last chunk, then end
        texts = []
        for got in (over_tcp, over_unix):
            events = [json.loads(line.removeprefix(b"data: ")) for line in got.split(b"\n")
                      if line.startswith(b"data: {")]
            texts.append("".join(e["choices"][0]["text"] for e in events))
        assert texts[0] == texts[1] and texts[0]
        # The native protocol still works on the same socket.
        async with Client.connect(path) as native:
            assert (await native.health()).status.value == "ok"
        await wait_idle(server)
        assert_no_leaks(server)


def _with_template(tmp_path: Path, text: str) -> ModelRuntime:
    """SmolLM2 served with ``text`` as its chat template (``--chat-template-file``)."""
    file = tmp_path / "template.jinja"
    file.write_text(text)
    return ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=1, draft_max=4,
                                      calibrate=False, threads=1,
                                      chat_template_file=str(file)))


async def test_templates_with_jinja_extras_are_served(tmp_path: Path) -> None:
    # Llama 3.2's template reads today's date with strftime_now; this one also
    # leaves its loop with {% break %}.
    rt = _with_template(tmp_path, (DATA / "llama-3.2.jinja").read_text().replace(
        "{%- for message in messages %}",
        "{%- for message in messages %}{%- if message.role == 'ignore' %}{% break %}"
        "{%- endif %}", 1))
    try:
        path = f"{short_tempdir()}/s"
        messages = [{"role": "user", "content": "Hi there"}]
        async with serving(rt, path) as server:
            got = await raw_exchange(path, _post("/v1/chat/completions", {
                "messages": messages, "max_tokens": 3, "temperature": 0}), timeout=60)
            assert status_of(got) == 200, got
            answer = json.loads(got.partition(b"\r\n\r\n")[2])
            expected = rt.tokenize_prompt(rt.render_chat(messages), chat=True)
            assert "Today Date" in rt.render_chat(messages)
            assert answer["usage"]["prompt_tokens"] == len(expected)
            await wait_idle(server)
            assert_no_leaks(server)
    finally:
        rt.close()


async def test_a_templates_own_refusal_is_a_bad_request(tmp_path: Path) -> None:
    rt = _with_template(tmp_path, (DATA / "gemma-3.jinja").read_text())
    try:
        path = f"{short_tempdir()}/s"
        async with serving(rt, path) as server:
            # A template's own refusal is a 400 naming it (and bad_request natively).
            twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
            got = await raw_exchange(path, _post("/v1/chat/completions", {
                "messages": twice, "max_tokens": 3}), timeout=60)
            assert status_of(got) == 400 and b"roles must alternate" in got
            async with Client.connect(path) as native:
                with pytest.raises(BadRequest, match="roles must alternate"):
                    await native.generate(messages=twice, max_tokens=3).collect()
            await wait_idle(server)
            assert_no_leaks(server)
    finally:
        rt.close()
