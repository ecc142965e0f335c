"""Measure what a verify window costs on this model and machine (the cost curve).

Why measure: on a CPU a batch of k rows can cost nearly k single decodes (Q4_1), or
much less (Q8_0, F16); speculation only pays where the tokens it commits outweigh
that cost. The adaptive draft length decides per step from this curve, so it must come
from the model actually loaded, on the machine actually running it.
"""

from __future__ import annotations

import statistics
import time

from .context import TargetContext


def measure_row_costs(
    context: TargetContext, k_max: int, *, reps: int = 5, context_tokens: int = 64
) -> list[float]:
    """Relative cost of a forward of k+1 rows vs 1 row, for k = 0..k_max (c[0] == 1).

    Arms are interleaved (1, 2, ..., k_max+1, 1, 2, ...) and medians taken, so machine
    noise hits every size alike. Uses one temporary session slot.
    """
    n_vocab = context.n_vocab
    filler = [(7 * i + 3) % n_vocab for i in range(context_tokens)]
    times: dict[int, list[float]] = {n: [] for n in range(1, k_max + 2)}
    with context.open_session() as session:
        session.prefill(filler)
        base_pos = session.n_past
        for _ in range(reps):
            for n in times:
                if session.recurrent:
                    session.checkpoint()
                t0 = time.perf_counter()
                session.verify(filler[:n])
                times[n].append(time.perf_counter() - t0)
                if session.recurrent:
                    session.restore_and_replay(base_pos, ())
                else:
                    session.trim(base_pos)
    base = statistics.median(times[1])
    return [statistics.median(times[n]) / base for n in range(1, k_max + 2)]
