"""OpenAI request validation: each bad field is a 400 naming it; good requests become
the ``generate`` a native client would send."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshd.daemon.http.openai_api import ApiError, parse_request
from meshd.protocol import MAX_MESSAGES, MAX_STOP_LENGTH, MAX_STOP_STRINGS


def _parse(body: dict[str, Any], chat: bool = False) -> Any:
    return parse_request(json.dumps(body).encode(), chat=chat)


def test_fields_map_onto_generate() -> None:
    req = _parse({"model": "m", "prompt": ["hi"], "max_completion_tokens": 7,
                  "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "\n", "stream": True,
                  "stream_options": {"include_usage": True}, "user": "ignored",
                  "speculative": {"proposer": "ngram", "draft_max": 4}})
    g = req.generate
    assert (g.prompt, g.max_tokens, g.stop) == ("hi", 7, ("\n",))
    assert (g.sampling.temperature, g.sampling.top_p, g.sampling.seed, g.sampling.top_k) == \
        (0.5, 0.9, 3, 0)
    assert (g.speculative.proposer, g.speculative.draft_max) == ("ngram", 4)
    assert req.stream and req.include_usage and not req.chat
    chat = _parse({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "speculative": {"enabled": False}}, chat=True)
    assert chat.generate.messages[0].content == "ab"
    assert chat.generate.speculative.proposer == "off"
    assert chat.generate.id.startswith("chatcmpl-")


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"prompt": "x", "stop": ["ok", "a" * (MAX_STOP_LENGTH + 1)]}, "stop[1]"),
    ({"prompt": "x", "stop": [""]}, "stop[0]"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "speculative": {"draft_max": 0}}, "speculative.draft_max"),
    ({"prompt": "x", "speculative": {"colour": 1}}, "speculative"),
    ({"prompt": "x", "model": 5}, "model"),
])
def test_bad_fields_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        _parse(body)
    assert caught.value.status == 400 and caught.value.param == param


def test_bad_messages_and_bodies() -> None:
    for body, param in (({"messages": []}, "messages"),
                        ({"messages": [{"content": "x"}]}, "messages[0].role"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                         "messages[0].content[0]")):
        with pytest.raises(ApiError) as caught:
            _parse(body, chat=True)
        assert caught.value.param == param
    for raw in (b"[1, 2]", b"\xff", b"{"):
        with pytest.raises(ApiError):
            parse_request(raw, chat=False)


def test_limits_are_the_protocols_and_name_their_value() -> None:
    """The native socket's limits, with the limit and the value sent in the message."""
    assert _parse({"prompt": "x", "stop": ["s"] * MAX_STOP_STRINGS}).generate.stop \
        == ("s",) * MAX_STOP_STRINGS
    cases = [
        ({"prompt": "x", "stop": ["a" * 1_000_000]}, False,
         (f"at most {MAX_STOP_LENGTH} chars", "1000000 chars")),
        ({"prompt": "x", "stop": ["s"] * 20}, False, (f"at most {MAX_STOP_STRINGS}", "20")),
        ({"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}, True,
         (f"at most {MAX_MESSAGES} messages", str(MAX_MESSAGES + 1))),
        ({"messages": [{"role": "r" * 100, "content": "hi"}]}, True,
         ("messages[0].role", "at most 64 chars", "100 chars")),
    ]
    for body, chat, wanted in cases:
        with pytest.raises(ApiError) as caught:
            _parse(body, chat=chat)
        assert caught.value.status == 400
        for part in wanted:
            assert part in caught.value.message, (part, caught.value.message)
