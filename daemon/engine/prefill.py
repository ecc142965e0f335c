"""Prompts prefilled a chunk at a time between decode steps, and never twice.

Why chunks: a long prompt's prefill is many forwards of hundreds of rows (seconds each
on a small CPU), and while one runs no other request gets a token. The scheduler runs
them one chunk at a time (:meth:`Prefills.advance`) after each decode step of the
requests already running, as vLLM's chunked prefill does; a prompt waits its turn
round-robin with the others, and a request whose client left is dropped between two
chunks. With no request decoding a forward takes ``n_batch`` rows, as before, so a
prompt alone gets its first token as soon. A prompt's chunks are the same whatever runs
beside it (:mod:`meshd.native.prefill_chunks`: fixed-size chunks from where its prefill
began; a forward holds one or, where that leaves the same state, several whole ones), so
its state, and its text, are the ones it gets alone. Prompt rows never share a forward
with decode or verify rows: a forward is of one kind.

Why never twice: the ``n`` choices of one request, and requests that open with the same
long system prompt, would otherwise prefill the same tokens once each. On an
attention-only context a position's KV depends on the tokens up to it alone, so a new
sequence can copy any prefix another sequence holds
(:meth:`~meshd.native.session.SequenceSession.share_prefix`) and prefill only the rest.
A prompt equal to one being prefilled is not prefilled again: once that one is done its
generation copies the sequence and takes its first-token logits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from meshd.daemon.engine.prefix_cache import MIN_SHARED, common_prefix
from meshd.native.prefill_chunks import prefill_chunk_rows, prefill_merges_chunks
from meshd.native.records import FloatArray
from meshd.native.session import prefill_parts

if TYPE_CHECKING:
    from meshd.daemon.engine.generation import Generation, StepOutcome

__all__ = ["MIN_SHARED", "PREFILL_SLICE_S", "Prefills"]

#: Beside running requests, the prefill time one step may take before their next decode
#: step: more chunks run while the last one's time still fits (one always runs). 0.3 s
#: keeps a bystander's longest wait under 0.5 s and gives the prompt most of the time
#: (SmolLM2, 3,400-token prompt: 19 s beside a streaming client, longest wait 0.33 s).
PREFILL_SLICE_S = 0.3


@attrs.define(eq=False)
class _Job:
    """One prompt being prefilled into ``lead``'s session, from position ``start`` on
    (its chunks count from there); ``copies`` have the same prompt and copy the
    sequence once it is done."""

    lead: Generation
    start: int
    copies: list[Generation] = attrs.field(factory=list)

    @property
    def generations(self) -> list[Generation]:
        return [self.lead, *self.copies]

    @property
    def left(self) -> int:
        """Prompt tokens still to prefill."""
        return len(self.lead.prompt) - self.lead.session.n_past

    def take(self, rows: int, space: int) -> int:
        """How many of its next tokens fit in ``space`` rows of a forward as whole
        chunks of ``rows`` (counted from ``start``; the last one may be short)."""
        assert (self.lead.session.n_past - self.start) % rows == 0, "off a chunk boundary"
        return self.left if self.left <= space else space // rows * rows

    def part(self, n: int) -> tuple[Sequence[int], bool]:
        """Its next ``n`` tokens, and whether they end the prompt."""
        at = self.lead.session.n_past
        return self.lead.prompt[at:at + n], at + n == len(self.lead.prompt)


class Prefills:
    """The prompts of admitted generations still to prefill. Used on the model's
    compute thread only (its methods run forwards, or change what they run)."""

    def __init__(self) -> None:
        self._jobs: list[_Job] = []
        #: Seconds per row of the last prefill forward (None before the first): sizes
        #: the next one beside decoding requests.
        self._row_s: float | None = None

    def __len__(self) -> int:
        return len(self._jobs)

    def seconds_left(self) -> float | None:
        """The longest time a queued prompt still needs to be prefilled, by the last
        forward's time per row (None: no forward measured yet)."""
        if self._row_s is None:
            return None
        rows = max((len(j.lead.prompt) - j.lead.session.n_past for j in self._jobs), default=0)
        return rows * self._row_s

    def add(self, generations: Sequence[Generation], *,
            running: Sequence[Generation] = ()) -> list[Exception | None]:
        """Begin each generation (:meth:`~meshd.daemon.engine.generation.Generation.begin`) and
        queue its prompt: first its session copies the longest prompt prefix a sequence
        of ``running`` (or of a prompt being prefilled) holds, and a prompt equal to one
        queued is not queued again (its generation waits for that one). Each gets None,
        or the exception it failed with (it is not queued then).

        Of equal prompts admitted together, the one whose session holds the most
        already (a prefix-cache hit) prefills for the others."""
        out: list[Exception | None] = [None] * len(generations)
        order = sorted(range(len(generations)), key=lambda i: -generations[i].session.n_past)
        for i in order:
            gen = generations[i]
            try:
                job = self._equal(gen)
                if job is None:
                    _borrow_prefix(gen, [*running, *(j.lead for j in self._jobs)])
                gen.begin()
            except Exception as exc:
                out[i] = exc
                continue
            if job is not None:
                job.copies.append(gen)
            else:
                self._jobs.append(_Job(gen, gen.session.n_past))
        return out

    def _equal(self, gen: Generation) -> _Job | None:
        """A queued prompt ``gen`` can copy once it is done (equal, both shareable)."""
        if not _shareable(gen):
            return None
        for job in self._jobs:
            if job.lead.prompt == gen.prompt and _shareable(job.lead) \
                    and job.lead.session.context is gen.session.context:
                return job
        return None

    def cancel(self, cancelled: Callable[[Generation], bool]) -> list[Generation]:
        """Take out the generations whose client left (``cancelled``); returns them
        (their owner closes them). One that prefills for others still waiting goes on
        until they have their copy."""
        removed: list[Generation] = []
        for job in list(self._jobs):
            removed += [g for g in job.copies if cancelled(g)]
            job.copies = [g for g in job.copies if not cancelled(g)]
            if not job.copies and cancelled(job.lead):
                self._jobs.remove(job)
                removed.append(job.lead)
        return removed

    def clear(self) -> list[Generation]:
        """Forget every queued prompt; returns their generations (to close)."""
        gens = [g for job in self._jobs for g in job.generations]
        self._jobs.clear()
        return gens

    def advance(self, *, alone: bool, budget_s: float | None = None,
                skip: Callable[[Generation], bool] = lambda _: False,
                ) -> tuple[list[tuple[Generation, StepOutcome]], int]:
        """Prefill forwards of whole chunks, the prompts taking turns (:func:`_pick`).

        ``alone`` (no request is decoding): one forward, of up to ``n_batch`` rows where
        chunks merge. Else forwards of as many chunks as the last forward's time per row
        says fit in ``budget_s`` (default :data:`PREFILL_SLICE_S`; one always runs,
        more while the last one's time still fits), and none past
        a prompt that is done: its generation can decode in the next step. ``skip``:
        generations whose chunks wait (their client left; :meth:`cancel` takes them
        out).

        Returns each generation whose prompt is done with its first events (or the
        exception its start or its forward failed with; a failed forward fails every
        prompt in it), and the number of forwards run."""
        t_end = time.perf_counter() + (PREFILL_SLICE_S if budget_s is None else budget_s)
        done: list[tuple[Generation, StepOutcome]] = []
        forwards = 0
        while True:
            ready = [j for j in self._jobs if not all(skip(g) for g in j.generations)]
            if not ready:
                break
            left_s = t_end - time.perf_counter()
            parts = _pick(ready, alone=alone,
                          fits=None if self._row_s is None else int(left_s / self._row_s))
            picked = [job for job, _ in parts]
            self._jobs = [j for j in self._jobs if j not in picked] + picked  # turns
            t0 = time.perf_counter()
            try:
                logits = prefill_parts([(job.lead.session, *job.part(n)) for job, n in parts])
            except Exception as exc:
                for job in picked:
                    self._jobs.remove(job)
                    done += [(g, exc) for g in job.generations]
            else:
                for job, row in zip(picked, logits, strict=True):
                    if row is not None:
                        self._jobs.remove(job)
                        done += _start(job, row)
            forwards += 1
            now = time.perf_counter()
            self._row_s = (now - t0) / sum(n for _, n in parts)
            if alone or done or now + (now - t0) > t_end:
                break
        return done, forwards


