"""How ``meshd serve``'s llama.cpp threads wait, as a real child process: with the
defaults an idle daemon sleeps (one OpenMP team, whose threads spin only briefly), and
``--thread-wait sleep`` / ``[model] thread_wait`` reach the OpenMP runtime."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshd.testing import testmodels
from tests.integration.helpers.daemon import short_tempdir
from tests.integration.helpers.processes import (
    Wire,
    daemon_env,
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


def _env_as_users_run_it() -> dict[str, str]:
    """The test environment without any OpenMP setting: the daemon's own defaults."""
    return {k: v for k, v in daemon_env().items()
            if not k.startswith(("OMP_", "GOMP_", "MESHD_"))}


def _cpu_ticks(pid: int) -> dict[int, int]:
    """utime + stime of each thread of ``pid``, in clock ticks."""
    ticks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        ticks[int(task.name)] = int(fields[11]) + int(fields[12])
    return ticks


def _generate(sock_path: str, max_tokens: int = 24) -> dict[str, object]:
    wire = Wire(sock_path)
    try:
        wire.hello()
        wire.send(op="generate", id="g", prompt="one two three four", max_tokens=max_tokens)
        while (frame := wire.recv()) is not None:
            if frame["op"] in ("done", "error"):
                return frame
    finally:
        wire.close()
    raise AssertionError("the connection closed before done")


@pytest.mark.quiet_machine
def test_an_idle_daemon_with_the_default_threads_sleeps(workdir: str) -> None:
    """After serving (load, calibration and decoding on two threads), no thread of the
    daemon keeps running: a team whose master is idle, or threads spinning at a barrier
    for good, would each take a core."""
    sock_path = os.path.join(workdir, "s")
    args = ["--socket", sock_path, "--threads", "2", "--ctx", "512",
            "--model", str(testmodels.test_model_path("llama"))]
    with reaped(start(args, _env_as_users_run_it())) as proc:
        wait_for_socket(sock_path, proc)
        assert "OMP_WAIT_POLICY" not in Path(f"/proc/{proc.pid}/environ").read_text()
        for _ in range(2):
            done = _generate(sock_path)
            assert done["op"] == "done", done
        time.sleep(0.5)
        before, t0 = _cpu_ticks(proc.pid), time.monotonic()
        time.sleep(3.0)
        after, elapsed = _cpu_ticks(proc.pid), time.monotonic() - t0
        code, err = stop(proc)
    assert code == 0, err
    hz = os.sysconf("SC_CLK_TCK")
    busy = {tid: (after[tid] - before.get(tid, 0)) / hz / elapsed for tid in after}
    assert sum(busy.values()) < 0.03, f"idle daemon's CPU share per thread: {busy}"


@pytest.mark.parametrize("how", ["flag", "config"])
def test_thread_wait_sleep_reaches_the_openmp_runtime(workdir: str, how: str) -> None:
    """The OpenMP runtime reads its wait policy once, when llama.cpp loads: the daemon
    sets it before that (running itself again where the runtime is already loaded),
    keeps serving, and says nothing about it twice. libgomp prints what it read
    (``OMP_DISPLAY_ENV``): passive waiting is a spin count of 0 (its default 300000)."""
    sock_path = os.path.join(workdir, "s")
    args = ["--socket", sock_path, "--threads", "1", "--ctx", "512",
            "--model", str(testmodels.test_model_path("llama"))]
    if how == "flag":
        args += ["--thread-wait", "sleep"]
    else:
        config = Path(workdir) / "meshd.toml"
        config.write_text('[model]\nthread_wait = "sleep"\n')
        args += ["--config", str(config)]
    with reaped(start(args, {**_env_as_users_run_it(), "OMP_DISPLAY_ENV": "VERBOSE"})) as proc:
        wait_for_socket(sock_path, proc)
        done = _generate(sock_path)
        code, err = stop(proc)
    assert "GOMP_SPINCOUNT = '0'" in err, err
    assert done["op"] == "done", done
    assert code == 0, err
    assert err.count("model_loaded") == 1, err


def test_the_environment_wins_and_spin_sets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from meshd.native.cpus import apply_thread_wait

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    apply_thread_wait("spin")
    assert "OMP_WAIT_POLICY" not in os.environ  # libgomp's own default
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    apply_thread_wait("sleep")  # an explicit choice in the environment is kept
    assert "OMP_WAIT_POLICY" not in os.environ
    with pytest.raises(ValueError, match="spin, sleep"):
        apply_thread_wait("busy")
