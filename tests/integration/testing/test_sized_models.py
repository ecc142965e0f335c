"""Sized synthetic MTP models: the rule survives llama.cpp's quantizer at real cost.

Slow (a 0.5B model is written, quantized to Q8_0 and run): marked ``slow``. The model is
cached like every synthetic model, so later runs only load it.
"""

from __future__ import annotations

import pytest

from meshd.testing import testmodels as tm
from meshd.testing.testcheck import check_rule, measure_head_cost

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen35_half() -> str:
    return str(tm.test_model_path("qwen35", acceptance=0.74, size="0.5b", qtype="q8_0"))


def test_quantized_model_follows_the_rule_at_its_size(qwen35_half: str) -> None:
    report = check_rule(qwen35_half, n_tokens=200, threads=2)
    print(report.describe())
    assert report.follows_rule, report.describe()
    assert report.checked == 200
    assert report.min_margin > 4.0  # designed ~6.5+; quantization must not eat it
    assert report.n_embd == 1024 and report.n_vocab >= 32768
    assert 0.45e9 <= report.n_params <= 0.55e9


def test_head_cost_is_measured(qwen35_half: str) -> None:
    costs = measure_head_cost(qwen35_half, threads=2)
    assert costs is not None
    print(f"qwen35-0.5b Q8_0: MTP catch-up {costs.overhead:.1%} of a target forward, "
          f"one draft {costs.draft_cost:.2f} target decodes")
    assert costs.overhead > 0 and costs.draft_cost > 0


def test_size_and_type_arguments_are_checked(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="needs a size"):
        tm.test_model_path("qwen35", qtype="q8_0")
    with pytest.raises(ValueError, match="unknown size"):
        tm.test_model_path("qwen35", size="70b")
    with pytest.raises(ValueError, match="unknown type"):
        tm.test_model_path("qwen35", size="0.5b", qtype="q2_k")
