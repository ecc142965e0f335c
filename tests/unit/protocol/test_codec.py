"""Codec examples: round trips, framing, and the errors bad frames produce."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from meshd.protocol import (
    DEFAULT_MAX_FRAME_SIZE,
    MAX_ID_LENGTH,
    REQUEST_TYPES,
    RESPONSE_TYPES,
    BadRequest,
    Cancel,
    CancelReply,
    ChatMessage,
    Detokenize,
    DetokenizeReply,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    FrameDecoder,
    FrameTooLarge,
    Generate,
    Health,
    HealthReply,
    HealthStatus,
    Hello,
    Load,
    LoadReply,
    ModelInfo,
    Models,
    ModelsReply,
    ProposerStats,
    ProtocolError,
    RequestDecoder,
    ResponseDecoder,
    SamplingParams,
    SpeculationStats,
    SpeculativeOverrides,
    Stats,
    StatsReply,
    Token,
    Tokenize,
    TokenizeReply,
    Unload,
    UnloadReply,
    Usage,
    Welcome,
    decode_request,
    decode_response,
    encode,
    error_message,
)

MODEL = ModelInfo(
    name="qwen",
    architecture="qwen3",
    n_ctx=8192,
    n_vocab=151936,
    n_params=8_000_000_000,
    size_bytes=5_000_000_000,
    has_mtp=True,
    has_chat_template=True,
)

REQUESTS: list[Any] = [
    Hello(id="h", protocol_version=1, client_name="meshctl"),
    Generate(id="g1", prompt="Once"),
    Generate(
        id="g2",
        messages=(ChatMessage("system", "be brief"), ChatMessage("user", "héllo ✓")),
        max_tokens=64,
        sampling=SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=2**63),
        stop=("\n\n", "</s>"),
        speculative=SpeculativeOverrides(proposer="off", draft_max=8),
    ),
    Cancel(id="g1"),
    Cancel(id="g1", ack="c2"),
    Stats(id="s"),
    Health(id="hl"),
    Models(id="m"),
    Tokenize(id="t", text="", add_special=False),
    Detokenize(id="d", tokens=(1, 2, 3)),
    Generate(id="g3", prompt="Once", model="qwen2.5:1b", keep_alive=-1),
    Load(id="l", model="qwen3-8b"),
    Load(id="l2", model="qwen3-8b", keep_alive=300.5),
    Unload(id="u", model="qwen3-8b"),
]

RESPONSES: list[Any] = [
    Welcome(
        id="h",
        protocol_version=1,
        server_version="0.1.0",
        model=MODEL,
        capabilities=("chat",),
        proposers=("mtp", "ngram"),
        max_frame_size=1024,
    ),
    Token(id="g1", text=" upon", token_ids=(5, 6)),
    Token(id="g1", text="", token_ids=(7,)),
    Done(id="g1", finish_reason=FinishReason.LENGTH),
    Done(
        id="g2",
        finish_reason=FinishReason.ERROR,
        usage=Usage(prompt_tokens=12, completion_tokens=3),
        speculation=SpeculationStats(
            proposer="mtp",
            emitted=3,
            target_forwards=2,
            verify_calls=2,
            drafted=4,
            accepted=2,
            accepted_per_position=[2, 0],
            rollbacks_in_place=1,
            checkpoints=1,
            checkpoint_bytes=4096,
            restores=1,
            wall_ms=12.5,
            prefill_ms=3.25,
            decode_ms=9,
            verify_ms=4.0,
            refusals={"deadline": 1},
            extra={"tree_width": 2, "temp": 0.5},
        ),
        error_message="device lost",
    ),
    ErrorMessage(id="g3", code=ErrorCode.BUSY, message="queue full"),
    ErrorMessage(id=None, code=ErrorCode.BAD_REQUEST, message="invalid JSON"),
    StatsReply(
        id="s",
        uptime_s=3.5,
        counters={"requests_total": 4, "tokens_per_s": 41.5},
        proposers={"mtp": ProposerStats(requests=2, drafted=10, accepted=6)},
    ),
    HealthReply(
        id="hl", status=HealthStatus.DRAINING, uptime_s=0, active_requests=1, queued_requests=2
    ),
    ModelsReply(id="m", models=(MODEL,)),
    ModelsReply(id="m2", models=()),
    TokenizeReply(id="t", tokens=()),
    DetokenizeReply(id="d", text="abc"),
    CancelReply(id="c2", cancelled=False),
    Done(id="g3", finish_reason=FinishReason.EOG, model="qwen2.5:1b"),
    LoadReply(id="l", model=attrs.evolve(MODEL, state="loaded", default=True,
                                         proposers=("mtp",), keep_alive_s=-1)),
    UnloadReply(id="u", model=attrs.evolve(MODEL, loaded=False, state="unloaded"),
                unloaded=True),
    UnloadReply(id="u2", model=attrs.evolve(MODEL, loaded=False, state="unloading",
                                            keep_alive_s=0),
                unloaded=False),
]


def test_samples_cover_every_message_type() -> None:
    assert {type(m).OP for m in REQUESTS} == set(REQUEST_TYPES)
    assert {type(m).OP for m in RESPONSES} == set(RESPONSE_TYPES)


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: f"{m.OP}-{m.id}")
def test_request_round_trip(msg: Any) -> None:
    frame = encode(msg)
    assert frame.endswith(b"\n") and frame.count(b"\n") == 1
    assert decode_request(frame) == msg
    assert decode_request(frame.decode()) == msg
    assert decode_request(json.loads(frame)) == msg


@pytest.mark.parametrize("msg", RESPONSES, ids=lambda m: f"{m.OP}-{m.id}")
def test_response_round_trip(msg: Any) -> None:
    frame = encode(msg)
    assert decode_response(frame) == msg


def test_encoding_is_compact_with_op_then_id() -> None:
    frame = encode(Token(id="x", text="é", token_ids=(1,)))
    assert frame == '{"op":"token","id":"x","text":"é","token_ids":[1]}\n'.encode()


def test_minimal_generate_uses_defaults() -> None:
    msg = decode_request(b'{"op":"generate","id":"1","prompt":"hi"}')
    assert msg == Generate(id="1", prompt="hi")
    assert isinstance(msg, Generate)
    assert msg.sampling == SamplingParams()
    assert msg.stop == ()


def test_sides_are_kept_apart() -> None:
    with pytest.raises(BadRequest, match="'welcome' is not a request op"):
        decode_request(encode(RESPONSES[0]))
    with pytest.raises(BadRequest, match="'hello' is not a response op"):
        decode_response(encode(REQUESTS[0]))


# ---------------------------------------------------------------- bad frames


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        # unknown fields, top level and nested, name the field and list the allowed ones
        (
            {"op": "generate", "id": "7", "prompt": "x", "promt": "y"},
            "generate: unknown field 'promt' (allowed: id, prompt, messages,",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "sampling": {"temp": 1}},
            "generate.sampling: unknown field 'temp'",
        ),
        (
            {"op": "generate", "id": "7", "messages": [{"role": "u", "content": "", "x": 1}]},
            "generate.messages[0]: unknown field 'x'",
        ),
        # wrong types
        (
            {"op": "generate", "id": "7", "prompt": 5},
            "generate.prompt: expected a string, got integer",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "max_tokens": "5"},
            "generate.max_tokens: expected an integer, got string",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "max_tokens": 5.0},
            "generate.max_tokens: expected an integer, got number",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "max_tokens": True},
            "generate.max_tokens: expected an integer, got boolean",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "stop": "abc"},
            "generate.stop: expected an array",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "sampling": []},
            "generate.sampling: expected an object, got array",
        ),
        (
            {"op": "tokenize", "id": "7", "text": "x", "add_special": 1},
            "tokenize.add_special: expected a boolean, got integer",
        ),
        (
            {"op": "detokenize", "id": "7", "tokens": [1, "2"]},
            "detokenize.tokens[1]: expected an integer",
        ),
        ({"op": "cancel", "id": 7}, "cancel.id: expected a string, got integer"),
        ({"op": "stats"}, "stats.id: missing required field"),
        ({"op": 3, "id": "7"}, "'op' must be a string"),
        ({"id": "7"}, "frame has no 'op' field"),
        ({"op": "launch", "id": "7"}, "unknown op 'launch' (expected one of: cancel, detokenize,"),
        # values
        (
            {"op": "generate", "id": "7", "prompt": "x", "max_tokens": 0},
            "generate.max_tokens: must be an integer >= 1",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "sampling": {"temperature": -1}},
            "generate.sampling.temperature: must be a finite number >= 0",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "sampling": {"top_p": 0}},
            "generate.sampling.top_p: must be a number in (0, 1]",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "sampling": {"top_p": 1.5}},
            "generate.sampling.top_p: must be a number in (0, 1]",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "sampling": {"top_k": -1}},
            "generate.sampling.top_k: must be an integer >= 0",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "sampling": {"seed": -1}},
            "generate.sampling.seed: must be an integer in [0, ",
        ),
        (
            {"op": "generate", "id": "7", "prompt": ""},
            "generate.prompt: must be a non-empty string",
        ),
        ({"op": "generate", "id": "7"}, "generate: exactly one of prompt and messages"),
        (
            {
                "op": "generate",
                "id": "7",
                "prompt": "x",
                "messages": [{"role": "u", "content": ""}],
            },
            "generate: exactly one of prompt and messages",
        ),
        ({"op": "generate", "id": "7", "messages": []}, "generate.messages: must be a non-empty"),
        (
            {"op": "generate", "id": "7", "prompt": "x", "stop": [""]},
            "generate.stop[0]: must be a non-empty",
        ),
        (
            {"op": "generate", "id": "7", "prompt": "x", "speculative": {"draft_max": 0}},
            "generate.speculative.draft_max: must be an integer in [1, 1024]",
        ),
        (
            {"op": "detokenize", "id": "7", "tokens": [-1]},
            "detokenize.tokens[0]: must be an integer >= 0",
        ),
        ({"op": "stats", "id": ""}, "stats.id: must be a non-empty string"),
        ({"op": "stats", "id": "x" * (MAX_ID_LENGTH + 1)}, "stats.id: must be a non-empty string"),
        ({"op": "tokenize", "id": "7", "text": "\ud800"}, "unpaired UTF-16 surrogate"),
    ],
)
def test_bad_request_messages(frame: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as info:
        decode_request(json.dumps(frame))
    assert message in info.value.message
    assert info.value.code is ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        ({"op": "done", "id": "1", "finish_reason": "bogus"}, "expected one of 'stop', 'length'"),
        ({"op": "done", "id": "1", "finish_reason": 1}, "done.finish_reason: expected one of"),
        (
            {"op": "done", "id": "1", "finish_reason": "stop", "speculation": {"refusals": []}},
            "done.speculation.refusals: expected an object, got array",
        ),
        (
            {"op": "done", "id": "1", "finish_reason": "stop", "speculation": {"wall_ms": "1"}},
            "done.speculation.wall_ms: expected a number, got string",
        ),
        (
            {"op": "stats_reply", "id": "1", "uptime_s": 0, "counters": {"x": -1}},
            "stats_reply.counters['x']: must be a finite number >= 0",
        ),
        ({"op": "error", "id": "1", "code": "nope", "message": ""}, "error.code: expected one of"),
        ({"op": "health_reply", "id": "1"}, "health_reply.status: missing required field"),
    ],
)
def test_bad_response_messages(frame: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as info:
        decode_response(json.dumps(frame))
    assert message in info.value.message
    assert info.value.request_id == "1"


def test_error_with_null_id_is_valid() -> None:
    msg = decode_response(b'{"op":"error","id":null,"code":"internal","message":"x"}')
    assert msg == ErrorMessage(id=None, code=ErrorCode.INTERNAL, message="x")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"not json", "invalid JSON"),
        (b'{"op":"stats","id":"1"', "invalid JSON"),
        (b"\xff\xfe{}", "not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid JSON: nesting too deep"),
        (b'{"op":"stats","id":"1","x":' + b"9" * 5000 + b"}", "invalid JSON"),
        (b'{"op":"stats","id":NaN}', "invalid JSON: NaN is not valid JSON"),
        (b'{"op":"stats","id":"1","x":1e999}', "number out of range"),
        (b"[1, 2]", "frame must be a JSON object, got array"),
        (b'"str"', "frame must be a JSON object, got string"),
        (b"null", "frame must be a JSON object, got null"),
    ],
)
def test_unparseable_frames(raw: bytes, reason: str) -> None:
    with pytest.raises(BadRequest, match=reason.replace("(", r"\(")):
        decode_request(raw)


# ----------------------------------------------------------------- id recovery


@pytest.mark.parametrize(
    ("raw", "request_id"),
    [
        # valid JSON, invalid message: the parsed id
        (b'{"op":"generate","id":"g7","prompt":3}', "g7"),
        (b'{"id":"g7"}', "g7"),
        (b'{"op":"nope","id":"g7"}', "g7"),
        (b'{"op":"generate","prompt":3,"id":"late"}', "late"),
        # unusable ids are not recovered
        (b'{"op":"generate","id":7,"prompt":3}', None),
        (b'{"op":"generate","id":"","prompt":3}', None),
        (b'[{"id":"g7"}]', None),
        # broken JSON: sniffed from the text
        (b'{"op":"generate","id":"g8","prompt":"unterminated', "g8"),
        (b'{"op":"generate", "id" : "g9", oops}', "g9"),
        (b'{"op":"generate","prompt":"say \\"id\\":\\"no\\"", oops}', None),
        (b"\xff" + b'{"id":"u1"}', "u1"),
    ],
)
def test_id_recovery(raw: bytes, request_id: str | None) -> None:
    with pytest.raises(BadRequest) as info:
        decode_request(raw)
    assert info.value.request_id == request_id
    assert error_message(info.value).id == request_id


# ----------------------------------------------------------------- framing


def test_frames_split_and_joined() -> None:
    dec = FrameDecoder()
    dec.feed(b'{"a":1}\n{"b"')
    assert dec.next_frame() == b'{"a":1}'
    assert dec.next_frame() is None
    dec.feed(b":2}\r\n\n  \n{}")
    assert dec.next_frame() == b'{"b":2}\r'
    assert dec.next_frame() is None  # blank lines skipped, "{}" still incomplete
    assert dec.buffered == 2
    dec.feed_eof()
    assert dec.next_frame() == b"{}"
    assert dec.next_frame() is None


def test_frame_of_exactly_max_size_is_accepted() -> None:
    dec = FrameDecoder(max_frame_size=10)
    dec.feed(b"x" * 10 + b"\n")
    assert dec.next_frame() == b"x" * 10
    dec.feed(b"y" * 10)
    assert dec.next_frame() is None
    dec.feed(b"\n")
    assert dec.next_frame() == b"y" * 10


def test_oversize_frame_before_newline_then_resync() -> None:
    dec = RequestDecoder(max_frame_size=64)
    head = b'{"op":"generate","id":"big","prompt":"'
    dec.feed(head + b"x" * 20)
    assert dec.next_message() is None  # not too large yet
    dec.feed(b"x" * 1000)  # now it is, with no newline in sight
    with pytest.raises(FrameTooLarge) as info:
        dec.next_message()
    assert info.value.request_id == "big"
    assert info.value.code is ErrorCode.TOO_LARGE
    assert dec.frames.buffered == 0  # nothing of the oversize line is kept
    dec.feed(b"x" * 1000)
    assert dec.next_message() is None
    dec.feed(b'xx"}\n{"op":"stats","id":"s"}\n')
    assert dec.next_message() == Stats(id="s")
    assert dec.next_message() is None


def test_oversize_complete_line_between_good_ones() -> None:
    dec = RequestDecoder(max_frame_size=40)
    good = encode(Health(id="a"))
    dec.feed(good + b'{"op":"stats","id":"b","pad":"' + b"p" * 100 + b'"}\n' + good)
    items = list(dec.drain())
    assert items[0] == Health(id="a")
    assert isinstance(items[1], FrameTooLarge) and items[1].request_id == "b"
    assert items[2] == Health(id="a")


def test_oversize_error_becomes_error_frame() -> None:
    dec = RequestDecoder(max_frame_size=8)
    dec.feed(b"0123456789")
    (err,) = list(dec.drain())
    assert isinstance(err, FrameTooLarge)
    assert error_message(err) == ErrorMessage(
        id=None, code=ErrorCode.TOO_LARGE, message="frame exceeds the maximum size of 8 bytes"
    )


def test_decoder_continues_after_bad_frames() -> None:
    dec = ResponseDecoder()
    dec.feed(b'garbage\n{"op":"token","id":"1","text":"a","token_ids":[1]}\n[]\n')
    with pytest.raises(BadRequest):
        dec.next_message()
    assert dec.next_message() == Token(id="1", text="a", token_ids=(1,))
    with pytest.raises(BadRequest):
        dec.next_message()
    assert dec.next_message() is None


def test_unterminated_oversize_tail_at_eof_is_dropped() -> None:
    dec = FrameDecoder(max_frame_size=4)
    dec.feed(b"123456")
    with pytest.raises(FrameTooLarge):
        dec.next_frame()
    dec.feed_eof()
    assert dec.next_frame() is None


def test_invalid_max_frame_size() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(max_frame_size=0)


def test_default_max_frame_size() -> None:
    assert FrameDecoder().max_frame_size == DEFAULT_MAX_FRAME_SIZE == 4 * 1024 * 1024


# ------------------------------------------------------------------ encoding


def test_encode_enforces_max_frame_size() -> None:
    msg = Generate(id="g", prompt="x" * 100)
    with pytest.raises(FrameTooLarge) as info:
        encode(msg, max_frame_size=50)
    assert info.value.request_id == "g"
    assert encode(msg, max_frame_size=1000)


def test_encode_rejects_unencodable_text() -> None:
    with pytest.raises(BadRequest, match="cannot encode generate"):
        encode(Generate(id="g", prompt="\ud800"))


def test_every_error_is_a_protocol_error() -> None:
    assert issubclass(FrameTooLarge, ProtocolError)
    assert issubclass(BadRequest, ValueError)
