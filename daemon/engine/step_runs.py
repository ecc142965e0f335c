"""Engine steps run back to back on the model's compute thread, with the admitted
prompts' prefill chunks between them (what one call of the scheduler's does).

Why one loop for both: a long prompt prefilled in one go stops every running request's
tokens for as long as it takes; here every step of the running requests is followed by
at most a slice of prefill (:meth:`~meshd.daemon.engine.prefill.Prefills.advance`), and a
prompt that is done joins the running requests at the next call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs

from meshd.daemon.engine.forwards import ForwardTiming
from meshd.daemon.engine.generation import Generation, StepOutcome, step_many
from meshd.daemon.engine.prefill import Prefills

__all__ = ["LONG_PREFILL_S", "PREFILL_STEP_DECODES", "Progress", "StepRun",
           "draft_beside_prefill", "run_steps"]

#: While prompts wait for their prefill, a running request's step may cost at most this
#: many one-row decodes: its draft is cut to fit. Why: each step is followed by one
#: prefill slice (:data:`~meshd.daemon.engine.prefill.PREFILL_SLICE_S`), so the steps'
#: width decides the prompt's share of the time. A bystander whose prompt lookup copied
#: 28 tokens a step verified 28-row windows at the long context, each as dear as a tenth
#: of the prompt, and the prompt's first token came 1.4x later than beside a plain one;
#: two decodes' worth still lets it draft a few tokens a step.
PREFILL_STEP_DECODES = 2.0
#: ... only while a queued prompt still needs this long (seconds) to be prefilled: a
#: short prompt is done within a slice or two whatever the steps beside it cost, and
#: cutting drafts that copy well for it only costs their requests (json-reformat, 4
#: clients: 104 tok/s cut against 109 uncut, first tokens alike).
LONG_PREFILL_S = 1.0


@attrs.define
class StepRun:
    """What :func:`run_steps` did: each generation's events not yet handed on (or its
    failure), the number of steps, and the time and shape of each forward; the
    generations whose prompts are done, with their first events (or their failure),
    and the number of prefill forwards."""

    outcomes: list[StepOutcome]
    steps: int
    forwards: list[ForwardTiming]
    #: Each step's wall time outside its forwards.
    host_seconds: list[float] = attrs.field(factory=list)
    started: list[tuple[Generation, StepOutcome]] = attrs.field(factory=list)
    prefill_forwards: int = 0


#: ``progress(part)``: the steps since the last call, their events included, handed on
#: between steps (called on the compute thread; must not wait for anything).
Progress = Callable[[StepRun], None]


def draft_beside_prefill(live: Sequence[Generation], prefills: Prefills) -> int | None:
    """While a queued prompt needs :data:`LONG_PREFILL_S` or more (or its time is not
    measured yet), the longest draft whose window costs at most
    :data:`PREFILL_STEP_DECODES` one-row decodes by the requests' cost curve; None (no
    cut) otherwise, or without a curve."""
    if not len(prefills):
        return None
    left = prefills.seconds_left()
    costs = live[0].costs if live else None
    if costs is None or (left is not None and left < LONG_PREFILL_S):
        return None
    return costs.curve().longest_within(PREFILL_STEP_DECODES)


def run_steps(live: Sequence[Generation], prefills: Prefills,
              skip: Callable[[Generation], bool], interval_s: float,
              should_yield: Callable[[], bool], progress: Progress,
              beat: Callable[[], None] = lambda: None) -> StepRun:
    """Engine steps of the ``live`` generations back to back, each followed by prefill
    chunks of the prompts in ``prefills`` (:meth:`~.prefill.Prefills.advance`: one
    chunk's worth beside running requests, up to ``n_batch`` rows when none runs;
    ``skip``: prompts whose clients left), until one request ends or fails, a prompt is
    done, or ``should_yield`` (what is left is returned); every ``interval_s`` the steps
    so far go to ``progress``, and ``beat`` hears of every step and prefill forward.
    Runs on the compute thread."""
    def fresh() -> StepRun:
        return StepRun([[] for _ in live], 0, [])

    t_next = time.perf_counter() + interval_s
    ran = fresh()
    while True:
        failed = False
        if live:
            t_step, forwards_before = time.perf_counter(), len(ran.forwards)
            results = step_many(live, on_forward=ran.forwards.append,
                                max_draft=draft_beside_prefill(live, prefills))
            ran.host_seconds.append(time.perf_counter() - t_step
                                    - sum(f.seconds for f in ran.forwards[forwards_before:]))
            ran.steps += 1
            for i, result in enumerate(results):
                acc = ran.outcomes[i]
                if isinstance(result, Exception):
                    ran.outcomes[i] = result
                    failed = True
                elif isinstance(acc, list):
                    acc.extend(result)
            beat()
        prefilled = 0
        if len(prefills) and not failed and not any(g.done for g in live):
            started, prefilled = prefills.advance(alone=not live, skip=skip)
            ran.started += started
            ran.prefill_forwards += prefilled
            beat()
        if failed or any(g.done for g in live) or ran.started or should_yield() \
                or not (live or prefilled):
            return ran
        now = time.perf_counter()
        if now >= t_next:
            progress(ran)
            ran = fresh()
            t_next = now + interval_s
