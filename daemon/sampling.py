"""Token sampling: greedy, and seeded sampling that speculation can verify exactly.

Why one random draw per committed token, always: speculative decoding with sampling is
verified by *sample-and-match* - each verify row is sampled with the request's RNG exactly
as plain decoding would sample that position, and drafts are accepted while equal. That
gives the same stream as plain decoding with the same seed only if the RNG advances by
exactly one draw per committed token and never for rows that are not committed. So rows
are sampled lazily, in order, and sampling stops at the first mismatch.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

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

    def __attrs_post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def exact_verifiable(self) -> bool:
        """Speculation can reproduce plain decoding exactly: greedy, or seeded sampling."""
        return self.greedy or self.seed is not None


GREEDY = SamplingParams(temperature=0.0)

#: Seeds the daemon chooses are below this (the wire allows 0 <= seed <= 2**64 - 1).
CHOSEN_SEED_BITS = 63


def with_chosen_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a seed: unseeded sampling gets one chosen at random here.

    Why: a sampled request without a seed cannot be verified exactly (the stream from an
    unknown seed cannot be replayed row by row), so it would run without speculation. A
    stream drawn from a freshly chosen seed is still a valid sample, and sample-and-match
    verification reproduces it exactly; reporting the seed lets the request be replayed.
    Greedy and already-seeded parameters are returned unchanged.
    """
    if params.greedy or params.seed is not None:
        return params
    return attrs.evolve(params, seed=secrets.randbits(CHOSEN_SEED_BITS))


class Sampler:
    """Chooses tokens from logits rows; owns the request's RNG."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        seed = params.seed if params.seed is not None else np.random.SeedSequence().entropy
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self.draws = 0

    def sample(self, logits: FloatArray) -> int:
        """One token from one logits row (one RNG draw unless greedy)."""
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        x = np.asarray(logits, dtype=np.float64) / p.temperature
        if p.top_k and p.top_k < x.shape[0]:
            idx = np.argpartition(-x, p.top_k - 1)[: p.top_k]
        else:
            idx = np.arange(x.shape[0])
        # Sort candidates by logit (ties by id) so the CDF order is deterministic.
        order = np.lexsort((idx, -x[idx]))
        idx = idx[order]
        z = x[idx] - x[idx[0]]
        probs = np.exp(z)
        probs /= probs.sum()
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            idx, probs = idx[:cut], probs[:cut] / probs[:cut].sum()
        u = self._rng.random()
        self.draws += 1
        pos = int(np.searchsorted(np.cumsum(probs), u, side="right"))
        return int(idx[min(pos, len(idx) - 1)])

    def match_rows(self, rows: FloatArray, draft: Sequence[int]) -> list[int]:
        """Target predictions for a verify window, sampled in order, stopping at a mismatch.

        Greedy: all rows (argmax is free of side effects). Sampling: rows up to and
        including the first row whose sample differs from the draft.
        """
        if self.params.greedy:
            return [int(t) for t in np.asarray(rows).argmax(axis=1)]
        out: list[int] = []
        for i in range(rows.shape[0]):
            tok = self.sample(rows[i])
            out.append(tok)
            if i >= len(draft) or tok != draft[i]:
                break
        return out
