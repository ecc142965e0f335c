"""The thread count adapts to other processes' CPU use: one thread given back while
another process takes a core, the full count back as soon as it is free, never a
thread lost on a quiet machine. Loads are the numbers measured on the 2-core Xeon
(docs/configuration.md, Threads)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from meshd.policy.load import OTHERS_BUSY, SHARE_BUSY, SHARE_MIN_S, Load, busy, cores_left
from meshd.policy.threads import (
    DROP_AFTER,
    PROBE_FIRST_COUNTED_S,
    PROBE_FIRST_S,
    PROBE_MAX_COUNTED_S,
    PROBE_MAX_S,
    WINDOW_S,
    ThreadTuner,
)

TICKS = 0.04  # two 10 ms ticks on each of 2 CPUs


def window(threads: int, others_cores: float | None, *, share: float = 1.0,
           cpus: int = 2, spins: bool = True, wall: float = WINDOW_S,
           nice: bool = False) -> Load:
    """One window as the daemon measures it: ``others_cores`` of other processes' CPU
    use (None: counters unreadable; ``nice``: at a lower priority), this process's
    threads at ``share`` of their cores."""
    others = None if others_cores is None else others_cores * wall
    return Load(wall_s=wall, cpu_s=share * min(threads, cpus) * wall, threads=threads,
                cpus=cpus, spins=spins, others_s=others, resolution_s=TICKS,
                others_nice_s=None if others is None else (others if nice else 0.0))


# Measured beside one `python -c "while True: pass"`: 2 spinning threads got 51% of
# their cores and the busy loop one core; 1 thread got all of its core.
BUSY_2 = dict(others_cores=0.99, share=0.51)
BUSY_1 = dict(others_cores=1.0, share=1.0)
QUIET = dict(others_cores=0.01, share=0.99)


def run(tuner: ThreadTuner, loads: list[dict[str, float | None]], t0: float = 0.0,
        dt: float = WINDOW_S) -> list[int]:
    counts = []
    t = t0
    for kw in loads:
        t += dt
        counts.append(tuner.observe(window(tuner.threads, **kw), t))  # type: ignore[arg-type]
    return counts


def test_busy_judges_company_by_the_counters_and_by_the_share_of_spinning_threads() -> None:
    assert busy(window(2, **BUSY_2))  # type: ignore[arg-type]
    assert not busy(window(2, **QUIET))  # type: ignore[arg-type]
    # Counters unreadable: spinning threads that got half their cores were descheduled.
    assert busy(window(2, None, share=0.51))
    assert not busy(window(2, None, share=0.97))
    # Sleeping threads use less CPU by design: their share says nothing.
    assert not busy(window(2, None, share=0.58, spins=False))
    assert busy(window(2, 0.99, share=0.3, spins=False))
    # The counters' ticks are given to the doubt: a tick's worth is no company.
    assert not busy(window(2, OTHERS_BUSY + TICKS / WINDOW_S - 0.01))
    assert cores_left(window(2, **BUSY_2)) == 2 - (0.99 * WINDOW_S - TICKS) / WINDOW_S  # type: ignore[arg-type]
    assert cores_left(window(2, None, share=0.97)) is None
    assert cores_left(window(2, None, share=0.5)) == 1.0
    assert SHARE_BUSY > 0.51


def test_a_few_milliseconds_of_a_tiny_models_forwards_are_judged_by_the_counters_only() -> None:
    """Measured on a quiet Xeon: a calibration piece of a tiny model's forwards (2-8 ms)
    got 50-72% of two spinning threads' cores, waking a worker for each sub-millisecond
    forward; judged by that share, every piece was dropped and the curve never came."""
    for wall, share in [(0.002, 0.72), (0.0075, 0.5), (0.015, 0.64)]:
        assert not busy(window(2, 0.0, share=share, wall=wall))
        assert not busy(window(2, None, share=share, wall=wall))
    assert busy(window(2, None, share=0.5, wall=SHARE_MIN_S))  # long enough to tell



def test_a_busy_process_takes_a_thread_at_once_and_gives_it_back_at_once() -> None:
    tuner = ThreadTuner(2)
    counts = run(tuner, [QUIET, QUIET, BUSY_2, BUSY_1, BUSY_1, BUSY_1, QUIET, QUIET])
    assert counts == [2, 2, 1, 1, 1, 1, 2, 2]
    assert [n for _, n, _ in tuner.changes] == [1, 2]


def test_a_moment_of_company_costs_one_window_with_counters_none_without() -> None:
    tuner = ThreadTuner(2)
    assert run(tuner, [QUIET, BUSY_2, QUIET, QUIET]) == [2, 1, 2, 2]
    blind = ThreadTuner(2)
    moment = dict(others_cores=None, share=0.51)
    calm = dict(others_cores=None, share=0.99)
    assert run(blind, [calm, moment, calm, moment, calm, moment, calm]) == [2] * 7
    assert run(blind, [moment] * DROP_AFTER) == [2] * (DROP_AFTER - 1) + [1]


@given(st.lists(st.tuples(st.floats(0.0, OTHERS_BUSY - 0.01), st.floats(0.85, 1.3)),
                min_size=1, max_size=60),
       st.integers(2, 16))
def test_a_quiet_machine_never_loses_a_thread(noise: list[tuple[float, float]],
                                               full: int) -> None:
    tuner = ThreadTuner(full)
    t = 0.0
    for others, share in noise:
        t += WINDOW_S
        assert tuner.observe(window(tuner.threads, others, share=share, cpus=full), t) == full


@given(st.lists(st.tuples(st.one_of(st.none(), st.floats(0.0, 16.0)), st.floats(0.0, 1.5),
                          st.floats(0.01, 5.0)), min_size=1, max_size=80),
       st.integers(1, 16), st.integers(1, 16))
def test_the_count_stays_between_one_and_the_configured_one(
        loads: list[tuple[float | None, float, float]], full: int, cpus: int) -> None:
    tuner = ThreadTuner(full)
    t = 0.0
    for others, share, dt in loads:
        t += dt
        n = tuner.observe(window(tuner.threads, others, share=share, cpus=cpus), t)
        assert 1 <= n <= full


def test_without_counters_the_full_count_is_tried_again_with_growing_waits() -> None:
    """Where the kernel's counters cannot be read, one thread alone says nothing about
    the other core: the full count is tried every probe interval, doubling while the
    company stays, and kept once a try finds the cores free."""
    tuner = ThreadTuner(2)
    busy2, busy1 = dict(others_cores=None, share=0.51), dict(others_cores=None, share=1.0)
    t = 0.0
    tries: list[float] = []
    for _ in range(400):
        t += WINDOW_S
        before = tuner.threads
        n = tuner.observe(window(before, **(busy2 if before == 2 else busy1)), t)  # type: ignore[arg-type]
        if before == 1 and n == 2:
            tries.append(t)
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert gaps[0] >= PROBE_FIRST_S * 2 - WINDOW_S  # the first failed try doubled it
    assert max(gaps) <= PROBE_MAX_S + 2 * WINDOW_S
    assert gaps == sorted(gaps)
    # The company leaves: the next try keeps the full count.
    quiet = dict(others_cores=None, share=1.0)
    for _ in range(int(PROBE_MAX_S / WINDOW_S) + 4):
        t += WINDOW_S
        tuner.observe(window(tuner.threads, **quiet), t)  # type: ignore[arg-type]
    assert tuner.threads == 2
    assert tuner.probe_every_s == PROBE_FIRST_S


def test_a_process_that_yields_to_the_full_count_gets_it_back_by_a_try() -> None:
    """A ``nice``'d batch job takes the core one thread leaves idle (so the counters
    show no room) but yields it to the full count: the try keeps the full count."""
    tuner = ThreadTuner(2)
    run(tuner, [BUSY_2, BUSY_2])
    assert tuner.threads == 1
    t = 2 * WINDOW_S
    while tuner.threads == 1:
        t += WINDOW_S
        tuner.observe(window(1, **BUSY_1, nice=True), t)  # type: ignore[arg-type]
        assert t < PROBE_FIRST_COUNTED_S + 1.0
    # At the full count the nice'd job gets 1.5% of a core.
    for _ in range(10):
        t += WINDOW_S
        assert tuner.observe(window(2, 0.015, share=0.99), t) == 2


def test_four_cores_and_one_busy_process_give_up_one_thread() -> None:
    tuner = ThreadTuner(4)
    t = 0.0
    for _ in range(3):
        t += WINDOW_S
        tuner.observe(window(tuner.threads, 0.8, share=0.8, cpus=4), t)
    assert tuner.threads == 3
    # The configured count below the cores: company on the spare cores costs nothing.
    small = ThreadTuner(2)
    for _ in range(5):
        t += WINDOW_S
        assert small.observe(window(2, 1.0, cpus=4), t) == 2


def test_one_thread_configured_is_left_alone() -> None:
    tuner = ThreadTuner(1)
    assert run(tuner, [BUSY_1] * 5) == [1] * 5


def test_with_counters_company_at_the_same_priority_is_never_tried_against() -> None:
    """A try beside busy processes costs a slow forward (a second and more): where the
    counters show the company runs at this process's priority, it will not yield, and
    the counters bring the full count back by themselves once it leaves."""
    tuner = ThreadTuner(2)
    t = 0.0
    for _ in range(2000):
        t += WINDOW_S
        before = tuner.threads
        n = tuner.observe(window(before, **(BUSY_2 if before == 2 else BUSY_1)), t)  # type: ignore[arg-type]
        assert not (before == 1 and n == 2)
    t += WINDOW_S
    assert tuner.observe(window(1, **QUIET), t) == 2  # type: ignore[arg-type]


def test_with_counters_tries_against_nice_company_back_off() -> None:
    """A ``nice``'d process that does not yield after all (nice 1, say): tries wait
    8 s, doubling to 64 s."""
    tuner = ThreadTuner(2)
    t = 0.0
    tries = []
    for _ in range(2000):
        t += WINDOW_S
        before = tuner.threads
        load = BUSY_2 if before == 2 else BUSY_1
        n = tuner.observe(window(before, **load, nice=True), t)  # type: ignore[arg-type]
        if before == 1 and n == 2:
            tries.append(t)
    assert tries[0] >= PROBE_FIRST_COUNTED_S
    gaps = [b - a for a, b in itertools.pairwise(tries)]
    assert max(gaps) <= PROBE_MAX_COUNTED_S + 2 * WINDOW_S
    assert len(tries) <= 2000 * WINDOW_S / PROBE_MAX_COUNTED_S + 4
