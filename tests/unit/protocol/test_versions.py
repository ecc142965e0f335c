"""Older protocol versions: the server reads and writes a version-1 client's frames as
version 1 defined them (``git show f2bc852^:protocol/messages.py``), and a version-2
client's as version 2 did (``git show 405622d:protocol/messages.py``): pure functions
tested on their own and through the sans-I/O server connection."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.protocol import (
    PROTOCOL_VERSION,
    REQUEST_TYPES,
    RESPONSE_TYPES,
    BadRequest,
    Cancel,
    CancelReply,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    Generate,
    Hello,
    Load,
    LoadReply,
    ModelInfo,
    ModelsReply,
    PermissionDenied,
    ProposerStats,
    StatsReply,
    UnknownModel,
    Unload,
    UnloadReply,
    Welcome,
    decode_request,
    decode_response,
    encode,
    unstructure,
    versions,
)
from meshd.protocol.connection import LocalProtocolError, Rejected, ServerConnection, State
from meshd.protocol.versions import (
    OLDEST_VERSION,
    SCHEMAS,
    V1,
    V2,
    V3,
    Shape,
    Unrepresentable,
    check_request,
    downgrade,
    speaks,
    unsupported_message,
)

from . import strategies

MODEL = ModelInfo(name="m", n_ctx=512, gpu_layers=30)


def test_every_version_from_the_first_to_the_current_is_spoken() -> None:
    assert OLDEST_VERSION == 1
    assert [v for v in range(-1, PROTOCOL_VERSION + 3) if speaks(v)] == \
        list(range(1, PROTOCOL_VERSION + 1))
    assert set(SCHEMAS) == set(range(OLDEST_VERSION, PROTOCOL_VERSION))
    assert PROTOCOL_VERSION == 4
    assert unsupported_message(5) == "server speaks protocol versions 1 to 4, not 5"


# ------------------------------------------------------------- the schema itself


def _attrs_class(hint: Any) -> type | None:
    """The attrs class inside a field's type (``X``, ``X | None``, ``tuple[X, ...]``,
    ``dict[str, X]``), if any."""
    if attrs.has(hint):
        return typing.cast(type, hint)
    for arg in typing.get_args(hint):
        found = _attrs_class(arg)
        if found is not None:
            return found
    return None


def _fields_today(cls: type, shape: Shape, path: str) -> dict[str, set[str]]:
    """Fields ``cls`` has today beyond ``shape``, by path (nested objects included)."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in attrs.fields(cls)]
    assert set(shape.fields) <= set(names), f"{path}: an older version's field was dropped"
    assert list(shape.fields) == [n for n in names if n in shape.fields], f"{path}: order"
    extra = {path: set(names) - set(shape.fields)}
    for name, (_, inner) in shape.nested.items():
        nested = _attrs_class(hints[name])
        assert nested is not None, f"{path}.{name}"
        extra.update(_fields_today(nested, inner, f"{path}.{name}"))
    return {p: e for p, e in extra.items() if e}


_REQUEST_ADDITIONS: dict[str, dict[str, set[str]]] = {
    "cancel": {"cancel": {"ack"}},
    "generate": {"generate": {"constraint", "model", "keep_alive"},
                 "generate.speculative": {"options"}},
}
"""The request fields PROTOCOL.md lists as added since version 1 (more may come within
a version: the schema is a whitelist, so they stay out of version 1 all the same)."""


@pytest.mark.parametrize("op", sorted(V1.requests))
def test_version_1_requests_keep_every_field(op: str) -> None:
    extra = _fields_today(REQUEST_TYPES[op], V1.requests[op], op)
    for path, added in _REQUEST_ADDITIONS.get(op, {}).items():
        assert added <= extra[path]


def test_version_1_responses_lack_exactly_the_documented_additions() -> None:
    extra = {op: _fields_today(RESPONSE_TYPES[op], shape, op)
             for op, shape in V1.responses.items()}
    model_additions = {"gpu_layers", "loaded", "state", "default", "proposers",
                       "keep_alive_s"}
    assert {k: v for e in extra.values() for k, v in e.items()} == {
        "done": {"seed", "model", "tool_calls"},
        "token": {"logprobs"},
        "health_reply": {"models"},
        "welcome.model": model_additions,
        "models_reply.models": model_additions,
    }
    assert set(RESPONSE_TYPES) - set(V1.responses) == {"cancel_reply", "load_reply",
                                                       "unload_reply"}
    assert set(REQUEST_TYPES) - set(V1.requests) == {"load", "unload"}
    assert set(V1.requests) <= set(REQUEST_TYPES)


