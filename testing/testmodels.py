"""Tiny synthetic GGUF models whose greedy behaviour is known in advance.

``meshd make-test-model KIND OUT.gguf [--seed N] [--acceptance A] [--size 0.5b|1b]
[--type f16|q8_0|q4_k_m]`` writes one; :func:`test_model_path` builds one once and caches
it. Kinds: ``llama`` (dense attention, no MTP head), ``qwen35`` (hybrid: gated delta-net
and full attention, one MTP block), ``mimo2`` (attention only, one MTP block). Without
``size`` the weights are tiny F32; with ``size`` the same rule runs in a model with the
compute of a real one (quantized by llama.cpp's own quantizer), because only a model of
real cost shows whether speculation, and its MTP head, pays.

Why synthetic: tests of speculative decoding need no near-ties (greedy output must not
flip on the last float bits of batched forwards), history that matters (a wrong rollback
must change *tokens*), and an MTP head with a chosen acceptance. The comment after the
imports says how the rule and the weights give that. Related modules:
:mod:`~meshd.testing.testrule`, :mod:`~meshd.testing.testweights` and
:mod:`~meshd.testing.testcheck`.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from .testrule import (
    BOS_ID,
    CYCLE_LENGTH,
    EOS_ID,
    N_VOCAB,
    PAD_ID,
    check_acceptance,
    filler_tokens,
    reference_continuation,
    reference_draft,
    vocab,
)
from .testweights import (
    HEAD_DIM,
    KINDS,
    N_EMBD,
    SIZES,
    Builder,
    prev_token_score_gap,
    sized_shape,
    tiny_shape,
    write_llama_like,
    write_qwen35,
)

# Why the models look the way they do
# -----------------------------------
# Tests of a speculative-decoding runtime need three things that random weights do not give:
#
# 1. **No near-ties.** Batched and serial forwards differ in the last float bits; if the
#    top two logits are close, greedy output flips and "speculative == plain" tests fail
#    for reasons that have nothing to do with the code under test. Here the winning logit
#    beats every other by 10 by design (``_M``/``_D`` below).
# 2. **History that matters.** A pure bigram model (next = f(current token)) cannot tell
#    a correct recurrent-state rollback or KV-cache trim from a wrong one. Here the next
#    token depends on the current token *and on the previous one*, and the logits also carry
#    a smaller, continuous dependence on the longer history. The previous token reaches the
#    current position through the part of the model whose rollback is most at risk:
#    the delta-net's short causal convolution (its conv state) in ``qwen35``, a
#    "previous-token" attention head (its KV cache) in ``llama`` and ``mimo2``.
#    A stale state therefore changes *tokens*, not just logits in the fourth decimal.
# 3. **An MTP head with a chosen acceptance rate.** The MTP block of ``qwen35``/``mimo2``
#    reproduces the target's rule exactly, except that for a seed-chosen fraction
#    ``1 - acceptance`` of the tokens its private input embedding (``nextn.embed_tokens``)
#    names another token, so its draft after such a token is always wrong. The target
#    model itself does not depend on ``acceptance``.
#
# The designed rule (a small finite-state machine, :func:`reference_continuation`):
# every token ``x`` has an *own bit* ``bit[x]``; every one of the 120 "active" tokens
# (printable ASCII, newline and 24 two-letter merges) has two successors; the next token is
# ``succ[x_t, bit[x_{t-1}]]`` (at position 0 the token itself stands in for its
# predecessor). Other tokens (control bytes, bytes >= 0x80, specials) share the code of an
# active token, so they behave like it as input and are never generated. The successor
# table comes from an Euler circuit, so from any start the output runs along one cycle of
# 240 (token, previous-bit) states: 200 generated tokens never repeat a state, each token
# occurs at most twice per 240, and EOS is never generated. After 240 tokens the output
# repeats exactly (n-gram drafting becomes perfect there).
#
# How the weights implement it (hidden size 128): dimension 0 is a constant, 1 the own
# bit, 2 the "previous bit" ``z`` that the trunk writes, 3-7 small history features, 8-127
# a one-hot code per active token. The LM head gives +10 to both successors of the current
# code and +/-5 by the successor's *colour* times ``z`` (successor ``b`` has colour ``b``),
# so the right successor gets 15, the other one 5, every other token at most 5, plus up to
# about +/-1.5 from the history features. In ``llama``/``mimo2`` layer 0 has a rotary
# "previous-token" head whose score at distance 1 beats every other distance up to 4096 by
# at least 20. In ``qwen35`` layer 0 has a delta-net head that forgets its state every step
# and whose value taps the conv input at lag 1. The history features come from
# content-based attention heads, slowly decaying delta-net heads and the FFNs.
# The MTP block gets the current token's embedding and the target's last hidden state
# (which carries the previous token's own bit); ``nextn.eh_proj`` copies the first and moves
# the bit into ``z``, so the head predicts exactly what the target will.

__all__ = [
    "BOS_ID",
    "CYCLE_LENGTH",
    "EOS_ID",
    "GENERATOR_VERSION",
    "HEAD_DIM",
    "KINDS",
    "N_EMBD",
    "N_VOCAB",
    "PAD_ID",
    "QUANT_TYPES",
    "SIZES",
    "main",
    "prev_token_score_gap",
    "reference_continuation",
    "reference_draft",
    "test_model_path",
    "write_test_model",
]

# Bump whenever the bytes written for the same arguments change (the cache is keyed by it).
GENERATOR_VERSION = 1

#: Types a sized model can be written in (llama.cpp file types).
QUANT_TYPES = {
    "f16": "LLAMA_FTYPE_MOSTLY_F16",
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
}
DEFAULT_SIZED_TYPE = "q8_0"


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown test model kind {kind!r}; expected one of {KINDS}")
    return kind


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return seed


def _check_size(size: str | None, qtype: str | None) -> str | None:
    if size is None:
        if qtype is not None:
            raise ValueError("a type (--type) needs a size (--size): tiny models are F32")
        return None
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    q = qtype or DEFAULT_SIZED_TYPE
    if q not in QUANT_TYPES:
        raise ValueError(f"unknown type {qtype!r}; known: {', '.join(QUANT_TYPES)}")
    return q


def _write_gguf(kind: str, path: Path, seed: int, acceptance: float, size: str | None) -> None:
    import gguf  # here, not at the top: keeps importing this module cheap

    shape = tiny_shape(kind) if size is None else sized_shape(kind, size)
    bld = Builder(kind, seed, shape)
    w = gguf.GGUFWriter(path, kind)
    w.add_name(f"meshd-test-{kind}" if size is None else f"meshd-test-{kind}-{size}")
    w.add_file_type(0 if size is None else 1)  # ALL_F32 / MOSTLY_F16
    w.add_uint32("meshd.testmodel.generator_version", GENERATOR_VERSION)
    w.add_uint32("meshd.testmodel.seed", seed)
    if kind != "llama":
        w.add_float32("meshd.testmodel.acceptance", acceptance)
    if size is not None:
        w.add_string("meshd.testmodel.size", size)
    if kind == "qwen35":
        write_qwen35(bld, w, acceptance)
    else:
        write_llama_like(bld, kind, w, acceptance)
    tokens, types, merges = vocab()
    if shape.n_vocab > N_VOCAB:
        tokens += filler_tokens(shape.n_vocab)
        types += [1] * (shape.n_vocab - N_VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    for name, arr in bld.tensors:
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src: Path, dst: Path, qtype: str, *, threads: int | None = None) -> None:
    """``dst`` = ``src`` quantized to ``qtype`` by llama.cpp's ``llama_model_quantize``."""
    from meshd.native.llama import ensure_backend, lc

    ensure_backend()
    params = lc.llama_model_quantize_default_params()
    params.ftype = int(getattr(lc, QUANT_TYPES[qtype]))
    params.allow_requantize = True
    params.nthread = threads or 0
    rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {qtype}) failed with code {rc}")


