"""What an operator reads in ``meshd serve``'s log: the slow start-up steps with their
durations, llama.cpp's lines at a level of their own, a log level changed by SIGHUP,
and a cache directory the daemon cannot write to. Real child processes (stderr is a
file, not a terminal, as under a supervisor) and real llama.cpp."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from meshd.daemon.system.logs import configure_logging, set_levels
from meshd.native.model import Model
from meshd.testing import testmodels
from tests.integration.helpers.daemon import short_tempdir
from tests.integration.helpers.processes import (
    NotifySocket,
    Wire,
    daemon_env,
    log_events,
    reaped,
    start,
    stop,
    wait_for_socket,
)


@pytest.fixture
def workdir() -> Iterator[str]:
    directory = short_tempdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _synthetic() -> str:
    return str(testmodels.test_model_path("llama"))


def _args(sock: str, *extra: str) -> list[str]:
    return ["--socket", sock, "--model", _synthetic(), "--threads", "1", "--slots", "1",
            "--ctx", "256", "--draft-max", "4", *extra]


def _generate(sock: str) -> dict[str, Any]:
    wire = Wire(sock)
    try:
        wire.hello()
        wire.send(op="generate", id="g", prompt="abc", max_tokens=3)
        while (frame := wire.recv()) is not None:
            if frame["op"] in ("done", "error"):
                return frame
        raise AssertionError("connection closed before done")
    finally:
        wire.close()


def _named(events: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [e for e in events if e["event"] == name]
    assert len(found) == 1, (name, [e["event"] for e in events])
    return found[0]


@pytest.mark.quiet_machine
def test_a_start_logs_each_slow_step_with_its_duration(workdir: str) -> None:
    """Not a terminal, nothing cached: the model load and the context build each log
    when they start and when they end, with seconds, before ``ready``; the calibration
    comes after ``ready`` (in idle moments), with its duration once done, or a
    ``calibration_waiting`` while other processes keep the CPUs busy."""
    sock = os.path.join(workdir, "s")
    env = daemon_env(CACHE_DIRECTORY=os.path.join(workdir, "cache"))
    with reaped(start(_args(sock), env)) as proc:
        wait_for_socket(sock, proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                e["event"] in ("calibration_done", "calibration_waiting")
                for e in log_events(proc.stderr())):
            time.sleep(0.1)
        code, err = stop(proc)
    assert code == 0, err
    events = log_events(err)
    names = [e["event"] for e in events]
    for kind in ("model_load", "context_build"):
        began, done = f"{kind}_started", f"{kind}_done"
        assert names.index(began) < names.index(done) < names.index("ready"), names
        seconds = _named(events, done)["seconds"]
        assert isinstance(seconds, float | int) and seconds >= 0, seconds
    assert _named(events, "model_load_done")["path"] == _synthetic()
    calibration = [n for n in names if n.startswith("calibration_")]
    assert calibration, names
    assert names.index("ready") < names.index(calibration[0]), names
    if "calibration_done" in names:
        assert names.index("calibration_started") < names.index("calibration_done")
        seconds = _named(events, "calibration_done")["seconds"]
        assert isinstance(seconds, float | int) and seconds >= 0, seconds


def test_an_unwritable_cache_directory_is_logged_and_serving_goes_on(workdir: str) -> None:
    blocker = Path(workdir, "not-a-directory")
    blocker.write_text("")
    sock = os.path.join(workdir, "s")
    env = daemon_env(CACHE_DIRECTORY=str(blocker))  # costs/ would go below a file
    with reaped(start(_args(sock), env)) as proc:
        wait_for_socket(sock, proc)
        done = _generate(sock)
        code, err = stop(proc)
    assert done["op"] == "done" and done["usage"]["completion_tokens"] == 3, done
    assert code == 0, err
    warning = _named(log_events(err), "cost_cache_unwritable")
    assert warning["level"] == "warning"
    assert str(blocker / "costs") in warning["message"]
    assert os.strerror(20) in warning["message"]  # ENOTDIR: the error itself


def test_sighup_changes_the_log_level_of_the_next_events(workdir: str) -> None:
    """``[log] level`` is live: after SIGHUP the next connection's debug events are
    logged (they were not before), and the reload event names the key."""
    notify = NotifySocket(os.path.join(workdir, "notify"))
    conf = Path(workdir, "meshd.toml")
    conf.write_text('[log]\nlevel = "info"\n')
    sock = os.path.join(workdir, "s")
    try:
        with reaped(start(["--config", str(conf), *_args(sock, "--fixed-k")],
                          daemon_env(NOTIFY_SOCKET=notify.path))) as proc:
            notify.until("READY", timeout=120, proc=proc)
            _hello(sock)  # connection_opened, client_hello: debug events
            conf.write_text('[log]\nlevel = "debug"\n')
            proc.send_signal(signal.SIGHUP)
            notify.until("RELOADING", timeout=30, proc=proc)
            notify.until("READY", timeout=30, proc=proc)
            _hello(sock)
            code, err = stop(proc)
        assert code == 0, err
    finally:
        notify.close()
    events = log_events(err)
    names = [e["event"] for e in events]
    reloaded = names.index("reloaded")
    assert events[reloaded]["changed"] == ["log.level"]
    assert "client_hello" not in names[:reloaded], names
    assert "client_hello" in names[reloaded:], names


def _hello(sock: str) -> None:
    wire = Wire(sock)
    wire.hello()
    wire.close()


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


def _load_and_log(out: io.StringIO) -> list[dict[str, Any]]:
    start_at = len(out.getvalue())
    Model.load(_synthetic()).close()
    return [json.loads(line) for line in out.getvalue()[start_at:].splitlines()]


def test_llama_cpp_lines_have_their_own_level(restore_logging: None) -> None:
    """At debug, a model load's llama.cpp info lines stay out of the log (default
    ``warn``) while the daemon's own debug events are kept; ``--llama-log-level info``
    lets them in, whatever the daemon's level."""
    if os.environ.get("MESHD_LLAMA_LOG_STDERR"):
        pytest.skip("llama.cpp logs straight to stderr here")
    out = io.StringIO()
    configure_logging("debug", stream=out, format="json")
    structlog.get_logger().debug("daemon_debug_event")
    quiet = _load_and_log(out)
    assert json.loads(out.getvalue().splitlines()[0])["event"] == "daemon_debug_event"
    assert {e["level"] for e in quiet} <= {"warning", "error"}, quiet[:3]
    set_levels("warning", "info")  # the daemon quieter, llama.cpp louder
    loud = _load_and_log(out)
    assert all(e.get("logger_name") == "meshd.llama" for e in loud), loud[:3]
    assert sum(e["level"] == "info" for e in loud) > 10, loud[:3]
    structlog.get_logger().info("daemon_info_event")
    assert "daemon_info_event" not in out.getvalue()
