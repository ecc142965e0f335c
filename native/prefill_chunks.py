"""How a prompt's prefill is cut into forwards: fixed-size chunks, so that its state
does not depend on what runs beside it.

A scheduler prefills a long prompt a chunk at a time between the other requests' decode
steps (``meshd.daemon.engine.prefill``), and all at once when nothing else runs; either way
the prompt is decoded in the same chunks, counted from where its prefill began.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .context import TargetContext

__all__ = ["PREFILL_CHUNK", "PREFILL_CHUNK_MERGED", "prefill_chunk_rows", "prefill_forward_rows",
           "prefill_merges_chunks"]


#: The rows of a prompt's chunk where every layer runs on this CPU and forwards do not
#: merge chunks (at most ``n_batch``): see :func:`prefill_chunk_rows`.
PREFILL_CHUNK = 64
#: The same where forwards merge chunks (:func:`prefill_merges_chunks`): a forward
#: beside decoding requests is then as many of them as fit its time.
PREFILL_CHUNK_MERGED = 32


def prefill_chunk_rows(context: TargetContext) -> int:
    """The rows of a prompt's chunks on ``context``: a prompt prefilled from position p
    is decoded in the chunks [p, p+C), [p+C, p+2C), ..., whatever runs beside it, a
    forward holding one chunk or, where :func:`prefill_merges_chunks`, several whole
    ones; so its state is the same bit for bit whether it was prefilled alone or a
    chunk at a time between other requests' decode steps.

    Why :data:`PREFILL_CHUNK` rows on a CPU: a forward of ``n_batch`` = 512 rows of
    SmolLM2 takes 1-2 s on two cores, the time of some fifty decode steps, and nothing
    else runs while it does; a chunk lets a scheduler run the other requests' decode
    steps between a long prompt's forwards. Where forwards do not merge chunks (a
    recurrent model), a chunk is the longest a bystander waits: 64 rows, the fewest
    whose prefill alone is as fast as wider chunks' (a 1B hybrid model, 1,800 tokens on
    two cores: 64 rows 20.9-21.5 s, 0.73-0.77 s a chunk; 128 rows 20.3-21.8 s, 1.4-1.5 s
    a chunk; 32 rows 28.3 s). Where forwards merge chunks,
    :data:`PREFILL_CHUNK_MERGED` rows: a forward beside decoding requests takes as many
    as fit its time, and 128 rows of SmolLM2 at 3,000 tokens of context take 0.5 s. On
    accelerators, where a wide forward is far cheaper per row and fast anyway,
    ``n_batch``.
    """
    n_batch = context.config.n_batch
    if context.model.gpu_layers:
        return n_batch
    merged = prefill_merges_chunks(context)
    return min(PREFILL_CHUNK_MERGED if merged else PREFILL_CHUNK, n_batch)


def prefill_merges_chunks(context: TargetContext) -> bool:
    """Whether one prefill forward on ``context`` may hold several whole chunks (of one
    prompt or several, up to ``n_batch`` rows) and leave the state those chunks leave
    one forward each: where every forward computes a row alike whatever shares it
    (``context.exact``, see :func:`~.primitives.rounds_rows_alike`) and no recurrent
    state runs through the rows (a recurrent layer's scan over a forward's rows rounds
    by where the forward begins). A prompt prefilled alone then takes ``n_batch`` rows
    a forward, as fast as ever; elsewhere every forward is one chunk."""
    return context.exact and not context.recurrent


def prefill_forward_rows(context: TargetContext) -> int:
    """The most rows of one prompt a prefill forward on ``context`` decodes: as many
    whole chunks as ``n_batch`` holds where forwards may merge chunks, else one."""
    rows = prefill_chunk_rows(context)
    if not prefill_merges_chunks(context):
        return rows
    return rows * max(1, context.config.n_batch // rows)
