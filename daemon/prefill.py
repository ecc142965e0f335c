"""Prompts prefilled together, and a prompt another sequence holds never prefilled again.

Why: the ``n`` choices of one request, and requests that open with the same long system
prompt, would otherwise prefill the same tokens once each. On an attention-only context
a position's KV depends on the tokens up to it alone, so a new sequence can copy any
prefix another sequence holds (:meth:`~meshd.native.session.SequenceSession.share_prefix`)
and prefill only the rest. Prompts equal within one admission are prefilled once; the
others copy that sequence and take its first-token logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshd.native.primitives import FloatArray
from meshd.native.session import prefill_many

from .prefix_cache import common_prefix

if TYPE_CHECKING:
    from .engine import Generation, StepOutcome

__all__ = ["MIN_SHARED", "start_many"]

#: llama.cpp copies a sequence across streams only whole (its whole context's KV), so a
#: copy pays only for a prompt at least this long.
MIN_SHARED = 64


def start_many(generations: Sequence[Generation], *,
               running: Sequence[Generation] = ()) -> list[StepOutcome]:
    """Start several generations, their prompts prefilled together
    (:func:`~meshd.native.session.prefill_many`); each gets its first events, or its
    exception in its place. A failed shared prefill fails every one of them.

    ``running``: generations decoding now, whose sequences may lend a prompt prefix.
    """
    out: list[StepOutcome] = [[] for _ in generations]
    ready: list[tuple[int, Generation]] = []
    suffixes: list[Sequence[int]] = []
    for i, gen in enumerate(generations):
        try:
            _borrow_prefix(gen, running)
            suffixes.append(gen.begin())
        except Exception as exc:
            out[i] = exc
            continue
        ready.append((i, gen))
    leaders, copies = _equal_prompts([gen for _, gen in ready])
    try:
        logits = prefill_many([(ready[j][1].session, suffixes[j]) for j in leaders])
    except Exception as exc:
        for i, _ in ready:
            out[i] = exc
        return out
    rows: dict[int, FloatArray] = dict(zip(leaders, logits, strict=True))
    for j, lead in copies.items():  # before any first token is committed
        i, gen = ready[j]
        try:
            gen.session.share_prefix(ready[lead][1].session, len(gen.prompt))
            gen.stats.reused_prompt_tokens = len(gen.prompt)
            rows[j] = rows[lead].copy()
        except Exception as exc:
            out[i] = exc
    for j, (i, gen) in enumerate(ready):
        if j in rows:
            try:
                out[i] = gen.start_with(rows[j])
            except Exception as exc:
                out[i] = exc
    return out


def _shareable(gen: Generation) -> bool:
    session = gen.session
    return not session.recurrent and session.mtp is None and len(gen.prompt) >= MIN_SHARED


def _borrow_prefix(gen: Generation, running: Sequence[Generation]) -> None:
    """Copy into ``gen``'s session the longest prompt prefix a running sequence holds,
    when that saves at least :data:`MIN_SHARED` tokens of prefill (the last prompt
    token is always decoded: its row gives the first token)."""
    if not _shareable(gen):
        return
    session, prompt = gen.session, gen.prompt
    best: tuple[Generation, int] | None = None
    for other in running:
        held = other.session
        if other.done or not held.usable or held.mtp is not None \
                or held.context is not session.context \
                or not held.context.holds_from_start(held.seq_id):
            continue
        n = min(common_prefix(other.tokens[:held.n_past], prompt), len(prompt) - 1)
        if n - session.n_past >= MIN_SHARED and (best is None or n > best[1]):
            best = (other, n)
    if best is not None:
        session.share_prefix(best[0].session, best[1])


def _equal_prompts(gens: Sequence[Generation]) -> tuple[list[int], dict[int, int]]:
    """Which generations prefill (their indexes) and which copy another's equal prompt
    once it is prefilled (index: the index it copies). The one holding the most of the
    prompt already prefills for the others."""
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    leaders: list[int] = []
    for j, gen in enumerate(gens):
        if _shareable(gen):
            by_prompt.setdefault(tuple(gen.prompt), []).append(j)
        else:
            leaders.append(j)
    copies: dict[int, int] = {}
    for group in by_prompt.values():
        lead = max(group, key=lambda j: gens[j].session.n_past)
        leaders.append(lead)
        copies.update({j: lead for j in group if j != lead})
    leaders.sort()
    return leaders, copies
