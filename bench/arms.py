"""Models, workloads and arms of ``meshd bench`` (the runner is :mod:`meshd.bench.run`).

Why a table of arms: every comparison the benchmark makes is "this arm against ``plain``
on the same model, the same prompt tokens and greedy decoding", so an arm is only a name
and a way to run one generation and say what it did (:class:`RunResult`). A new arm (a
draft model, the daemon through its socket) is one more :class:`ArmSpec` in :data:`ARMS`;
interleaving, medians, ratios, identity checks and the report pick it up unchanged.

Why ``plain`` is llama-cpp-python's own ``Llama``: it is what users run today, so "meshd
is faster" must mean faster than that, measured in the same process on the same tokens.
Its generation is observed, not reimplemented: the instance's ``generate`` and ``eval``
are wrapped to record the token ids (``create_completion`` only returns text), the time
of the first token and the time spent in forwards, so nothing in its decode loop changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np

from meshd.clients.terminal import Progress
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.native.default_model import default_model_path
from meshd.native.llama import ensure_backend, lc
from meshd.native.primitives import GGML_TYPES
from meshd.native.session import SequenceSession
from meshd.testing import testmodels

from .workloads import ArmUnavailable, BenchError, Workload

#: MTP acceptance of a synthetic model named without one (``qwen35``, ``mimo2``): below 1
#: so drafts get rejected and every repair path runs.
DEFAULT_SYNTHETIC_ACCEPTANCE = 0.74

#: Requantized copies of the default model ``smollm2-<type>`` can name.
QUANT_TYPES: Mapping[str, str] = {
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "f16": "LLAMA_FTYPE_MOSTLY_F16",
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
}


#: ``anchor-pld``'s draft length unless told: ``LlamaPromptLookupDecoding``'s own default
#: (``num_pred_tokens=10``), i.e. what its users get.
PLD_DEFAULT_TOKENS = 10


def render_prompt(rt: ModelRuntime, workload: Workload, *, room: int) -> tuple[list[int], bool]:
    """Prompt token ids for ``workload`` on ``rt``'s model, every arm gets exactly these.

    Uses the model's chat template when it has one. A prompt that would leave fewer than
    ``room`` tokens of context is cut from the left (the synthetic models have a small
    context and byte-level tokens); the second value says whether that happened.
    """
    if rt.model.chat_template is not None:
        text = rt.render_chat([{"role": r, "content": c} for r, c in workload.messages])
        tokens = rt.tokenize_prompt(text, chat=True)
    else:
        tokens = rt.tokenize_prompt(workload.plain_text, chat=False)
    limit = rt.context.config.n_ctx_seq - room - 1
    if limit < 1:
        raise BenchError(f"a context of {rt.context.config.n_ctx_seq} tokens leaves no room "
                         f"for a prompt and {room} generated tokens")
    if len(tokens) > limit:
        return tokens[-limit:], True
    return tokens, False


# --------------------------------------------------------------------------- models


@attrs.frozen
class ModelSpec:
    """A model as named on the command line, resolved to a file."""

    name: str
    path: Path
    synthetic: bool = False
    note: str = ""


def bench_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/meshd/bench`` (default ``~/.cache/meshd/bench``)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "meshd" / "bench"


def requantized(src: Path, qtype: str, *, cache_dir: Path | None = None,
                threads: int | None = None) -> Path:
    """A copy of ``src`` requantized to ``qtype`` by llama.cpp's own quantizer (cached).

    Why requantize at bench time instead of shipping files: the cost of a verify batch
    depends on the quantization (Q4_1 rows are expensive on these CPUs, Q8_0 rows cheap),
    and llama.cpp makes the copy from the shipped Q4_1 in seconds.
    """
    if qtype not in QUANT_TYPES:
        raise BenchError(f"unknown quantization {qtype!r}; known: {', '.join(QUANT_TYPES)}")
    st = src.stat()
    key = hashlib.sha256(
        json.dumps([str(src), st.st_size, st.st_mtime_ns, qtype]).encode()
    ).hexdigest()[:12]
    directory = cache_dir if cache_dir is not None else bench_cache_dir()
    out = directory / f"{src.stem.split('.')[0]}.{qtype}.{key}.gguf"
    if out.is_file():
        return out
    directory.mkdir(parents=True, exist_ok=True)
    ensure_backend()
    params = lc.llama_model_quantize_default_params()
    params.ftype = int(getattr(lc, QUANT_TYPES[qtype]))
    params.allow_requantize = True
    params.nthread = threads or 0
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    bar = Progress(f"quantizing {src.name} to {qtype.upper()} (once; cached)")
    try:
        rc = lc.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0:
            raise BenchError(f"llama_model_quantize({src} -> {qtype}) failed with code {rc}")
        os.replace(tmp, out)
        bar.done()
    finally:
        tmp.unlink(missing_ok=True)
    return out


def resolve_model(name: str, *, cache_dir: Path | None = None,
                  threads: int | None = None) -> ModelSpec:
    """Resolve a model name: ``smollm2[-q4_1|-q8_0|-f16|-q4_0]``, a synthetic kind with an
    optional MTP acceptance (``llama``, ``qwen35-0.74``, ``mimo2-0.9``), the same of
    realistic cost (``qwen35-1b-0.74``, ``mimo2-0.5b-0.9-q4_k_m``), or a GGUF path."""
    low = name.lower()
    if low in ("smollm2", "smollm2-q4_1"):
        return ModelSpec("smollm2-q4_1", default_model_path(), note="as shipped")
    if low.startswith("smollm2-"):
        qtype = low.partition("-")[2]
        path = requantized(default_model_path(), qtype, cache_dir=cache_dir, threads=threads)
        return ModelSpec(low, path, note="requantized from the shipped Q4_1 by llama.cpp")
    kind, _, acc = low.partition("-")
    if kind in testmodels.KINDS and acc.split("-")[0] in testmodels.SIZES:
        return _sized_model(name, kind, acc.split("-"))
    if kind in testmodels.KINDS:
        if kind == "llama":
            if acc:
                raise BenchError("the synthetic llama model has no MTP head (no acceptance)")
            return ModelSpec("llama", testmodels.test_model_path("llama"), synthetic=True)
        try:
            acceptance = float(acc) if acc else DEFAULT_SYNTHETIC_ACCEPTANCE
            path = testmodels.test_model_path(kind, acceptance=acceptance)
        except ValueError as exc:
            raise BenchError(f"model {name!r}: {exc}") from exc
        return ModelSpec(f"{kind}-{acceptance:g}", path, synthetic=True,
                         note=f"synthetic, MTP acceptance {acceptance:g}")
    path = Path(name).expanduser()
    if path.is_file():
        return ModelSpec(path.stem, path)
    raise BenchError(
        f"unknown model {name!r}: use smollm2[-q4_1|-{'|-'.join(QUANT_TYPES)}], a synthetic "
        f"kind ({', '.join(testmodels.KINDS)}, optionally -SIZE and -ACCEPTANCE) or a GGUF path"
    )


def _sized_model(name: str, kind: str, parts: list[str]) -> ModelSpec:
    """``KIND-SIZE[-ACCEPTANCE][-TYPE]``: a synthetic model of realistic cost (Q8_0 unless
    a type is named), e.g. ``qwen35-1b-0.74``, ``mimo2-0.5b-0.9-q4_k_m``."""
    size, rest = parts[0], parts[1:]
    qtype = rest.pop() if rest and rest[-1] in testmodels.QUANT_TYPES else None
    if kind == "llama" and rest:
        raise BenchError("the synthetic llama model has no MTP head (no acceptance)")
    if len(rest) > 1:
        raise BenchError(f"model {name!r}: expected KIND-SIZE[-ACCEPTANCE][-TYPE]")
    try:
        acceptance = float(rest[0]) if rest else DEFAULT_SYNTHETIC_ACCEPTANCE
        path = testmodels.test_model_path(kind, acceptance=acceptance, size=size, qtype=qtype)
    except ValueError as exc:
        raise BenchError(f"model {name!r}: {exc}") from exc
    q = qtype or testmodels.DEFAULT_SIZED_TYPE
    label = f"{kind}-{size}" + ("" if kind == "llama" else f"-{acceptance:g}") + \
        ("" if qtype is None else f"-{q}")
    return ModelSpec(label, path, synthetic=True,
                     note=f"synthetic {size} {q.upper()}"
                          + ("" if kind == "llama" else f", MTP acceptance {acceptance:g}"))


def default_draft(spec: ModelSpec) -> Path | None:
    """The draft model ``meshd-draft`` uses when none is named: a cheaper model with the
    same vocabulary — the shipped Q4_1 for a requantized SmolLM2, the synthetic llama
    (same rule, same vocabulary, no recurrent state) for a synthetic MTP model."""
    if spec.name.startswith("smollm2-") and spec.name != "smollm2-q4_1":
        return default_model_path()
    sized = any(f"-{size}" in spec.name for size in testmodels.SIZES)
    if spec.synthetic and not spec.name.startswith("llama") and not sized:
        return testmodels.test_model_path("llama")
    return None


def default_threads() -> int:
    """The thread count meshd's context uses by default; the Llama arms get the same."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


