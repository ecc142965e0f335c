"""The pieces of the systemd conversation, each against the real thing it talks to: the
notify datagram (path and abstract addresses), the watchdog interval, socket-activation
variables and descriptor checks, and log lines (stdlib and warnings routed through
structlog, journald priority prefixes)."""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import warnings
from collections.abc import Iterator

import pytest
import structlog

from meshd.daemon.system.activation import ActivationError, listen_fds
from meshd.daemon.system.logs import configure_logging, get_logger, under_journald
from meshd.daemon.system.notify import Notifier, watchdog_interval
from tests.integration.helpers.daemon import short_tempdir


def _dgram(address: str | bytes) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_notify_to_a_path_and_an_abstract_address() -> None:
    directory = short_tempdir()
    path = os.path.join(directory, "notify")
    receiver = _dgram(path)
    abstract_name = f"meshd-test-{os.getpid()}"
    abstract = _dgram(b"\0" + abstract_name.encode())
    try:
        assert Notifier(path).ready("serving: 0 active")
        assert receiver.recv(4096) == b"READY=1\nSTATUS=serving: 0 active"
        notifier = Notifier("@" + abstract_name)
        assert notifier.reloading()
        fields = dict(line.split("=", 1) for line in abstract.recv(4096).decode().splitlines())
        assert fields["RELOADING"] == "1" and int(fields["MONOTONIC_USEC"]) > 0
        assert notifier.status("two\nlines")  # a newline must not start a bogus field
        assert abstract.recv(4096) == b"STATUS=two lines"
        notifier.close()
    finally:
        receiver.close()
        abstract.close()
        os.unlink(path)
        os.rmdir(directory)


def test_notify_is_a_no_op_without_notify_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled and not notifier.send(READY=1)
    vsock = Notifier("vsock:2:1234")
    assert not vsock.enabled and vsock.last_error is not None
    gone = Notifier("/nonexistent-dir/notify")
    assert not gone.send(READY=1) and gone.last_error  # never raises


def test_watchdog_interval() -> None:
    pid = str(os.getpid())
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "4000000"}) == 2.0
    assert watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": pid}) == 2.0
    assert watchdog_interval({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}) is None


def test_listen_fds_variables() -> None:
    pid = str(os.getpid())
    env = {"PATH": "/bin"}
    assert listen_fds(env) == []
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1"}
    assert listen_fds(env) == [] and "LISTEN_FDS" not in env  # another process's; unset
    with pytest.raises(ActivationError, match="LISTEN_PID"):
        listen_fds({"LISTEN_FDS": "1"})
    with pytest.raises(ActivationError, match="number"):
        listen_fds({"LISTEN_PID": pid, "LISTEN_FDS": "two"})
    with pytest.raises(ActivationError, match="names 2"):
        listen_fds({"LISTEN_PID": pid, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "a:b"})


def test_listen_fds_checks_the_descriptor() -> None:
    """fd 3 is whatever we put there: a listening socket passes, others are refused."""
    pid = str(os.getpid())
    saved = os.dup(3) if _is_open(3) else None
    inheritable = os.get_inheritable(3) if saved is not None else False
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(f"\0meshd-activation-test-{os.getpid()}")
    listening.listen(1)
    unbound = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.dup2(listening.fileno(), 3)
        found = listen_fds({"LISTEN_PID": pid, "LISTEN_FDS": "1", "LISTEN_FDNAMES": "meshd"})
        assert [(s.fd, s.name, s.family, s.bind) for s in found] == \
            [(3, "meshd", "unix", "fd://3")]
        os.dup2(unbound.fileno(), 3)
        with pytest.raises(ActivationError, match="not listening"):
            listen_fds({"LISTEN_PID": pid, "LISTEN_FDS": "1"})
    finally:
        if saved is not None:
            os.dup2(saved, 3, inheritable=inheritable)
            os.close(saved)
        else:
            os.close(3)
        listening.close()
        unbound.close()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root, llama = logging.getLogger(), logging.getLogger("meshd.llama")
    handlers, level, llama_level = list(root.handlers), root.level, llama.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    llama.setLevel(llama_level)
    logging.captureWarnings(False)
    structlog.reset_defaults()


def test_stdlib_records_and_warnings_become_json_events(restore_logging: None) -> None:
    out = io.StringIO()
    configure_logging("info", stream=out, format="json")
    get_logger("meshd.test").info("structlog_event", n=1)
    logging.getLogger("meshd.llama").warning("llama.cpp says %s", "hello")
    logging.getLogger("meshd.llama").debug("below the level")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a plugin could not load", RuntimeWarning, stacklevel=1)
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in events[:2]] == ["structlog_event", "llama.cpp says hello"]
    assert events[1]["logger_name"] == "meshd.llama" and events[1]["level"] == "warning"
    assert events[2]["logger_name"] == "py.warnings"
    assert "a plugin could not load" in events[2]["event"] and "\n" not in events[2]["event"]
    assert len(events) == 3


def test_journald_lines_carry_priorities(restore_logging: None, tmp_path: object) -> None:
    directory = short_tempdir()
    path = os.path.join(directory, "journal")
    try:
        with open(path, "w+") as stream:
            st = os.fstat(stream.fileno())
            os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
            try:
                assert under_journald(stream)
                configure_logging("debug", stream=stream)  # auto: journal format
                log = get_logger("meshd.test")
                log.error("it_broke", code=7)
                log.info("ready", address="unix:/run/meshd/meshd.sock")
                try:
                    raise ValueError("first\nsecond")
                except ValueError:
                    log.exception("crashed")
            finally:
                del os.environ["JOURNAL_STREAM"]
            stream.seek(0)
            lines = stream.read().splitlines()
        assert lines[0].startswith("<3>event=it_broke ") and "code=7" in lines[0]
        assert lines[1].startswith("<6>event=ready ")
        assert lines[2].startswith("<3>event=crashed ")
        assert len(lines) == 3  # the traceback stays inside its one entry
    finally:
        os.unlink(path)
        os.rmdir(directory)
    assert not under_journald(io.StringIO())