def write_test_model(
    kind: str,
    path: Path,
    *,
    seed: int = 0,
    acceptance: float = 1.0,
    size: str | None = None,
    qtype: str | None = None,
) -> Path:
    """Write the ``kind`` test model for ``seed`` to ``path`` (same arguments, same bytes).

    ``acceptance`` (in [0, 1]) sets how often the MTP head's draft matches the target's
    next token; it is ignored for ``llama``, which has no MTP head. ``size`` (``0.5b``,
    ``1b``) writes a model of realistic cost, in ``qtype`` (``f16``, ``q8_0`` (default),
    ``q4_k_m``); without it the model is tiny and F32.
    """
    _check_kind(kind)
    _check_seed(seed)
    acceptance = check_acceptance(acceptance)
    qtype = _check_size(size, qtype)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if qtype is None or qtype == "f16":
        _write_gguf(kind, path, seed, acceptance, size)
        return path
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".f16", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _write_gguf(kind, tmp, seed, acceptance, size)
        quantize(tmp, path, qtype)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _default_cache_dir() -> Path:
    env = os.environ.get("MESHD_TEST_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "meshd" / "test-models"


def test_model_path(
    kind: str,
    *,
    seed: int = 0,
    acceptance: float = 1.0,
    size: str | None = None,
    qtype: str | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """Path of the cached test model, building it (atomically) on first use.

    Cached by (kind, seed, acceptance, size, type, GENERATOR_VERSION) in ``cache_dir``
    (default: ``$MESHD_TEST_MODEL_CACHE`` or ``~/.cache/meshd/test-models``). Import the
    module, not this function, into test files: pytest would collect a bare ``test_*``.
    """
    _check_kind(kind)
    _check_seed(seed)
    acceptance = 1.0 if kind == "llama" else check_acceptance(acceptance)
    qtype = _check_size(size, qtype)
    directory = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    sized = "" if size is None else f"-{size}-{qtype}"
    path = directory / f"{kind}{sized}-seed{seed}-acc{acceptance!r}-v{GENERATOR_VERSION}.gguf"
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write_test_model(kind, tmp, seed=seed, acceptance=acceptance, size=size, qtype=qtype)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


test_model_path.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``make-test-model`` arguments (shared with ``meshd``)."""
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out", type=Path, help="output .gguf path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--acceptance",
        type=float,
        default=1.0,
        help="share of steps where the MTP head's draft is right (qwen35, mimo2)",
    )
    parser.add_argument("--size", choices=list(SIZES), default=None,
                        help="a model of realistic cost (default: tiny, F32)")
    parser.add_argument("--type", dest="qtype", choices=list(QUANT_TYPES), default=None,
                        help=f"weights of a sized model (default {DEFAULT_SIZED_TYPE})")
    parser.add_argument("--no-check", action="store_true",
                        help="skip running a sized model to report its margins")


def run(args: argparse.Namespace) -> int:
    """Write the model; for a sized one, run it and print size and the rule's margins."""
    try:
        path = write_test_model(args.kind, args.out, seed=args.seed, acceptance=args.acceptance,
                                size=args.size, qtype=args.qtype)
    except ValueError as exc:
        print(f"meshd make-test-model: {exc}", file=sys.stderr)
        return 2
    print(path)
    if args.size is not None and not args.no_check:
        from .testcheck import check_rule

        report = check_rule(path, seed=args.seed)
        print(report.describe())
        return 0 if report.follows_rule else 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m meshd.testing.testmodels KIND OUT.gguf [--seed N] [--acceptance A]``."""
    parser = argparse.ArgumentParser(
        prog="meshd make-test-model",
        description="Write a synthetic GGUF model with a known greedy behaviour.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
