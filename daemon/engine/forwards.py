"""One shared target forward: which planned windows verify together, and verifying,
judging and applying them.

Apart from :mod:`meshd.daemon.engine.generation` (which plans each generation's window and runs a
step over many) so that the forward's own rules read in one place: windows share a
forward only in the layouts whose repairs stay exact, and repairs that decode
(restore-and-replay) go after every in-place one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from meshd.daemon.engine.sampling import FloatArray
from meshd.daemon.engine.window import Judged, Window
from meshd.native.batching import forward_groups
from meshd.native.session import SequenceSession, verify_many
from meshd.policy.costs import CostModel
from meshd.policy.decision import RepairKind

__all__ = ["ForwardTiming", "WindowOwner", "forward_groups_of", "verify_and_apply"]


class WindowOwner(Protocol):
    """What a forward needs of a generation
    (:class:`~meshd.daemon.engine.generation.Generation`)."""

    session: SequenceSession
    costs: CostModel | None

    def judge_window(self, window: Window, logits: FloatArray) -> Judged: ...

    def apply(self, window: Window, judged: Judged) -> list[Any]: ...


@attrs.frozen
class ForwardTiming:
    """One decode-phase target forward: its wall time and its shape.

    Why the shape: a forward whose windows are all one row is a plain decode step, one
    with drafts (or filler) a verify; ``/metrics`` keeps their times apart
    (``meshd_decode_seconds``, ``meshd_verify_seconds``), as they cost differently.
    """

    seconds: float
    windows: int
    rows: int

    @property
    def plain(self) -> bool:
        """Every window one row: a plain decode of each sequence, nothing verified."""
        return self.rows == self.windows


def forward_groups_of(planned: Sequence[tuple[SequenceSession, Window]]) -> list[list[int]]:
    """Which planned windows verify together: indices into ``planned``, one list per
    forward (see :func:`meshd.native.batching.forward_groups`). Attention-only sessions
    share one forward; recurrent (hybrid) ones share it when llama.cpp runs their windows
    as one micro-batch (equal rows, consecutive sequence ids), the only layout whose
    in-place rollbacks stay exact."""
    if not planned:
        return []
    context = planned[0][0].context
    return forward_groups([(s.seq_id, 1 + len(w.draft)) for s, w in planned],
                          recurrent=context.recurrent, n_batch=context.config.n_batch)


def verify_and_apply(planned: Sequence[tuple[int, WindowOwner, Window]],
                     out: list[Any],
                     on_forward: Callable[[ForwardTiming], None] | None) -> None:
    """Verify ``planned`` windows in ONE forward, then decide, repair and commit each
    (into ``out`` at its index)."""
    windows = [(gen.session, [w.last, *w.draft]) for _, gen, w in planned]
    try:
        t0 = time.perf_counter()
        # One session verifies on its own (a failed forward then names its positions).
        logits = ([windows[0][0].verify(windows[0][1])] if len(windows) == 1
                  else verify_many(windows))
        elapsed = time.perf_counter() - t0
    except Exception as exc:
        for i, _, _ in planned:
            out[i] = exc
        return
    costs = planned[0][1].costs
    if costs is not None:
        costs.record(sum(len(tokens) for _, tokens in windows), elapsed,
                     sequences=len(windows))
    if on_forward is not None:
        on_forward(ForwardTiming(elapsed, len(windows),
                                 sum(len(tokens) for _, tokens in windows)))
    decided: list[tuple[int, WindowOwner, Window, Judged]] = []
    for (i, gen, window), rows in zip(planned, logits, strict=True):
        try:
            decided.append((i, gen, window, gen.judge_window(window, rows)))
        except Exception as exc:
            out[i] = exc
    # Repairs that decode (restore-and-replay) go after the others: an in-place rollback
    # is exact only before any other forward.
    decided.sort(key=lambda t: t[3].decision.repair.kind is RepairKind.RESTORE_AND_REPLAY)
    for i, gen, window, judged in decided:
        try:
            out[i] = gen.apply(window, judged)
        except Exception as exc:
            out[i] = exc
