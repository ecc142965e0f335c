"""Token sampling: greedy, and seeded sampling that speculation can verify exactly.

Why one random draw per committed token, always: speculative decoding with sampling is
verified by *sample-and-match* - each verify row is sampled with the request's RNG exactly
as plain decoding would sample that position, and drafts are accepted while equal. That
gives the same stream as plain decoding with the same seed only if the RNG advances by
exactly one draw per committed token and never for rows that are not committed. So rows
are sampled lazily, in order, and sampling stops at the first mismatch.

What adjusts the logits first (``logit_bias``, and the penalties on tokens already in the
text, as llama.cpp applies them) depends on the tokens before a row; a verify row's are
the committed ones and the drafts before it, so a row is judged exactly as plain
decoding would judge that position if the drafts before it are accepted. The same holds
for ``min_tokens``: whether a row may end the text depends only on its position in the
output, which a verify row knows as plain decoding does.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from typing import Final, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from meshd.protocol import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P

FloatArray = npt.NDArray[np.float32]


@attrs.frozen
class SamplingParams:
    """How to choose each token. ``temperature == 0`` is greedy (argmax)."""

    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    seed: int | None = None
    min_p: float = 0.0
    typical_p: float = 1.0
    #: llama.cpp's penalties over the last ``repeat_last_n`` tokens (prompt included):
    #: a repeated token's logit divided (positive) or multiplied (negative) by
    #: ``repeat_penalty``, less ``frequency_penalty`` per occurrence and
    #: ``presence_penalty`` once.
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: Added to the logit of each token id before anything else.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: vLLM's ``min_tokens``: the end-of-generation tokens are held back until this many
    #: tokens are out (a constraint that allows nothing else still ends the answer).
    min_tokens: int = 0

    def __attrs_post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if not 0.0 < self.typical_p <= 1.0:
            raise ValueError("typical_p must be in (0, 1]")
        if self.repeat_penalty <= 0 or self.repeat_last_n < 0:
            raise ValueError("repeat_penalty must be > 0 and repeat_last_n >= 0")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")

    @property
    def adjusts(self) -> bool:
        """Whether logits change with the tokens before them (bias or a penalty)."""
        return bool(self.logit_bias) or (self.repeat_last_n > 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def exact_verifiable(self) -> bool:
        """Speculation can reproduce plain decoding exactly: greedy, or seeded sampling."""
        return self.greedy or self.seed is not None


GREEDY = SamplingParams(temperature=0.0)


class RowConstraint(Protocol):
    """What restricts each row's choice (an output grammar: ``GrammarState``)."""

    def choose(self, row: FloatArray, sampler: Sampler) -> int: ...

    def advance(self, token: int) -> None: ...

    def allowed(self) -> npt.NDArray[np.bool_]: ...

#: Seeds the daemon chooses are below this (the wire allows 0 <= seed <= 2**64 - 1).
CHOSEN_SEED_BITS = 63


def with_chosen_seed(params: SamplingParams, default: int | None = None) -> SamplingParams:
    """``params`` with a seed: unseeded sampling gets ``default`` (the daemon's
    ``--seed``, as llama-server's: equal requests then give equal answers), else one
    chosen at random here.

    Why: a sampled request without a seed cannot be verified exactly (the stream from an
    unknown seed cannot be replayed row by row), so it would run without speculation. A
    stream drawn from a freshly chosen seed is still a valid sample, and sample-and-match
    verification reproduces it exactly; reporting the seed lets the request be replayed.
    Greedy and already-seeded parameters are returned unchanged.
    """
    if params.greedy or params.seed is not None:
        return params
    return attrs.evolve(params, seed=secrets.randbits(CHOSEN_SEED_BITS)
                        if default is None else default)


#: The logit of a token held back (``min_tokens``): below any real logit, yet finite, so
#: a row whose constraint allows only that token (a finished JSON document) still
#: chooses it rather than nothing.
_HELD_BACK: Final = np.float32(np.finfo(np.float32).min)


