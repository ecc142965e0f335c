"""Which verify windows may share one llama.cpp forward, and in what row order.

Attention-only state: any windows may (trimming a KV suffix is exact at any time).

Recurrent (hybrid) state with in-place rollback is different, because of how llama.cpp
lays it out. ``llama_decode`` cuts a batch into micro-batches ("ubatches") with
``split_equal(sequential=True, n_keep_tail=n_rs_seq+1)``: one ubatch holds sequences of
consecutive ascending ids with the same number of rows each; other windows go to ubatches
of their own, computed one after another inside the same ``llama_decode``. Every ubatch
first gathers its sequences' state cells into one contiguous run (``find_slot``: "gather
and re-order" swaps cell metadata), which moves the cells of sequences NOT in that ubatch
that lie in the way; a moved sequence gets its current state copied along (the graph's
"extra" state copy, slot 0) but not its per-token rollback snapshots, which stay in the
rows ``slot * size + old_cell``. A sequence whose window ran in an EARLIER ubatch of the
same forward and is moved by a later one therefore loses its snapshots, and the in-place
rollback right after the forward (``seq_rm`` -> ``rs_idx``) then resumes from the new
cell's rows: another sequence's or an older state, and tokens change.

Minimal pattern: sequences 0, 1, 2 with state cells 1, 0, 2 (1 was prefilled first);
one forward of ``[0: 3 rows][1: 1 row][2: 1 row]`` runs as ubatches ``[0]`` then
``[1, 2]``; the second gathers 1 and 2 into cells 0-1 and moves sequence 0 from cell 1
to cell 2; rolling sequence 0 back by 2 then reads cell 2's snapshots.

What stays exact: a forward that llama.cpp runs as ONE ubatch moves only sequences that
are not in it, and those have no rollback to come in this forward (each group is
repaired before the next group's forward); a rollback still pending then is either
materialised by the extra copy (``s_copy`` consumes ``rs_idx`` with the old cell's rows)
or left alone. Splitting a step's windows into such forwards costs little: llama.cpp
computes each ubatch as a graph of its own anyway.
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