class BenchModel:
    """One model under test: its meshd runtime (loaded once) and the settings every arm
    shares (context length, threads, batch size), so arms differ only in how they decode.
    """

    def __init__(self, spec: ModelSpec, *, n_ctx: int, threads: int, draft_max: int,
                 llama_flash_attn: bool = True, pld_tokens: int | None = None,
                 draft_path: Path | None = None, cache_type_k: str = "auto") -> None:
        self.spec = spec
        #: The ``meshd-draft`` arm's draft model (``None``: that arm does not run).
        self.draft_path = draft_path
        self.threads = threads
        self.draft_max = draft_max
        self.llama_flash_attn = llama_flash_attn
        self.pld_tokens = pld_tokens if pld_tokens is not None else PLD_DEFAULT_TOKENS
        self.rt = ModelRuntime(RuntimeConfig(
            model_path=str(spec.path), n_ctx_seq=n_ctx, n_seq_max=1, draft_max=draft_max,
            threads=threads, calibrate=draft_max > 0,
            # Every run must prefill its whole prompt, as the Llama arms (reset before
            # each run) do: a prefix-cache hit would time a different amount of work.
            prefix_cache_tokens=0, cache_type_k=cache_type_k,
        ))
        self.n_ctx = self.rt.context.config.n_ctx_seq
        self.n_batch = self.rt.context.config.n_batch
        #: The K cache's type as meshd's context resolved it; the llama.cpp arms get the
        #: same, so that every arm runs the same attention kernels and, where none of
        #: them leaves plain decoding's text, they all decode one text.
        self.cache_type_k = self.rt.context.config.cache_type_k

    def close(self) -> None:
        self.rt.close()


