"""``meshd bench``: the identity gate, the report's structure, divergence reporting.

No timing assertions anywhere: the machine is shared and noisy. These tests check that the
benchmark runs every arm, computes what it says it computes (ratios of medians, identity
against ``plain``) and reports a divergence where one happened.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from meshd.bench import identity as bench_identity
from meshd.bench.arms import (
    ARMS,
    REFERENCE_ARM,
    ArmRunner,
    ArmSpec,
    BenchModel,
    MeshdRunner,
    RunResult,
    first_divergence,
)
from meshd.bench.format import format_report
from meshd.bench.plot import write_plot
from meshd.bench.run import FORMAT, BenchConfig, plain_baseline, run_bench
from meshd.bench.summary import (
    conditional_acceptance,
    fit_curve_to_run,
    summarize_arm,
)
from meshd.bench.targets import evaluate_targets
from meshd.bench.workloads import load_workloads
from meshd.daemon.commands.cli import main
from meshd.native import context as native_context
from meshd.native.calibrate import measure_row_costs
from meshd.native.context import DEFAULT_DRAFT_MAX, ContextConfig, TargetContext
from meshd.native.model import Model
from meshd.policy.costs import CostCurve, speedup_limit
from meshd.testing import testmodels

SYNTHETIC = ("llama", "qwen35", "mimo2")


def _quiet(_line: str) -> None:
    pass


# --------------------------------------------------------------------------- pure parts


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # a prefix diverges where it ends
    assert first_divergence([], []) is None


def test_conditional_acceptance() -> None:
    # 10 windows drafted position 0, 8 accepted it; 8 drafted position 1, 4 accepted both.
    cond = conditional_acceptance([8, 4], [10, 8])
    assert cond[0] == pytest.approx(0.8)
    assert cond[1] == pytest.approx((4 / 8) / 0.8)
    assert conditional_acceptance([0, 0], [0, 0]) == []


def test_workloads_are_package_data() -> None:
    names = {w.name for w in load_workloads()}
    assert {"code-edit", "summarise", "json-reformat", "story", "chat-long-system"} <= names
    assert all(w.messages and w.messages[-1][0] == "user" for w in load_workloads())


# --------------------------------------------------------------------------- identity gate


def test_identity_gate_on_synthetic_models(tmp_path: Path) -> None:
    out = tmp_path / "identity.json"
    args = ["bench", "--identity", "--prompts", "1", "--tokens", "24", "--json", str(out)]
    for kind in SYNTHETIC:
        args += ["--model", kind]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["synthetic_divergences"] == 0
    by_name = {m["name"].split("-")[0]: m for m in report["models"]}
    assert set(by_name) == set(SYNTHETIC)
    for kind, m in by_name.items():
        assert m["synthetic"] is True
        assert m["runs"] > 0 and m["identical"] == m["runs"], kind
        assert m["identity_rate"] == 1.0
        assert m["verify_windows"] > 0, f"{kind}: nothing was speculated, the gate is void"
    # Models with an MTP head run the mtp proposer too.
    assert any(case.startswith("mtp ") for case in by_name["qwen35"]["cases"])
    assert not any(case.startswith("mtp ") for case in by_name["llama"]["cases"])


@pytest.fixture
def diverge_at_3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run of the identity gate "diverges" at token 3 (a fault the real runtime
    does not make: the gate's own verdict is under test)."""
    real = bench_identity.first_divergence

    def fake(ref: Sequence[int], got: Sequence[int]) -> int | None:
        d = real(ref, got)
        return 3 if d is None else d

    monkeypatch.setattr(bench_identity, "first_divergence", fake)


@pytest.mark.usefixtures("diverge_at_3")
def test_identity_gate_fails_on_a_synthetic_divergence(
    capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["bench", "--identity", "--model", "llama", "--prompts", "1", "--tokens", "8",
                 "--k", "2"])
    assert code == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "at token 3" in out and "margin" in out


