"""Property tests: the decoder never crashes, and framing is split-invariant."""

from __future__ import annotations

import contextlib
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshd.protocol import (
    REQUEST_TYPES,
    RESPONSE_TYPES,
    BadRequest,
    FrameDecoder,
    ProtocolError,
    RequestDecoder,
    ResponseDecoder,
    decode_request,
    decode_response,
    encode,
    unstructure,
)

from .strategies import json_values, requests, responses

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALL_OPS = sorted(set(REQUEST_TYPES) | set(RESPONSE_TYPES))
ALLOWED = (ProtocolError, *REQUEST_TYPES.values(), *RESPONSE_TYPES.values())


@SETTINGS
@given(requests)
def test_request_round_trip(msg: Any) -> None:
    assert decode_request(encode(msg)) == msg


@SETTINGS
@given(responses)
def test_response_round_trip(msg: Any) -> None:
    assert decode_response(encode(msg)) == msg


def _outcomes(decoder: RequestDecoder | ResponseDecoder) -> list[Any]:
    out: list[Any] = []
    for item in decoder.drain():
        if isinstance(item, ProtocolError):
            out.append((type(item), item.message, item.request_id))
        else:
            out.append(item)
    return out


@SETTINGS
@given(st.binary(max_size=300), st.integers(1, 64))
def test_arbitrary_bytes_only_raise_protocol_errors(data: bytes, max_frame_size: int) -> None:
    for decoder in (RequestDecoder(max_frame_size), ResponseDecoder(max_frame_size)):
        decoder.feed(data)
        decoder.feed_eof()
        for item in decoder.drain():
            assert isinstance(item, ALLOWED)


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_frame_bytes(data: bytes) -> None:
    for decode in (decode_request, decode_response):
        with contextlib.suppress(BadRequest):
            decode(data)


@SETTINGS
@given(json_values)
def test_arbitrary_json_only_raises_bad_request(value: Any) -> None:
    text = json.dumps(value)
    for decode in (decode_request, decode_response):
        with contextlib.suppress(BadRequest):
            decode(text)


frame_like = st.fixed_dictionaries(
    {"op": st.sampled_from(ALL_OPS)},
    optional={
        "id": st.text(max_size=4) | json_values,
        "prompt": json_values,
        "messages": json_values,
        "sampling": json_values | st.dictionaries(st.sampled_from(["top_p", "seed"]), json_values),
        "finish_reason": json_values,
        "tokens": json_values,
        "speculation": json_values,
        "models": json_values,
        "text": json_values,
    },
)


@SETTINGS
@given(frame_like)
def test_frame_shaped_json_only_raises_bad_request(value: dict[str, Any]) -> None:
    for decode in (decode_request, decode_response):
        with contextlib.suppress(BadRequest):
            decode(json.dumps(value))


@SETTINGS
@given(st.data())
def test_corrupting_one_field_gives_bad_request_with_the_id(data: st.DataObject) -> None:
    """Replace one (possibly nested) field of a valid frame with arbitrary JSON: the
    decoder accepts it or raises BadRequest, and the error carries the frame's id."""
    msg = data.draw(requests | responses)
    decode = decode_request if type(msg).OP in REQUEST_TYPES else decode_response
    obj = json.loads(json.dumps(unstructure(msg)))
    target = obj
    keys = [k for k in obj if k not in ("op", "id")]
    if not keys:
        return
    key = data.draw(st.sampled_from(keys))
    if isinstance(obj[key], dict) and obj[key] and data.draw(st.booleans()):
        target = obj[key]
        key = data.draw(st.sampled_from(sorted(target)))
    target[key] = data.draw(json_values)
    try:
        decode(obj)
    except BadRequest as exc:
        assert exc.request_id == msg.id
        assert exc.message


segments = st.one_of(
    (requests | responses).map(encode),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"") + b"\n"),  # garbage lines
    st.integers(60, 200).map(lambda n: b'{"op":"stats","id":"big","x":"' + b"x" * n + b'"}\n'),
    st.just(b"\n"),
    st.just(b"  \r\n"),
)


@SETTINGS
@given(st.lists(segments, max_size=8), st.data())
def test_split_anywhere_gives_the_same_frames(chunks: list[bytes], data: st.DataObject) -> None:
    stream = b"".join(chunks) + data.draw(st.binary(max_size=20))  # maybe a partial tail
    max_frame_size = 120

    whole = RequestDecoder(max_frame_size)
    whole.feed(stream)
    whole.feed_eof()
    expected = _outcomes(whole)

    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    split = RequestDecoder(max_frame_size)
    got: list[Any] = []
    previous = 0
    for cut in [*cuts, len(stream)]:
        split.feed(stream[previous:cut])
        previous = cut
        got.extend(_outcomes(split))  # interleave draining with feeding
    split.feed_eof()
    got.extend(_outcomes(split))
    assert got == expected


@SETTINGS
@given(st.binary(max_size=120), st.integers(1, 20))
def test_byte_at_a_time_framing(stream: bytes, max_frame_size: int) -> None:
    def frames(pieces: list[bytes]) -> list[Any]:
        dec = FrameDecoder(max_frame_size)
        out: list[Any] = []
        for piece in pieces:
            dec.feed(piece)
            out.extend(x if isinstance(x, bytes) else (type(x), x.request_id) for x in dec)
        dec.feed_eof()
        out.extend(x if isinstance(x, bytes) else (type(x), x.request_id) for x in dec)
        return out

    expected = frames([stream])
    assert frames([stream[i : i + 1] for i in range(len(stream))]) == expected
    for item in expected:
        if isinstance(item, bytes):
            assert len(item) <= max_frame_size and b"\n" not in item and item.strip()
    # Memory is bounded by the frame limit whatever arrives.
    dec = FrameDecoder(max_frame_size)
    dec.feed(stream)
    assert dec.buffered <= max_frame_size