# --------------------------------------------------------------------------- runs


@attrs.frozen
class RunResult:
    """One generation of one arm: what it produced and where its time went.

    ``ttft_s`` is the time to the first token (prefill included); everything after it is
    decoding. ``forward_s`` is time inside llama.cpp forwards after the prefill (for meshd
    the sessions' own timers, for ``Llama`` its ``eval`` calls), so ``wall - prefill -
    forward`` is host-side work: sampling, drafting, bookkeeping, Python.
    """

    tokens: tuple[int, ...]
    wall_s: float
    ttft_s: float
    prefill_s: float
    forward_s: float
    decode_forwards: int
    stats: Mapping[str, Any] | None = None
    #: CPU seconds used during the run by the process that decoded (all threads): set
    #: by an out-of-process runner, else by the benchmark from its own process time.
    cpu_s: float | None = None
    #: ``(drafted, accepted)`` from a runner that reports no per-position ``stats``
    #: (llama-server's ``timings``).
    drafts: tuple[int, int] | None = None

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def tok_s(self) -> float:
        """End-to-end tokens per second (prefill included)."""
        return self.n / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first token (what speculation changes)."""
        dt = self.wall_s - self.ttft_s
        return (self.n - 1) / dt if self.n > 1 and dt > 0 else 0.0


class ArmRunner(Protocol):
    """One arm opened on one model."""

    def run(self, prompt: Sequence[int], max_tokens: int) -> RunResult:
        """Generate greedily from ``prompt`` (up to ``max_tokens`` tokens or an EOG)."""
        ...

    def close(self) -> None:
        ...


@attrs.frozen
class ArmSpec:
    """An arm: a name, what it is, and how to open it on a model.

    ``open`` raises :class:`ArmUnavailable` when the arm does not apply to the model.
    """

    name: str
    description: str
    open: Callable[[BenchModel], ArmRunner]


class MeshdRunner:
    """meshd in-process: exactly what ``meshd generate --proposer P`` does."""

    def __init__(self, rt: ModelRuntime, proposer: str, *, adaptive: bool = True,
                 options: Mapping[str, object] | None = None) -> None:
        self.rt = rt
        self.proposer = proposer
        self.adaptive = adaptive
        self.options = options

    def run(self, prompt: Sequence[int], max_tokens: int) -> RunResult:
        t0 = time.perf_counter()
        # No owner: the arms repeat one prompt, and drafting one arm's answer from
        # another's (history lookup) would measure the repetition, not the arm.
        gen = self.rt.generation(prompt, max_tokens=max_tokens, proposer=self.proposer,
                                 adaptive=self.adaptive, proposer_options=self.options,
                                 owner=None)
        first: float | None = None
        for ev in self.rt.run(gen):
            if first is None and ev.tokens:
                first = time.perf_counter()
        end = time.perf_counter()
        st = gen.stats
        return RunResult(
            tokens=tuple(gen.committed), wall_s=end - t0,
            ttft_s=(first if first is not None else end) - t0,
            prefill_s=st.session.prefill_ms / 1e3, forward_s=st.decode_ms / 1e3,
            decode_forwards=st.session.target_forwards - st.session.prefill_forwards,
            stats={**st.as_dict(), "head_ms": gen.decode_head_ms},
        )

    def close(self) -> None:
        """The runtime belongs to the :class:`BenchModel`."""


def meshd_arm(name: str, proposer: str, description: str, *, adaptive: bool = True,
              options: Mapping[str, object] | None = None) -> ArmSpec:
    """An in-process meshd arm for ``proposer`` (``off``, ``auto`` or a registry name)."""

    def open_(bm: BenchModel) -> ArmRunner:
        rt = bm.rt
        resolved = rt.resolve_proposer(proposer)  # None for "off"; "draft:PATH" -> "draft"
        if resolved == "mtp" and not rt.model.info.has_mtp:
            raise ArmUnavailable("the model has no MTP head")
        if resolved is not None and resolved not in rt.registry:
            raise ArmUnavailable(f"no proposer {resolved!r} is installed")
        if proposer != "off" and bm.draft_max == 0:
            raise ArmUnavailable("--draft-max 0 turns speculation off")
        return MeshdRunner(rt, proposer, adaptive=adaptive, options=options)

    return ArmSpec(name, description, open_)


def draft_arm(name: str, description: str) -> ArmSpec:
    """meshd with the ``draft`` proposer on the model's :attr:`BenchModel.draft_path`."""

    def open_(bm: BenchModel) -> ArmRunner:
        if bm.draft_path is None:
            raise ArmUnavailable("no cheaper model with this vocabulary is known; "
                                 "name one with --draft-model")
        if bm.draft_max == 0:
            raise ArmUnavailable("--draft-max 0 turns speculation off")
        return MeshdRunner(bm.rt, f"draft:{bm.draft_path}")

    return ArmSpec(name, description, open_)


