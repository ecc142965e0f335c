"""``meshd bench --identity``: the identity gate, speculation vs ``--proposer off``.

Why a separate gate next to the unit tests: meshd's promise is that speculation never
changes the token stream. The unit tests check it on chosen cases; this runs the real
product path (``ModelRuntime.generation``, the calibrated cost curve, every installed
proposer, fixed and adaptive draft lengths, greedy and seeded sampling) over workload
prompts, and CI runs a small version of it.

On the synthetic models (:mod:`meshd.testing.testmodels`) the winning logit beats the
runner-up by several logits by design, so any divergence is a bug: the gate exits 1.
On a real model (SmolLM2, quantized) it gates too where every forward computes a row's
logits in the same kernel, as on the CPU by default (the attention kernel pinned per
forward, docs/identity.md, "Identity and its limits"): a divergence there is a bug as
well. On an accelerator (or a runtime without meshd's patch, with an f16 cache) batched
and serial forwards may round differently and a near-tie can flip, so there it only
reports the identity rate and, for each divergence, the reference's top-1/top-2 logit
margin at the diverging position, so a divergence at a large margin (a bug) stands out
from one at a near-tie.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from meshd.daemon.engine.sampling import GREEDY, SamplingParams
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig

from .arms import (
    ModelSpec,
    default_threads,
    divergence_margin,
    first_divergence,
    resolve_model,
)
from .workloads import BenchError, load_workloads

Log = Callable[[str], None]

#: The synthetic models rarely repeat a bigram (by design), so n-gram lookup is allowed
#: to match single tokens there: its drafts are then often wrong, which exercises every
#: repair path (the same options the engine's unit tests use).
SYNTHETIC_OPTIONS: Mapping[str, Mapping[str, object]] = {
    "ngram": {"min_n": 1},
    "composite": {"ngram": {"min_n": 1}},
}

#: Characters of a workload prompt given to a synthetic model (byte-level tokens, a
#: context of 2048): enough text for n-gram matches, short enough to stay fast.
SYNTHETIC_PROMPT_CHARS = 240

#: Characters kept of each chat message for a real model: on 2 cores a full workload
#: prompt (450 tokens) takes longer to prefill than the gate's 32 tokens take to
#: generate, and the gate runs dozens of generations per prompt.
CHAT_MESSAGE_CHARS = 360


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@attrs.frozen
class IdentityConfig:
    models: tuple[str, ...] = ("llama", "qwen35", "mimo2", "smollm2")
    prompts: int = 2
    max_tokens: int = 32
    ks: tuple[int, ...] = (1, 3, 8)
    n_ctx: int = 2048
    threads: int | None = None
    seed: int = 1234
    cache_type_k: str = "auto"


def identity_prompts(rt: ModelRuntime, spec: ModelSpec, n: int) -> list[list[int]]:
    """``n`` prompts from the workloads (cycled; later rounds start further into the
    text so every prompt differs), rendered with the chat template when there is one.

    Copy-heavy workloads come first: there prompt lookup drafts often, so even a small
    gate verifies many windows instead of a handful.
    """
    workloads = sorted(load_workloads(), key=lambda w: not w.copies)
    out: list[list[int]] = []
    for i in range(n):
        w = workloads[i % len(workloads)]
        shift = 40 * (i // len(workloads))
        messages = [(role, content[shift:] if role == "user" else content)
                    for role, content in w.messages]
        if spec.synthetic or rt.model.chat_template is None:
            text = "\n\n".join(c for _, c in messages)
            if spec.synthetic:
                text = text[-SYNTHETIC_PROMPT_CHARS:]
            out.append(rt.tokenize_prompt(text + "\n", chat=False))
        else:
            rendered = rt.render_chat([{"role": r, "content": c[:CHAT_MESSAGE_CHARS]}
                                       for r, c in messages])
            out.append(rt.tokenize_prompt(rendered, chat=True))
    return out


#: Proposers the gate runs with fixed draft lengths (when installed and applicable);
#: ``auto`` (adaptive) always runs as well.
PROPOSERS = ("ngram", "mtp", "composite")


def _cases(rt: ModelRuntime, ks: Sequence[int]) -> list[tuple[str, int | None]]:
    """(proposer, fixed k) pairs for a model; ``k = None``: adaptive (the default path)."""
    names = [n for n in PROPOSERS
             if n in rt.registry and (n != "mtp" or rt.model.info.has_mtp)]
    cases: list[tuple[str, int | None]] = [(n, k) for n in names for k in ks]
    cases.append(("auto", None))
    return cases


def check_model(name: str, config: IdentityConfig, log: Log) -> dict[str, Any]:
    """Every case on one model against meshd-off; returns the model's report entry."""
    threads = config.threads or default_threads()
    spec = resolve_model(name, threads=threads)
    t0 = time.perf_counter()
    rt = ModelRuntime(RuntimeConfig(
        model_path=str(spec.path), n_ctx_seq=config.n_ctx, n_seq_max=1,
        draft_max=max(config.ks), threads=threads, calibrate=True, prefix_cache_tokens=0,
        cache_type_k=config.cache_type_k,
    ))
    try:
        prompts = identity_prompts(rt, spec, config.prompts)
        options = SYNTHETIC_OPTIONS if spec.synthetic else {}
        runs = 0
        identical = 0
        windows = 0
        divergences: list[dict[str, Any]] = []
        per_case: dict[str, dict[str, int]] = {}
        for pi, prompt in enumerate(prompts):
            samplings = [("greedy", GREEDY), ("seeded", SamplingParams(
                temperature=0.8, top_k=40, top_p=0.95, seed=config.seed + pi))]
            for label, sampling in samplings:
                ref_gen = rt.generation(prompt, max_tokens=config.max_tokens,
                                        sampling=sampling, proposer="off")
                for _ in rt.run(ref_gen):
                    pass
                ref = ref_gen.committed
                for proposer, k in _cases(rt, config.ks):
                    gen = rt.generation(
                        prompt, max_tokens=config.max_tokens, sampling=sampling,
                        proposer=proposer, draft_max=k, adaptive=k is None,
                        proposer_options=options.get(proposer),
                    )
                    for _ in rt.run(gen):
                        pass
                    key = f"{proposer} k={k if k is not None else 'adaptive'}"
                    case = per_case.setdefault(key, {"runs": 0, "identical": 0, "windows": 0})
                    runs += 1
                    case["runs"] += 1
                    windows += gen.stats.verify_calls
                    case["windows"] += gen.stats.verify_calls
                    div = first_divergence(ref, gen.committed)
                    if div is None:
                        identical += 1
                        case["identical"] += 1
                        continue
                    margin = divergence_margin(rt, prompt, ref, gen.committed, div)
                    d = {"prompt": pi, "sampling": label, "proposer": proposer, "k": k,
                         "index": div, "margin": margin.as_dict()}
                    divergences.append(d)
                    log(f"  {spec.name}: DIVERGENCE {key} {label} prompt {pi} at token "
                        f"{div} (margin {margin.margin:.3f})")
        entry = {
            "name": spec.name, "path": str(spec.path), "synthetic": spec.synthetic,
            # Whether every divergence is a bug: margins are wide by design (synthetic)
            # or every forward rounds a row alike (the CPU, its kernel pinned).
            "gated": spec.synthetic or rt.context.exact,
            "cache_type_k": rt.context.config.cache_type_k,
            "runs": runs, "identical": identical,
            "identity_rate": identical / runs if runs else None,
            "verify_windows": windows, "cases": per_case, "divergences": divergences,
            "prompt_tokens": [len(p) for p in prompts], "seconds": time.perf_counter() - t0,
        }
        log(f"{spec.name}: {identical}/{runs} identical, {windows} verify windows, "
            f"{entry['seconds']:.1f} s")
        return entry
    finally:
        rt.close()


