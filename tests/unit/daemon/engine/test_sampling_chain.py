"""The sampler chain in llama.cpp's default order: top-k, typical-p, top-p and min-p on
the model's own distribution, the temperature last. So a temperature changes how the
kept tokens are weighed, never which are kept, as on llama-server."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from meshd.daemon.engine.sampling import Sampler, SamplingParams, candidates

ROW = np.log(np.array([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02], dtype=np.float32))


def test_the_filters_read_the_models_distribution_and_the_temperature_comes_last() -> None:
    for temperature in (0.3, 1.0, 1.7):
        params = SamplingParams(temperature=temperature, top_k=0, top_p=0.75, min_p=0.0)
        idx, probs = candidates(ROW, params)
        assert list(idx) == [0, 1, 2]  # 0.40 + 0.25 + 0.15 reach 0.75
        weights = np.exp(ROW[[0, 1, 2]] / temperature)
        np.testing.assert_allclose(probs, weights / weights.sum(), rtol=1e-6)
    # min_p is relative to the most likely token of the model's own distribution
    idx, _ = candidates(ROW, SamplingParams(temperature=2.0, top_k=0, top_p=1.0, min_p=0.2))
    assert list(idx) == [0, 1, 2, 3]  # p >= 0.08, whatever the temperature
    # top_k keeps the k most likely; out-of-the-running tokens (-inf) are never kept
    masked = ROW.copy()
    masked[0] = -np.inf
    idx, _ = candidates(masked, SamplingParams(temperature=1.0, top_k=2, top_p=1.0))
    assert list(idx) == [1, 2]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(-8, 8), min_size=2, max_size=40), st.floats(0.1, 3.0),
       st.floats(0.05, 1.0), st.floats(0.0, 0.5), st.integers(0, 2**32))
def test_a_sampled_token_is_always_a_kept_one(logits: list[float], temperature: float,
                                              top_p: float, min_p: float, seed: int) -> None:
    row = np.array(logits, dtype=np.float32)
    params = SamplingParams(temperature=temperature, top_k=0, top_p=top_p, min_p=min_p,
                            seed=seed)
    kept, probs = candidates(row, params)
    assert np.isclose(probs.sum(), 1.0) and (probs > 0).all()
    same, _ = candidates(row, SamplingParams(temperature=1.0, top_k=0, top_p=top_p,
                                             min_p=min_p))
    assert list(kept) == list(same)
    assert Sampler(params).sample(row) in set(kept.tolist())