# ------------------------------------------------------------- server frames


def test_done_loses_its_seed_and_shutdown_reads_cancelled() -> None:
    done = Done(id="g", finish_reason=FinishReason.SHUTDOWN, seed=7)
    frame = downgrade(unstructure(done), 1)
    assert list(frame)[:2] == ["op", "id"]
    assert "seed" not in frame and frame["finish_reason"] == "cancelled"
    assert set(frame) == {"op", *V1.responses["done"].fields}
    for reason in set(FinishReason) - {FinishReason.SHUTDOWN}:
        got = downgrade(unstructure(Done(id="g", finish_reason=reason)), 1)
        assert got["finish_reason"] == reason.value


def test_forbidden_and_unknown_model_read_bad_request_and_other_codes_stay() -> None:
    for code in ErrorCode:
        frame = downgrade(unstructure(ErrorMessage(id=None, code=code, message="x")), 1)
        assert frame["code"] == ("bad_request" if code in _V1_BAD_REQUEST else code.value)


def test_models_lose_gpu_layers_wherever_they_are() -> None:
    welcome = downgrade(unstructure(Welcome(id="h", protocol_version=1, server_version="t",
                                            model=MODEL)), 1)
    models = downgrade(unstructure(ModelsReply(id="m", models=(MODEL, MODEL))), 1)
    assert "gpu_layers" not in welcome["model"] and welcome["model"]["n_ctx"] == 512
    assert all("gpu_layers" not in m for m in models["models"])
    stats = StatsReply(id="s", uptime_s=1.0, proposers={"ngram": ProposerStats(drafted=3)})
    assert downgrade(unstructure(stats), 1) == unstructure(stats)


def test_a_frame_version_1_lacks_cannot_be_written() -> None:
    with pytest.raises(Unrepresentable, match="protocol version 1 has no 'cancel_reply'"):
        downgrade(unstructure(CancelReply(id="a", cancelled=True)), 1)
    with pytest.raises(BadRequest, match="cannot encode cancel_reply"):
        encode(CancelReply(id="a", cancelled=True), version=1)
    assert downgrade({"op": "cancel_reply", "id": "a", "cancelled": True},
                     PROTOCOL_VERSION)["cancelled"] is True


_V1_BAD_REQUEST = (ErrorCode.FORBIDDEN, ErrorCode.UNKNOWN_MODEL)
"""The error codes a version-1 client reads as ``bad_request``."""


def _v1_model(model: ModelInfo) -> ModelInfo:
    """A model as a version-1 client reads it: the fields it lacks at their defaults."""
    return ModelInfo(**{name: getattr(model, name) for name in V1.responses["welcome"]
                        .nested["model"][1].fields})


def _as_version_1(msg: Any) -> Any:
    """What a version-1 client reads: today's message less what version 1 lacks."""
    if isinstance(msg, Done):
        finish = FinishReason.CANCELLED if msg.finish_reason is FinishReason.SHUTDOWN \
            else msg.finish_reason
        return attrs.evolve(msg, seed=None, model=None, tool_calls=None, finish_reason=finish)
    if isinstance(msg, ErrorMessage) and msg.code in _V1_BAD_REQUEST:
        return attrs.evolve(msg, code=ErrorCode.BAD_REQUEST)
    if isinstance(msg, Welcome):
        return attrs.evolve(msg, model=_v1_model(msg.model))
    if isinstance(msg, ModelsReply):
        return attrs.evolve(msg, models=tuple(_v1_model(m) for m in msg.models))
    return msg


_NOT_IN_V1 = (CancelReply, LoadReply, UnloadReply)
"""Responses version 1 has no frame for."""


@settings(max_examples=200, deadline=None)
@given(strategies.responses.filter(lambda m: not isinstance(m, _NOT_IN_V1)))
def test_every_version_1_frame_is_a_valid_frame(msg: Any) -> None:
    line = encode(msg, version=1)
    assert decode_response(line) == _as_version_1(msg)
    assert json.loads(line) == downgrade(unstructure(msg), 1)


