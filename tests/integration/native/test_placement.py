"""The layer split over workers: whole layers per device, the MTP blocks and the output
head on the last (local) device, the trunk by the devices' weights."""

from __future__ import annotations

import pytest

from meshd.native.placement import Placement, apportion, block_counts
from meshd.testing import testmodels


def test_apportion_gives_whole_units_by_weight() -> None:
    assert apportion(10, [1, 1]) == [5, 5]
    assert apportion(7, [1, 1]) == [4, 3]  # a tie goes to the earlier device
    assert apportion(10, [3, 1, 0]) == [8, 2, 0]
    assert apportion(0, [1, 2]) == [0, 0]
    for total in range(40):
        assert sum(apportion(total, [0.3, 0.5, 0.2])) == total
    with pytest.raises(ValueError, match="not all 0"):
        apportion(3, [0, 0])


def test_plan_keeps_the_mtp_blocks_and_the_output_on_the_last_device() -> None:
    # Two workers and this CPU (weight 0: it takes only the tail).
    p = Placement((1, 2, 3), (1.0, 1.0, 0.0), cpu_tail=True)
    # 24 blocks, the last of them an MTP block; llama.cpp counts the output as one more.
    plan = p.plan(24, 1, -1)
    assert plan.counts == (12, 11, 2) and plan.on_cpu == 0 and plan.tail == 2
    assert p.plan(24, 0, -1).counts == (12, 12, 1)
    # --tensor-split 3,1 weighs the trunk only.
    assert Placement((1, 2, 3), (3.0, 1.0, 0.0)).plan(24, 1, -1).counts == (17, 6, 2)
    # --gpu-layers 10: the first 15 units stay on this CPU, the tail still comes last.
    plan = p.plan(24, 1, 10)
    assert plan.counts == (4, 4, 2) and plan.on_cpu == 15
    # Fewer offloaded layers than the tail: all of them on the last device.
    assert p.plan(24, 1, 1).counts == (0, 0, 1)
    # A local GPU as the last device takes its trunk share and the tail.
    assert Placement((1, 2), (1.0, 1.0)).plan(24, 1, -1).counts == (12, 13)


def test_block_counts_are_read_from_the_file() -> None:
    qwen = testmodels.test_model_path("qwen35")
    n_blocks, n_nextn = block_counts(qwen)
    assert n_nextn == 1 and n_blocks > n_nextn
    assert block_counts(testmodels.test_model_path("llama"))[1] == 0
