"""``meshd bench``: meshd against llama-cpp-python on the same tokens, side by side.

Why it is built this way: the machine is shared and noisy, so an absolute tokens/s
number from one run means little. Every arm (see :mod:`meshd.bench.arms`) runs
on the same model, the same prompt token ids and greedy decoding, in one process,
interleaved (arm order forward on even repetitions, reversed on odd ones, so a drift in
machine speed hits every arm alike), repeated ``--reps`` times; the report gives medians
and ratios to ``plain`` (llama-cpp-python's own ``Llama``, what users run today, with
flash attention on like meshd's context so both compute the same logits; ``--llama-flash-
attn off`` gives Llama's own default). A run's CPU share is recorded too: on a shared
machine llama.cpp's OpenMP barriers stall whenever one of its threads is descheduled, and
such runs are flagged in the table rather than silently averaged in.

Speed is reported twice: end-to-end tokens/s (prefill included) and decode tokens/s
(after the first token; prefill is the same work for every arm, so this is the part
speculation changes). The PASS/MISS target lines use the decode ratios and show the
end-to-end ones next to them.

Next to the speeds it prints the physical limit of speculation on this machine: the
measured cost of a verify batch of ``k + 1`` rows against one decode, and the best
speedup that curve allows at full and at the measured acceptance. On a recurrent model
that rolls back in place the one-row unit is a decode on a context without rollback
snapshots (what plain decoding runs), so every window's cost includes the snapshots it
needs and the limit is what speculation can reach against plain decoding; the
snapshots' own cost on a one-row decode is reported as ``snapshot_cost``. Every arm's output is
compared token by token with ``plain``; a divergence is reported with its index and the
reference model's top-1/top-2 logit margin there.

``meshd bench --identity`` is the identity gate (:mod:`meshd.bench.identity`).

JSON report (``--json FILE``), format 1::

    {"format": 1, "config": {...}, "machine": {...}, "llama_server": "...",
     "models": [{"name", "path", "note", "synthetic", "has_mtp", "recurrent", "n_ctx",
                 "cache_type_k", "cost_curve", "runtime_curve", "draft_model",
                 "limit": {"k", "speedup"}, "snapshot_cost",
                 "reference", "unavailable": {arm: reason},
                 "workloads": [{"name", "copies", "prompt_tokens", "truncated",
                                "cost_context", "cost_curve",
                                "arms": {arm: ArmSummary}}]}],
     "targets": [{"target", "model", "workload", "arm", "status", "value", "threshold",
                  "detail"}]}

where ArmSummary holds ``runs`` (one entry per repetition), ``error``, the medians,
``ratio_vs_plain`` (median tok/s over the reference's median tok/s) and
``decode_ratio_vs_plain``, ``forwards_per_token``, ``acceptance`` and
``acceptance_per_position``, ``forward_ms`` and ``forward_cost_vs_plain`` (verify
cost against the reference's decode cost), ``host_ms_per_token``, ``checkpoint_bytes``,
``limit`` (``speedup``: the best this arm could do with the acceptance it measured where
it drafted, ``drafting_speedup`` on those steps, its ``plain_steps`` held to plain
decoding; ``fraction``: what it reached of that) and ``identical`` / ``first_divergence``
/ ``margin``.
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from meshd.native.calibrate import measure_row_costs
from meshd.native.context import DEFAULT_DRAFT_MAX, TargetContext
from meshd.native.errors import NativeError
from meshd.policy.costs import CostCurve, RepairCost, speedup_limit

from .arms import (
    ARMS,
    REFERENCE_ARM,
    ArmRunner,
    ArmSpec,
    BenchModel,
    RunResult,
    default_draft,
    default_threads,
    divergence_margin,
    render_prompt,
    resolve_model,
)
from .llama_server import ARM_PREFIX, NGRAM_MODES, llama_server_arms, server_version
from .summary import forward_ms, summarize_arm
from .targets import evaluate_targets
from .workloads import ArmUnavailable, BenchError, load_workloads

#: What ``meshd bench`` measures without ``--model``.
DEFAULT_MODELS = ("smollm2-q4_1", "smollm2-q8_0", "qwen35-0.5", "qwen35-0.74", "qwen35-0.9")

#: Report format version (bump on incompatible JSON changes).
FORMAT = 1

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@attrs.frozen
class BenchConfig:
    """What to measure; ``None`` lists mean "all"."""

    models: tuple[str, ...] = DEFAULT_MODELS
    workloads: tuple[str, ...] | None = None
    arms: tuple[str, ...] | None = None
    reps: int = 3
    max_tokens: int = 128
    n_ctx: int = 2048
    threads: int | None = None
    draft_max: int = DEFAULT_DRAFT_MAX
    pld_tokens: int | None = None
    #: Flash attention in the Llama arms. On by default because meshd's context lets
    #: llama.cpp choose and it chooses flash attention on CPU: with Llama's own default
    #: (off) the attention sums round differently and ``plain`` parts from meshd-off at
    #: the first near-tie, which would make every identity check meaningless.
    llama_flash_attn: bool = True
    warmup: bool = True
    cost_reps: int = 5
    #: ``meshd-draft``'s draft model (a name :func:`resolve_model` knows or a path);
    #: ``None``: :func:`default_draft` of each model.
    draft_model: str | None = None
    #: llama.cpp's ``llama-server`` binary for the extra arms (``None``: not run).
    llama_server: str | None = None
    #: Its speculation types to run, one arm each (``llama-server`` plain always runs).
    llama_server_modes: tuple[str, ...] = NGRAM_MODES
    #: The K cache's type for every arm (``ContextConfig.cache_type_k``).
    cache_type_k: str = "auto"


# --------------------------------------------------------------------------- running


def _open_arms(arms: Sequence[ArmSpec], bm: BenchModel, log: Log,
               ) -> tuple[dict[str, ArmRunner], dict[str, str]]:
    runners: dict[str, ArmRunner] = {}
    unavailable: dict[str, str] = {}
    for spec in arms:
        try:
            runners[spec.name] = spec.open(bm)
        except ArmUnavailable as exc:
            unavailable[spec.name] = str(exc)
        except Exception as exc:  # an arm that cannot even load is reported, not fatal
            unavailable[spec.name] = f"failed to open: {type(exc).__name__}: {exc}"
            log(f"  {spec.name}: {unavailable[spec.name]}")
    return runners, unavailable


def bench_model(name: str, config: BenchConfig, arms: Sequence[ArmSpec], log: Log,
                ) -> dict[str, Any]:
    """Every workload x arm on one model, interleaved; returns the model's report entry."""
    threads = config.threads or default_threads()
    spec = resolve_model(name, threads=threads)
    workloads = load_workloads(config.workloads)
    log(f"{spec.name}: loading {spec.path}")
    draft = (resolve_model(config.draft_model, threads=threads).path if config.draft_model
             else default_draft(spec))
    bm = BenchModel(spec, n_ctx=config.n_ctx, threads=threads, draft_max=config.draft_max,
                    llama_flash_attn=config.llama_flash_attn, pld_tokens=config.pld_tokens,
                    draft_path=draft, cache_type_k=config.cache_type_k)
    runners: dict[str, ArmRunner] = {}
    baseline: TargetContext | None = None
    try:
        info = bm.rt.model.info
        entry: dict[str, Any] = {
            "name": spec.name, "path": str(spec.path), "note": spec.note,
            "synthetic": spec.synthetic, "has_mtp": info.has_mtp,
            "recurrent": info.has_recurrent_state, "n_ctx": bm.n_ctx,
            "cache_type_k": bm.cache_type_k,
            "runtime_curve": list(bm.rt.curve.costs) if bm.rt.curve else None,
            "draft_model": None if draft is None else str(draft),
        }
        prompts = {w.name: render_prompt(bm.rt, w, room=config.max_tokens) for w in workloads}
        curve: CostCurve | None = None
        entry["snapshot_cost"] = None
        if config.draft_max > 0:
            # A context that rolls back in place pays for its snapshots on every forward;
            # the costs are priced against a decode on one without them (plain decoding).
            baseline = plain_baseline(bm.rt.context)
            log(f"{spec.name}: measuring the cost of k+1 rows vs 1 (k = 1..{config.draft_max})")
            raw = measure_row_costs(bm.rt.context, config.draft_max, reps=config.cost_reps,
                                    baseline=baseline)
            curve = CostCurve.sanitized(raw)
            k, s = speedup_limit(curve)
            entry.update(cost_curve=list(curve.costs), limit={"k": k, "speedup": s})
            if baseline is not None:
                entry["snapshot_cost"] = raw[0]
        else:
            entry.update(cost_curve=None, limit=None)
        # Each workload's limit is priced at the context its decoding runs at: a window
        # attends to the whole prompt, so at a few hundred tokens wide forwards cost
        # relatively more than at the 64 tokens of the model-level curve above.
        curves: dict[str, tuple[int, CostCurve] | None] = {}
        for w in workloads:
            curves[w.name] = None
            if curve is not None:
                at = workload_cost_context(len(prompts[w.name][0]), config.max_tokens,
                                           bm.n_ctx, config.draft_max)
                log(f"{spec.name}: cost of k+1 rows at {at} tokens of context ({w.name})")
                curves[w.name] = (at, CostCurve.sanitized(measure_row_costs(
                    bm.rt.context, config.draft_max, reps=config.cost_reps,
                    context_tokens=at, baseline=baseline)))
        runners, unavailable = _open_arms(arms, bm, log)
        entry["unavailable"] = unavailable
        order = [a.name for a in arms if a.name in runners]
        runs: dict[tuple[str, str], list[RunResult]] = {}
        errors: dict[tuple[str, str], str] = {}

        def attempt(w: str, arm: str, max_tokens: int) -> RunResult | None:
            gc.collect()
            try:
                cpu0 = time.process_time()
                r = runners[arm].run(prompts[w][0], max_tokens)
                if r.cpu_s is not None:  # measured on the process that decoded
                    return r
                return attrs.evolve(r, cpu_s=time.process_time() - cpu0)
            except (KeyboardInterrupt, MemoryError):
                raise
            except Exception as exc:  # e.g. Llama's draft path on a recurrent model
                errors[(w, arm)] = f"{type(exc).__name__}: {exc}"
                log(f"  {arm} on {w}: {errors[(w, arm)]}")
                return None

        if config.warmup and workloads:
            for arm in order:
                attempt(workloads[0].name, arm, min(8, config.max_tokens))
            errors.clear()  # a warm-up failure repeats (and is recorded) in the real runs
        for rep in range(config.reps):
            rep_order = order if rep % 2 == 0 else order[::-1]
            for w in workloads:
                for arm in rep_order:
                    if (w.name, arm) in errors:
                        continue
                    r = attempt(w.name, arm, config.max_tokens)
                    if r is not None:
                        runs.setdefault((w.name, arm), []).append(r)
                        log(f"  rep {rep + 1}/{config.reps} {w.name:<17} {arm:<26} "
                            f"{r.n:4d} tok {r.tok_s:8.1f} tok/s  decode {r.decode_tok_s:8.1f}")
        reference = REFERENCE_ARM
        if not any(k[1] == reference for k in runs) and any(k[1] == "meshd-off" for k in runs):
            reference = "meshd-off"
        entry["reference"] = reference
        entry["workloads"] = []
        for w in workloads:
            ref_runs = runs.get((w.name, reference))
            if (w.name, reference) in errors:
                ref_runs = None
            arms_out: dict[str, Any] = {}
            measured = curves[w.name]
            unit = forward_ms(runs.get((w.name, "meshd-off"), []))
            ctx = bm.rt.context
            repair = RepairCost(ctx.rollback_window) if ctx.recurrent else None
            for arm in order:
                arm_runs = runs.get((w.name, arm), [])
                summary = summarize_arm(arm_runs, ref_runs,
                                        None if measured is None else measured[1],
                                        error=errors.get((w.name, arm)), unit_forward_ms=unit,
                                        threads=threads, repair=repair)
                div = summary["first_divergence"]
                if div is not None and ref_runs:
                    bad = next(i for i, run in enumerate(summary["runs"])
                               if run["first_divergence"] is not None)
                    try:
                        summary["margin"] = divergence_margin(
                            bm.rt, prompts[w.name][0], ref_runs[bad].tokens,
                            arm_runs[bad].tokens, summary["runs"][bad]["first_divergence"],
                        ).as_dict()
                    except (NativeError, ValueError) as exc:
                        summary["margin"] = {"error": str(exc)}
                arms_out[arm] = summary
            entry["workloads"].append({
                "name": w.name, "copies": w.copies, "prompt_tokens": len(prompts[w.name][0]),
                "truncated": prompts[w.name][1], "arms": arms_out,
                "cost_context": None if measured is None else measured[0],
                "cost_curve": None if measured is None else list(measured[1].costs),
            })
        return entry
    finally:
        for runner in runners.values():
            runner.close()
        if baseline is not None:
            baseline.close()
        bm.close()


