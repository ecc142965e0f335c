"""A daemon that is ready at once and decodes well on a busy machine (real llama.cpp).

- ``meshd serve`` is ready (socket, ``/health``) as soon as the model is loaded, with a
  fresh cost cache; the curve is measured afterwards in idle moments, and a request that
  arrives meanwhile is served at once (priced by the conservative prior: no drafts).
- Nothing measured beside a busy process is cached (a real ``while True: pass`` per
  CPU beside the runtime).
- The thread count is given back while a busy process takes a core, and taken back
  once it stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshd.daemon.models.compute import ComputeThread
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.native.cpus import CpuMeter, usable_cpus
from meshd.native.default_model import default_model_path
from meshd.policy.costs import conservative_prior
from meshd.policy.load import OTHERS_BUSY
from meshd.testing import testmodels
from tests.integration.helpers.daemon import short_tempdir
from tests.integration.helpers.processes import (
    Wire,
    daemon_env,
    log_events,
    reaped,
    start,
    stop,
    wait_for_socket,
)

pytestmark = pytest.mark.quiet_machine  # it measures the machine's idle CPUs


@pytest.fixture
def workdir() -> Iterator[str]:
    directory = short_tempdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` CPU-bound processes beside the test, ended (by pid) on the way out."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.3)
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _others_busy(seconds: float = 0.5) -> bool:
    """Whether other processes use the CPUs now (the machine is shared)."""
    meter = CpuMeter()
    a = meter.read()
    time.sleep(seconds)
    b = meter.read()
    others = meter.others_s(a, b)
    return others is not None and others / (b.wall_s - a.wall_s) > OTHERS_BUSY


def _generate(sock: str, prompt: str, max_tokens: int) -> dict[str, object]:
    wire = Wire(sock)
    try:
        wire.hello()
        wire.send(op="generate", id="g", prompt=prompt, max_tokens=max_tokens)
        while (frame := wire.recv()) is not None:
            if frame["op"] in ("done", "error"):
                return frame
        raise AssertionError("connection closed before done")
    finally:
        wire.close()


def test_serve_is_ready_before_the_calibration_and_serves_during_it(workdir: str) -> None:
    """SmolLM2, nothing cached, 32-draft curve (18 s to measure on a quiet machine,
    minutes beside a busy process): ready and serving at once."""
    sock = os.path.join(workdir, "s")
    cache = Path(workdir, "cache")
    env = daemon_env(CACHE_DIRECTORY=str(cache))
    t0 = time.monotonic()
    with reaped(start(["--socket", sock, "--threads", "2", "--slots", "1", "--ctx", "1024"],
                      env)) as proc:
        wait_for_socket(sock, proc)
        ready_s = time.monotonic() - t0
        done = _generate(sock, "Once upon a time", 8)
        served_s = time.monotonic() - t0
        during = "calibration_done" not in proc.stderr()
        assert not list(cache.glob("costs/*.json")) or not during
        code, err = stop(proc)
    assert code == 0, err
    assert done["op"] == "done", done
    assert during, f"the calibration finished before the first request ({served_s:.1f} s)"
    events = [e["event"] for e in log_events(err)]
    assert events.index("model_loaded") < events.index("ready")
    calibration = [e for e in events if e.startswith("calibration_")]
    assert all(events.index("ready") < events.index(e) for e in calibration), events
    assert ready_s < 60, ready_s  # the model load and Python's start, no calibration


def test_a_runtime_calibrating_in_idle_moments_serves_meanwhile_and_caches_when_quiet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process, as the daemon runs it: the prior prices speculation (no drafts) until
    the idle work has measured the curve; a request on the compute thread meanwhile is
    served; once done the curve replaces the prior (same cost model object) and is
    cached, unless the machine stayed busy all along."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(testmodels.test_model_path("llama"))
    compute = ComputeThread()
    try:
        rt = compute.call(lambda: ModelRuntime(
            RuntimeConfig(model_path=path, n_ctx_seq=256, draft_max=4, threads=2),
            calibrate_now=False))
        assert rt.calibrating and rt.curve is not None
        assert list(rt.curve.costs) == conservative_prior(4)
        costs = rt.costs
        compute.set_idle_work(rt.idle_work())

        def serve() -> int:
            prompt = rt.tokenize_prompt("ab ab ab ab ab ab ab ab", chat=False)
            gen = rt.generation(prompt, max_tokens=16, proposer="ngram")
            for _ in rt.run(gen):
                pass
            return gen.stats.emitted

        assert compute.call(serve) > 0
        deadline = time.monotonic() + 45
        while rt.calibrating and time.monotonic() < deadline:
            time.sleep(0.2)
        plan = rt.calibration.plan if rt.calibration is not None else None
        assert plan is not None
        files = list((tmp_path / "meshd" / "costs").glob("*.json"))
        if rt.calibrating:  # busy all along: still waiting, nothing kept
            assert plan.busy_pieces > 0 and files == []
            return
        assert rt.costs is costs  # running requests see the new curve too
        assert list(rt.curve.forward_costs) != conservative_prior(4)
        assert len(files) == (1 if plan.outcome().cache else 0)
        assert compute.call(serve) > 0
    finally:
        with contextlib.suppress(Exception):
            compute.call(lambda: rt.close())
        compute.close()


def test_nothing_measured_beside_busy_processes_is_cached(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One busy process per CPU: in-process (it cannot wait) the calibration gives up
    and the run decodes without drafts; in idle moments every try is dropped. No curve
    is written either way."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(testmodels.test_model_path("llama"))
    config = RuntimeConfig(model_path=path, n_ctx_seq=256, draft_max=4, threads=2)
    notes: list[tuple[str, str]] = []
    with busy_processes(usable_cpus()):
        with ModelRuntime(config, notes=lambda e, m: notes.append((e, m))) as rt:
            assert rt.calibration is not None and rt.calibration.plan.tainted
            assert list(rt.curve.costs) == conservative_prior(4)  # type: ignore[union-attr]
        assert "calibration_skipped" in [e for e, _ in notes]
        with ModelRuntime(config, calibrate_now=False) as rt:
            work = rt.idle_work()
            assert work is not None
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                wait = work.step()
                assert wait is not None, "finished beside busy processes"
                time.sleep(min(wait, 0.5))
            assert rt.calibrating and rt.calibration is not None
            assert rt.calibration.plan.busy_pieces > 0
    assert not list((tmp_path / "meshd" / "costs").glob("*.json"))


def test_auto_follows_an_mtp_head_only_once_its_costs_are_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the idle work has measured the head (its first pieces), following it might
    cost more than it saves: ``auto`` uses prompt and history lookup; a request naming ``mtp`` still
    gets it. Then the head's costs are set from quiet pieces."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    with ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, draft_max=4, threads=2),
                      calibrate_now=False) as rt:
        assert rt.calibrating and rt.mtp_costs is None
        assert rt.resolve_proposer("auto") == "composite"  # prompt and history lookup
        assert rt.resolve_proposer("mtp") == "mtp"
        work = rt.idle_work()
        assert work is not None
        deadline = time.monotonic() + 30
        while rt.mtp_costs is None and rt.calibrating and time.monotonic() < deadline:
            wait = work.step()
            time.sleep(min(wait or 0.0, 0.5))
        if rt.mtp_costs is None:
            assert rt.calibration is not None and rt.calibration.plan.busy_pieces > 0
            pytest.skip("other processes kept the machine busy")
        assert rt.mtp_costs.overhead > 0 and rt.mtp_costs.draft_cost > 0


def test_threads_are_given_back_beside_a_busy_process_and_taken_back_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2 on every CPU, decoding: with a busy process taking a core the count drops
    within seconds, and comes back within seconds once it stops."""
    cpus = usable_cpus()
    if cpus < 2:
        pytest.skip("one CPU: nothing to give back")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    events: list[tuple[float, dict[str, object]]] = []
    rt = ModelRuntime(RuntimeConfig(model_path=str(default_model_path()), n_ctx_seq=2048,
                                    threads=cpus, draft_max=4),
                      events=lambda name, **kw: events.append((time.monotonic(), kw))
                      if name == "threads_adapted" else None)
    try:
        assert rt.threads is not None and rt.threads.full == cpus
        prompt = rt.tokenize_prompt("Once upon a time", chat=False)

        def decode_until(cond, seconds: float) -> bool:  # type: ignore[no-untyped-def]
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                gen = rt.generation(prompt, max_tokens=1500, proposer="off")
                try:
                    for _ in gen.events():
                        if cond():
                            return True
                        if time.monotonic() > end:
                            break
                finally:
                    rt.finish(gen)
            return bool(cond())

        with busy_processes(cpus - 1):
            assert decode_until(lambda: rt.threads.threads < cpus, 20), events  # type: ignore[union-attr]
        if _others_busy():
            pytest.skip("other processes keep the machine busy: the full count stays away")
        assert decode_until(lambda: rt.threads.threads == cpus, 10), events  # type: ignore[union-attr]
        reasons = [str(kw["reason"]) for _, kw in events]
        assert any(r.startswith("other processes left") for r in reasons), reasons
    finally:
        rt.close()