def run_identity(config: IdentityConfig, *, log: Log = _stderr) -> dict[str, Any]:
    """Run the gate; ``gated_divergences`` > 0 means a bug (the CLI exits 1)."""
    if not config.ks or min(config.ks) < 1:
        raise BenchError("--k values must be at least 1")
    models = [check_model(m, config, log) for m in config.models]
    return {
        "format": 1, "config": attrs.asdict(config), "models": models,
        "synthetic_divergences": sum(len(m["divergences"]) for m in models if m["synthetic"]),
        "gated_divergences": sum(len(m["divergences"]) for m in models if m["gated"]),
    }


def format_identity(report: Mapping[str, Any]) -> str:
    """One line per model, one per divergence, and the verdict."""
    cfg = report["config"]
    lines = [f"meshd bench --identity: {cfg['prompts']} prompts x {cfg['max_tokens']} tokens, "
             f"k in {list(cfg['ks'])} + adaptive, greedy and seeded sampling; "
             f"reference: meshd-off"]
    for m in report["models"]:
        rate = m["identity_rate"]
        lines.append(f"  {m['name']:<14} identity {m['identical']}/{m['runs']} "
                     f"({rate:.1%})  verify windows {m['verify_windows']}"
                     f"{'' if m['gated'] else '  (kernel not pinned: divergences reported)'}")
        for case, c in m["cases"].items():
            if c["windows"] == 0:
                lines.append(f"    note: {case} never speculated on this model")
        for d in m["divergences"]:
            mg = d["margin"]
            lines.append(f"    divergence: {d['proposer']} k={d['k']} {d['sampling']} "
                         f"prompt {d['prompt']} at token {d['index']}: reference "
                         f"{mg['ref_token']} vs {mg['got_token']}, top1-top2 margin "
                         f"{mg['margin']:.3f}")
    n = report["gated_divergences"]
    gated = ", ".join(m["name"] for m in report["models"] if m["gated"]) or "none"
    lines.append(f"FAIL: {n} divergence(s) on a gated model ({gated})" if n
                 else f"OK: no divergence on the gated models ({gated})")
    return "\n".join(lines)