# ------------------------------------------------------------- client frames


@pytest.mark.parametrize(("frame", "message", "today"), [
    ({"op": "cancel", "id": "g", "ack": "a"}, "cancel: unknown field 'ack' (allowed: id)",
     True),
    ({"op": "cancel", "id": "g", "ack": None}, "cancel: unknown field 'ack' (allowed: id)",
     True),
    ({"op": "generate", "id": "g", "prompt": "p", "constraint": {"kind": "json_object"}},
     "generate: unknown field 'constraint' (allowed: id, prompt, messages, max_tokens, "
     "sampling, stop, speculative)", True),
    ({"op": "generate", "id": "g", "prompt": "p", "speculative": {"options": {}}},
     "generate.speculative: unknown field 'options' (allowed: proposer, draft_max)", True),
    ({"op": "generate", "id": "g", "prompt": "p", "sampling": {"min_p": 0.1, "x": 1}},
     "generate.sampling: unknown fields 'min_p', 'x' (allowed: temperature, top_k, top_p, "
     "seed)", False),
    # Unknown in every version: said the way today's decoder says it.
    ({"op": "generate", "id": "g", "messages": [{"role": "user", "content": "c", "n": 1}]},
     "generate.messages[0]: unknown field 'n' (allowed: role, content)", False),
])
def test_a_field_version_1_lacks_is_refused_as_version_1_did(
        frame: dict[str, Any], message: str, today: bool) -> None:
    with pytest.raises(BadRequest) as info:
        decode_request(json.dumps(frame), version=1)
    assert (info.value.message, info.value.request_id) == (message, "g")
    if today:
        decode_request(frame)
    else:
        with pytest.raises(BadRequest):
            decode_request(frame)


def test_version_1_samples_at_0_8_unless_told() -> None:
    prompt = {"op": "generate", "id": "g", "prompt": "p"}
    v1 = decode_request(prompt, version=1)
    assert isinstance(v1, Generate) and v1.sampling.temperature == 0.8
    told = decode_request({**prompt, "sampling": {"top_k": 5}}, version=1)
    assert isinstance(told, Generate)
    assert (told.sampling.temperature, told.sampling.top_k) == (0.8, 5)
    greedy = decode_request({**prompt, "sampling": {"temperature": 0}}, version=1)
    assert isinstance(greedy, Generate) and greedy.sampling.temperature == 0
    today = decode_request(prompt)
    assert isinstance(today, Generate) and today.sampling.temperature == 0.0


def test_what_is_wrong_otherwise_is_left_to_the_decoder() -> None:
    for frame in ({"op": 3}, {"id": "x"},
                  {"op": "generate", "id": "g", "prompt": "p", "sampling": None}):
        assert check_request(frame, 1) == frame
    with pytest.raises(BadRequest, match=r"generate\.sampling: expected an object"):
        decode_request({"op": "generate", "id": "g", "prompt": "p", "sampling": None},
                       version=1)


_TOOL_FIELDS = ("tools", "tool_choice", "tool_name", "parallel_tool_calls")
"""What version 4 added to ``generate``."""


def _without_turn_tools(frame: dict[str, Any]) -> dict[str, Any]:
    """A generate frame whose messages lack version 4's tool fields."""
    if frame.get("messages"):
        frame["messages"] = [{k: v for k, v in m.items()
                              if k not in ("tool_calls", "tool_call_id")}
                             for m in frame["messages"]]
    return frame


_V1_ONLY: dict[str, tuple[str, ...]] = {
    "sampling": ("temperature", "top_k", "top_p", "seed"),
    "speculative": ("proposer", "draft_max"),
}


@settings(max_examples=200, deadline=None)
@given(strategies.requests.filter(lambda m: not isinstance(m, Load | Unload)))
def test_a_version_1_request_means_what_it_means_today(msg: Any) -> None:
    """Written out by version 1's rules (every field it knew present), a request
    decodes the same in both versions."""
    frame = {k: v for k, v in unstructure(msg).items()
             if k not in ("ack", "constraint", "logprobs", "prediction", "model",
                          "keep_alive", *_TOOL_FIELDS)}
    frame = _without_turn_tools(frame)
    for name, keep in _V1_ONLY.items():
        if name in frame:
            frame[name] = {k: v for k, v in frame[name].items() if k in keep}
    assert decode_request(frame, version=1) == decode_request(frame)


