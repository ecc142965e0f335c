"""The verify-cost model follows what forwards actually cost, and rejects noisy curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.daemon.costs import MIN_SAMPLES, REBUILD_EVERY, CostModel, is_plausible
from meshd.daemon.runtime import ModelRuntime, RuntimeConfig
from meshd.native import testmodels

Q4_1 = [1.0, 1.75, 2.32, 3.40, 3.9, 4.3, 4.7, 5.0, 5.4]


def test_plausibility() -> None:
    assert is_plausible(Q4_1)
    # Curves measured here while other jobs hogged both cores:
    assert not is_plausible([1.0, 0.898, 0.545, 1.228, 2.879, 3.259, 2.146, 2.125, 3.484])
    assert not is_plausible([1.0, 1.50, 1.55, 0.998, 1.79, 3.34, 3.49, 1.68, 3.88])
    assert not is_plausible([1.0])
    assert not is_plausible([1.0, 1.8, 2.2, 2.5, 3.1, 3.6, 4.1, 4.4, 18.3])


def test_online_samples_replace_the_calibration() -> None:
    model = CostModel(Q4_1)
    assert model.curve().costs == pytest.approx(Q4_1)
    # The machine turns out to verify 2 rows almost as cheaply as 1 (e.g. a GPU).
    for _ in range(max(MIN_SAMPLES, REBUILD_EVERY)):
        model.record(1, 0.010)
        model.record(2, 0.011)
        model.record(99, 5.0)  # beyond the curve: ignored
    curve = model.curve()
    assert curve.cost(1) == pytest.approx(1.1)
    assert curve.cost(2) == pytest.approx(2.32)  # no samples: the calibrated ratio
    assert curve.cost(0) == 1.0


def test_runtime_caches_only_plausible_calibrations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(testmodels.test_model_path("llama"))
    with ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, draft_max=4)) as rt:
        assert rt.curve is not None and rt.curve.max_k == 4
        measured = rt.curve.costs
    files = list((tmp_path / "meshd" / "costs").glob("*.json"))
    if is_plausible(measured):
        assert len(files) == 1
        assert json.loads(files[0].read_text())["costs"][0] == pytest.approx(1.0)
    else:
        assert files == []
