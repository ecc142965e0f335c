"""The resumable streams' bounds: a stream keeps its last MAX_BYTES (a replay from before
them is refused), at most MAX_SESSIONS streams live (finished ones make room first), and a
Stop cancels what the stream's request registered. Streams are their owner's: another
owner's id names another stream, and reusing one's own live id is a conflict."""

from __future__ import annotations

import pytest

from meshd.daemon.frontends.http import stream_sessions as ss
from meshd.daemon.system.peercred import PeerCredentials


def test_a_long_stream_keeps_its_last_bytes_and_refuses_older_offsets() -> None:
    session = ss.StreamSessions().create("uid:1", "c")
    session.append(b"a" * (ss.MAX_BYTES - 10))
    session.append(b"0123456789tail")
    assert session.total == ss.MAX_BYTES + 4 and session.dropped == 4
    assert session.read(session.total - 4) == b"tail"
    with pytest.raises(ss.OffsetLost):
        session.read(3)


def test_finished_streams_make_room_first_and_a_live_id_is_not_reused() -> None:
    sessions = ss.StreamSessions()
    stopped: list[str] = []
    for i in range(ss.MAX_SESSIONS):
        s = sessions.create("me", f"c{i}")
        s.on_stop(lambda i=i: stopped.append(f"c{i}"))
    sessions.get("me", "c5").finish()  # type: ignore[union-attr]
    sessions.create("me", "new")
    assert sessions.get("me", "c5") is None and sessions.get("me", "c0") is not None
    assert stopped == ["c5"]
    with pytest.raises(ss.StreamConflict) as conflict:  # live: refused, not stopped
        sessions.create("me", "c1")
    assert conflict.value.status == 409 and "'c1'" in conflict.value.message
    assert stopped == ["c5"] and not sessions.get("me", "c1").done  # type: ignore[union-attr]
    sessions.get("me", "c1").finish()  # type: ignore[union-attr]
    assert sessions.create("me", "c1").total == 0  # finished: replaced
    assert [s.conversation for s in sessions.lookup("me", ["c2", "c3"])] == ["c2", "c3"]
    assert sessions.stop("me", "c2") and not sessions.stop("me", "c2")


def test_another_owner_neither_sees_nor_stops_nor_evicts_a_stream() -> None:
    sessions = ss.StreamSessions()
    mine = sessions.create("uid:1000", "c")
    stopped: list[bool] = []
    mine.on_stop(lambda: stopped.append(True))
    assert sessions.get("uid:1001", "c") is None
    assert sessions.lookup("uid:1001", ["c"]) == []
    assert not sessions.stop("uid:1001", "c") and not stopped
    theirs = sessions.create("uid:1001", "c")  # the same id: their own stream
    assert theirs is not mine and sessions.get("uid:1000", "c") is mine
    for i in range(ss.MAX_SESSIONS - 2):
        sessions.create("uid:1000", f"more{i}")
    with pytest.raises(ss.StreamConflict) as full:  # only others' live streams are left
        sessions.create("uid:1002", "c")
    assert full.value.status == 503 and not stopped
    sessions.create("uid:1000", "c2")  # the owner's own oldest makes room
    assert stopped == [True] and sessions.get("uid:1001", "c") is theirs


def test_the_owner_is_the_uid_on_the_socket_and_the_key_over_tcp() -> None:
    peer = PeerCredentials(pid=1, uid=1000, gid=1000)
    assert ss.stream_owner(peer, tcp=False, api_key="k") == "uid:1000"
    assert ss.stream_owner(None, tcp=True, api_key=None) == "tcp"
    one, two = (ss.stream_owner(None, tcp=True, api_key=k) for k in ("k1", "k2"))
    assert one != two and "k1" not in one and one.startswith("key:")
