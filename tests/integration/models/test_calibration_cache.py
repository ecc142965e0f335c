"""The runtime's calibrated cost curve: cached per model and machine, only when plausible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.daemon.models.cost_cache import (
    cost_cache_path,
    cost_model_key,
    read_cached_mtp,
    write_cached_costs,
)
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.native.context import ContextConfig
from meshd.native.default_model import default_model_path
from meshd.policy.costs import is_plausible
from meshd.testing import testmodels

pytestmark = pytest.mark.quiet_machine  # it measures the machine's idle CPUs



def test_runtime_caches_only_plausible_calibrations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured in-process (the run waits for it): kept when plausible and measured on
    a quiet machine; a measurement with company (another test, say) is used for the run
    and not kept."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = str(testmodels.test_model_path("llama"))
    with ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, draft_max=4)) as rt:
        assert rt.curve is not None and rt.curve.max_k == 4
        measured = rt.curve.forward_costs
        assert rt.calibration is not None and not rt.calibrating
        under_load = rt.calibration.plan.tainted
    files = list((tmp_path / "meshd" / "costs").glob("*.json"))
    if is_plausible(measured) and not under_load:
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
    skewed = [1.0, 1.01, 1.02, 1.03, 1.04]  # rows nearly free: plausible, and wrong
    assert is_plausible(skewed)
    cache = cost_cache_path(Path(path), ContextConfig(draft_max=4), None)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"costs": skewed, "threads": None,
                                 "model": cost_model_key(Path(path), ContextConfig(draft_max=4))}))
    notes: list[tuple[str, str]] = []
    with ModelRuntime(config, notes=lambda event, message: notes.append((event, message))) \
            as rt:
        assert rt.curve is not None and rt.calibration is not None
        plan = rt.calibration.plan
    if plan.tainted and not notes:
        # The check ran beside other busy processes (and again on each retry): it cannot
        # judge the cached curve, which is kept (the restart measured in production
        # beside a busy process threw a good curve away and measured for 551 s).
        assert rt.curve.forward_costs == pytest.approx(skewed)
        return
    assert rt.curve.forward_costs[1] > 1.1
    assert [event for event, _ in notes][:1] == ["recalibrating"]
    assert "disagrees" in notes[0][1]
    if is_plausible(rt.curve.forward_costs) and not plan.tainted:
        assert json.loads(cache.read_text())["costs"][1] == pytest.approx(rt.curve.forward_costs[1])


def test_the_heads_cached_costs_let_auto_follow_it_from_the_first_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The MTP head's costs are kept with the curve: a daemon that starts with them
    follows the head from its first request, where one without waits for its own
    measurement of the head (idle pieces: about a minute on a 1B model)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = Path(testmodels.test_model_path("qwen35", acceptance=0.9))
    config = RuntimeConfig(model_path=str(path), n_ctx_seq=256, draft_max=4)
    cache = cost_cache_path(path, ContextConfig(draft_max=4), None)
    key = cost_model_key(path, ContextConfig(draft_max=4))
    curve = [1.0, 1.1, 1.2, 1.3, 1.4]
    for mtp, auto in ((None, "composite"), ((0.05, 0.1), "mtp")):
        assert write_cached_costs(cache, curve, key, None, mtp) is None
        assert read_cached_mtp(cache) == mtp
        with ModelRuntime(config, calibrate_now=False) as rt:
            assert rt.calibrating
            assert rt.resolve_proposer("auto") == auto
