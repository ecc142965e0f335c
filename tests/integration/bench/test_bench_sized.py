"""`meshd bench` names the synthetic models of realistic cost."""

from __future__ import annotations

import pytest

from meshd.bench.arms import BenchError, default_draft, resolve_model
from meshd.testing import testmodels


def test_bad_sized_names_are_refused_before_building() -> None:
    for name in ("qwen35-0.5b-1.5", "qwen35-0.5b-0.5-0.7", "llama-1b-0.9"):
        with pytest.raises(BenchError):
            resolve_model(name)


@pytest.mark.slow
def test_sized_name_resolves_to_the_cached_model() -> None:
    spec = resolve_model("qwen35-0.5b-0.74")
    assert spec.path == testmodels.test_model_path("qwen35", acceptance=0.74, size="0.5b")
    assert spec.name == "qwen35-0.5b-0.74" and spec.synthetic
    assert "Q8_0" in spec.note
    assert default_draft(spec) is None  # the tiny llama's vocabulary does not match


def test_draft_mtp_arms_at_each_draft_length(tmp_path: object) -> None:
    from pathlib import Path

    from meshd.bench.llama_server import DRAFT_MTP_MODES, llama_server_arms

    binary = Path(str(tmp_path)) / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    names = [a.name for a in llama_server_arms(str(binary), DRAFT_MTP_MODES)]
    assert names == ["llama-server", *(f"llama-server-draft-mtp-{n}" for n in range(1, 5))]
