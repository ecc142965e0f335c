"""The runtime's calibrated cost curve: cached per model and machine, only when plausible."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshd.daemon.runtime import ModelRuntime, RuntimeConfig
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
