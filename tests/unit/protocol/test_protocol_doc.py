"""PROTOCOL.md stays in step with the code: every field documented, every example valid."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

import meshd.protocol
from meshd.protocol import (
    PROTOCOL_VERSION,
    REQUEST_TYPES,
    RESPONSE_TYPES,
    BadRequest,
    ChatMessage,
    ErrorCode,
    ModelInfo,
    ProposerStats,
    SamplingParams,
    SpeculationStats,
    SpeculativeOverrides,
    Usage,
    decode_request,
    decode_response,
    error_message,
)

DOC = (Path(meshd.protocol.__file__).parent / "PROTOCOL.md").read_text(encoding="utf-8")


def _sections() -> dict[str, str]:
    """Map each `#### heading` to its body."""
    parts = re.split(r"^#### (.+)$", DOC, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _section_for(name: str) -> str:
    for heading, body in _sections().items():
        if heading == name or f"`{name}`" in heading:
            return body
    raise AssertionError(f"PROTOCOL.md has no section for {name}")


@pytest.mark.parametrize("cls", [*REQUEST_TYPES.values(), *RESPONSE_TYPES.values()])
def test_every_message_field_is_documented(cls: type) -> None:
    body = _section_for(cls.OP)  # type: ignore[attr-defined]
    for field in attrs.fields(cls):
        assert f"| `{field.name}` |" in body, f"{cls.OP}.{field.name} undocumented"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "cls",
    [
        ChatMessage,
        SamplingParams,
        SpeculativeOverrides,
        Usage,
        SpeculationStats,
        ModelInfo,
        ProposerStats,
    ],
)
def test_every_shared_object_field_is_documented(cls: type) -> None:
    body = _section_for(cls.__name__)
    documented = set(re.findall(r"^\| `(\w+)` \|", body, flags=re.M))
    assert documented == {f.name for f in attrs.fields(cls)}


def test_error_codes_and_version_documented() -> None:
    for code in ErrorCode:
        assert f"| `{code.value}` |" in DOC
    assert f"PROTOCOL_VERSION = {PROTOCOL_VERSION}" in DOC


INVALID_EXAMPLES = {
    "not json": "invalid JSON",
    '{"op":"generate","id":"5","prompt":"hi","max_tokens":0}': "max_tokens",
    '{"op":"generate","id":"6","promt":"hi"}': "promt",
}


def test_examples_are_valid_frames() -> None:
    lines = re.findall(r"^([CS]): (.*)$", DOC, flags=re.M)
    assert len(lines) > 20
    for side, frame in lines:
        decode = decode_request if side == "C" else decode_response
        if frame in INVALID_EXAMPLES:
            # The error examples: the documented error must be what the decoder says.
            with pytest.raises(BadRequest) as info:
                decode(frame)
            assert INVALID_EXAMPLES[frame] in DOC
            assert error_message(info.value).message in DOC
            continue
        decode(frame)