# ------------------------------------------------------------- the server connection


def _opened(version: int) -> ServerConnection:
    server = ServerConnection()
    server.receive_data(encode(Hello(id="h", protocol_version=version, client_name="t")))
    assert isinstance(server.next_event(), Hello)
    frame = json.loads(server.send(Welcome(id="h", protocol_version=version,
                                           server_version="t", model=MODEL)))
    assert frame["protocol_version"] == version and server.version == version
    assert ("gpu_layers" in frame["model"]) == (version >= 2)
    assert ("state" in frame["model"]) == (version >= 3)
    return server


def test_a_version_1_connection_reads_and_writes_version_1() -> None:
    server = _opened(1)
    server.receive_data(b'{"op":"generate","id":"g","prompt":"p"}\n'
                        b'{"op":"cancel","id":"g","ack":"a"}\n')
    generate = server.next_event()
    assert isinstance(generate, Generate) and generate.sampling.temperature == 0.8
    rejected = server.next_event()
    assert isinstance(rejected, Rejected) and not rejected.fatal
    error = json.loads(server.reject(rejected))
    assert (error["id"], error["code"]) == ("g", "bad_request")
    assert "unknown field 'ack'" in error["message"]
    with pytest.raises(LocalProtocolError, match="protocol version 1 has no cancel_reply"):
        server.send(CancelReply(id="a", cancelled=True))
    done = json.loads(server.send(Done(id="g", finish_reason=FinishReason.SHUTDOWN, seed=3)))
    assert "seed" not in done and done["finish_reason"] == "cancelled"
    refused = json.loads(server.encode(ErrorMessage.from_error(PermissionDenied("no"))))
    assert refused["code"] == "bad_request"
    assert server.state is State.OPEN and server.in_flight == 0


def test_a_current_connection_is_unchanged() -> None:
    server = _opened(PROTOCOL_VERSION)
    server.receive_data(b'{"op":"generate","id":"g","prompt":"p"}\n')
    assert isinstance(server.next_event(), Generate)
    done = json.loads(server.send(Done(id="g", finish_reason=FinishReason.SHUTDOWN, seed=3)))
    assert (done["seed"], done["finish_reason"]) == (3, "shutdown")


@pytest.mark.parametrize(("asked", "welcomed"), [
    (PROTOCOL_VERSION, 1), (1, PROTOCOL_VERSION), (2, 1), (2, PROTOCOL_VERSION),
    (PROTOCOL_VERSION, 2), (PROTOCOL_VERSION + 1, PROTOCOL_VERSION + 1),
    (0, 0),
])
def test_the_welcome_answers_in_the_hellos_version(asked: int, welcomed: int) -> None:
    server = ServerConnection()
    server.receive_data(encode(Hello(id="h", protocol_version=asked, client_name="t")))
    assert isinstance(server.next_event(), Hello)
    with pytest.raises(LocalProtocolError, match="welcome in protocol"):
        server.send(Welcome(id="h", protocol_version=welcomed, server_version="t",
                            model=MODEL))
    assert server.state is State.HANDSHAKE


@given(st.integers(OLDEST_VERSION, PROTOCOL_VERSION))
def test_any_spoken_version_opens(version: int) -> None:
    assert _opened(version).state is State.OPEN


def test_protocol_md_shows_what_version_1_is_told() -> None:
    doc = (Path(versions.__file__).parent / "PROTOCOL.md").read_text(encoding="utf-8")
    with pytest.raises(BadRequest) as info:
        decode_request('{"op":"cancel","id":"2","ack":"3"}', version=1)
    assert f'"message":"{info.value.message}"' in doc
    assert f'"message":"{unsupported_message(PROTOCOL_VERSION + 1)}"' in doc


# ------------------------------------------------------------- version 2

_V2_MODEL_FIELDS = ["name", "architecture", "n_ctx", "n_vocab", "n_params", "size_bytes",
                    "has_mtp", "has_chat_template", "gpu_layers"]
"""A model as version 2 wrote it, spelled out rather than read from the schema."""
_V3_MODEL_ADDITIONS = {"loaded", "state", "default", "proposers", "keep_alive_s"}
_V2_OPS = "cancel, detokenize, generate, health, hello, models, stats, tokenize"
_V2_GENERATE = ("id, prompt, messages, max_tokens, sampling, stop, speculative, constraint, "
                "logprobs, prediction")


