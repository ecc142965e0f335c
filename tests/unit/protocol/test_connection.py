"""The sans-I/O connections: handshake first, every request answered to the end once.

The property tests drive a ClientConnection and a ServerConnection against each other
with random interleavings of sends and partial deliveries (bytes split anywhere), and a
hostile server that sends whatever frames it likes.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.protocol import (
    PROTOCOL_VERSION,
    BadRequest,
    Cancel,
    CancelReply,
    ConnectionClosed,
    Done,
    ErrorCode,
    ErrorMessage,
    FinishReason,
    Generate,
    Health,
    HealthReply,
    HealthStatus,
    Hello,
    InternalError,
    ModelInfo,
    ServerBusy,
    Stats,
    Token,
    Tokenize,
    TokenizeReply,
    UnsupportedVersion,
    Welcome,
    encode,
    error_message,
)
from meshd.protocol.connection import (
    ClientConnection,
    ConnectionEnded,
    Failed,
    LocalProtocolError,
    Rejected,
    Reply,
    ServerConnection,
    State,
    Stray,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
IDS = ("a", "b", "c")
MODEL = ModelInfo(name="m")


def welcome(hello_id: str = "h", version: int = PROTOCOL_VERSION) -> Welcome:
    return Welcome(id=hello_id, protocol_version=version, server_version="t", model=MODEL)


def hello(hello_id: str = "h") -> Hello:
    return Hello(id=hello_id, protocol_version=PROTOCOL_VERSION, client_name="t")


def events(conn: ClientConnection | ServerConnection) -> list[Any]:
    out = []
    while (event := conn.next_event()) is not None:
        if isinstance(event, ConnectionEnded):
            break
        out.append(event)
        if isinstance(event, Failed):
            break
    return out


def connected() -> tuple[ClientConnection, ServerConnection]:
    client, server = ClientConnection(), ServerConnection()
    server.receive_data(client.send(hello()))
    (got,) = events(server)
    assert isinstance(got, Hello)
    client.receive_data(server.send(welcome()))
    (reply,) = events(client)
    assert reply == Reply("h", welcome(), True) and client.state is State.OPEN
    return client, server


# ------------------------------------------------------------------ handshake


def test_hello_comes_first_on_both_sides() -> None:
    client = ClientConnection()
    with pytest.raises(LocalProtocolError, match="first frame must be hello"):
        client.send(Health(id="1"))
    server = ServerConnection()
    server.receive_data(encode(Health(id="1")))
    (event,) = events(server)
    assert isinstance(event, Rejected) and event.fatal
    assert "the first frame must be hello (got health)" in event.error.message
    server.reject(event)
    assert server.state is State.CLOSED
    with pytest.raises(LocalProtocolError):
        server.send(HealthReply(id="1", status=HealthStatus.OK, uptime_s=0,
                                active_requests=0, queued_requests=0))


def test_server_answers_nothing_before_hello() -> None:
    server = ServerConnection()
    with pytest.raises(LocalProtocolError):
        server.send(welcome())
    refused = server.refuse(ServerBusy("too many"))
    assert refused.startswith(b'{"op":"error","id":null,"code":"busy"')
    assert server.state is State.CLOSED


def test_second_hello_is_rejected_but_not_fatal() -> None:
    client, server = connected()
    server.receive_data(encode(hello("h2")))
    (event,) = events(server)
    assert isinstance(event, Rejected) and not event.fatal
    assert event.error.message == "hello was already received"
    with pytest.raises(LocalProtocolError):
        client.send(hello("h2"))


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (ErrorMessage(id="h", code=ErrorCode.UNSUPPORTED_VERSION, message="no"),
         UnsupportedVersion),
        (welcome(version=PROTOCOL_VERSION + 1), UnsupportedVersion),
        (welcome("other"), InternalError),
        (HealthReply(id="h", status=HealthStatus.OK, uptime_s=0, active_requests=0,
                     queued_requests=0), InternalError),
        (None, ConnectionClosed),
    ],
)
def test_failed_handshakes(answer: Any, error: type[Exception]) -> None:
    client = ClientConnection()
    client.send(hello())
    client.receive_data(b"" if answer is None else encode(answer))
    if answer is not None:
        client.receive_data(b"")
    (event,) = events(client)
    assert isinstance(event, Failed) and type(event.error) is error
    assert client.state is State.CLOSED
    with pytest.raises(type(event.error)):
        client.send(Health(id="1"))


# ------------------------------------------------------------------ in flight


def test_generate_ends_with_exactly_one_terminal_frame() -> None:
    client, server = connected()
    server.receive_data(client.send(Generate(id="g", prompt="x")))
    (request,) = events(server)
    assert isinstance(request, Generate) and server.generating("g")
    data = server.send(Token(id="g", text="a", token_ids=(1,)))
    data += server.send(Done(id="g", finish_reason=FinishReason.LENGTH))
    for late in (Token(id="g", text="a", token_ids=(1,)),
                 Done(id="g", finish_reason=FinishReason.STOP),
                 ErrorMessage(id="g", code=ErrorCode.INTERNAL, message="x")):
        with pytest.raises(LocalProtocolError):
            server.send(late)
    client.receive_data(data)
    assert [(e.final, type(e.item)) for e in events(client)] == [(False, Token), (True, Done)]
    assert not client.in_flight("g") and server.in_flight == 0


def test_duplicate_generate_id_is_refused_and_the_first_runs_on() -> None:
    client, server = connected()
    server.receive_data(client.send(Generate(id="g", prompt="x")))
    with pytest.raises(ValueError, match="already in use"):
        client.send(Generate(id="g", prompt="y"))
    server.receive_data(encode(Generate(id="g", prompt="y")))  # a client without the check
    _, rejected = events(server)
    assert isinstance(rejected, Rejected) and "already in flight" in rejected.error.message
    server.reject(rejected)
    assert server.generating("g")
    server.send(Done(id="g", finish_reason=FinishReason.STOP))


def test_rejected_frame_with_an_id_keeps_the_connection() -> None:
    _, server = connected()
    server.receive_data(b'{"op":"generate","id":"7","prompt":"x","max_tokens":0}\n')
    (event,) = events(server)
    assert isinstance(event, Rejected) and not event.fatal and event.error.request_id == "7"
    assert isinstance(event.error, BadRequest) and event.frame is not None
    server.reject(event)
    assert server.state is State.OPEN and server.in_flight == 0


def test_single_reply_requests_and_cancel_ack() -> None:
    client, server = connected()
    data = client.send(Stats(id="s")) + client.send(Cancel(id="g", ack="k"))
    data += client.send(Cancel(id="g"))  # no ack: no answer expected
    server.receive_data(data)
    assert [type(e) for e in events(server)] == [Stats, Cancel, Cancel]
    assert server.in_flight == 2
    with pytest.raises(LocalProtocolError):
        server.send(CancelReply(id="g", cancelled=False))
    out = server.send(CancelReply(id="k", cancelled=False))
    out += server.send(error_message(InternalError("stats failed", request_id="s")))
    client.receive_data(out)
    assert [(e.request_id, e.final) for e in events(client)] == [("k", True), ("s", True)]
    assert server.in_flight == 0


def test_frames_for_ids_not_in_flight_are_strays() -> None:
    client, _ = connected()
    client.receive_data(encode(Token(id="nobody", text="x", token_ids=(1,))))
    client.receive_data(b'{"op":"token","id":"nobody2","text":1}\n')
    assert [type(e) for e in events(client)] == [Stray, Stray]


def test_error_without_id_or_unplaceable_garbage_fails_the_connection() -> None:
    client, _ = connected()
    client.send(Generate(id="g", prompt="x"))
    client.receive_data(b"garbage\n")
    (event,) = events(client)
    assert isinstance(event, Failed) and isinstance(event.error, InternalError)
    assert not client.in_flight("g")
    with pytest.raises(InternalError):
        client.send(Health(id="1"))


# ------------------------------------------------------------------ properties

client_actions = st.one_of(
    st.tuples(st.just("generate"), st.sampled_from(IDS)),
    st.tuples(st.just("tokenize"), st.sampled_from(IDS)),
    st.tuples(st.just("cancel"), st.sampled_from(IDS), st.none() | st.sampled_from(IDS)),
)
server_actions = st.tuples(
    st.sampled_from(["token", "done", "error", "reply"]), st.sampled_from(IDS)
)
deliveries = st.tuples(st.sampled_from(["to_server", "to_client"]), st.integers(1, 64))
actions = st.lists(st.one_of(client_actions, server_actions, deliveries), max_size=60)


def server_frame(kind: str, rid: str) -> Any:
    if kind == "token":
        return Token(id=rid, text="t", token_ids=(1,))
    if kind == "done":
        return Done(id=rid, finish_reason=FinishReason.STOP)
    if kind == "error":
        return ErrorMessage(id=rid, code=ErrorCode.MODEL_ERROR, message="x")
    return TokenizeReply(id=rid, tokens=(1,))


@SETTINGS
@given(actions)
def test_random_interleavings_keep_every_rule(script: list[tuple[Any, ...]]) -> None:
    client, server = connected()
    to_server, to_client = bytearray(), bytearray()
    client_events: list[Reply] = []
    sent: dict[str, list[str]] = collections.defaultdict(list)  # per id, kinds in order
    server_generating: set[str] = set()
    server_awaiting: collections.Counter[str] = collections.Counter()

    def pump_server() -> None:
        for event in events(server):
            assert not isinstance(event, Rejected), event  # an honest client
            if isinstance(event, Generate):
                server_generating.add(event.id)
            elif isinstance(event, Cancel):
                if event.ack is not None:
                    server_awaiting[event.ack] += 1
            else:
                server_awaiting[event.id] += 1

    def pump_client() -> None:
        for event in events(client):
            assert isinstance(event, Reply), event  # an honest server: no strays
            client_events.append(event)

    for action in script:
        kind = action[0]
        if kind in ("generate", "tokenize", "cancel"):
            request: Any = (Generate(id=action[1], prompt="p") if kind == "generate"
                            else Tokenize(id=action[1], text="t") if kind == "tokenize"
                            else Cancel(id=action[1], ack=action[2]))
            key = action[2] if kind == "cancel" else action[1]
            busy = key is not None and client.in_flight(key)
            try:
                to_server += client.send(request)
            except ValueError:
                assert busy
                continue
            assert not busy
            if key is not None:
                sent[key].append("generate" if kind == "generate" else "single")
        elif kind in ("token", "done", "error", "reply"):
            rid = action[1]
            generating = rid in server_generating
            allowed = ((generating and kind != "reply")
                       or (rid in server_awaiting and kind in ("reply", "error")))
            try:
                to_client += server.send(server_frame(kind, rid))
            except LocalProtocolError:
                assert not allowed
                continue
            assert allowed
            if generating:
                if kind != "token":
                    server_generating.discard(rid)
            else:
                server_awaiting[rid] -= 1
                server_awaiting += collections.Counter()
        else:
            buf, feed, pump = ((to_server, server.receive_data, pump_server)
                               if kind == "to_server"
                               else (to_client, client.receive_data, pump_client))
            chunk = bytes(buf[: action[1]])
            del buf[: action[1]]
            if chunk:
                feed(chunk)
            pump()

    # Deliver what is left, then end every generate still running.
    if to_server:
        server.receive_data(bytes(to_server))
    pump_server()
    for rid in sorted(server_generating):
        to_client += server.send(Done(id=rid, finish_reason=FinishReason.CANCELLED))
    if to_client:
        client.receive_data(bytes(to_client))
    pump_client()

    # Per id, the client saw its requests answered in order: tokens only for a
    # generate, then exactly one final frame; nothing for an id with nothing in flight.
    for event in client_events:
        queue = sent[event.request_id]
        assert queue, f"a reply for {event.request_id!r}, which has nothing in flight"
        if isinstance(event.item, Token):
            assert queue[0] == "generate" and not event.final
        else:
            assert event.final
        if event.final:
            queue.pop(0)
    # Every generate ended; what is left are single replies the server still owes.
    leftover = collections.Counter({rid: len(q) for rid, q in sent.items() if q})
    assert all(q == ["single"] for q in sent.values() if q)
    assert leftover == server_awaiting
    assert server.in_flight == server_awaiting.total()


hostile_frames = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["token", "done", "error", "reply"]),
                  st.sampled_from((*IDS, "x"))).map(lambda a: encode(server_frame(*a))),
        st.sampled_from([b"garbage\n", b'{"op":"token","id":"a"}\n', b"\n",
                         b'{"op":"error","id":null,"code":"internal","message":"m"}\n']),
    ),
    max_size=30,
)


@SETTINGS
@given(hostile_frames, st.lists(st.sampled_from(IDS), max_size=3, unique=True),
       st.integers(1, 50))
def test_hostile_server_never_breaks_the_client_rules(
    frames: list[bytes], generating: list[str], split: int
) -> None:
    client, _ = connected()
    for rid in generating:
        client.send(Generate(id=rid, prompt="p"))
    data = b"".join(frames)
    seen: list[Any] = []
    for start in range(0, len(data), split):
        client.receive_data(data[start:start + split])
        seen.extend(events(client))
    client.receive_data(b"")
    seen.extend(events(client))
    finished: set[str] = set()
    failed = False
    for event in seen:
        assert not failed, "nothing comes after Failed"
        if isinstance(event, Failed):
            failed = True
        elif isinstance(event, Reply):
            assert event.request_id in generating and event.request_id not in finished
            if event.final:
                finished.add(event.request_id)
    assert failed, "the end of the stream always fails the connection"


client_frames = st.lists(
    st.one_of(
        st.sampled_from(IDS).map(lambda rid: encode(Generate(id=rid, prompt="p"))),
        st.sampled_from(IDS).map(lambda rid: encode(Stats(id=rid))),
        st.sampled_from(IDS).map(lambda rid: encode(Cancel(id=rid, ack="k"))),
        st.just(encode(hello("h2"))),
        st.sampled_from([b"garbage\n", b'{"op":"generate","id":"a"}\n', b"\n",
                         b'{"op":"done","id":"a","finish_reason":"stop"}\n']),
    ),
    max_size=30,
)


@SETTINGS
@given(st.booleans(), client_frames, st.integers(1, 50))
def test_hostile_client_never_breaks_the_server_rules(
    hello_first: bool, frames: list[bytes], split: int
) -> None:
    """Whatever a client sends, the server admits hello first, never two generates with
    one id in flight, and turns everything else into a Rejected frame to answer."""
    server = ServerConnection()
    data = (encode(hello()) if hello_first else b"") + b"".join(frames)
    generating: set[str] = set()
    first = True
    for start in range(0, len(data), split):
        server.receive_data(data[start:start + split])
        # One event at a time: the hello is answered before the next frame is taken.
        while (event := server.next_event()) is not None:
            if isinstance(event, ConnectionEnded):
                break
            if first:
                first = False
                if hello_first:
                    assert isinstance(event, Hello)
                if isinstance(event, Hello):
                    server.send(welcome(event.id))
                    continue
                assert isinstance(event, Rejected) and event.fatal
            if isinstance(event, Rejected):
                assert event.fatal == (server.state is State.HANDSHAKE)
                server.reject(event)
                if event.fatal:
                    assert server.state is State.CLOSED
                continue
            assert server.state is State.OPEN and not isinstance(event, Hello)
            if isinstance(event, Generate):
                assert event.id not in generating
                generating.add(event.id)
                if len(generating) == 2:  # end one now and then
                    rid = sorted(generating)[0]
                    server.send(Done(id=rid, finish_reason=FinishReason.STOP))
                    generating.discard(rid)
    assert server.in_flight >= len(generating)