def plain_baseline(context: TargetContext) -> TargetContext | None:
    """A one-sequence context like ``context`` without in-place rollback, to time the
    decodes window costs are priced against; None where ``context`` keeps no rollback
    snapshots (their cost is then nothing) or llama.cpp cannot make a second one."""
    if not context.recurrent or context.rollback_window == 0:
        return None
    config = attrs.evolve(context.config, n_seq_max=1, use_mtp=False,
                          in_place_rollback=False)
    try:
        return TargetContext(context.model, config)
    except NativeError:
        return None


def workload_cost_context(prompt_tokens: int, max_tokens: int, n_ctx: int,
                          draft_max: int) -> int:
    """The context a workload's cost curve is measured at: its prompt plus half the
    tokens it generates (the mean context of its decode steps), within the room a
    window of ``draft_max + 1`` rows needs."""
    return max(1, min(prompt_tokens + max_tokens // 2, n_ctx - draft_max - 2))


def run_bench(config: BenchConfig, *, arms: Sequence[ArmSpec] = ARMS,
              log: Log = _stderr) -> dict[str, Any]:
    """Run the benchmark and return the report (see the module docstring for its shape)."""
    if config.reps < 1 or config.max_tokens < 1:
        raise BenchError("--reps and --tokens must be at least 1")
    every = list(arms)
    server = "not run (no --llama-server PATH)"
    if config.llama_server:
        every += llama_server_arms(config.llama_server, config.llama_server_modes)
        server = f"{config.llama_server} ({server_version(config.llama_server)})"
    selected = every
    if config.arms:
        known = {a.name for a in every}
        unknown = [a for a in config.arms if a not in known]
        if unknown:
            raise BenchError(f"unknown arm(s) {', '.join(unknown)}; available: "
                             f"{', '.join(a.name for a in every)}")
        wanted = set(config.arms) | {REFERENCE_ARM}
        if not any(a.startswith(ARM_PREFIX) for a in config.arms):
            # --arm picks among meshd's and llama-cpp-python's arms; --llama-server asks
            # for the server's arms (--llama-server-mode picks those), so naming no
            # llama-server arm keeps them all rather than silently dropping them.
            wanted |= {a.name for a in every if a.name.startswith(ARM_PREFIX)}
        selected = [a for a in every if a.name in wanted]
    load_workloads(config.workloads)  # fail on a bad name before loading any model
    report: dict[str, Any] = {
        "format": FORMAT,
        "config": {**attrs.asdict(config), "arms": [a.name for a in selected]},
        "machine": _machine(config),
        "llama_server": server,
        "models": [bench_model(m, config, selected, log) for m in config.models],
    }
    report["targets"] = evaluate_targets(report["models"])
    return report


def _machine(config: BenchConfig) -> dict[str, Any]:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"threads": config.threads or default_threads(), "cpu_count": os.cpu_count(),
            "llama_cpp_python": version("llama_cpp_python"), "meshd": version("meshd")}