class Sampler:
    """Chooses tokens from logits rows; owns the request's RNG.

    ``n_prompt`` and ``eog`` (the prompt's length, the end-of-generation tokens) place
    each row in the output, for ``min_tokens``: a row of history ``h`` is output token
    ``len(h) - n_prompt``."""

    def __init__(self, params: SamplingParams, *, n_prompt: int = 0,
                 eog: Iterable[int] = ()) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.draws = 0
        self._n_prompt = n_prompt
        self._eog = np.fromiter(sorted(eog), dtype=np.int64)

    def _holds_end(self, history: Sequence[int], i: int) -> bool:
        """Whether verify row ``i`` after ``history`` comes before ``min_tokens``."""
        return (len(history) - self._n_prompt + i < self.params.min_tokens
                and self._eog.shape[0] > 0)

    def _held_back(self, row: FloatArray) -> FloatArray:
        """``row`` with the end-of-generation tokens as unlikely as a logit can be."""
        x = np.array(row, dtype=np.float32)
        eog = self._eog[self._eog < x.shape[0]]
        x[eog] = _HELD_BACK
        return x

    def adjusted(self, logits: FloatArray, history: Sequence[int]) -> FloatArray:
        """``logits`` with the bias and the penalties for a row after ``history``."""
        p = self.params
        if not p.adjusts:
            return logits
        x = np.array(logits, dtype=np.float32)
        for token, bias in p.logit_bias:
            if 0 <= token < x.shape[0]:
                x[token] += bias
        recent = history[-p.repeat_last_n:] if p.repeat_last_n else ()
        if recent and (p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty):
            ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
            keep = ids < x.shape[0]
            ids, counts = ids[keep], counts[keep]
            vals = x[ids]
            vals = np.where(vals <= 0, vals * p.repeat_penalty, vals / p.repeat_penalty)
            x[ids] = vals - counts * p.frequency_penalty - p.presence_penalty
        return x

    def row_history(self, history: Sequence[int], draft: Sequence[int], i: int
                    ) -> Sequence[int]:
        """What the penalties of verify row ``i`` look back on: the last
        ``repeat_last_n`` of ``history`` and ``draft[:i]``."""
        n = self.params.repeat_last_n
        if n == 0:
            return ()
        return [*history[-n:], *draft[:i]][-n:]

    def sample(self, logits: FloatArray) -> int:
        """One token from one logits row (one RNG draw unless greedy)."""
        if self.params.greedy:
            return int(np.argmax(logits))
        idx, probs = candidates(logits, self.params)
        u = self._rng.random()
        self.draws += 1
        pos = int(np.searchsorted(np.cumsum(probs), u, side="right"))
        return int(idx[min(pos, len(idx) - 1)])

    def match_rows(self, rows: FloatArray, draft: Sequence[int],
                   history: Sequence[int] = (), constraint: RowConstraint | None = None,
                   masks: list[npt.NDArray[np.bool_]] | None = None) -> list[int]:
        """Target predictions for a verify window, sampled in order, stopping at a mismatch.

        Greedy without bias, penalties or constraint: all rows (argmax is free of side
        effects). Otherwise rows up to and including the first whose choice differs from
        the draft; row ``i`` comes after ``history`` (prompt and committed tokens) and
        ``draft[:i]``: the ``constraint`` chooses under its state after them (it consumes
        each matched draft; the engine then settles it on the commits), and ``masks``
        (for log-probabilities) gets each row's mask.
        """
        if (self.params.greedy and not self.params.adjusts and constraint is None
                and not self._holds_end(history, 0)):
            return [int(t) for t in np.asarray(rows).argmax(axis=1)]
        out: list[int] = []
        for i in range(rows.shape[0]):
            row = rows[i]
            if self.params.adjusts:
                row = self.adjusted(row, self.row_history(history, draft, i))
            if self._holds_end(history, i):
                row = self._held_back(row)
            if constraint is None:
                tok = self.sample(row)
            else:
                if masks is not None:
                    masks.append(constraint.allowed())
                tok = constraint.choose(row, self)
            out.append(tok)
            if i >= len(draft) or tok != draft[i]:
                break
            if constraint is not None:
                constraint.advance(tok)
        return out


def candidates(row: FloatArray, params: SamplingParams
               ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """The tokens a sampled row draws from (``-inf``: out of the running) and their
    probabilities, most likely first, by llama.cpp's default chain: top-k, typical-p,
    top-p and min-p on the model's own distribution, then the temperature over what is
    left (so a temperature changes how the kept tokens are weighed, never which)."""
    x = np.asarray(row, dtype=np.float64)
    idx = np.flatnonzero(np.isfinite(x))
    if params.top_k and params.top_k < idx.shape[0]:
        idx = idx[np.argpartition(-x[idx], params.top_k - 1)[: params.top_k]]
    # Sorted by logit (ties by id), so the CDF order is deterministic.
    idx = idx[np.lexsort((idx, -x[idx]))]
    probs = _softmax(x[idx])
    if params.typical_p < 1.0:
        idx, probs = _typical(idx, probs, params.typical_p)
    if params.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        idx, probs = idx[:cut], probs[:cut]
    if params.min_p > 0.0:
        keep = probs >= params.min_p * probs[0]  # sorted: the first is the most likely
        idx = idx[keep]
    return idx, _softmax(x[idx] / params.temperature)


def _softmax(z: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    e = np.exp(z - z.max())
    out: npt.NDArray[np.float64] = e / e.sum()
    return out


def _typical(idx: npt.NDArray[np.int64], probs: npt.NDArray[np.float64], mass: float
             ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Locally typical sampling (llama.cpp's ``typical_p``): keep the tokens whose
    surprise is closest to the distribution's entropy, up to ``mass`` of probability."""
    logp = np.log(np.maximum(probs, 1e-300))
    entropy = -float(np.sum(probs * logp))
    order = np.argsort(np.abs(-logp - entropy), kind="stable")
    cut = int(np.searchsorted(np.cumsum(probs[order]), mass) + 1)
    chosen = np.sort(order[:cut])  # back in likelihood order
    return idx[chosen], probs[chosen] / probs[chosen].sum()

