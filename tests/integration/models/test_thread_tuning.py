"""The thread tuning's edge: forwards gathered into windows, idle gaps never counted as
company, a new count applied to every context once and again to contexts made later.
The clocks and counters are scripted (a meter that reads what the test says), the
contexts are stand-ins that record the counts they are given."""

from __future__ import annotations

from typing import Any

import pytest

from meshd.daemon.models import thread_tuning
from meshd.daemon.models.thread_tuning import GAP_S, ThreadTuning
from meshd.native.cpus import CpuReading
from meshd.policy.threads import WINDOW_S


class ScriptedMeter:
    """Readings as the test sets them: wall and CPU seconds, other processes' busy time."""

    cpus = 2
    resolution_s = 0.04
    counters_usable = True

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0
        self.others = 0.0

    def read(self) -> CpuReading:
        return CpuReading(self.wall, self.cpu, self.others + self.cpu)

    def others_nice_s(self, before: CpuReading, after: CpuReading) -> float | None:
        return 0.0

    def others_s(self, before: CpuReading, after: CpuReading) -> float | None:
        assert before.machine_busy_s is not None and after.machine_busy_s is not None
        return (after.machine_busy_s - before.machine_busy_s) - (after.cpu_s - before.cpu_s)


class Ctx:
    def __init__(self) -> None:
        self.mtp = None
        self.config = type("C", (), {"n_threads": 2})()


class Runtime:
    def __init__(self) -> None:
        self.context = Ctx()
        self._drafts: dict[str, Any] = {}
        self.model = type("M", (), {"gpu_layers": 0})()
        self.remote = None


@pytest.fixture
def applied(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    calls: list[tuple[int, int]] = []

    def record(contexts: Any, threads: int) -> None:
        calls.extend((id(c), threads) for c in contexts)

    monkeypatch.setattr(thread_tuning, "set_threads", record)
    return calls


def tuned(runtime: Runtime, meter: ScriptedMeter, **kw: Any) -> ThreadTuning:
    return ThreadTuning(runtime, 2, meter=meter, clock=lambda: meter.wall,  # type: ignore[arg-type]
                        **kw)


def run(tuning: ThreadTuning, meter: ScriptedMeter, forwards: int, *, forward_s: float,
        others_cores: float, share: float = 1.0, gap_s: float = 0.001) -> None:
    for _ in range(forwards):
        meter.wall += gap_s
        meter.wall += forward_s
        meter.cpu += forward_s * share * tuning.threads
        meter.others += forward_s * others_cores
        tuning.forward(1, forward_s, 1)


def test_windows_of_forwards_drop_and_restore_the_count(applied: list[tuple[int, int]]) -> None:
    meter = ScriptedMeter()
    rt = Runtime()
    events: list[dict[str, object]] = []
    tuning = tuned(rt, meter, events=lambda name, **kw: events.append(kw))
    run(tuning, meter, 100, forward_s=0.011, others_cores=0.0)
    assert tuning.threads == 2 and applied == []
    # A busy process: spinning threads collapse (0.4 s forwards, half their cores).
    run(tuning, meter, 3, forward_s=0.4, others_cores=1.0, share=0.5)
    assert tuning.threads == 1
    assert applied == [(id(rt.context), 1)]
    run(tuning, meter, 50, forward_s=0.019, others_cores=1.0)
    assert tuning.threads == 1
    # It stops: the next window shows the room.
    run(tuning, meter, int(2 * WINDOW_S / 0.019) + 2, forward_s=0.019,
        others_cores=0.0)
    assert tuning.threads == 2 and applied[-1] == (id(rt.context), 2)
    assert [e["threads"] for e in events] == [1, 2]


def test_an_idle_gap_is_no_window(applied: list[tuple[int, int]]) -> None:
    """Between requests other processes may use the CPUs as they like: that is no
    company for forwards that did not run."""
    meter = ScriptedMeter()
    tuning = tuned(Runtime(), meter)
    for _ in range(20):
        run(tuning, meter, 3, forward_s=0.011, others_cores=0.0)
        meter.wall += GAP_S * 4  # idle, with a busy process running
        meter.others += GAP_S * 4 * 2.0
    assert tuning.threads == 2 and applied == []


def test_a_context_made_later_gets_the_adapted_count(applied: list[tuple[int, int]]) -> None:
    meter = ScriptedMeter()
    rt = Runtime()
    tuning = tuned(rt, meter)
    run(tuning, meter, 3, forward_s=0.4, others_cores=1.0, share=0.5)
    assert tuning.threads == 1
    draft = type("D", (), {"context": Ctx()})()
    rt._drafts["d"] = draft
    rt.context = Ctx()  # a rebuilt context
    run(tuning, meter, 30, forward_s=0.019, others_cores=1.0)
    assert (id(rt.context), 1) in applied and (id(draft.context), 1) in applied
    n = len(applied)
    run(tuning, meter, 30, forward_s=0.019, others_cores=1.0)
    assert len(applied) == n  # applied once
    with tuning.full_threads():
        assert applied[-1][1] == 2
    assert applied[-1][1] == 1


def test_no_tuning_for_one_thread_or_layers_elsewhere() -> None:
    rt = Runtime()
    rt.context.config.n_threads = 1
    assert ThreadTuning.for_runtime(rt) is None  # type: ignore[arg-type]
    rt = Runtime()
    rt.model.gpu_layers = 8
    assert ThreadTuning.for_runtime(rt) is None  # type: ignore[arg-type]
    rt = Runtime()
    rt.remote = object()
    assert ThreadTuning.for_runtime(rt) is None  # type: ignore[arg-type]
    assert ThreadTuning.for_runtime(Runtime()) is not None  # type: ignore[arg-type]
