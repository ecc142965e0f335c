"""Several models in one daemon, the protocol's side: ``generate.model`` and
``keep_alive``, ``done.model``, the model's state in ``ModelInfo``, the ``load`` and
``unload`` requests, the ``unknown_model`` error, and what a version-1 client is shown
of all that. The daemon's routing and loading are tested with the daemon."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshd.protocol import (
    MAX_KEEP_ALIVE_S,
    PROTOCOL_VERSION,
    BadRequest,
    ClientConnection,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    Generate,
    Hello,
    Load,
    LoadReply,
    LocalProtocolError,
    ModelInfo,
    ModelsReply,
    Rejected,
    Reply,
    ServerConnection,
    SyncClient,
    UnknownModel,
    Unload,
    UnloadReply,
    Welcome,
    decode_request,
    decode_response,
    encode,
    error_from_code,
    exception_class,
    unstructure,
)
from meshd.protocol.client import Client
from meshd.protocol.versions import V1, downgrade

from .fake_server import running_server
from .test_sync_client import server_thread

NAME_RULE = ("must be a model name: a letter or digit, then letters, digits, '.', '_', ':' "
             "or '-', at most 64 characters")
KEEP_ALIVE_RULE = f"must be -1 (stay loaded) or a number of seconds in [0, {MAX_KEEP_ALIVE_S}]"
V1_OPS = "cancel, detokenize, generate, health, hello, models, stats, tokenize"

LOADED = ModelInfo(name="qwen3-8b", n_ctx=8192, size_bytes=5_000_000_000, has_mtp=True,
                   gpu_layers=12, state="loaded", default=True, proposers=("mtp", "ngram"),
                   keep_alive_s=-1)
UNLOADED = ModelInfo(name="qwen2.5:1b", n_ctx=4096, size_bytes=986_046_272, loaded=False,
                     state="unloaded", keep_alive_s=300)


def _request_error(frame: dict[str, Any], *, version: int = PROTOCOL_VERSION) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        decode_request(json.dumps(frame), version=version)
    return info.value


# ------------------------------------------------------------------ the frames


def test_the_new_fields_and_ops_on_the_wire() -> None:
    generate = Generate(id="g", prompt="p", model="qwen2.5:1b", keep_alive=-1)
    frame = json.loads(encode(generate))
    assert (frame["model"], frame["keep_alive"]) == ("qwen2.5:1b", -1)
    assert decode_request(encode(generate)) == generate
    defaults = json.loads(encode(Generate(id="g", prompt="p")))
    assert (defaults["model"], defaults["keep_alive"]) == (None, None)
    assert decode_request('{"op":"generate","id":"g","prompt":"p"}') == \
        Generate(id="g", prompt="p")

    assert json.loads(encode(Load(id="l", model="m", keep_alive=2.5))) == \
        {"op": "load", "id": "l", "model": "m", "keep_alive": 2.5}
    assert decode_request('{"op":"load","id":"l","model":"m"}') == Load(id="l", model="m")
    assert json.loads(encode(Unload(id="u", model="m"))) == \
        {"op": "unload", "id": "u", "model": "m"}

    done = Done(id="g", finish_reason=FinishReason.EOG, model="qwen2.5:1b")
    assert list(json.loads(encode(done)))[-2:] == ["model", "tool_calls"]
    assert decode_response(encode(done)) == done
    model = unstructure(LoadReply(id="l", model=LOADED))["model"]
    assert {k: model[k] for k in ("loaded", "state", "default", "proposers", "keep_alive_s")} \
        == {"loaded": True, "state": "loaded", "default": True, "proposers": ["mtp", "ngram"],
            "keep_alive_s": -1}
    for reply in (LoadReply(id="l", model=LOADED),
                  UnloadReply(id="u", model=UNLOADED, unloaded=True),
                  ModelsReply(id="m", models=(LOADED, UNLOADED))):
        assert decode_response(encode(reply)) == reply
    assert list(json.loads(encode(UnloadReply(id="u", model=UNLOADED, unloaded=True)))) == \
        ["op", "id", "model", "unloaded"]


def test_a_model_from_an_older_daemon_reads_as_before() -> None:
    """The new fields default to what a one-model daemon meant: loaded, state unsaid."""
    old = {"name": "m", "architecture": None, "n_ctx": 512, "n_vocab": 10, "n_params": None,
           "size_bytes": None, "has_mtp": False, "has_chat_template": False}
    (model,) = decode_response(json.dumps({"op": "models_reply", "id": "m",
                                           "models": [old]})).models  # type: ignore[union-attr]
    assert (model.loaded, model.state, model.default, model.proposers, model.keep_alive_s) \
        == (True, None, False, (), None)


@pytest.mark.parametrize("name", ["qwen2.5:1b", "Qwen3-8B-Q4_K_M", "a", "7b", "a" * 64,
                                  "m_1.gguf"])
def test_model_names_that_pass(name: str) -> None:
    assert decode_request({"op": "generate", "id": "g", "prompt": "p", "model": name}) == \
        Generate(id="g", prompt="p", model=name)
    assert Load(id="l", model=name).model == Unload(id="u", model=name).model == name


@pytest.mark.parametrize("name", ["", "a b", "-lead", ".hidden", "a" * 65, "a/b", "a=b",
                                  "é", 5, True, ["m"]])
def test_a_bad_model_name_is_a_bad_request_naming_the_field(name: object) -> None:
    for op in ("generate", "load", "unload"):
        frame = {"op": op, "id": "r", "model": name, **({"prompt": "p"} if op == "generate"
                                                         else {})}
        error = _request_error(frame)
        assert error.code is ErrorCode.BAD_REQUEST and error.request_id == "r"
        expected = (f"{op}.model: expected a string" if not isinstance(name, str)
                    else f"{op}.model: {NAME_RULE} (got {name[:40]!r}")
        assert error.message.startswith(expected), error.message
    if isinstance(name, str):
        with pytest.raises(BadRequest, match=r"^model: must be a model name"):
            Generate(id="g", prompt="p", model=name)


@pytest.mark.parametrize("value", [-1, -1.0, 0, 0.5, 300, MAX_KEEP_ALIVE_S,
                                   float(MAX_KEEP_ALIVE_S)])
def test_keep_alives_that_pass(value: float) -> None:
    generate = decode_request({"op": "generate", "id": "g", "prompt": "p", "keep_alive": value})
    assert isinstance(generate, Generate) and generate.keep_alive == value
    assert Load(id="l", model="m", keep_alive=value).keep_alive == value
    assert ModelInfo(name="m", keep_alive_s=value).keep_alive_s == value


@pytest.mark.parametrize("value", [-2, -0.5, -1e-9, MAX_KEEP_ALIVE_S + 1, 1e300])
def test_keep_alive_is_minus_one_or_bounded(value: float) -> None:
    for op, extra in (("generate", {"prompt": "p"}), ("load", {"model": "m"})):
        error = _request_error({"op": op, "id": "r", "keep_alive": value, **extra})
        assert error.message == f"{op}.keep_alive: {KEEP_ALIVE_RULE} (got {value!r})"
    with pytest.raises(BadRequest, match=r"^keep_alive_s: must be -1"):
        ModelInfo(name="m", keep_alive_s=value)


@pytest.mark.parametrize("value", ["5m", True, None])
def test_keep_alive_is_a_number(value: object) -> None:
    frame = {"op": "generate", "id": "g", "prompt": "p", "keep_alive": value}
    if value is None:
        assert decode_request(frame) == Generate(id="g", prompt="p")
    else:
        assert _request_error(frame).message.startswith("generate.keep_alive: expected a number")


def test_a_models_state_is_one_of_four_and_agrees_with_loaded() -> None:
    for state, loaded in (("loading", False), ("loaded", True), ("unloading", False),
                          ("unloaded", False)):
        assert ModelInfo(name="m", state=state, loaded=loaded).state == state
        with pytest.raises(BadRequest, match=f"^loaded: must be {str(loaded).lower()} for "
                                             f"state {state}$"):
            ModelInfo(name="m", state=state, loaded=not loaded)
    with pytest.raises(BadRequest, match=r"^state: must be one of loading, loaded, "
                                         r"unloading, unloaded"):
        ModelInfo(name="m", state="sleeping")
    frame = {"op": "load_reply", "id": "l",
             "model": {"name": "m", "state": "unloaded", "loaded": True}}
    with pytest.raises(BadRequest, match=r"load_reply\.model\.loaded: must be false"):
        decode_response(json.dumps(frame))
    assert ModelInfo(name="m", loaded=False).state is None  # a daemon may leave it unsaid


def test_unknown_model_is_an_error_code_with_its_exception() -> None:
    assert ErrorCode("unknown_model") is ErrorCode.UNKNOWN_MODEL
    assert exception_class(ErrorCode.UNKNOWN_MODEL) is UnknownModel
    error = error_from_code("unknown_model", "generate.model: no model 'x'", "g")
    assert isinstance(error, UnknownModel) and error.request_id == "g"
    frame = ErrorMessage.from_error(error)
    assert json.loads(encode(frame))["code"] == "unknown_model"
    assert isinstance(decode_response(encode(frame)).to_error(),  # type: ignore[union-attr]
                      UnknownModel)


# ------------------------------------------------------------------ the connection


def _opened(version: int) -> ServerConnection:
    server = ServerConnection()
    server.receive_data(encode(Hello(id="h", protocol_version=version, client_name="t")))
    assert isinstance(server.next_event(), Hello)
    server.send(Welcome(id="h", protocol_version=version, server_version="t", model=LOADED))
    return server


def test_load_and_unload_are_answered_once() -> None:
    server = _opened(PROTOCOL_VERSION)
    server.receive_data(encode(Load(id="l", model="m")) + encode(Unload(id="u", model="m")))
    assert server.next_event() == Load(id="l", model="m")
    assert server.next_event() == Unload(id="u", model="m")
    assert server.in_flight == 2
    server.send(LoadReply(id="l", model=LOADED))
    server.send(ErrorMessage.from_error(UnknownModel("no model 'm'", request_id="u")))
    assert server.in_flight == 0
    with pytest.raises(LocalProtocolError, match="awaits no reply"):
        server.send(LoadReply(id="l", model=LOADED))

    client = ClientConnection()
    client.send(Hello(id="h", protocol_version=PROTOCOL_VERSION, client_name="t"))
    client.receive_data(encode(Welcome(id="h", protocol_version=PROTOCOL_VERSION,
                                       server_version="t", model=LOADED)))
    assert isinstance(client.next_event(), Reply)
    client.send(Unload(id="u", model="m"))
    assert client.in_flight("u")
    reply = UnloadReply(id="u", model=UNLOADED, unloaded=True)
    client.receive_data(encode(reply))
    assert client.next_event() == Reply("u", reply, True)
    assert not client.in_flight("u")


# ------------------------------------------------------------------ version 1


def test_version_1_is_shown_none_of_it() -> None:
    done = downgrade(unstructure(Done(id="g", finish_reason=FinishReason.EOG, model="m")), 1)
    assert "model" not in done and set(done) == {"op", *V1.responses["done"].fields}
    v1_model = set(V1.responses["welcome"].nested["model"][1].fields)
    welcome = downgrade(unstructure(Welcome(id="h", protocol_version=1, server_version="t",
                                            model=LOADED)), 1)
    assert set(welcome["model"]) == v1_model and welcome["model"]["n_ctx"] == 8192
    models = downgrade(unstructure(ModelsReply(id="m", models=(LOADED, UNLOADED))), 1)
    assert all(set(m) == v1_model for m in models["models"])
    error = ErrorMessage(id="g", code=ErrorCode.UNKNOWN_MODEL, message="no model 'm'")
    assert downgrade(unstructure(error), 1)["code"] == "bad_request"


def test_a_version_1_connection_refuses_the_new_fields_and_ops_as_version_1_did() -> None:
    server = _opened(1)
    server.receive_data(b'{"op":"load","id":"l","model":"m"}\n'
                        b'{"op":"unload","id":"u","model":"m"}\n'
                        b'{"op":"generate","id":"g","prompt":"p","model":"m"}\n'
                        b'{"op":"generate","id":"k","prompt":"p","keep_alive":0}\n'
                        b'{"op":"welcome","id":"w"}\n'
                        b'{"op":"nope","id":"n"}\n')
    answers = []
    for _ in range(6):
        event = server.next_event()
        assert isinstance(event, Rejected) and not event.fatal
        answers.append(json.loads(server.reject(event)))
    assert [(a["id"], a["code"]) for a in answers] == \
        [(rid, "bad_request") for rid in ("l", "u", "g", "k", "w", "n")]
    messages = [a["message"] for a in answers]
    # What version 1's decoder said of an op it did not have, with its own list of ops.
    assert messages[0] == f"unknown op 'load' (expected one of: {V1_OPS})"
    assert messages[1] == f"unknown op 'unload' (expected one of: {V1_OPS})"
    assert messages[2].startswith("generate: unknown field 'model' (allowed: id, prompt,")
    assert messages[3].startswith("generate: unknown field 'keep_alive' (allowed: id,")
    assert messages[4] == f"'welcome' is not a request op (expected one of: {V1_OPS})"
    assert messages[5] == f"unknown op 'nope' (expected one of: {V1_OPS})"
    with pytest.raises(LocalProtocolError, match="protocol version 1 has no load_reply"):
        server.send(LoadReply(id="l", model=LOADED))
    assert server.in_flight == 0
    # Today's client is told the same things with today's list.
    error = _request_error({"op": "nope", "id": "n"})
    assert "load" in error.message and "unload" in error.message


# ------------------------------------------------------------------ the clients


@pytest.mark.anyio
async def test_the_async_client_loads_unloads_and_names_a_model() -> None:
    async with running_server() as (server, path), Client.connect(path) as client:
        model = await client.load("qwen2.5:1b", keep_alive=300)
        assert (model.name, model.state, model.keep_alive_s) == ("qwen2.5:1b", "loaded", 300)
        assert (await client.unload("qwen2.5:1b")).unloaded
        busy = await client.unload("busy")
        assert (busy.unloaded, busy.model.state) == (False, "unloading")
        with pytest.raises(UnknownModel, match="no model 'nosuch'"):
            await client.load("nosuch")
        completion = await client.generate("hi", model="qwen2.5:1b", keep_alive=-1).collect()
        assert completion.done.model == "qwen2.5:1b"
        assert (await client.generate("hi").collect()).done.model == "fake-model"
        sent = [m for m in server.received if isinstance(m, Load | Unload | Generate)]
        assert sent[0] == Load(id=sent[0].id, model="qwen2.5:1b", keep_alive=300)
        generates = [m for m in sent if isinstance(m, Generate)]
        assert [(g.model, g.keep_alive) for g in generates] == \
            [("qwen2.5:1b", -1), (None, None)]


@pytest.mark.anyio
async def test_the_async_client_refuses_bad_values_before_sending() -> None:
    async with running_server() as (server, path), Client.connect(path) as client:
        with pytest.raises(BadRequest, match=r"^generate\.model: must be a model name"):
            client.generate("hi", model="a b")
        with pytest.raises(BadRequest, match=r"^generate\.keep_alive: must be -1"):
            client.generate("hi", keep_alive=-2)
        with pytest.raises(BadRequest, match=r"^load\.model: must be a model name"):
            await client.load("a/b")
        with pytest.raises(BadRequest, match=r"^load\.keep_alive: must be -1"):
            await client.load("m", keep_alive=MAX_KEEP_ALIVE_S * 2)
        with pytest.raises(BadRequest, match=r"^unload\.model: must be a model name"):
            await client.unload("")
        assert [type(m) for m in server.received] == [Hello]


def test_the_sync_client_loads_unloads_and_names_a_model() -> None:
    with server_thread() as (_, path), SyncClient.connect(path) as client:
        assert client.load("m", keep_alive=0).keep_alive_s == 0
        assert client.load("m").keep_alive_s is None
        reply = client.unload("m")
        assert isinstance(reply, UnloadReply) and reply.unloaded
        with pytest.raises(UnknownModel):
            client.unload("nosuch")
        stream = client.generate("hi", model="m2", keep_alive=60)
        assert stream.collect().done.model == "m2"