@pytest.mark.slow
def test_identity_gate_on_smollm2_gates_with_the_default_cache(tmp_path: Path) -> None:
    """With the default K cache every forward rounds a row alike, so the real model is
    gated like the synthetic ones: every run identical."""
    out = tmp_path / "identity.json"
    assert main(["bench", "--identity", "--model", "smollm2", "--prompts", "1",
                 "--tokens", "12", "--k", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    m = report["models"][0]
    assert m["synthetic"] is False and m["gated"] is True and m["cache_type_k"] == "f16"
    assert m["runs"] > 0 and m["identical"] == m["runs"]
    assert report["gated_divergences"] == 0


@pytest.mark.usefixtures("diverge_at_3")
def test_identity_gate_only_reports_smollm2_divergences_without_a_pinned_kernel(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the attention kernel is not pinned (a runtime without meshd's patch, with an
    f16 cache) a quantized near-tie may flip: reported, not failed."""
    # The divergences are injected (diverge_at_3): what is checked is the verdict and the
    # report, so shorter chat messages (a shorter prompt to prefill per run) will do.
    monkeypatch.setattr(bench_identity, "CHAT_MESSAGE_CHARS", 60)
    monkeypatch.setattr(native_context, "attn_kernel_pinnable", lambda: False)
    out = tmp_path / "identity.json"
    assert main(["bench", "--identity", "--model", "smollm2", "--prompts", "1", "--tokens",
                 "6", "--k", "2", "--cache-type-k", "f16", "--json", str(out)]) == 0
    m = json.loads(out.read_text())["models"][0]
    assert m["gated"] is False and m["cache_type_k"] == "f16"
    assert m["divergences"] and all("margin" in d["margin"] for d in m["divergences"])
    assert "kernel not pinned: divergences reported" in capsys.readouterr().out


# --------------------------------------------------------------------------- timing bench


def _tiny_config(**overrides: Any) -> BenchConfig:
    base: dict[str, Any] = dict(models=("qwen35-0.74",), workloads=("story",), reps=2,
                                max_tokens=12, warmup=False, cost_reps=1)
    base.update(overrides)
    return BenchConfig(**base)


def test_tiny_bench_report_structure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "--model", "qwen35-0.74", "--workload", "story", "--reps", "2",
                 "--tokens", "12", "--no-warmup", "--cost-reps", "1", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["format"] == FORMAT
    (model,) = report["models"]
    assert model["has_mtp"] and model["recurrent"]
    assert len(model["cost_curve"]) == DEFAULT_DRAFT_MAX + 1 and model["cost_curve"][0] == 1.0
    assert model["limit"]["speedup"] >= 1.0
    # Priced against a decode without the in-place rollback's snapshots.
    assert model["snapshot_cost"] is not None and model["snapshot_cost"] > 0
    assert model["unavailable"] == {}
    (wl,) = model["workloads"]
    assert set(wl["arms"]) == {a.name for a in ARMS}
    # The workload's own curve, measured at the mean context of its decode steps.
    assert wl["cost_context"] == min(wl["prompt_tokens"] + 12 // 2,
                                     model["n_ctx"] - DEFAULT_DRAFT_MAX - 2)
    assert len(wl["cost_curve"]) == DEFAULT_DRAFT_MAX + 1 and wl["cost_curve"][0] == 1.0
    ceiling = speedup_limit(CostCurve.sanitized(wl["cost_curve"]))[1]
    ref = wl["arms"][REFERENCE_ARM]
    ref_tok = statistics.median(r["tok_s"] for r in ref["runs"])
    ref_dec = statistics.median(r["decode_tok_s"] for r in ref["runs"])
    for name, arm in wl["arms"].items():
        if arm["error"] is not None:
            # Llama's prompt-lookup path cannot roll back a recurrent state: reported, not
            # fatal, and never counted as identical.
            assert name == "anchor-pld" and arm["identical"] is False
            continue
        assert len(arm["runs"]) == 2, name
        tok = statistics.median(r["tok_s"] for r in arm["runs"])
        dec = statistics.median(r["decode_tok_s"] for r in arm["runs"])
        assert arm["median_tok_s"] == pytest.approx(tok)
        assert arm["ratio_vs_plain"] == pytest.approx(tok / ref_tok)
        assert arm["decode_ratio_vs_plain"] == pytest.approx(dec / ref_dec)
        assert isinstance(arm["identical"], bool)
        assert all(r["identical"] is not None for r in arm["runs"])
        if name.startswith("meshd-"):
            # meshd is identical to plain on the synthetic models (clear logit margins).
            assert arm["identical"] is True, name
            assert arm["forwards_per_token"] is not None
    assert wl["arms"]["meshd-mtp-fixed"]["verify_calls"] > 0
    assert wl["arms"]["meshd-mtp-fixed"]["acceptance"] is not None
    limits = [arm["limit"] | {"runs": arm["runs"]} for arm in wl["arms"].values()
              if arm.get("limit")]
    assert limits
    for lim in limits:
        # The steps an arm decoded plainly are held to plain decoding in its limit.
        n = sum(r["tokens"] - 1 for r in lim["runs"])
        plain = lim["plain_steps"]
        assert 0 <= plain <= n
        assert lim["speedup"] == pytest.approx(
            n / (plain + (n - plain) / lim["drafting_speedup"]))
        # Priced by the workload's curve (fitted to the run's forwards where it says
        # so): never above that curve's limit at full acceptance.
        top = ceiling
        if lim["curve_scale"] is not None:
            measured = CostCurve.sanitized(wl["cost_curve"]).costs
            top = speedup_limit(CostCurve(
                [1.0, *(1.0 + lim["curve_scale"] * (c - 1.0) for c in measured[1:])]))[1]
        assert lim["drafting_speedup"] <= top + 1e-9
    statuses = {t["status"] for t in report["targets"]}
    assert statuses <= {"PASS", "MISS", "n/a"}
    assert any(t["target"].startswith("MTP: forwards/token") and t["arm"] == "meshd-mtp-fixed"
               for t in report["targets"])


class _AlteringRunner:
    """meshd-off, with token 5 of every output replaced: a divergence on purpose."""

    def __init__(self, inner: ArmRunner, n_vocab: int) -> None:
        self.inner = inner
        self.n_vocab = n_vocab

    def run(self, prompt: Sequence[int], max_tokens: int) -> RunResult:
        r = self.inner.run(prompt, max_tokens)
        tokens = list(r.tokens)
        tokens[5] = (tokens[5] + 1) % self.n_vocab
        return RunResult(tuple(tokens), r.wall_s, r.ttft_s, r.prefill_s, r.forward_s,
                         r.decode_forwards, r.stats)

    def close(self) -> None:
        self.inner.close()


def test_injected_divergence_is_reported() -> None:
    def open_broken(bm: BenchModel) -> ArmRunner:
        return _AlteringRunner(MeshdRunner(bm.rt, "off"), bm.rt.model.info.n_vocab)

    arms = [a for a in ARMS if a.name in (REFERENCE_ARM, "meshd-off")]
    arms.append(ArmSpec("broken", "meshd-off with token 5 altered", open_broken))
    report = run_bench(_tiny_config(models=("llama",)), arms=arms, log=_quiet)
    (wl,) = report["models"][0]["workloads"]
    assert wl["arms"]["meshd-off"]["identical"] is True
    broken = wl["arms"]["broken"]
    assert broken["identical"] is False
    assert broken["first_divergence"] == 5
    assert all(r["first_divergence"] == 5 for r in broken["runs"])
    margin = broken["margin"]
    assert margin["index"] == 5
    assert margin["got_token"] != margin["ref_token"]
    assert margin["top1"] == margin["ref_token"]  # greedy: the reference took the argmax
    assert margin["margin"] > 0
    table = format_report(report)
    assert "no @5 (margin" in table
    assert f"context {wl['prompt_tokens'] + 5})" in table  # where it parted, in tokens


def test_unknown_names_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["bench", "--model", "llama", "--workload", "nope"]) == 2
    assert "unknown workload" in capsys.readouterr().err
    assert main(["bench", "--model", "llama", "--arm", "nope"]) == 2
    assert "unknown arm" in capsys.readouterr().err


def test_a_workload_file_runs_like_a_shipped_one(tmp_path: Path) -> None:
    wl = tmp_path / "mine.json"
    wl.write_text(json.dumps({"name": "mine", "copies": True, "messages": [
        {"role": "user", "content": "Repeat: alpha beta gamma delta alpha beta gamma"}]}))
    report = run_bench(BenchConfig(
        models=("llama",), workloads=(str(wl), "story"), reps=1, max_tokens=8,
        warmup=False, cost_reps=1, arms=("meshd-off",)), log=lambda _line: None)
    names = [w["name"] for w in report["models"][0]["workloads"]]
    assert names == ["mine", "story"]
    assert report["models"][0]["workloads"][0]["arms"]["meshd-off"]["error"] is None


def test_a_bad_workload_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "bad"}')
    assert main(["bench", "--model", "llama", "--workload", str(bad)]) == 2
    assert "messages" in capsys.readouterr().err
    assert main(["bench", "--model", "llama", "--workload", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err


def test_plot_without_matplotlib_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    assert main(["bench", "--model", "llama", "--plot", "x.png"]) == 2
    assert "matplotlib" in capsys.readouterr().err


@pytest.mark.slow
def test_requantized_copy_is_cached(tmp_path: Path) -> None:
    from meshd.bench.arms import requantized
    from meshd.native.default_model import default_model_path
    from meshd.native.model import Model

    path = requantized(default_model_path(), "q8_0", cache_dir=tmp_path)
    assert path.is_file() and path.parent == tmp_path
    assert requantized(default_model_path(), "q8_0", cache_dir=tmp_path) == path
    with Model.load(path) as model:
        assert "Q8_0" in model.info.description


def test_plot_draws_every_model(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    arms = {"plain": {"median_decode_tok_s": 100.0}, "meshd-off": {"median_decode_tok_s": 99.0}}
    report = {"models": [
        {"name": name, "workloads": [{"name": "story", "arms": arms},
                                     {"name": "code-edit", "arms": arms}]}
        for name in ("a", "b")
    ]}
    out = tmp_path / "plot.png"
    write_plot(report, out)
    assert out.stat().st_size > 1000


def _mtp_run(head_ms: float) -> RunResult:
    """A run of 41 tokens: 20 windows of 3 drafts, 1 accepted each, 10 ms per forward."""
    stats = {"drafted": 60, "accepted": 20, "verify_calls": 20,
             "accepted_per_position": [20], "drafted_per_position": [20, 20, 20],
             "checkpoints": 0, "checkpoint_bytes": 0, "restores": 0,
             "rollbacks_in_place": 0, "refusals": {}, "proposer_faults": {},
             "propose_ms": 30.0, "head_ms": head_ms}
    return RunResult(tuple(range(41)), 0.5, 0.1, 0.09, 0.2, 20, stats)


def test_the_limit_charges_the_heads_measured_catch_up() -> None:
    curve = CostCurve((1.0, 1.2, 1.4, 1.6))
    free = summarize_arm([_mtp_run(0.0)], None, curve, unit_forward_ms=10.0)
    paid = summarize_arm([_mtp_run(40.0)], None, curve, unit_forward_ms=10.0)
    assert free["head_share"] is None or free["head_share"] == 0.0
    assert paid["head_share"] == pytest.approx(40.0 / 400.0)  # of 0.4 s decoding
    assert paid["head_overhead"] == pytest.approx(40.0 / 160.0)
    assert paid["draft_share"] == pytest.approx(30.0 / 400.0)
    assert paid["draft_cost"] == pytest.approx(0.5 / 10.0)
    assert paid["limit"]["drafting_speedup"] < free["limit"]["drafting_speedup"]


def test_the_curve_is_fitted_to_what_the_arms_windows_cost_in_the_run() -> None:
    curve = CostCurve((1.0, 1.2, 1.4, 1.6))
    # 10 windows of 3 drafts and 10 of 1: 10 * 0.6 + 10 * 0.2 = 8 decodes of excess.
    drafted = [20, 10, 10]
    same = fit_curve_to_run(curve, drafted, verify_decodes=10 * 1.6 + 10 * 1.2)
    assert same is not None and same[1] == pytest.approx(1.0)
    assert same[0].costs == pytest.approx(curve.costs)
    dearer = fit_curve_to_run(curve, drafted, verify_decodes=20 + 2 * 8.0)
    assert dearer is not None and dearer[1] == pytest.approx(2.0)
    assert dearer[0].costs == pytest.approx((1.0, 1.4, 1.8, 2.2))
    cheaper = fit_curve_to_run(curve, drafted, verify_decodes=20 + 0.5 * 8.0)
    assert cheaper is not None and cheaper[0].costs == pytest.approx((1.0, 1.1, 1.2, 1.3))
    # Two windows: their timing alone must not set the curve's level.
    assert fit_curve_to_run(curve, [2, 2, 2], verify_decodes=10.0) is None
    # A window longer than the curve covers cannot be priced.
    assert fit_curve_to_run(curve, [20, 20, 20, 20], verify_decodes=60.0) is None


def _window_run(forward_s: float) -> RunResult:
    """41 tokens in 20 verify windows of 3 drafts (no plain steps), ``forward_s`` in all."""
    stats = {"drafted": 60, "accepted": 35, "verify_calls": 20,
             "accepted_per_position": [20, 10, 5], "drafted_per_position": [20, 20, 20],
             "checkpoints": 0, "checkpoint_bytes": 0, "restores": 0,
             "rollbacks_in_place": 0, "refusals": {}, "proposer_faults": {},
             "propose_ms": 0.0}
    return RunResult(tuple(range(41)), 0.1 + forward_s, 0.1, 0.09, forward_s, 20, stats)


def test_the_limit_is_priced_at_what_the_runs_forwards_cost() -> None:
    curve = CostCurve((1.0, 1.2, 1.4, 1.6))
    plain = [RunResult(tuple(range(41)), 0.5, 0.1, 0.09, 0.4, 40)]  # 10 ms per forward
    as_measured = summarize_arm([_window_run(20 * 0.016)], plain, curve)["limit"]
    assert as_measured["curve_scale"] == pytest.approx(1.0)
    assert as_measured["speedup"] == pytest.approx(as_measured["curve_speedup"])
    # The same windows costing 2.2 decodes each: the curve's excess doubled in this run.
    dearer = summarize_arm([_window_run(20 * 0.022)], plain, curve)["limit"]
    assert dearer["curve_scale"] == pytest.approx(2.0)
    assert dearer["curve_speedup"] == pytest.approx(as_measured["curve_speedup"])
    # Acceptance 1, 0.5, 0.5 by position: on (1, 1.2, 1.4, 1.6) two drafts pay best,
    # 2.5 tokens for 1.4 decodes; on the fitted (1, 1.4, 1.8, 2.2) one draft, 2 for 1.4.
    assert (as_measured["k"], as_measured["speedup"]) == (2, pytest.approx(2.5 / 1.4))
    assert (dearer["k"], dearer["speedup"]) == (1, pytest.approx(2.0 / 1.4))
    # Without a reference run there is no unit to fit with: the pre-run curve stands.
    alone = summarize_arm([_window_run(20 * 0.022)], None, curve)["limit"]
    assert alone["curve_scale"] is None and alone["speedup"] == alone["curve_speedup"]


def test_the_fit_takes_its_unit_from_the_arms_own_plain_steps() -> None:
    curve = CostCurve((1.0, 1.2, 1.4, 1.6))
    # 20 windows of 3 drafts at 1.6 decodes and 12 plain steps, all at 12 ms a decode,
    # while the reference ran at 10 ms a decode (other load came and went between arms).
    verify_ms, plain_ms = 20 * 1.6 * 12.0, 12 * 12.0
    stats = {"drafted": 60, "accepted": 35, "verify_calls": 20,
             "accepted_per_position": [20, 10, 5], "drafted_per_position": [20, 20, 20],
             "checkpoints": 0, "checkpoint_bytes": 0, "restores": 0,
             "rollbacks_in_place": 0, "refusals": {}, "proposer_faults": {},
             "propose_ms": 0.0, "verify_ms": verify_ms, "decode_ms": verify_ms + plain_ms}
    run = RunResult(tuple(range(53)), 1.0, 0.1, 0.09, (verify_ms + plain_ms) / 1e3, 32, stats)
    plain = [RunResult(tuple(range(41)), 0.5, 0.1, 0.09, 0.4, 40)]
    limit = summarize_arm([run], plain, curve)["limit"]
    assert limit["curve_scale"] == pytest.approx(1.0)
    # Priced at the reference's 10 ms, the same windows would have looked dearer.
    fewer = {**stats, "verify_ms": None}
    assert summarize_arm([attrs.evolve(run, stats=fewer)], plain, curve)["limit"][
        "curve_scale"] > 1.3


def test_auto_without_drafts_is_held_to_the_mtp_arms_limit_never_below_plain() -> None:
    def arm(ratio: float, limit: dict[str, object] | None) -> dict[str, object]:
        return {"median_decode_tok_s": 100.0 * ratio, "decode_ratio_vs_plain": ratio,
                "error": None, "limit": limit}

    def limit_line(mtp_speedup: float) -> dict[str, object]:
        arms = {"plain": arm(1.0, None), "meshd-auto": arm(0.99, None),
                "meshd-mtp": arm(0.9, {"k": 3, "speedup": mtp_speedup})}
        models = [{"name": "m", "has_mtp": True,
                   "workloads": [{"name": "w", "arms": arms}]}]
        (line,) = [t for t in evaluate_targets(models)
                   if t["target"] == "meshd-auto >= 90% of the limit"]
        return line

    paying = limit_line(1.25)
    assert paying["value"] == pytest.approx(0.99 / 1.25) and paying["status"] == "MISS"
    assert "meshd-mtp" in paying["detail"]
    losing = limit_line(0.8)  # no draft length pays: plain decoding is the limit
    assert losing["value"] == pytest.approx(0.99) and losing["status"] == "PASS"


def test_window_costs_are_priced_against_a_decode_without_snapshots() -> None:
    """A hybrid context that rolls back in place stores snapshots on every forward;
    the bench prices windows against a decode on one that does not (plain decoding's)."""
    model = Model.load(testmodels.test_model_path("qwen35", acceptance=1.0))
    try:
        with TargetContext(model, ContextConfig(n_ctx_seq=256, draft_max=4)) as ctx:
            assert ctx.rollback_window > 0
            baseline = plain_baseline(ctx)
            assert baseline is not None
            try:
                assert baseline.rollback_window == 0 and baseline.mtp is None
                costs = measure_row_costs(ctx, 4, reps=2, context_tokens=32,
                                          baseline=baseline)
                assert len(costs) == 5
                assert all(math.isfinite(c) and c > 0 for c in costs)
            finally:
                baseline.close()
            # Both hand their session slots back.
            assert ctx.free_slots == ctx.config.n_seq_max
        attention = Model.load(testmodels.test_model_path("llama", acceptance=1.0))
        try:
            with TargetContext(attention, ContextConfig(n_ctx_seq=256)) as plain_ctx:
                assert plain_baseline(plain_ctx) is None
        finally:
            attention.close()
    finally:
        model.close()


def test_a_run_is_contended_only_against_its_own_workloads_runs() -> None:
    """The CPU share a run gets depends on its shape: a long prompt's prefill keeps both
    threads busy, decoding leaves them idle at barriers. Only a run that got much less
    than the same arm's other runs of the same workload was slowed down by other load."""
    def runs(*shares: float) -> list[RunResult]:
        return [RunResult(tuple(range(41)), 1.0, 0.1, 0.09, 0.8, 40, cpu_s=2 * share)
                for share in shares]

    prefill_heavy = summarize_arm(runs(0.9, 0.88, 0.91), None, None, threads=2)
    decode_heavy = summarize_arm(runs(0.55, 0.56, 0.54), None, None, threads=2)
    assert prefill_heavy["contended_runs"] == decode_heavy["contended_runs"] == 0
    slowed = summarize_arm(runs(0.55, 0.3, 0.54), None, None, threads=2)
    assert slowed["contended_runs"] == 1