class LlamaRunner:
    """llama-cpp-python's ``Llama.create_completion``, greedy, on the same prompt tokens.

    The prompt goes in as a token list (``create_completion`` accepts one and then adds no
    BOS), so ``Llama`` sees exactly meshd's tokens. ``reset()`` before each run forces a
    full prefill: otherwise ``Llama`` would reuse the previous run's KV prefix and its
    timing would not be comparable.
    """

    def __init__(self, bm: BenchModel, *, pld_tokens: int | None = None) -> None:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=pld_tokens) if pld_tokens else None
        self.n_batch = bm.n_batch
        # Any: llama-cpp-python's own annotations are partial (``reset`` is untyped).
        self.llm: Any = Llama(
            model_path=str(bm.spec.path), n_ctx=bm.n_ctx, n_batch=bm.n_batch,
            n_ubatch=bm.n_batch, n_threads=bm.threads, n_threads_batch=bm.threads,
            flash_attn=bm.llama_flash_attn, draft_model=draft, verbose=False,
            type_k=GGML_TYPES[bm.cache_type_k],
            # A draft model forces logits for every row, but Llama sizes its score buffer
            # from this argument (n_batch rows when False): a prompt longer than n_batch
            # then fails with a numpy broadcast error. True only fixes the buffer size.
            logits_all=draft is not None,
        )
        self._tokens: list[int] = []
        self._first = 0.0
        self._evals: list[tuple[int, float]] = []  # (llama_decode calls, seconds) per eval
        generate = self.llm.generate
        evaluate = self.llm.eval

        def recording_generate(*args: Any, **kwargs: Any) -> Iterator[int]:
            for token in generate(*args, **kwargs):
                if not self._tokens:
                    self._first = time.perf_counter()
                self._tokens.append(int(token))
                yield token

        def timed_eval(tokens: Sequence[int]) -> None:
            t0 = time.perf_counter()
            evaluate(tokens)
            self._evals.append((math.ceil(len(tokens) / self.n_batch),
                                time.perf_counter() - t0))

        # Instance attributes shadow the methods create_completion calls (self.generate,
        # self.eval): observation only, the decode loop itself is Llama's.
        setattr(self.llm, "generate", recording_generate)  # noqa: B010
        setattr(self.llm, "eval", timed_eval)  # noqa: B010

    def run(self, prompt: Sequence[int], max_tokens: int) -> RunResult:
        self._tokens = []
        self._evals = []
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.create_completion(
            list(prompt), max_tokens=max_tokens, temperature=0.0, top_k=1, top_p=1.0,
            min_p=0.0, repeat_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0,
            stop=[], seed=0,
        )
        end = time.perf_counter()
        prefill = self._evals[:1]
        decode = self._evals[1:]
        first = self._first if self._tokens else end
        return RunResult(
            tokens=tuple(self._tokens), wall_s=end - t0, ttft_s=first - t0,
            prefill_s=sum(s for _, s in prefill), forward_s=sum(s for _, s in decode),
            decode_forwards=sum(n for n, _ in decode),
        )

    def close(self) -> None:
        self.llm.close()


