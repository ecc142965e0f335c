"""Replaying a recorded protocol session over a raw Unix socket: frames read as raw JSON
(the decoder would fill in defaults and hide a field the daemon should have left out) and
matched against the recording's templates."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from meshd.protocol import decode_response

V1_FINISH_REASONS = {"stop", "length", "eog", "cancelled", "error"}
V1_ERROR_CODES = {"bad_request", "unsupported_version", "too_large", "busy", "model_error",
                  "cancelled", "internal"}


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
