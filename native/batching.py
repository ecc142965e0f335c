"""Which verify windows may share one llama.cpp forward, and in what row order.

Attention-only state: any windows may (trimming a KV suffix is exact at any time).
Recurrent (hybrid) state with in-place rollback may share a forward only where llama.cpp
runs it as ONE micro-batch (ubatch): equal rows, consecutive ascending sequence ids.
Otherwise a later ubatch can move an earlier one's state cells without their per-token
rollback snapshots, and the rollback after the forward reads another sequence's state,
so tokens change. :func:`forward_groups` says why in detail.
"""

from __future__ import annotations

from collections.abc import Sequence


def forward_groups(windows: Sequence[tuple[int, int]], *, recurrent: bool,
                   n_batch: int) -> list[list[int]]:
    """Split windows ``(seq_id, rows)`` into forwards that are safe to share.

    Returns lists of indices into ``windows``, each list in ascending ``seq_id`` order
    (the row order its forward must use), every list at most ``n_batch`` rows. For a
    recurrent state each list is one llama.cpp ubatch: equal ``rows`` and consecutive
    ``seq_id``; windows of several rows go first, so that sessions with a repair to make
    are grouped as tightly as the rule allows. Attention-only windows share one forward
    per ``n_batch`` rows.

    Why, for a recurrent state: ``llama_decode`` cuts a batch into ubatches with
    ``split_equal(sequential=True, n_keep_tail=n_rs_seq+1)``, each holding sequences of
    consecutive ascending ids with the same number of rows. Every ubatch first gathers
    its sequences' state cells into one contiguous run (``find_slot``), which moves the
    cells of sequences NOT in it that lie in the way; a moved sequence keeps its current
    state (the graph's "extra" copy) but not its rollback snapshots, which stay in the
    rows ``slot * size + old_cell``. A sequence whose window ran in an earlier ubatch of
    the same forward and is moved by a later one then rolls back (``seq_rm`` ->
    ``rs_idx``) from the new cell's rows. Example: sequences 0, 1, 2 in cells 1, 0, 2; a
    forward ``[0: 3 rows][1: 1 row][2: 1 row]`` runs as ubatches ``[0]`` then ``[1, 2]``,
    which moves sequence 0 to cell 2, so rolling it back by 2 reads cell 2's snapshots.
    A forward run as ONE ubatch moves only sequences not in it, which have no rollback
    to come in this forward (each group is repaired before the next group's forward).
    Splitting costs little: llama.cpp computes each ubatch as a graph of its own anyway.
    """
    if any(rows < 1 for _, rows in windows):
        raise ValueError("a window has at least one row")
    if any(rows > n_batch for _, rows in windows):
        raise ValueError(f"a window is longer than n_batch={n_batch}")
    order = sorted(range(len(windows)),
                   key=(lambda i: (-windows[i][1], windows[i][0])) if recurrent
                   else (lambda i: windows[i][0]))
    groups: list[list[int]] = []
    total = 0
    for i in order:
        seq_id, rows = windows[i]
        if groups and total + rows <= n_batch and (
                not recurrent or _extends(windows[groups[-1][-1]], seq_id, rows)):
            groups[-1].append(i)
            total += rows
        else:
            groups.append([i])
            total = rows
    return groups


def _extends(previous: tuple[int, int], seq_id: int, rows: int) -> bool:
    """Whether a window continues a recurrent ubatch that ends with ``previous``."""
    return previous[1] == rows and previous[0] + 1 == seq_id
