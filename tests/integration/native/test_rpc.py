"""Remote workers without a model: addresses, the handshake probe, the fault-isolating
relay (against stand-in workers that speak ggml-rpc's framing), and the worker's
listen-address rules."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator

import pytest

from meshd.daemon.commands.worker import check_listen, free_port
from meshd.native.errors import WorkerUnreachable
from meshd.native.rpc import Endpoint, hello, parse_endpoint, parse_endpoints
from meshd.native.rpc_relay import WorkerLink

Handler = Callable[[socket.socket], None]


@contextlib.contextmanager
def stand_in_worker(handler: Handler) -> Iterator[Endpoint]:
    """A TCP server on loopback that runs ``handler`` on each connection (one thread)."""
    server = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def loop() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conns.append(conn)
            with contextlib.suppress(OSError, AssertionError):  # the peer went away
                handler(conn)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield Endpoint("127.0.0.1", server.getsockname()[1])
    finally:
        for s in (server, *conns):  # shutdown wakes a thread blocked on the socket
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        t.join(timeout=5)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed early"
        data += chunk
    return data


def answer_hello(conn: socket.socket, version: tuple[int, int, int] = (7, 0, 0)) -> None:
    cmd, size = struct.unpack("<BQ", recv_exact(conn, 9))
    assert cmd == 14
    recv_exact(conn, size)
    conn.sendall(struct.pack("<Q", 28) + bytes([*version, 0]) + bytes(24))


def test_endpoints_parse_and_reject_clearly() -> None:
    assert parse_endpoints("10.0.0.2:50052, host-b:6000") == (
        Endpoint("10.0.0.2", 50052), Endpoint("host-b", 6000))
    assert parse_endpoint("127.0.0.1", default_port=50052) == Endpoint("127.0.0.1", 50052)
    for bad, words in (("host", "HOST:PORT"), ("h:0", "1-65535"), ("h:x", "not a number"),
                       (":80", "bad host"), ("", "no worker")):
        with pytest.raises(ValueError, match=words):
            parse_endpoints(bad)
    with pytest.raises(ValueError, match="twice"):
        parse_endpoints("a:1,a:1")


def test_worker_listens_on_loopback_unless_told_otherwise() -> None:
    assert check_listen("127.0.0.1:6000", allow_remote=False) == Endpoint("127.0.0.1", 6000)
    assert check_listen("127.0.0.1", allow_remote=False).port == 50052
    with pytest.raises(ValueError, match="--allow-remote"):
        check_listen("0.0.0.0:6000", allow_remote=False)
    assert check_listen("0.0.0.0:6000", allow_remote=True) == Endpoint("0.0.0.0", 6000)
    with pytest.raises(ValueError, match="IPv4"):
        check_listen("localhost:6000", allow_remote=True)


def test_probe_names_the_address_and_the_reason() -> None:
    port = free_port()
    with pytest.raises(WorkerUnreachable, match=f"127.0.0.1:{port}.*refused") as info:
        hello(Endpoint("127.0.0.1", port), timeout=2)
    assert info.value.endpoint == f"127.0.0.1:{port}"
    # A worker busy with another client accepts (backlog) but never answers.
    with stand_in_worker(lambda conn: conn.recv(1)) as ep, \
            pytest.raises(WorkerUnreachable, match="busy"):
        hello(ep, timeout=0.5)
    with stand_in_worker(lambda conn: answer_hello(conn, (6, 1, 0))) as ep, \
            pytest.raises(WorkerUnreachable, match=r"6\.1\.0"):
        hello(ep, timeout=2)
    with stand_in_worker(answer_hello) as ep:
        assert hello(ep, timeout=2) == (7, 0, 0)


def _get_tensor(sock: socket.socket, size: int) -> bytes:
    """Send a GET_TENSOR request for ``size`` bytes; return the payload answered."""
    payload = bytes(8 * 40) + struct.pack("<QQ", 0, size)
    sock.sendall(struct.pack("<BQ", 8, len(payload)) + payload)
    n = struct.unpack("<Q", recv_exact(sock, 8))[0]
    assert n == size
    return recv_exact(sock, n)


def test_relay_forwards_and_counts_round_trips() -> None:
    def worker(conn: socket.socket) -> None:
        while True:
            cmd, size = struct.unpack("<BQ", recv_exact(conn, 9))
            body = recv_exact(conn, size)
            if cmd == 8:  # GET_TENSOR: answer the bytes asked for
                n = struct.unpack("<Q", body[-8:])[0]
                conn.sendall(struct.pack("<Q", n) + bytes([7]) * n)

    with stand_in_worker(worker) as ep:
        link = WorkerLink(ep)
        try:
            host, port = link.local.split(":")
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(struct.pack("<BQ", 6, 3) + b"abc")  # SET_TENSOR: no answer
                assert _get_tensor(sock, 5) == bytes([7]) * 5
            assert link.lost is None
            assert (link.stats.requests, link.stats.round_trips) == (2, 1)
        finally:
            link.close()


def test_relay_answers_for_a_lost_worker_so_llama_cpp_never_aborts() -> None:
    """The worker dies with a request in flight: the relay completes that answer and
    every later one with zeros of the expected size and reports the worker lost."""
    def dies_mid_answer(conn: socket.socket) -> None:
        recv_exact(conn, 9 + 8 * 42)
        conn.sendall(struct.pack("<Q", 64) + bytes([9]) * 10)  # 10 of 64 bytes, then gone
        conn.close()

    with stand_in_worker(dies_mid_answer) as ep:
        link = WorkerLink(ep)
        try:
            host, port = link.local.split(":")
            with socket.create_connection((host, int(port))) as sock:
                assert _get_tensor(sock, 64) == bytes([9]) * 10 + bytes(54)
                assert link.lost is not None
                assert _get_tensor(sock, 3) == bytes(3)  # answered by the relay itself
            # A new connection (llama.cpp reconnecting) is answered too, never refused.
            with socket.create_connection((host, int(port))) as sock:
                assert _get_tensor(sock, 2) == bytes(2)
        finally:
            link.close()


def test_relay_notices_a_worker_that_dies_while_idle() -> None:
    closed = threading.Event()

    def closes_after_one(conn: socket.socket) -> None:
        _cmd, size = struct.unpack("<BQ", recv_exact(conn, 9))
        recv_exact(conn, size)
        conn.close()
        closed.set()

    with stand_in_worker(closes_after_one) as ep:
        link = WorkerLink(ep)
        try:
            host, port = link.local.split(":")
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(struct.pack("<BQ", 6, 1) + b"x")
                assert closed.wait(5)
                for _ in range(500):  # the relay notices without a further request
                    if link.lost is not None:
                        break
                    threading.Event().wait(0.01)
                assert link.lost is not None and "closed" in link.lost
        finally:
            link.close()
