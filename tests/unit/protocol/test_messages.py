"""Message construction rules and the error hierarchy."""

from __future__ import annotations

import pickle

import pytest

from meshd.protocol import (
    PROTOCOL_VERSION,
    BadRequest,
    ConnectionClosed,
    Detokenize,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    FrameTooLarge,
    Generate,
    InternalError,
    ModelError,
    PermissionDenied,
    ProposerStats,
    ProtocolError,
    RequestCancelled,
    SamplingParams,
    ServerBusy,
    SpeculationStats,
    SpeculativeOverrides,
    StatsReply,
    Token,
    UnknownModel,
    UnsupportedVersion,
    Usage,
    error_from_code,
    error_from_message,
    error_message,
    exception_class,
)


def test_protocol_version_is_an_int() -> None:
    assert isinstance(PROTOCOL_VERSION, int)
    assert PROTOCOL_VERSION == 4  # 4: tool calls (generate.tools, done.tool_calls, ...)


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: Generate(id="1", prompt="x", max_tokens=0), "max_tokens"),
        (lambda: SamplingParams(temperature=float("nan")), "temperature"),
        (lambda: SamplingParams(temperature=float("inf")), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_k=True), "top_k"),  # bools are not ints here
        (lambda: SamplingParams(seed=2**64), "seed"),
        (lambda: Token(id="1", text="a", token_ids=(-1,)), "token_ids[0]"),
        (lambda: Generate(id="", prompt="x"), "id"),
        (lambda: Done(id="1", finish_reason="stop"), "finish_reason"),  # type: ignore[arg-type]
        (lambda: Usage(prompt_tokens=-1), "prompt_tokens"),
    ],
)
def test_local_construction_validates(build: object, field: str) -> None:
    with pytest.raises(BadRequest) as info:
        build()  # type: ignore[operator]
    assert info.value.field == field
    assert info.value.message.startswith(field)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("build", "field", "detail"),
    [
        (lambda: StatsReply(id="1", uptime_s=0, counters={"x": -1}), "counters['x']",
         "must be a finite number >= 0 (got -1)"),
        (lambda: StatsReply(id="1", uptime_s=0, counters={1: 2}), "counters[1]",
         "must be a finite number >= 0 (got 2)"),
        (lambda: StatsReply(id="1", uptime_s=0, proposers={"a": 1}), "proposers['a']",
         "must be a ProposerStats (got 1)"),
        (lambda: Detokenize(id="1", tokens=(1, True)), "tokens[1]",
         "must be an integer >= 0 (got True)"),
        (lambda: SpeculativeOverrides(options={1: 2}), "options", "must be an object"),
        (lambda: Generate(id="1", messages=()), "messages",
         "must be a non-empty array of at most 4096 chat messages (got ())"),
        (lambda: Generate(id="1", prompt="x", stop=("ab",) * 17), "stop",
         "must be an array of at most 16 stop strings (got an array of 17 items)"),
        (lambda: Generate(id="1", prompt="x", stop=("ok", "s" * 2000)), "stop[1]",
         "must be a non-empty string of at most 1024 chars (got 'ssss"),
        (lambda: Token(id="1", text="a", token_ids=(1,) * 100 + (-1,)), "token_ids[100]",
         "must be an integer >= 0 (got -1)"),
    ],
)
def test_item_errors_name_the_item(build: object, field: str, detail: str) -> None:
    """The one validator wrapper names the offending item of an array or object."""
    with pytest.raises(BadRequest) as info:
        build()  # type: ignore[operator]
    assert info.value.field == field
    assert info.value.message.startswith(f"{field}: {detail}")


def test_generate_needs_exactly_one_input() -> None:
    with pytest.raises(BadRequest, match="exactly one"):
        Generate(id="1")
    with pytest.raises(BadRequest, match="must be a ChatMessage"):
        Generate(id="1", messages=({"role": "user", "content": "x"},))  # type: ignore[arg-type]


def test_speculation_stats_is_fillable_and_validated() -> None:
    stats = SpeculationStats()
    assert stats.acceptance_rate is None and stats.tokens_per_forward is None
    stats.drafted += 4
    stats.accepted += 3
    stats.emitted = 6
    stats.target_forwards = 2
    stats.refusals["deadline"] = 1
    stats.accepted_per_position.extend([2, 1])
    assert stats.acceptance_rate == 0.75
    assert stats.tokens_per_forward == 3.0
    with pytest.raises(BadRequest, match="drafted"):
        stats.drafted = -1
    assert ProposerStats(drafted=4, accepted=1).acceptance_rate == 0.25
    assert ProposerStats().acceptance_rate is None
    assert Usage(prompt_tokens=2, completion_tokens=3).total_tokens == 5


def test_every_code_has_an_exception() -> None:
    expected = {
        ErrorCode.BAD_REQUEST: BadRequest,
        ErrorCode.UNSUPPORTED_VERSION: UnsupportedVersion,
        ErrorCode.TOO_LARGE: FrameTooLarge,
        ErrorCode.BUSY: ServerBusy,
        ErrorCode.MODEL_ERROR: ModelError,
        ErrorCode.CANCELLED: RequestCancelled,
        ErrorCode.INTERNAL: InternalError,
        ErrorCode.FORBIDDEN: PermissionDenied,
        ErrorCode.UNKNOWN_MODEL: UnknownModel,
    }
    assert set(expected) == set(ErrorCode)
    for code, cls in expected.items():
        assert exception_class(code) is cls
        assert cls.code is code
        exc = error_from_code(code, "why", "r1")
        assert type(exc) is cls and exc.request_id == "r1" and str(exc) == "why"
        assert isinstance(exc, ProtocolError)


def test_error_frame_round_trip() -> None:
    exc = ServerBusy("queue full", request_id="7")
    msg = error_message(exc)
    assert msg == ErrorMessage(id="7", code=ErrorCode.BUSY, message="queue full")
    back = error_from_message(msg)
    assert type(back) is ServerBusy and back.message == "queue full" and back.request_id == "7"


def test_unknown_code_becomes_internal() -> None:
    exc = error_from_code("weird", "msg")
    assert type(exc) is InternalError and "weird" in exc.message


def test_errors_pickle_and_reattribute() -> None:
    exc = BadRequest.invalid_field("top_k", "must be >= 0").with_request_id("q")
    assert isinstance(exc, BadRequest)
    assert exc.field == "top_k" and exc.request_id == "q"
    clone = pickle.loads(pickle.dumps(exc))
    assert type(clone) is BadRequest
    assert (clone.message, clone.request_id, clone.field) == (exc.message, "q", "top_k")
    assert "bad_request" in repr(clone)
    closed = ConnectionClosed("gone")
    assert isinstance(closed, ConnectionError) and closed.code is ErrorCode.INTERNAL
    assert closed.with_request_id(None) is closed


def test_finish_reasons() -> None:
    assert [r.value for r in FinishReason] == ["stop", "length", "eog", "cancelled", "shutdown",
                                              "error"]
