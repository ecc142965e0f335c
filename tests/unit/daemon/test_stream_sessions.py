"""The resumable streams' bounds: a stream keeps its last MAX_BYTES (a replay from before
them is refused), at most MAX_SESSIONS streams live (finished ones make room first), and a
Stop cancels what the stream's request registered."""

from __future__ import annotations

import pytest

from meshd.daemon.frontends.http import stream_sessions as ss


def test_a_long_stream_keeps_its_last_bytes_and_refuses_older_offsets() -> None:
    session = ss.StreamSessions().create("c")
    session.append(b"a" * (ss.MAX_BYTES - 10))
    session.append(b"0123456789tail")
    assert session.total == ss.MAX_BYTES + 4 and session.dropped == 4
    assert session.read(session.total - 4) == b"tail"
    with pytest.raises(ss.OffsetLost):
        session.read(3)


def test_finished_streams_make_room_first_and_a_replaced_stream_stops() -> None:
    sessions = ss.StreamSessions()
    stopped: list[str] = []
    for i in range(ss.MAX_SESSIONS):
        s = sessions.create(f"c{i}")
        s.on_stop(lambda i=i: stopped.append(f"c{i}"))
    sessions.get("c5").finish()  # type: ignore[union-attr]
    sessions.create("new")
    assert sessions.get("c5") is None and sessions.get("c0") is not None
    assert stopped == ["c5"]
    sessions.create("c1")  # the same conversation again: the old stream is stopped
    assert stopped == ["c5", "c1"] and not sessions.get("c1").done  # type: ignore[union-attr]
    assert [s.conversation for s in sessions.lookup(["c2", "c3"])] == ["c2", "c3"]
    assert sessions.stop("c2") and not sessions.stop("c2")
