"""Plugin messages: round trips, and strict refusal of whatever a plugin may send."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

from meshd.protocol.plugin import (
    Abstain,
    Begin,
    End,
    Outcome,
    PluginError,
    PluginHello,
    PluginProtocolError,
    PluginReject,
    PluginWelcome,
    Proposal,
    Propose,
    Ready,
    Tokenize,
    Tokenized,
    decode_plugin,
    encode_plugin,
)
from meshd.protocol.plugin_channel import ChannelClosed, PluginChannel

MESSAGES = [
    PluginHello("snippets", "1.0", 1, {"max_len": 8}),
    PluginWelcome(1, {"name": "m.gguf", "n_vocab": 100}, {"files": ["a.py"]}),
    PluginReject("no"),
    PluginReject("taken", "name_in_use"),
    Tokenize(("def f():", "x")),
    Tokenized(((1, 2), ())),
    Ready(),
    Begin("r1", (1, 2, 3), 100, (2,), None, {"k": 1}),
    Propose("r1", 4, 7, (5, 6), 8, 1234.5),
    Proposal("r1", 4, (7, 8)),
    Abstain("r1", 4),
    PluginError("r1", 4, "boom"),
    Outcome("r1", 4, 2, 1, (7, 9)),
    End("r1"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m.OP)
def test_round_trip(message: object) -> None:
    line = encode_plugin(message)  # type: ignore[arg-type]
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_plugin(line) == message


@pytest.mark.parametrize("line", [
    b"\x00\xff garbage", b"[1, 2]", b'{"op": "nope"}', b'{"no_op": 1}',
    b'{"op": "proposal", "request": "r", "step": 1}',  # missing tokens
    b'{"op": "proposal", "request": "r", "step": 1, "tokens": [1, "2"]}',
    b'{"op": "proposal", "request": "r", "step": true, "tokens": [1]}',
    b'{"op": "outcome", "request": "r", "step": 1, "proposed": 1, "accepted": 1, '
    b'"committed": 3}',
])
def test_bad_frames_are_refused(line: bytes) -> None:
    with pytest.raises(PluginProtocolError):
        decode_plugin(line)


def test_channel_deadline_flood_and_eof() -> None:
    a, b = socket.socketpair()
    left, right = PluginChannel(a), PluginChannel(b, max_frame=64)
    assert right.recv(time.monotonic() + 0.05) is None  # nothing by the deadline
    left.send(Abstain("r", 1))
    assert right.recv(time.monotonic() + 5) == Abstain("r", 1)
    left.send_bytes(b"x" * 200)  # a line longer than allowed, never ending
    with pytest.raises(PluginProtocolError, match="longer"):
        right.recv(time.monotonic() + 5)
    left.close()
    c, d = socket.socketpair()
    reader = PluginChannel(d)
    c.close()
    with pytest.raises(ChannelClosed):
        reader.recv(None)
    reader.close()
    right.close()


def test_the_documented_exchange_decodes() -> None:
    doc = (Path(__file__).parents[3] / "protocol" / "PROTOCOL.md").read_text()
    lines = re.findall(r"^([PD]): (.*)$", doc, flags=re.M)
    assert len(lines) >= 10
    for who, frame in lines:
        message = decode_plugin(frame)
        plugin_ops = {"plugin_hello", "tokenize", "ready", "proposal", "abstain",
                      "plugin_error"}
        assert (message.OP in plugin_ops) == (who == "P"), frame
        assert json.loads(encode_plugin(message)) == json.loads(frame)