def _contains(new: Shape, old: Shape, path: str) -> None:
    assert set(old.fields) <= set(new.fields), path
    for name, (nesting, inner) in old.nested.items():
        assert new.nested[name][0] == nesting, f"{path}.{name}"
        _contains(new.nested[name][1], inner, f"{path}.{name}")


def test_version_2_only_adds_to_version_1() -> None:
    for old, new in ((V1.requests, V2.requests), (V1.responses, V2.responses)):
        assert set(old) <= set(new)
        for op, shape in old.items():
            _contains(new[op], shape, op)


@pytest.mark.parametrize("op", sorted(V2.requests))
def test_version_2_requests_lack_exactly_the_version_3_additions(op: str) -> None:
    extra = _fields_today(REQUEST_TYPES[op], V2.requests[op], op)
    assert extra == ({"generate": {"model", "keep_alive", *_TOOL_FIELDS},
                      "generate.messages": {"tool_calls", "tool_call_id"}}
                     if op == "generate" else {})


def test_version_2_responses_lack_exactly_the_version_3_additions() -> None:
    extra = {op: _fields_today(RESPONSE_TYPES[op], shape, op)
             for op, shape in V2.responses.items()}
    assert {k: v for e in extra.values() for k, v in e.items()} == {
        "done": {"model", "tool_calls"},
        "health_reply": {"models"},
        "welcome.model": _V3_MODEL_ADDITIONS,
        "models_reply.models": _V3_MODEL_ADDITIONS,
    }
    assert set(RESPONSE_TYPES) - set(V2.responses) == {"load_reply", "unload_reply"}
    assert set(REQUEST_TYPES) - set(V2.requests) == {"load", "unload"}
    assert set(V2.responses) <= set(RESPONSE_TYPES)


def test_version_2_done_loses_its_model_and_keeps_seed_and_shutdown() -> None:
    done = Done(id="g", finish_reason=FinishReason.SHUTDOWN, seed=7, model="m")
    frame = downgrade(unstructure(done), 2)
    assert list(frame) == ["op", "id", "finish_reason", "usage", "speculation",
                           "error_message", "seed"]
    assert (frame["seed"], frame["finish_reason"]) == (7, "shutdown")


def test_version_2_reads_unknown_model_as_bad_request_and_forbidden_as_itself() -> None:
    for code in ErrorCode:
        frame = downgrade(unstructure(ErrorMessage(id="r", code=code, message="x")), 2)
        assert frame["code"] == ("bad_request" if code is ErrorCode.UNKNOWN_MODEL
                                 else code.value)


def test_version_2_models_keep_gpu_layers_and_lose_the_version_3_fields() -> None:
    model = ModelInfo(name="m", gpu_layers=30, loaded=False, state="unloading", default=True,
                      proposers=("ngram",), keep_alive_s=300)
    welcome = downgrade(unstructure(Welcome(id="h", protocol_version=2, server_version="t",
                                            model=model)), 2)
    models = downgrade(unstructure(ModelsReply(id="m", models=(model, MODEL))), 2)
    assert list(welcome["model"]) == _V2_MODEL_FIELDS and welcome["model"]["gpu_layers"] == 30
    assert [list(m) for m in models["models"]] == [_V2_MODEL_FIELDS, _V2_MODEL_FIELDS]


def test_version_2_has_cancel_reply_but_no_load_or_unload_reply() -> None:
    assert downgrade(unstructure(CancelReply(id="a", cancelled=True)), 2) == \
        {"op": "cancel_reply", "id": "a", "cancelled": True}
    for msg in (LoadReply(id="l", model=MODEL), UnloadReply(id="u", model=MODEL,
                                                              unloaded=False)):
        with pytest.raises(Unrepresentable, match=f"protocol version 2 has no '{msg.OP}'"):
            downgrade(unstructure(msg), 2)
        with pytest.raises(BadRequest, match=f"cannot encode {msg.OP}"):
            encode(msg, version=2)


def _v2_model(model: ModelInfo) -> ModelInfo:
    """A model as a version-2 client reads it: the fields it lacks at their defaults."""
    return ModelInfo(**{name: getattr(model, name) for name in _V2_MODEL_FIELDS})