def test_the_adapted_count_reaches_every_context(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The count is applied with llama_set_n_threads to the target and its MTP head,
    and a context rebuilt later gets it too."""
    from meshd.native.llama import lc

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    with ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, draft_max=4, threads=2,
                                    calibrate=False)) as rt:
        tuning = rt.threads
        assert tuning is not None and rt.context.mtp is not None
        tuning.tuner.threads = 1
        tuning._apply(1, force=True)
        assert lc.llama_n_threads(rt.context.ctx) == 1
        assert lc.llama_n_threads(rt.context.mtp.ctx) == 1
        with tuning.full_threads():
            assert lc.llama_n_threads(rt.context.ctx) == 2
        assert lc.llama_n_threads(rt.context.ctx) == 1
        rt.context = rt.context.rebuilt(in_place_rollback=False)
        tuning._apply(1)
        assert lc.llama_n_threads(rt.context.ctx) == 1


def test_the_cost_cache_keeps_json(tmp_path: Path) -> None:
    from meshd.daemon.models.cost_cache import read_cached_costs, write_cached_costs

    cache = tmp_path / "c" / "x.json"
    assert write_cached_costs(cache, [1.0, 1.5], ["m"], 2) is None
    assert read_cached_costs(cache) == [1.0, 1.5]
    assert json.loads(cache.read_text())["threads"] == 2
    assert read_cached_costs(tmp_path / "none.json") is None
