"""A request's sampling as the front ends see it: the engine's parameters (the record
llama-server's ``generation_settings`` reports field by field) and the probabilities
after the sampler chain (its ``post_sampling_probs``).

Why here: running the chain is the engine's; a front end asks for the numbers and
formats them, so it never imports the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshd.daemon.engine.logprobs import TokenLogprob
from meshd.daemon.engine.sampling import Sampler, SamplingParams, candidates

__all__ = ["PostSampling", "SamplingParams"]


class PostSampling:
    """Probabilities under one request's sampler chain (bias and penalties, then
    llama.cpp's order: top-k, typical, top-p, min-p, temperature), run over the most
    likely tokens the engine reported: exact whenever top-k keeps no more tokens than
    were reported."""

    def __init__(self, sampling: SamplingParams) -> None:
        self._sampler = Sampler(sampling)

    def probs(self, lp: TokenLogprob, history: Sequence[int], n_vocab: int, n_probs: int
              ) -> tuple[float, list[tuple[int, float]]]:
        """The chosen token's probability under the chain, and the ``n_probs`` most
        likely tokens after it (none with probability 0); ``history``: the tokens before
        it (prompt included). Greedy decoding keeps one token."""
        sampler = self._sampler
        if sampler.params.greedy:
            return 1.0, [(lp.token, 1.0)][:n_probs]
        row = np.full(n_vocab, -np.inf, dtype=np.float32)
        for token, value in lp.top:
            row[token] = value
        row[lp.token] = lp.logprob
        row = sampler.adjusted(row, history)
        if not np.isfinite(row).any():
            return 1.0, [(lp.token, 1.0)][:n_probs]
        idx, probs = candidates(row, sampler.params)
        where = np.flatnonzero(idx == lp.token)
        if where.size:
            chosen = float(probs[where[0]])
        else:  # (cut from the reported tokens only: its share of them before the filters)
            finite = row[np.isfinite(row)].astype(np.float64) / sampler.params.temperature
            chosen = float(np.exp(row[lp.token] / sampler.params.temperature
                                  - np.logaddexp.reduce(finite)))
        top = [(int(t), float(p)) for t, p in zip(idx[:n_probs], probs[:n_probs], strict=True)
               if p > 0.0]
        return max(chosen, np.finfo(np.float64).tiny), top