def _as_version_2(msg: Any) -> Any:
    """What a version-2 client reads: today's message less what version 2 lacks."""
    if isinstance(msg, Done):
        return attrs.evolve(msg, model=None, tool_calls=None)
    if isinstance(msg, ErrorMessage) and msg.code is ErrorCode.UNKNOWN_MODEL:
        return attrs.evolve(msg, code=ErrorCode.BAD_REQUEST)
    if isinstance(msg, Welcome):
        return attrs.evolve(msg, model=_v2_model(msg.model))
    if isinstance(msg, ModelsReply):
        return attrs.evolve(msg, models=tuple(_v2_model(m) for m in msg.models))
    return msg


@settings(max_examples=200, deadline=None)
@given(strategies.responses.filter(lambda m: not isinstance(m, LoadReply | UnloadReply)))
def test_every_version_2_frame_is_a_valid_frame(msg: Any) -> None:
    line = encode(msg, version=2)
    assert decode_response(line) == _as_version_2(msg)
    assert json.loads(line) == downgrade(unstructure(msg), 2)


@pytest.mark.parametrize(("frame", "message"), [
    ({"op": "load", "id": "g", "model": "m"},
     f"unknown op 'load' (expected one of: {_V2_OPS})"),
    ({"op": "unload", "id": "g", "model": "m"},
     f"unknown op 'unload' (expected one of: {_V2_OPS})"),
    ({"op": "generate", "id": "g", "prompt": "p", "model": "m"},
     f"generate: unknown field 'model' (allowed: {_V2_GENERATE})"),
    ({"op": "generate", "id": "g", "prompt": "p", "keep_alive": 5},
     f"generate: unknown field 'keep_alive' (allowed: {_V2_GENERATE})"),
    ({"op": "generate", "id": "g", "prompt": "p", "model": None, "keep_alive": None},
     f"generate: unknown fields 'keep_alive', 'model' (allowed: {_V2_GENERATE})"),
])
def test_what_version_2_lacks_is_refused_as_version_2_did(
        frame: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as info:
        decode_request(json.dumps(frame), version=2)
    assert (info.value.message, info.value.request_id) == (message, "g")
    decode_request(frame)  # today's version takes it


def test_version_2_keeps_what_version_2_had() -> None:
    for frame in ({"op": "cancel", "id": "g", "ack": "a"},
                  {"op": "generate", "id": "g", "prompt": "p", "logprobs": 2,
                   "prediction": "q", "constraint": {"kind": "json_object"},
                   "sampling": {"min_p": 0.1, "logit_bias": {"5": -1}},
                   "speculative": {"proposer": "ngram", "options": {"n": 3}}}):
        assert decode_request(frame, version=2) == decode_request(frame)
    greedy = decode_request({"op": "generate", "id": "g", "prompt": "p"}, version=2)
    assert isinstance(greedy, Generate) and greedy.sampling.temperature == 0.0


@settings(max_examples=200, deadline=None)
@given(strategies.requests.filter(lambda m: not isinstance(m, Load | Unload)))
def test_a_version_2_request_means_what_it_means_today(msg: Any) -> None:
    """Written out by version 2's rules (every field it knew present), a request
    decodes the same in both versions."""
    frame = _without_turn_tools({k: v for k, v in unstructure(msg).items()
                                 if k not in ("model", "keep_alive", *_TOOL_FIELDS)})
    assert decode_request(frame, version=2) == decode_request(frame)


def test_a_version_2_connection_reads_and_writes_version_2() -> None:
    server = _opened(2)
    server.receive_data(b'{"op":"generate","id":"g","prompt":"p"}\n'
                        b'{"op":"cancel","id":"g","ack":"a"}\n'
                        b'{"op":"load","id":"l","model":"m"}\n'
                        b'{"op":"generate","id":"g2","prompt":"p","model":"m"}\n')
    assert isinstance(server.next_event(), Generate)
    assert isinstance(server.next_event(), Cancel)
    assert json.loads(server.send(CancelReply(id="a", cancelled=True)))["cancelled"] is True
    for rid, said in (("l", "unknown op 'load'"), ("g2", "generate: unknown field 'model'")):
        rejected = server.next_event()
        assert isinstance(rejected, Rejected) and not rejected.fatal
        error = json.loads(server.reject(rejected))
        assert (error["id"], error["code"]) == (rid, "bad_request")
        assert error["message"].startswith(said)
    with pytest.raises(LocalProtocolError, match="protocol version 2 has no load_reply"):
        server.send(LoadReply(id="l", model=MODEL))
    done = json.loads(server.send(Done(id="g", finish_reason=FinishReason.SHUTDOWN, seed=3,
                                       model="m")))
    assert "model" not in done and (done["seed"], done["finish_reason"]) == (3, "shutdown")
    unknown = json.loads(server.encode(ErrorMessage.from_error(UnknownModel("no", request_id="x"))))
    assert unknown["code"] == "bad_request"
    assert server.state is State.OPEN and server.in_flight == 0


def test_protocol_md_shows_what_version_2_is_told() -> None:
    doc = (Path(versions.__file__).parent / "PROTOCOL.md").read_text(encoding="utf-8")
    for frame in ('{"op":"generate","id":"3","prompt":"hi","model":"qwen2.5:1b"}',
                  '{"op":"load","id":"4","model":"qwen2.5:1b"}'):
        with pytest.raises(BadRequest) as info:
            decode_request(frame, version=2)
        assert f"C: {frame}" in doc and f'"message":"{info.value.message}"' in doc


# ------------------------------------------------------------- version 3

_V3_GENERATE = ("id, prompt, messages, max_tokens, sampling, stop, speculative, constraint, "
                "logprobs, prediction, model, keep_alive")


def test_version_3_only_adds_to_version_2() -> None:
    for old, new in ((V2.requests, V3.requests), (V2.responses, V3.responses)):
        assert set(old) <= set(new)
        for op, shape in old.items():
            assert set(shape.fields) <= set(new[op].fields), op


@pytest.mark.parametrize("op", sorted(V3.requests))
def test_version_3_requests_lack_exactly_the_version_4_additions(op: str) -> None:
    extra = _fields_today(REQUEST_TYPES[op], V3.requests[op], op)
    assert extra == ({"generate": set(_TOOL_FIELDS),
                      "generate.messages": {"tool_calls", "tool_call_id"}}
                     if op == "generate" else {})


def test_version_3_responses_lack_exactly_the_version_4_additions() -> None:
    extra = {op: _fields_today(RESPONSE_TYPES[op], shape, op)
             for op, shape in V3.responses.items()}
    assert {k: v for e in extra.values() for k, v in e.items()} == {"done": {"tool_calls"}}
    assert set(RESPONSE_TYPES) == set(V3.responses)
    assert set(REQUEST_TYPES) == set(V3.requests)


@settings(max_examples=200, deadline=None)
@given(strategies.responses)
def test_every_version_3_frame_is_a_valid_frame(msg: Any) -> None:
    line = encode(msg, version=3)
    want = attrs.evolve(msg, tool_calls=None) if isinstance(msg, Done) else msg
    assert decode_response(line) == want
    assert json.loads(line) == downgrade(unstructure(msg), 3)


@pytest.mark.parametrize(("frame", "message"), [
    ({"op": "generate", "id": "g", "messages": [{"role": "user", "content": "c"}],
      "tools": [{"name": "f"}]}, f"generate: unknown field 'tools' (allowed: {_V3_GENERATE})"),
    ({"op": "generate", "id": "g", "messages": [{"role": "user", "content": "c"}],
      "tool_choice": "auto"},
     f"generate: unknown field 'tool_choice' (allowed: {_V3_GENERATE})"),
    ({"op": "generate", "id": "g", "messages": [
        {"role": "tool", "content": "c", "tool_call_id": "x"}]},
     "generate.messages[0]: unknown field 'tool_call_id' (allowed: role, content)"),
])
def test_what_version_3_lacks_is_refused_as_version_3_did(
        frame: dict[str, Any], message: str) -> None:
    with pytest.raises(BadRequest) as info:
        decode_request(json.dumps(frame), version=3)
    assert (info.value.message, info.value.request_id) == (message, "g")
    decode_request(frame)  # today's version takes it


@settings(max_examples=200, deadline=None)
@given(strategies.requests)
def test_a_version_3_request_means_what_it_means_today(msg: Any) -> None:
    frame = _without_turn_tools({k: v for k, v in unstructure(msg).items()
                                 if k not in _TOOL_FIELDS})
    assert decode_request(frame, version=3) == decode_request(frame)
