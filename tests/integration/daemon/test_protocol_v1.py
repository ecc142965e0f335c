"""A version-1 client against today's daemon: the recorded session of a first-release
client (tests/integration/data/protocol_v1_session.ndjson) replayed over a raw Unix socket gets
only what version 1 defines, fields version 1 lacks are refused as it refused them,
the current version is untouched, and versions never spoken are still refused.

Frames are read as raw JSON, not through the decoder: the decoder fills in defaults,
which would hide a field the daemon should have left out.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.protocol import PROTOCOL_VERSION, Client, decode_response

from .daemon_helpers import assert_no_leaks, running_daemon, wait_idle

pytestmark = pytest.mark.anyio

SESSION = Path(__file__).resolve().parent.parent / "data" / "protocol_v1_session.ndjson"

V1_FINISH_REASONS = {"stop", "length", "eog", "cancelled", "error"}
V1_ERROR_CODES = {"bad_request", "unsupported_version", "too_large", "busy", "model_error",
                  "cancelled", "internal"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    """The default SmolLM2, small and single-threaded: these tests are about frames."""
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=2, calibrate=False, threads=1))
    yield rt
    rt.close()


class JsonLines:
    """A raw connection: JSON objects out, JSON objects in (``None`` once closed)."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.eof = False

    @classmethod
    @asynccontextmanager
    async def open(cls, path: str) -> AsyncIterator[JsonLines]:
        async with await anyio.connect_unix(path) as stream:
            yield cls(stream)

    async def send(self, frame: dict[str, Any]) -> None:
        await self.stream.send(json.dumps(frame, separators=(",", ":")).encode() + b"\n")

    async def recv(self, timeout: float = 30.0) -> dict[str, Any] | None:
        with anyio.fail_after(timeout):
            while b"\n" not in self.buffer and not self.eof:
                try:
                    self.buffer += await self.stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    self.eof = True
        if b"\n" not in self.buffer:
            return None
        line, self.buffer = self.buffer.split(b"\n", 1)
        frame: dict[str, Any] = json.loads(line)
        decode_response(line)  # a well-formed frame of today's protocol as well
        return frame

    async def hello(self, version: int) -> dict[str, Any]:
        await self.send({"op": "hello", "id": "h", "protocol_version": version,
                         "client_name": "test"})
        reply = await self.recv()
        assert reply is not None
        return reply


def matches(frame: Any, template: Any) -> bool:
    """``frame`` has the template's keys and no others; ``"*"`` matches anything, and
    ``[T]`` an array whose every item matches ``T``."""
    if template == "*":
        return True
    if isinstance(template, dict):
        return (isinstance(frame, dict) and frame.keys() == template.keys()
                and all(matches(frame[k], v) for k, v in template.items()))
    if isinstance(template, list) and len(template) == 1 and isinstance(template[0], dict):
        return isinstance(frame, list) and all(matches(item, template[0]) for item in frame)
    return type(frame) is type(template) and bool(frame == template)


def check_v1_values(frame: dict[str, Any]) -> None:
    """Enum values version 1 has (the templates leave some of them open)."""
    if frame["op"] == "done":
        assert frame["finish_reason"] in V1_FINISH_REASONS, frame
    elif frame["op"] == "error":
        assert frame["code"] in V1_ERROR_CODES, frame


def load_session(path: Path) -> list[dict[str, Any]]:
    """The steps of a recorded session (one JSON object a line)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def replay(conn: JsonLines, steps: list[dict[str, Any]],
                 check_values: Callable[[dict[str, Any]], None] = check_v1_values,
                 ) -> list[dict[str, Any]]:
    """Send the ``c`` frames and match what comes back against the ``s`` templates
    (``repeat``: any number of frames like it), each frame's enum values checked by
    ``check_values`` (the session's version); returns every frame received."""
    seen: list[dict[str, Any]] = []
    pending: dict[str, Any] | None = None
    for n, step in enumerate(steps, 1):
        if "c" in step:
            await conn.send(step["c"])
        elif "s" in step:
            while True:
                if pending is None:
                    pending = await conn.recv()
                    assert pending is not None, f"step {n}: the daemon closed the connection"
                    seen.append(pending)
                    check_values(pending)
                frame, pending = pending, None
                if matches(frame, step["s"]):
                    if step.get("repeat"):
                        continue
                    break
                assert step.get("repeat"), f"step {n}: {frame} does not match {step['s']}"
                pending = frame  # for the next step
                break
    assert pending is None, f"left over: {pending}"
    return seen


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
