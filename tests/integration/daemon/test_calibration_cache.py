"""The runtime's calibrated cost curve: cached per model and machine, only when plausible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.daemon.runtime import ModelRuntime, RuntimeConfig
from meshd.native.default_model import default_model_path
from meshd.policy.costs import is_plausible
from meshd.testing import testmodels


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


def test_a_cached_curve_that_disagrees_with_a_quick_check_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A curve cached while other work ran (plausible, but its first sizes far cheaper
    than they are) is not used for good: the start-up check of its first sizes
    disagrees, a note says so, and the curve is measured and cached again. (The default
    model: a tiny one's forwards are too short to time, and keep their curve.)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(default_model_path())
    config = RuntimeConfig(model_path=path, n_ctx_seq=256, draft_max=4)
    with ModelRuntime(config):
        pass
    (cache,) = (tmp_path / "meshd" / "costs").glob("*.json")
    data = json.loads(cache.read_text())
    skewed = [1.0, 1.01, 1.02, 1.03, 1.04]  # rows nearly free: plausible, and wrong
    assert is_plausible(skewed)
    cache.write_text(json.dumps({**data, "costs": skewed}))
    notes: list[tuple[str, str]] = []
    with ModelRuntime(config, notes=lambda event, message: notes.append((event, message))) \
            as rt:
        assert rt.curve is not None
        assert rt.curve.forward_costs[1] > 1.1
    assert [event for event, _ in notes] == ["recalibrating"]
    assert "disagrees" in notes[0][1]
    if is_plausible(rt.curve.forward_costs):
        assert json.loads(cache.read_text())["costs"][1] == pytest.approx(rt.curve.forward_costs[1])
