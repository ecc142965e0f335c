"""Child processes of the benchmarks: servers on loopback, started clean, never left behind.

Why one module: ``meshd bench --llama-server`` and ``meshd bench-e2e`` both start servers
they talk to over HTTP on loopback, wait for ``/health``, read their CPU time from
``/proc`` and must stop them on every exit path, including the benchmark being killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final

from .workloads import ArmUnavailable, BenchError

#: Seconds a server may take to load the model and answer ``/health``.
START_TIMEOUT_S: Final = 180.0

#: Seconds one request may take before the benchmark gives up on the server.
REQUEST_TIMEOUT_S: Final = 600.0

#: Seconds a server gets to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S: Final = 10.0

#: Prefixes of the variables a child must not inherit: an OpenMP wait policy or spin
#: count (libgomp's ``OMP_``/``GOMP_``, LLVM's and Intel's ``KMP_``) set for this process
#: — by the user, or by meshd in its own environment before it loads llama.cpp — would
#: change how a server's threads wait (an inherited policy can slow a peer several
#: times), and a ``MESHD_`` variable would change ``meshd serve``'s defaults.
STRIPPED_ENV_PREFIXES: Final = ("OMP_", "GOMP_", "KMP_", "MESHD_")


def clean_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default ``os.environ``) without the variables of
    :data:`STRIPPED_ENV_PREFIXES`, so every server runs with its own defaults."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if not k.startswith(STRIPPED_ENV_PREFIXES)}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """In the child before exec: ask Linux to SIGTERM it when the benchmark dies, so an
    interrupted run (SIGTERM/SIGKILL, no ``finally``) leaves no server behind.

    Linux sends it when the *thread* that forked the child ends, so children that must
    outlive a call are started from the main thread."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of ``pid``, all its threads (Linux ``/proc``; ``None``
    elsewhere or once it has gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        # After "pid (comm)": state is fields[0], utime fields[11], stime fields[12].
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class ServerProcess:
    """A server child process listening on ``127.0.0.1:port``, ready once ``GET /health``
    answers 200; its output goes to a temporary file (a pipe nobody reads would fill up
    and block it), whose tail explains a failure. ``ready_s``: seconds from just before
    the process was started to the first ``/health`` 200 (polled every 50 ms).

    Raises :class:`BenchError` when the command cannot run and :class:`ArmUnavailable`
    when the server exits or stays unready; either way nothing is left running.
    """

    def __init__(self, command: Sequence[str], port: int, *, name: str,
                 env: Mapping[str, str] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.name = name
        self.port = port
        self.command = list(command)
        # Held open for the process's lifetime (closed in close()), so no with-block.
        self._log_file: IO[bytes] = tempfile.TemporaryFile(  # noqa: SIM115
            prefix=f"meshd-{name}-")
        started = time.perf_counter()
        try:
            self.proc = subprocess.Popen(
                self.command, env=None if env is None else dict(env),
                stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent)
        except OSError as exc:
            self._log_file.close()
            raise BenchError(f"cannot run {name} {self.command[0]!r}: {exc}") from exc
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise
        self.ready_s: float = time.perf_counter() - started

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_s(self) -> float | None:
        """CPU seconds the server has used so far (see :func:`proc_cpu_s`)."""
        return proc_cpu_s(self.proc.pid)

    def wait_quiet(self, timeout_s: float = 30.0, *, window_s: float = 0.25,
                   max_share: float = 0.05) -> bool:
        """Wait until the server uses under ``max_share`` of one core over ``window_s``
        (it has finished or abandoned what it was doing); False if that did not happen
        within ``timeout_s`` (or its CPU time cannot be read)."""
        deadline = time.monotonic() + timeout_s
        before = self.cpu_s()
        while before is not None and time.monotonic() < deadline:
            time.sleep(window_s)
            after = self.cpu_s()
            if after is None:
                return False
            if after - before < max_share * window_s:
                return True
            before = after
        return False

    def log_tail(self, n: int = 12) -> str:
        """The last ``n`` lines the server printed."""
        self._log_file.flush()
        self._log_file.seek(0)
        lines = self._log_file.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None,
                timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, Any]:
        """One JSON request; the answer's status and its body (JSON when it parses)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            payload = None if body is None else json.dumps(body).encode()
            headers = {} if body is None else {"Content-Type": "application/json"}
            conn.request(method, path, body=payload, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = raw.decode("utf-8", "replace")
        return resp.status, data

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ArmUnavailable(
                    f"{self.name} exited with status {code} before it was ready; its "
                    f"last lines:\n{self.log_tail()}")
            try:
                status, _ = self.request("GET", "/health", timeout=2.0)
                if status == 200:
                    return
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise ArmUnavailable(
                    f"{self.name} did not answer /health within {timeout_s:.0f} s; its "
                    f"last lines:\n{self.log_tail()}")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT_S`; the process is reaped."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            self._log_file.close()


def check_alive(name: str, servers: dict[str, ServerProcess],
                unavailable: dict[str, str]) -> None:
    """A server that exited is dropped from ``servers``, and why is kept in
    ``unavailable`` for the report."""
    server = servers[name]
    code = server.proc.poll()
    if code is not None:
        unavailable[name] = f"{name} exited with status {code} during the runs; its last " \
                            f"lines:\n{server.log_tail()}"
        del servers[name]


#: What a busy-machine process runs: one core's worth of a Python busy loop.
BUSY_LOOP: Final = ("-c", "while True: pass")


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[list[int]]:
    """``n`` ``python -c "while True: pass"`` processes for the ``with`` block (a busy
    machine, as a server meets it beside other work); their pids. Each is killed by pid
    on the way out, an exception included, and dies with this process otherwise."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, *BUSY_LOOP], env=clean_env(), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=die_with_parent))
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