def _pick(jobs: Sequence[_Job], *, alone: bool, fits: int | None = None,
          ) -> list[tuple[_Job, int]]:
    """What one forward prefills: the first prompt in turn, one chunk of it, and where
    a forward may merge chunks, as many more whole chunks, of it and then of the next
    prompts in turn, as fit in the forward (``n_batch`` rows with no request decoding,
    else the whole chunks of the ``fits`` rows the step's time has room for, one at
    least); each with its number of tokens."""
    context = jobs[0].lead.session.context
    rows = prefill_chunk_rows(context)
    if not prefill_merges_chunks(context):
        return [(jobs[0], min(jobs[0].left, rows))]
    n_batch = context.config.n_batch
    space = n_batch if alone else min(n_batch, rows * max(1, (fits or 0) // rows))
    picked: list[tuple[_Job, int]] = []
    for job in jobs:
        n = job.take(rows, space)
        if n > 0:
            picked.append((job, n))
            space -= n
    return picked


def _start(job: _Job, logits: FloatArray) -> list[tuple[Generation, StepOutcome]]:
    """A prompt is done: its copies copy the sequence (before any first token is
    committed), then each generation commits its first token."""
    rows: list[tuple[Generation, FloatArray]] = [(job.lead, logits)]
    out: list[tuple[Generation, StepOutcome]] = []
    for gen in job.copies:
        try:
            gen.session.share_prefix(job.lead.session, len(gen.prompt))
            gen.stats.reused_prompt_tokens = len(gen.prompt)
            rows.append((gen, logits.copy()))
        except Exception as exc:
            out.append((gen, exc))
    for gen, row in rows:
        try:
            out.append((gen, gen.start_with(row)))
        except Exception as exc:
            out.append((gen, exc))
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
        if other is gen or other.done or not held.usable or held.mtp is not None \
                or held.context is not session.context or held.n_past == 0 \
                or not held.context.holds_from_start(held.seq_id):
            continue
        n = min(common_prefix(other.tokens[:held.n_past], prompt), len(prompt) - 1)
        if n - session.n_past >= MIN_SHARED and (best is None or n > best[1]):
            best = (other, n)
    if best is not None:
        session.share_prefix(best[0].session, best[1])