def llama_arm(name: str, description: str, *, pld: bool) -> ArmSpec:
    """``plain`` (``pld=False``) or ``anchor-pld`` (``LlamaPromptLookupDecoding``)."""

    def open_(bm: BenchModel) -> ArmRunner:
        return LlamaRunner(bm, pld_tokens=bm.pld_tokens if pld else None)

    return ArmSpec(name, description, open_)


#: The reference every other arm is compared with.
REFERENCE_ARM = "plain"

#: Every arm, in the order runs are interleaved (reversed on odd repetitions).
ARMS: tuple[ArmSpec, ...] = (
    llama_arm("plain", "llama_cpp.Llama greedy create_completion (what users run now)",
              pld=False),
    llama_arm("anchor-pld", "llama_cpp.Llama with LlamaPromptLookupDecoding", pld=True),
    meshd_arm("meshd-off", "off", "meshd, speculation off (same engine, empty drafts)"),
    meshd_arm("meshd-ngram", "ngram", "meshd, prompt lookup, adaptive draft length"),
    meshd_arm("meshd-mtp", "mtp", "meshd, the model's MTP head, adaptive draft length"),
    meshd_arm("meshd-mtp-fixed", "mtp", "meshd, MTP head, always --draft-max (no cost model)",
              adaptive=False),
    draft_arm("meshd-draft", "meshd, a smaller same-vocabulary draft model, adaptive"),
    meshd_arm("meshd-composite", "composite", "meshd, MTP + n-gram composite"),
    meshd_arm("meshd-auto", "auto", "meshd default: proposer auto, adaptive"),
)


def arm_names(arms: Sequence[ArmSpec] = ARMS) -> list[str]:
    return [a.name for a in arms]


# --------------------------------------------------------------------------- identity


def first_divergence(ref: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first token where ``got`` leaves ``ref`` (None if identical).

    A stream that is a strict prefix of the other diverges where the shorter one ends.
    """
    for i, (a, b) in enumerate(zip(ref, got, strict=False)):
        if a != b:
            return i
    return None if len(ref) == len(got) else min(len(ref), len(got))


@attrs.frozen
class Margin:
    """The reference model's logits where two streams diverge.

    ``margin`` is top-1 minus top-2 logit: a divergence at a margin of a few hundredths
    is a near-tie that batched and serial float sums may break either way; one at a margin
    of several logits is a bug. ``gap`` is the reference token's logit minus the other
    stream's token's logit (None where one stream had ended).
    """

    index: int
    ref_token: int | None
    got_token: int | None
    top1: int
    top2: int
    margin: float
    gap: float | None

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


def divergence_margin(rt: ModelRuntime, prompt: Sequence[int], ref: Sequence[int],
                      got: Sequence[int], index: int) -> Margin:
    """Prefill ``prompt + ref[:index]`` on a fresh meshd session and read the logits that
    chose token ``index`` (needs a free session slot)."""
    seq = [*prompt, *ref[:index]]
    with SequenceSession.open(rt.context, reserve=len(seq) + 1) as session:
        logits = np.asarray(session.prefill(seq), dtype=np.float64)
    top = np.argsort(-logits, kind="stable")[:2]
    ref_tok = ref[index] if index < len(ref) else None
    got_tok = got[index] if index < len(got) else None
    gap = (float(logits[ref_tok] - logits[got_tok])
           if ref_tok is not None and got_tok is not None else None)
    return Margin(index, ref_tok, got_tok, int(top[0]), int(top[1]),
                  float(logits[top[0]] - logits[top[1]]), gap)


@contextlib.contextmanager
def opened(spec: ArmSpec, bm: BenchModel) -> Iterator[ArmRunner]:
    """Open an arm for a ``with`` block (closed on every exit path)."""
    runner = spec.open(bm)
    try:
        yield runner
    finally:
        runner.close()
