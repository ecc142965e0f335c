"""The TCP listener's API key and CORS: off by default; with ``api_key`` every TCP
request but ``/health`` needs ``Authorization: Bearer KEY`` (the Unix socket never asks,
it knows its peer); with ``cors_origins`` a browser's preflight is answered and the
allowed origin is named on every answer."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import openai
import pytest

from meshd.daemon.commands.server import serving
from meshd.daemon.config.http import HttpConfig
from meshd.daemon.frontends.http.access import authorized, cors_headers
from meshd.daemon.frontends.http.tcp import HttpAddressError, check_http_address
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from tests.integration.helpers.daemon import short_tempdir

pytestmark = pytest.mark.anyio
KEY = "s3cret-key"
BODY = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=256, calibrate=False, threads=1))
    yield rt
    rt.close()


def test_key_and_origin_rules() -> None:
    assert authorized({}, None, "/v1/models")
    assert authorized({}, KEY, "/health")
    assert not authorized({}, KEY, "/v1/models")
    assert not authorized({b"authorization": b"Bearer wrong"}, KEY, "/v1/models")
    assert authorized({b"authorization": b"bearer " + KEY.encode()}, KEY, "/v1/models")
    assert cors_headers(b"http://ui.local", ()) == []
    assert cors_headers(b"http://evil", ("http://ui.local",)) == []
    assert ("Access-Control-Allow-Origin", "http://ui.local") in \
        cors_headers(b"http://ui.local", ("http://ui.local",))
    assert authorized({b"x-api-key": KEY.encode()}, KEY, "/v1/models")
    assert not authorized({b"x-api-key": b"wrong"}, KEY, "/v1/models")
    # "localhost": a page from any loopback name, any port, http or https; nothing else
    for origin in (b"http://localhost", b"http://localhost:8080", b"https://127.0.0.1:3000",
                   b"http://[::1]", b"http://[::1]:3000"):
        assert ("Access-Control-Allow-Origin", origin.decode()) in \
            cors_headers(origin, ("localhost",)), origin
    for origin in (b"http://localhost.evil.com", b"http://notlocalhost", b"http://evil.com",
                   b"file://localhost", b"http://localhost:99999"):
        assert cors_headers(origin, ("localhost",)) == [], origin


async def test_tcp_needs_the_key_and_unix_does_not(smol: ModelRuntime) -> None:
    path = f"{short_tempdir()}/s"
    config = ServerConfig(http=HttpConfig(api_key=KEY, cors_origins=("http://ui.local",)))
    async with serving(smol, path, config, http="tcp:127.0.0.1:0") as server:
        assert server.http_listener is not None
        port = int(server.http_listener.address.rpartition(":")[2])
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=60) as tcp:
            r = await tcp.post("/v1/completions", json=BODY)
            assert r.status_code == 401
            err = r.json()["error"]
            assert (err["code"], err["type"]) == ("invalid_api_key", "authentication_error")
            assert (await tcp.get("/health")).status_code == 200
            r = await tcp.post("/v1/completions", json=BODY,
                               headers={"Authorization": f"Bearer {KEY}",
                                        "Origin": "http://ui.local"})
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == "http://ui.local"
            r = await tcp.options("/v1/chat/completions", headers={
                "Origin": "http://ui.local", "Access-Control-Request-Method": "POST"})
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == "http://ui.local"
            assert "Authorization" in r.headers["access-control-allow-headers"]
            r = await tcp.options("/v1/chat/completions", headers={"Origin": "http://evil"})
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
            r = await tcp.post("/v1/completions", json=BODY, headers={"X-Api-Key": KEY})
            assert r.status_code == 200
            r = await tcp.post("/v1/completions", json=BODY, headers={"X-Api-Key": "wrong"})
            assert r.status_code == 401
            api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, http_client=tcp,
                                     max_retries=0)
            got = await api.completions.create(model="m", prompt="Hi", max_tokens=2)
            assert got.choices[0].text is not None
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://meshd") as unix:
            assert (await unix.post("/v1/completions", json=BODY)).status_code == 200


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


async def test_several_addresses_each_serve_and_ask_the_key(smol: ModelRuntime) -> None:
    """``--http A,B`` (llama-server's ``--host 127.0.0.1,::1``): every address serves,
    each asks the key; a list with one address that is not loopback is refused whole."""
    with pytest.raises(HttpAddressError, match=r"192\.0\.2\.1"):
        check_http_address("tcp:127.0.0.1:0,tcp:192.0.2.1:8080")
    six = _ipv6_loopback()
    addresses = "tcp:127.0.0.1:0,tcp:[::1]:0" if six else "tcp:127.0.0.1:0,tcp:127.0.0.2:0"
    config = ServerConfig(http=HttpConfig(api_key=KEY))
    async with serving(smol, f"{short_tempdir()}/s", config, http=addresses) as server:
        assert len(server.http_listeners) == 2
        for listener in server.http_listeners:
            host, _, port = listener.address.removeprefix("tcp:").rpartition(":")
            async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=60) as tcp:
                assert (await tcp.get("/health")).status_code == 200
                assert (await tcp.post("/v1/completions", json=BODY)).status_code == 401
                r = await tcp.post("/v1/completions", json=BODY,
                                   headers={"Authorization": f"Bearer {KEY}"})
                assert r.status_code == 200, host
