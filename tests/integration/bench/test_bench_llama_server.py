"""``meshd bench --llama-server``: the arms that run llama.cpp's server on loopback.

The binary is a stand-in (``fake_llama_server.py``) that answers with the synthetic
models' exact greedy rule, so these tests check what the arms do with a server: the
command line they start it with, the numbers they take from its ``timings``, identity
against ``plain``, the targets, a server that fails to start, and that no process is
left behind.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from meshd.bench.arms import BenchModel, resolve_model
from meshd.bench.format import format_report
from meshd.bench.llama_server import LlamaServerRunner, llama_server_arms
from meshd.bench.run import BenchConfig, run_bench
from meshd.bench.targets import evaluate_targets
from meshd.bench.workloads import BenchError
from meshd.daemon.commands.cli import main
from meshd.testing import testmodels
from tests.integration.helpers import FAKE_LLAMA_SERVER


def _quiet(_line: str) -> None:
    pass


@pytest.fixture
def fake_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = FAKE_LLAMA_SERVER
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_LLAMA_SERVER_ARGV", str(tmp_path / "argv.jsonl"))
    return exe


def _argvs(fake: Path) -> list[list[str]]:
    lines = (fake.parent / "argv.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _config(fake: Path, arms: tuple[str, ...]) -> BenchConfig:
    return BenchConfig(models=("llama",), workloads=("story",), reps=2, max_tokens=12,
                             warmup=False, cost_reps=1, arms=arms, llama_server=str(fake),
                             llama_server_modes=("ngram-mod",))


def test_server_arms_run_side_by_side_with_meshd(fake_server: Path) -> None:
    report = run_bench(
        _config(fake_server, ("meshd-off", "llama-server", "llama-server-ngram-mod",
                              "llama-server-draft-mtp")), log=_quiet)
    assert "version: 9999 (fake)" in report["llama_server"]
    (model,) = report["models"]
    assert "no MTP head" in model["unavailable"]["llama-server-draft-mtp"]
    (wl,) = model["workloads"]
    plain_srv, ngram_srv = wl["arms"]["llama-server"], wl["arms"]["llama-server-ngram-mod"]
    for arm in (plain_srv, ngram_srv):
        assert arm["error"] is None and len(arm["runs"]) == 2
        assert arm["identical"] is True  # the fake follows the model's greedy rule
        assert all(r["tokens"] == 12 for r in arm["runs"])
        # Decode rate from the server's own timings: 11 tokens after the first one over
        # predicted_ms (the fake sleeps 1 ms a token, so it is at most ~1000 tok/s).
        assert all(0 < r["decode_tok_s"] < 1100 for r in arm["runs"])
    assert plain_srv["speculation"] is False and plain_srv.get("acceptance") is None
    assert ngram_srv["acceptance"] == pytest.approx(0.5)
    assert ngram_srv["forwards_per_token"] == pytest.approx((11 - 6) / 12)

    # Every server got the settings the other arms use, and its own speculation type;
    # ngram-mod keeps its table across requests, so it was restarted for its 2nd run.
    argvs = _argvs(fake_server)
    assert len(argvs) == 3
    for argv in argvs:
        flags = dict(itertools.pairwise(argv))  # each flag -> the word after it
        assert flags["--threads"] == str(report["machine"]["threads"])
        assert flags["--ctx-size"] == str(model["n_ctx"])
        assert flags["--flash-attn"] == "on" and flags["--host"] == "127.0.0.1"
        assert flags["--model"] == model["path"]
    assert sorted(a[a.index("--spec-type") + 1] for a in argvs if "--spec-type" in a) == [
        "ngram-mod", "ngram-mod"]

    targets = {t["target"]: t for t in report["targets"]}
    off_vs = targets["meshd-off >= 0.95x llama-server"]
    assert off_vs["value"] == pytest.approx(
        wl["arms"]["meshd-off"]["median_decode_tok_s"] / plain_srv["median_decode_tok_s"])
    best = targets["meshd best >= llama-server best n-gram"]
    assert best["arm"] == "meshd-off" and "llama-server-ngram-mod" in best["detail"]
    table = format_report(report)
    assert "llama-server-ngram-mod" in table and "meshd-off >= 0.95x llama-server" in table


def test_a_server_that_fails_to_start_is_reported(fake_server: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_LLAMA_SERVER_FAIL", "1")
    report = run_bench(_config(fake_server, ("llama-server",)), log=_quiet)
    (model,) = report["models"]
    why = model["unavailable"]["llama-server"]
    assert "exited with status 1" in why and "fake failure" in why
    assert "llama-server" not in model["workloads"][0]["arms"]


def test_runner_stops_its_server(fake_server: Path) -> None:
    bm = BenchModel(resolve_model("llama", threads=1), n_ctx=256, threads=1, draft_max=0)
    try:
        runner = LlamaServerRunner(str(fake_server), bm, "ngram-simple")
        try:
            prompt = [testmodels.BOS_ID, 10, 11, 12]
            r = runner.run(prompt, 5)
            assert list(r.tokens) == testmodels.reference_continuation(prompt, 5)
            assert r.drafts == (5, 2) and r.cpu_s is not None
        finally:
            runner.close()
        assert runner.proc.poll() is not None
    finally:
        bm.close()


def test_a_missing_binary_is_a_usage_error(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert main(["bench", "--model", "llama", "--llama-server", str(missing)]) == 2
    assert "not an executable file" in capsys.readouterr().err
    with pytest.raises(BenchError):
        llama_server_arms(os.devnull)


def test_modes_are_checked_and_named_once(fake_server: Path) -> None:
    names = [a.name for a in llama_server_arms(str(fake_server), ("ngram-mod", "draft-mtp"))]
    assert names == ["llama-server", "llama-server-ngram-mod", "llama-server-draft-mtp"]
    with pytest.raises(BenchError, match="unknown llama-server mode"):
        llama_server_arms(str(fake_server), ("ngram-fancy",))


def test_arm_without_a_server_arm_keeps_the_server_arms(fake_server: Path) -> None:
    report = run_bench(_config(fake_server, ("meshd-off",)), log=_quiet)
    arms = report["config"]["arms"]
    assert "meshd-off" in arms and "meshd-auto" not in arms
    assert {"llama-server", "llama-server-ngram-mod"} <= set(arms)
    (wl,) = report["models"][0]["workloads"]
    assert wl["arms"]["llama-server-ngram-mod"]["error"] is None


def test_copy_workloads_hold_meshd_auto_to_1_1x_the_best_ngram_mode() -> None:
    """On a workload that copies its prompt the bar is meshd-auto at 1.1x llama-server's
    best n-gram mode (another meshd arm being faster does not count); elsewhere
    meshd's best arm at 1.0x."""
    def arm(rate: float) -> dict[str, object]:
        return {"median_decode_tok_s": rate, "decode_ratio_vs_plain": rate / 100.0,
                "error": None}

    arms = {"plain": arm(100.0), "meshd-auto": arm(120.0), "meshd-ngram": arm(150.0),
            "llama-server": arm(100.0), "llama-server-ngram-simple": arm(105.0),
            "llama-server-ngram-mod": arm(112.0)}
    models = [{"name": "m", "workloads": [
        {"name": "copy", "copies": True, "arms": arms},
        {"name": "prose", "copies": False, "arms": arms}]}]
    got = {(t["workload"], t["target"]): t for t in evaluate_targets(models)}
    copy = got["copy", "meshd-auto >= 1.1x llama-server best n-gram"]
    assert copy["value"] == pytest.approx(120 / 112) and copy["status"] == "MISS"
    assert "llama-server-ngram-mod" in copy["detail"]
    assert ("copy", "meshd best >= llama-server best n-gram") not in got
    prose = got["prose", "meshd best >= llama-server best n-gram"]
    assert prose["arm"] == "meshd-ngram" and prose["status"] == "PASS"
    assert got["prose", "meshd-auto >= 0.98x plain"]["status"] == "PASS"
    arms["meshd-auto"] = arm(125.0)
    again = {(t["workload"], t["target"]): t for t in evaluate_targets(models)}
    assert again["copy", "meshd-auto >= 1.1x llama-server best n-gram"]["status"] == "PASS"
    assert "texts differ" not in again["copy", "meshd-auto >= 1.1x llama-server best n-gram"][
        "detail"]
    # A ratio between different texts says so, and where each left plain decoding's.
    arms["meshd-auto"] = {**arm(125.0), "first_divergence": 27}
    arms["llama-server-ngram-mod"] = {**arm(112.0), "first_divergence": 90}
    parted = {(t["workload"], t["target"]): t for t in evaluate_targets(models)}
    detail = parted["copy", "meshd-auto >= 1.1x llama-server best n-gram"]["detail"]
    assert "texts differ from plain's: meshd-auto @27, llama-server-ngram-mod @90" in detail
