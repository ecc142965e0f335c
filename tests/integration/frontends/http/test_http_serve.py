"""``meshd serve --http tcp:127.0.0.1:PORT``: a real daemon process serves HTTP on the
loopback port (and on its Unix socket) and refuses addresses it must not use."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from meshd.daemon.frontends.http.tcp import HttpAddressError, check_http_address
from tests.integration.helpers.daemon import short_tempdir


def _serve(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    return subprocess.Popen(
        [sys.executable, "-m", "meshd.daemon.commands.cli", "serve", "--threads", "1",
         "--slots", "1",
         "--ctx", "512", "--fixed-k", "--log-format", "json", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_bad_http_addresses_are_refused_before_loading() -> None:
    """A malformed or non-loopback ``--http`` is a usage error (exit 2), reported before
    the model loads; loopback is 127.0.0.0/8, ::1 and localhost."""
    sock = os.path.join(short_tempdir(), "s")
    for address, why in (("tcp:0.0.0.0:8080", "only loopback"),
                         ("tcp:192.168.1.7:8080", "only loopback"),
                         ("tcp:[::]:8080", "only loopback"),
                         ("tcp:example.com:8080", "IP address or localhost"),
                         ("tcp:127.0.0.1", "expected tcp:127.0.0.1:PORT"),
                         ("fd://x", "fd://N")):
        proc = _serve("--socket", sock, "--http", address)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 2, out
        assert why in out
        assert "loading_model" not in out


@pytest.mark.slow
def test_serve_answers_http_on_loopback_tcp_and_the_unix_socket() -> None:
    directory = short_tempdir()
    sock = os.path.join(directory, "s")
    proc = _serve("--socket", sock, "--http", "tcp:127.0.0.1:0")
    try:
        assert proc.stdout is not None
        address = None
        for line in proc.stdout:
            if '"ready"' in line:
                address = json.loads(line)["http"]
                break
        assert address is not None and address.startswith("tcp:127.0.0.1:"), address
        port = int(address.rpartition(":")[2])
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", method="POST",
            data=json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            answer = json.load(r)
        assert answer["usage"]["completion_tokens"] == 4
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
            assert b"meshd_requests_total" in r.read()
        curl = shutil.which("curl")
        if curl is not None:
            health = subprocess.run([curl, "-sS", "--unix-socket", sock,
                                     "http://localhost/health"],
                                    capture_output=True, text=True, timeout=60)
            assert json.loads(health.stdout)["status"] == "ok"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            shutil.rmtree(directory, ignore_errors=True)
    assert proc.returncode == 0


def test_an_inherited_http_socket_must_be_bound_to_loopback() -> None:
    """``fd://N`` from a socket unit: ``ListenStream=8080`` listens on every address,
    which the daemon refuses as it refuses ``tcp:0.0.0.0:8080``."""
    for host, refused in (("0.0.0.0", True), ("127.0.0.1", False)):
        with socket.socket() as sock:
            sock.bind((host, 0))
            sock.listen()
            if refused:
                with pytest.raises(HttpAddressError, match="only loopback"):
                    check_http_address(f"fd://{sock.fileno()}")
            else:
                check_http_address(f"fd://{sock.fileno()}")
            assert sock.fileno() >= 0  # checked, not taken over


@pytest.mark.slow
def test_an_allow_list_with_tcp_http_logs_that_tcp_bypasses_it() -> None:
    """TCP peers have no credentials: with ``--allow-user`` and ``--http tcp:`` the
    daemon says, as a warning, that the allow-list does not cover the TCP port."""
    directory = short_tempdir()
    sock = os.path.join(directory, "s")
    proc = _serve("--socket", sock, "--http", "tcp:127.0.0.1:0",
                  "--allow-user", str(os.getuid()))
    try:
        assert proc.stdout is not None
        events = []
        for line in proc.stdout:
            if line.startswith("{"):
                events.append(json.loads(line))
                if events[-1]["event"] == "ready":
                    break
        warning = [e for e in events if e["event"] == "allow_list_bypassed_by_tcp"]
        assert warning and warning[0]["level"] == "warning", events
        assert warning[0]["http"].startswith("tcp:127.0.0.1:")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
            shutil.rmtree(directory, ignore_errors=True)
    assert proc.returncode == 0
