"""A model's cost calibration, run piece by piece on its compute thread.

The plan is :class:`meshd.policy.calibration.Calibration` (its docstring says why it is
cut in pieces and judged by the machine's load); this is where it meets the model: it
reads and writes the cost cache (:mod:`.cost_cache`), runs each piece's forwards
(:class:`~meshd.native.calibrate.CalibrationBench`, the MTP head's steps) with the
configured thread count, measures the load they ran under
(:class:`~meshd.native.cpus.CpuMeter`) and hands the result to the runtime.

Two ways to run it:

- :meth:`CostCalibration.run_to_end`, while the runtime is made (``meshd generate``,
  benchmarks, tests: one run that waits for it, with a progress display);
- as the compute thread's idle work (``meshd serve``: :meth:`step` and :meth:`pause`,
  see :mod:`.compute`): the daemon is ready as soon as the model is loaded, prices
  speculation with the cached curve or the conservative prior meanwhile, and a request
  that arrives waits at most for the piece running.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from meshd.daemon.engine.prefix_cache import PrefixCache
from meshd.daemon.models.cost_cache import (
    check_writable,
    cost_cache_path,
    cost_model_key,
    other_threads_note,
    read_cached_costs,
    read_cached_mtp,
    unwritable_note,
    write_cached_costs,
)
from meshd.daemon.models.thread_tuning import ThreadTuning, TunedModel
from meshd.daemon.models.timed_steps import Events, StepProgress
from meshd.native.calibrate import CalibrationBench, MtpCosts, mtp_cost_samples
from meshd.native.cpus import CpuMeter, CpuReading, threads_spin
from meshd.policy.calibration import Calibration, Outcome, Phase, Piece, Timed
from meshd.policy.costs import CostModel, conservative_prior
from meshd.policy.load import OTHERS_BUSY, Load, busy

__all__ = ["CalibratedModel", "CostCalibration"]


class _Config(Protocol):
    @property
    def threads(self) -> int | None: ...

    @property
    def rpc_workers(self) -> tuple[str, ...]: ...

    @property
    def tensor_split(self) -> tuple[float, ...]: ...


class CalibratedModel(TunedModel, Protocol):
    """What the calibration reads and sets of a runtime
    (:class:`~meshd.daemon.models.runtime.ModelRuntime`): what the thread tuning reads, and
    more."""

    path: Path
    costs: CostModel | None
    mtp_costs: MtpCosts | None
    threads: ThreadTuning | None
    prefix_cache: PrefixCache

    @property
    def config(self) -> _Config: ...

#: An idle spell shorter than this says too little about other processes' CPU use
#: (the kernel counts in ticks) to skip a piece for it.
IDLE_SPELL_MIN_S = 0.15
#: How long an in-process calibration looks at the machine before its first piece (and
#: after a busy one): the kernel's counters of other processes' CPU use over it.
LOOK_S = 0.1
#: Without a free sequence slot (requests hold them all), try again after this.
NO_SLOT_WAIT_S = 1.0


class CostCalibration:
    """One runtime's calibration (see the module docstring)."""

    def __init__(self, runtime: CalibratedModel, *, wait_for_quiet: bool,
                 note: Callable[[str, str], None],
                 step: Callable[[str, str], StepProgress],
                 events: Events | None = None, meter: CpuMeter | None = None) -> None:
        self._runtime = runtime
        self._note = note
        self._step = step
        self._events = events
        self.meter = meter if meter is not None else CpuMeter()
        config = runtime.context.config
        threads = runtime.config.threads
        placement = [*runtime.config.rpc_workers, *runtime.config.tensor_split]
        self.cache = cost_cache_path(runtime.path, config, threads, placement)
        self._model_key = cost_model_key(runtime.path, config, placement)
        self._threads_key = threads
        self.plan = Calibration(config.draft_max, read_cached_costs(self.cache),
                                has_mtp=runtime.context.mtp is not None,
                                wait_for_quiet=wait_for_quiet)
        # The head's costs from the last quiet measurement: ``auto`` may follow the head
        # from the first request instead of after this run's own measurement (about
        # 25 s of idle pieces on a 1B model), which then replaces them.
        cached_mtp = read_cached_mtp(self.cache) if runtime.context.mtp is not None else None
        if cached_mtp is not None and self.plan.cached is not None:
            runtime.mtp_costs = MtpCosts(*cached_mtp)
        #: Why a measured curve cannot be kept (None: it can), said at start.
        self._unwritable: OSError | None = None
        if self.plan.cached is None:
            why = other_threads_note(self._model_key, threads)
            if why is not None:
                note("recalibrating", why)
            self._unwritable = check_writable(self.cache)
            if self._unwritable is not None:
                note("cost_cache_unwritable", unwritable_note(self.cache, self._unwritable))
        #: Whether the model's forwards run on these CPUs (else the load is not judged).
        self.cpu_bound = runtime.model.gpu_layers == 0 and runtime.remote is None
        self._spins = threads_spin()
        self._bench: CalibrationBench | None = None
        self._last: CpuReading | None = None
        self._started: float | None = None
        self._waiting = False
        #: The calibration is over (its results applied), or was stopped.
        self.finished = False
        self.closed = False

    # ------------------------------------------------------------------ results

    def costs_now(self) -> list[float]:
        """The curve to price speculation with now: measured, else cached, else the
        conservative prior."""
        costs = self.plan.outcome().costs
        return list(costs) if costs is not None else conservative_prior(self.plan.k_max)

    @property
    def holds_slot(self) -> bool:
        """Whether a sequence slot is held between pieces (freed before any call)."""
        return self._bench is not None and self._bench.holds_slot

    # ------------------------------------------------------------------ in-process

    def run_to_end(self) -> None:
        """Every piece now, one after another (in-process runs); on a machine that
        stays busy it stops early and leaves the cached curve or the prior."""
        bar: StepProgress | None = None
        look = True  # at the machine before the first piece, and after a busy one
        try:
            while not self.plan.done:
                piece = self.plan.next_piece()
                if piece is None:
                    break
                if look and piece.phase is not Phase.MTP and self._company_now():
                    self.plan.company(time.monotonic())
                    self._tell()
                    continue
                busy_before = self.plan.busy_pieces
                if piece.phase is Phase.CURVE and bar is None:
                    bar = self._step("measuring the verify cost (once per model, threads "
                                     "and machine)", "calibration")
                elif piece.phase is Phase.MTP and bar is None:
                    bar = self._step("measuring the MTP head", "mtp_calibration")
                if not self._run(piece):
                    break  # no free sequence slot: the cached curve or the prior stays
                look = self.plan.busy_pieces > busy_before
                if bar is not None:
                    if piece.phase is Phase.MTP and self.plan.phase is not Phase.MTP:
                        bar.done()
                        bar = None
                    else:
                        bar.update(self.plan.progress())
            if bar is not None:
                bar.done()
                bar = None
        finally:
            self._close_bench()
        self._finish()

    # ------------------------------------------------------------------ idle work

    def step(self) -> float | None:
        """One piece, in an idle moment on the compute thread; seconds until the next
        one is wanted, None when done (:class:`~meshd.daemon.models.compute.IdleWork`)."""
        if self.closed or self.finished:
            return None
        now = time.monotonic()
        wait = self.plan.wait_s(now)
        if wait > 0:
            return wait
        if self.cpu_bound and self.meter.counters_usable and self._last is None:
            self._last = self.meter.read()  # the idle spell starts: judged at the next step
            return IDLE_SPELL_MIN_S
        if self._company_while_idle():
            self.plan.company(now)
            self._tell()
            self._busy_event()
            return self.plan.wait_s(time.monotonic())
        piece = self.plan.next_piece()
        if piece is None:
            self._finish()
            return None
        if self._started is None:
            self._started = time.monotonic()
            self._event("calibration_started", phase=str(self.plan.phase),
                        cached=self.plan.cached is not None)
        try:
            if not self._run(piece):
                return NO_SLOT_WAIT_S
        except Exception as exc:  # the model's calls failed: serving goes on uncalibrated
            self._close_bench()
            self._event("calibration_failed", error=str(exc))
            self.finished = True
            return None
        if self.plan.busy_pieces and self.plan.wait_s(time.monotonic()) > 0:
            self._busy_event()
        else:
            self._waiting = False
        if self.plan.done:
            self._close_bench()
            self._finish()
            return None
        return self.plan.wait_s(time.monotonic())

    def pause(self) -> None:
        """A call is about to run on the compute thread: the slot goes back."""
        self._close_bench()

    def close(self) -> None:
        self.closed = True
        self._close_bench()

    # ------------------------------------------------------------------ pieces

    def _company_now(self) -> bool:
        """Whether other processes use the CPUs now (over :data:`LOOK_S`): a piece run
        now would only measure them."""
        if not self.cpu_bound or not self.meter.counters_usable:
            return False
        before = self.meter.read()
        time.sleep(LOOK_S)
        after = self.meter.read()
        self._last = after
        others = self.meter.others_s(before, after)
        if others is None:
            return False
        return max(0.0, others - self.meter.resolution_s) / (after.wall_s - before.wall_s) \
            > OTHERS_BUSY

    def _company_while_idle(self) -> bool:
        """Whether other processes used the CPUs while the model was idle (since the
        last piece): no piece is run then, it would only be dropped."""
        if not self.cpu_bound:
            return False
        before, now = self._last, self.meter.read()
        self._last = now
        if before is None or now.wall_s - before.wall_s < IDLE_SPELL_MIN_S:
            return False
        others = self.meter.others_s(before, now)
        if others is None:
            return False
        wall = now.wall_s - before.wall_s
        return max(0.0, others - self.meter.resolution_s) / wall > OTHERS_BUSY

    def _run(self, piece: Piece) -> bool:
        """Run ``piece`` and feed what it measured to the plan; False where it could not
        run (no free sequence slot)."""
        rt = self._runtime
        if not self._slot_free():
            return False
        tuning = rt.threads
        full = tuning.full if tuning is not None else (
            rt.context.config.n_threads or self.meter.cpus)
        guard = tuning.full_threads() if tuning is not None else _nothing()
        with guard:
            before = self.meter.read()
            timed = self._time(piece)
            after = self.meter.read()
        self._last = after
        load = Load(wall_s=after.wall_s - before.wall_s, cpu_s=after.cpu_s - before.cpu_s,
                    threads=full, cpus=self.meter.cpus, spins=self._spins,
                    others_s=self.meter.others_s(before, after),
                    resolution_s=self.meter.resolution_s) if self.cpu_bound else None
        if load is not None and busy(load) and self._events is not None:
            self._events("calibration_piece_dropped" if self.plan.wait_for_quiet
                         else "calibration_piece_busy",
                         phase=str(piece.phase), seconds=round(load.wall_s, 3),
                         share=_round(load.share()), others=_round(load.others_low()))
        self.plan.feed(piece, timed, load, time.monotonic())
        mtp = self.plan.outcome().mtp
        if mtp is not None and rt.mtp_costs is None:  # the head's part is done
            rt.mtp_costs = MtpCosts(overhead=mtp[0], draft_cost=mtp[1])
        self._tell()
        return True

    def _tell(self) -> None:
        for event, message in self.plan.notes:
            self._note(event, message)
        self.plan.notes.clear()

    def _slot_free(self) -> bool:
        rt = self._runtime
        if self._bench is not None and self._bench.context is not rt.context:
            self._close_bench()  # the context was rebuilt
        if self._bench is not None and self._bench.holds_slot:
            return True
        return rt.context.free_slots > 0 or rt.prefix_cache.evict_one()

    def _time(self, piece: Piece) -> Timed:
        rt = self._runtime
        if piece.phase is Phase.MTP:
            self._close_bench()  # the head's steps take a slot of their own
            samples = mtp_cost_samples(rt.context, steps=piece.steps)
            if samples is None:
                return Timed(failed=True)
            return Timed(overheads=tuple(samples[0]), draft_costs=tuple(samples[1]))
        if self._bench is None:
            self._bench = CalibrationBench(rt.context)
        times, cut = self._bench.time(piece.rows, budget_s=piece.budget_s)
        return Timed(times=tuple(times), cut=cut)

    def _close_bench(self) -> None:
        bench, self._bench = self._bench, None
        if bench is not None:
            bench.close()

    # ------------------------------------------------------------------ the end

    def _finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        rt = self._runtime
        out = self.plan.outcome()
        if out.costs is not None and rt.costs is not None:
            rt.costs.recalibrated(list(out.costs))
        if out.mtp is not None:
            rt.mtp_costs = MtpCosts(overhead=out.mtp[0], draft_cost=out.mtp[1])
        if out.cache and out.costs is not None:
            exc = write_cached_costs(self.cache, out.costs, self._model_key, self._threads_key,
                                     out.mtp)
            if exc is not None and self._unwritable is None:
                self._note("cost_cache_unwritable", unwritable_note(self.cache, exc))
        self._event("calibration_done", **self._summary(out))

    def _summary(self, out: Outcome) -> dict[str, object]:
        fields: dict[str, object] = {
            "result": _result(self.plan, out), "cached": out.cache,
            "pieces": self.plan.pieces, "busy_pieces": self.plan.busy_pieces,
        }
        if self._started is not None:
            fields["seconds"] = round(time.monotonic() - self._started, 3)
        if out.costs is not None:
            fields["costs"] = [round(c, 3) for c in out.costs[:5]]
        if self.plan.unit_s is not None:
            fields["decode_ms"] = round(self.plan.unit_s * 1e3, 3)
        return fields

    def _busy_event(self) -> None:
        if self._waiting:
            return
        self._waiting = True
        self._event("calibration_waiting", seconds=round(self.plan.wait_s(time.monotonic()), 1),
                    message="other processes are using the CPUs: the verify cost is measured "
                            "once they are quiet (speculation uses "
                            + ("the cached curve" if self.plan.cached is not None
                               else "no drafts") + " meanwhile)")

    def _event(self, name: str, **fields: object) -> None:
        if self._events is not None and self.plan.wait_for_quiet:
            self._events(name, **fields)


def _result(plan: Calibration, out: Outcome) -> str:
    if out.costs is None:
        return "not measured (machine busy)" if plan.tainted else "not measured"
    if plan.cached is not None and out.costs == plan.cached:
        return "cached curve kept"
    return "measured"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

