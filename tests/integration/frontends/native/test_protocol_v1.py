"""A version-1 client against today's daemon: the recorded session of a first-release
client (tests/integration/data/protocol_v1_session.ndjson) replayed over a raw Unix socket gets
only what version 1 defines, fields version 1 lacks are refused as it refused them,
the current version is untouched, and versions never spoken are still refused.

Frames are read as raw JSON, not through the decoder: the decoder fills in defaults,
which would hide a field the daemon should have left out.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.protocol import PROTOCOL_VERSION, Client
from tests.integration.helpers import DATA
from tests.integration.helpers.daemon import assert_no_leaks, running_daemon, wait_idle
from tests.integration.helpers.protocol_replay import JsonLines, load_session, replay

pytestmark = pytest.mark.anyio

SESSION = DATA / "protocol_v1_session.ndjson"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    """The default SmolLM2, small and single-threaded: these tests are about frames."""
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=2, calibrate=False, threads=1))
    yield rt
    rt.close()


async def test_a_recorded_version_1_session_is_answered_in_version_1(
        runtime: ModelRuntime) -> None:
    steps = load_session(SESSION)
    async with running_daemon(runtime) as (server, path):
        async with JsonLines.open(path) as conn:
            seen = await replay(conn, steps)
        await wait_idle(server)
        assert_no_leaks(server)
    done = [f for f in seen if f["op"] == "done"]
    assert len(done) == 4 and done[-1]["finish_reason"] == "cancelled"
    assert done[-1]["usage"]["completion_tokens"] < 400


@pytest.mark.parametrize(("frame", "field"), [
    ({"op": "cancel", "id": "g", "ack": "a"}, "cancel: unknown field 'ack'"),
    ({"op": "generate", "id": "g", "prompt": "Hi", "max_tokens": 2,
      "constraint": {"kind": "json_object"}}, "generate: unknown field 'constraint'"),
    ({"op": "generate", "id": "g", "prompt": "Hi", "max_tokens": 2,
      "speculative": {"proposer": "ngram", "options": {}}},
     "generate.speculative: unknown field 'options'"),
])
async def test_a_version_1_client_may_not_use_later_fields(
        runtime: ModelRuntime, frame: dict[str, Any], field: str) -> None:
    async with running_daemon(runtime) as (server, path), JsonLines.open(path) as conn:
        assert (await conn.hello(1))["protocol_version"] == 1
        await conn.send(frame)
        error = await conn.recv()
        assert error is not None and error["op"] == "error"
        assert (error["id"], error["code"]) == ("g", "bad_request")
        assert error["message"].startswith(field)
        await conn.send({"op": "health", "id": "after"})  # the connection carries on
        health = await conn.recv()
        assert health is not None and health["op"] == "health_reply"
        await wait_idle(server)


async def test_the_current_version_is_unchanged(runtime: ModelRuntime) -> None:
    async with running_daemon(runtime) as (server, path):
        async with JsonLines.open(path) as conn:
            welcome = await conn.hello(PROTOCOL_VERSION)
            assert welcome["protocol_version"] == PROTOCOL_VERSION
            assert {"gpu_layers", "state"} <= welcome["model"].keys()
            await conn.send({"op": "generate", "id": "g", "prompt": "Hi", "max_tokens": 2,
                             "sampling": {"temperature": 0.8}})
            while (frame := await conn.recv()) is not None and frame["op"] == "token":
                pass
            assert frame is not None and frame["op"] == "done"
            assert isinstance(frame["seed"], int)  # chosen by the daemon, reported
        async with Client.connect(path) as client:
            assert client.welcome.protocol_version == PROTOCOL_VERSION
        await wait_idle(server)


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1])
async def test_a_version_never_spoken_is_refused(runtime: ModelRuntime, version: int) -> None:
    async with running_daemon(runtime) as (_, path), JsonLines.open(path) as conn:
        error = await conn.hello(version)
        assert (error["op"], error["id"], error["code"]) == ("error", "h",
                                                            "unsupported_version")
        assert error["message"] == (
            f"server speaks protocol versions 1 to {PROTOCOL_VERSION}, not {version}")
        assert await conn.recv() is None
