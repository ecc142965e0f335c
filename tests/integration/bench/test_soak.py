"""The soak in its small form: the daemon (a child process, on the hybrid synthetic
model with checkpointing draft models) under mixed load, cancels and garbage, judged for
protocol violations, outputs unequal to single-client runs, unexpected errors and leaks.
``meshd soak --minutes N`` runs it longer by hand."""

from __future__ import annotations

import anyio
import pytest

from meshd.bench.soak.load import SoakConfig
from meshd.bench.soak.run import run_soak


@pytest.mark.slow
def test_small_soak_finds_nothing() -> None:
    report = anyio.run(run_soak, SoakConfig(seconds=15, clients=6, sample_interval_s=1))
    print(report.format())
    assert not report.violations
    assert not report.mismatches
    assert not report.unexpected_errors
    assert not any(report.leaks.values()), report.leaks
    assert report.daemon_exit == 0
    assert report.ok
    # The run exercised what it is meant to (else passing would mean nothing).
    assert report.compared > 20
    assert report.checkpoints > 0 and report.restores > 0
    assert report.outcomes["cancelled"] > 0
    assert report.errors["bad_request"] > 0
    for action in ("generate", "cancel_op", "disconnect", "garbage", "tokenize", "stats"):
        assert report.actions[action] > 0, action
    assert report.fd_end == report.fd_baseline
