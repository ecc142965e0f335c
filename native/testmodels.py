"""Tiny synthetic GGUF models whose greedy behaviour is known in advance.

``python -m meshd.native.testmodels KIND OUT.gguf [--seed N] [--acceptance A]`` writes one;
:func:`test_model_path` builds one once and caches it. Three kinds:

* ``llama``  - dense attention (2 layers), no MTP head.
* ``qwen35`` - hybrid: gated-delta-net layers 0-2, full attention at layer 3, plus one
  MTP (nextn) block.
* ``mimo2``  - attention only (layer 0 sliding-window, layer 1 full) plus one MTP block.

All weights are F32 and tiny (embedding 128, vocabulary 283, context 2048): a model loads
and generates 200 tokens in a few milliseconds on one CPU core.

Why the models look the way they do
-----------------------------------
Tests of a speculative-decoding runtime need three things that random weights do not give:

1. **No near-ties.** Batched and serial forwards differ in the last float bits; if the
   top two logits are close, greedy output flips and "speculative == plain" tests fail
   for reasons that have nothing to do with the code under test. Here the winning logit
   beats every other by 10 by design (``_M``/``_D`` below); measured over many prompts and
   seeds the smallest gap is about 6.5 for ``qwen35`` and 8 for the others.
2. **History that matters.** A pure bigram model (next = f(current token)) cannot tell
   a correct recurrent-state rollback or KV-cache trim from a wrong one. Here the next
   token depends on the current token *and on the previous one*, and the logits also carry
   a smaller, continuous dependence on the longer history. The previous token reaches the
   current position through the part of the model whose rollback is most at risk:
   the delta-net's short causal convolution (its conv state) in ``qwen35``, a
   "previous-token" attention head (its KV cache) in ``llama`` and ``mimo2``.
   A stale state therefore changes *tokens*, not just logits in the fourth decimal.
3. **An MTP head with a chosen acceptance rate.** The MTP block of ``qwen35``/``mimo2``
   reproduces the target's rule exactly, except that for a seed-chosen fraction
   ``1 - acceptance`` of the tokens its private input embedding (``nextn.embed_tokens``)
   names another token, so its draft after such a token is always wrong. The target
   model itself does not depend on ``acceptance``.

The designed rule (a small finite-state machine, :func:`reference_continuation`):
every token ``x`` has an *own bit* ``bit[x]``; every one of the 120 "active" tokens
(printable ASCII, newline and 24 two-letter merges) has two successors; the next token is
``succ[x_t, bit[x_{t-1}]]`` (at position 0 the token itself stands in for its
predecessor). Other tokens (control bytes, bytes >= 0x80, specials) share the code of an
active token, so they behave like it as input and are never generated. The successor
table comes from an Euler circuit, so from any start the output runs along one cycle of
240 (token, previous-bit) states: 200 generated tokens never repeat a state, each token
occurs at most twice per 240, and EOS is never generated. After 240 tokens the output
repeats exactly (n-gram drafting becomes perfect there).

How the weights implement it (hidden size 128): dimension 0 is a constant, 1 the own
bit, 2 the "previous bit" ``z`` that the trunk writes, 3-7 small history features, 8-127
a one-hot code per active token. The LM head gives +10 to both successors of the current
code and +/-5 by the successor's *colour* times ``z`` (successor ``b`` has colour ``b``),
so the right successor gets 15, the other one 5, every other token at most 5, plus up to
about +/-1.5 from the history features. In ``llama``/``mimo2`` layer 0 has a rotary
"previous-token" head whose score at distance 1 beats every other distance up to 4096 by
at least 20. In ``qwen35`` layer 0 has a delta-net head that forgets its state every step
and whose value taps the conv input at lag 1. The history features come from
content-based attention heads, slowly decaying delta-net heads and the FFNs.
The MTP block gets the current token's embedding and the target's last hidden state
(which carries the previous token's own bit); ``nextn.eh_proj`` copies the first and moves
the bit into ``z``, so the head predicts exactly what the target will.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "BOS_ID",
    "CONTEXT_LENGTH",
    "CYCLE_LENGTH",
    "EOS_ID",
    "GENERATOR_VERSION",
    "KINDS",
    "N_EMBD",
    "N_VOCAB",
    "PAD_ID",
    "main",
    "prev_token_score_gap",
    "reference_continuation",
    "reference_draft",
    "test_model_path",
    "write_test_model",
]

# Bump whenever the bytes written for the same arguments change (the cache is keyed by it).
GENERATOR_VERSION = 1

KINDS = ("llama", "qwen35", "mimo2")

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

# ---------------------------------------------------------------------------- vocabulary

_MERGES = (
    " t", " a", "he", "in", "re", "on", "er", "an", " s", " w", "or", "en",
    " o", " c", "at", "es", "is", "it", " b", " f", "ar", " p", " m", "ou",
)  # fmt: skip
_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>")
FIRST_MERGE_ID = 256
BOS_ID = FIRST_MERGE_ID + len(_MERGES)  # 280
EOS_ID = BOS_ID + 1
PAD_ID = BOS_ID + 2
N_VOCAB = BOS_ID + len(_SPECIALS)  # 283

# Tokens the machine generates: newline, printable ASCII and the merges.
_ACTIVE = np.array(
    [0x0A, *range(0x20, 0x7F), *range(FIRST_MERGE_ID, FIRST_MERGE_ID + len(_MERGES))],
    dtype=np.int64,
)
_N_ACTIVE = len(_ACTIVE)  # 120
CYCLE_LENGTH = 2 * _N_ACTIVE  # 240 (token, previous bit) states

# -------------------------------------------------------------------------- dimensions

N_EMBD = 128
N_FF = 128
HEAD_DIM = 16
CONTEXT_LENGTH = 2048
ROPE_BASE = 10000.0
RMS_EPS = 1e-6

# hidden-state layout
_ONE, _OWN, _Z = 0, 1, 2
_PERT0, _N_PERT = 3, 5
_CODE0 = 8
assert _CODE0 + _N_ACTIVE == N_EMBD

# magnitudes in the residual stream (its RMS stays close to 1)
_ONE_V, _OWN_V, _CODE_V, _BETA = 4.0, 2.0, 10.0, 2.0
_R0 = math.sqrt((_ONE_V**2 + _OWN_V**2 + _CODE_V**2 + _BETA**2) / N_EMBD)
# LM head: +_M for both successors of the current token, +/-_D by colour * previous bit.
_M, _D = 10.0, 5.0
# spread of the history features' weights in the LM head (logit units per unit feature)
_PERT_LOGIT = 0.3

# Previous-token rotary head: share of the score carried by each frequency pair
# (theta_i = 10000^(-2i/16)). Found by a linear program that maximises the smallest
# score gap between distance 1 and any other distance < 4096: the gap is >= 0.205 of
# the total; the head's total score is _PREV_SCORE, so the gap is >= 20.
_ROPE_SHARE = (0.4316, 0.1232, 0.1356, 0.0839, 0.0794, 0.0587, 0.0875, 0.0)
_PREV_SCORE = 100.0


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the byte-level BPE vocabulary."""
    b2u = _bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    for m in _MERGES:
        left, right = (b2u[ord(c)] for c in m)
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    tokens += list(_SPECIALS)
    types = [1] * (N_VOCAB - len(_SPECIALS)) + [3] * len(_SPECIALS)  # NORMAL, CONTROL
    return tokens, types, merges


# ------------------------------------------------------------------------ the machine


@dataclass(frozen=True)
class _Machine:
    """The token rule the weights implement (depends on the seed only)."""

    axis: I64  # (V,) code axis (0..119) of the token, shared by its alias
    sign: F64  # (V,) sign of that code
    bit: I64  # (V,) own bit
    col: I64  # (V,) colour (meaningful for active tokens)
    succ: I64  # (V, 2) next token given the previous token's bit
    partner: I64  # (V,) for active tokens: the token an MTP head with a wrong embedding names
    bad_order: I64  # active tokens in the order they get a wrong MTP embedding


def _euler_cycle(col: I64, bit: I64, rng: np.random.Generator) -> list[tuple[int, int]]:
    """An Euler circuit over the slots (token, previous bit) of the active tokens.

    Slot (y, b) is an edge from node (col[y], b) to node (b, bit[y]); following edges means
    col[next token] == bit[token before the current one], which is what the LM head needs.
    """
    edges = [(int(y), b) for y in _ACTIVE for b in (0, 1)]
    order = rng.permutation(len(edges))
    adj: dict[tuple[int, int], list[int]] = {(a, b): [] for a in (0, 1) for b in (0, 1)}
    for i in order:
        y, b = edges[i]
        adj[(int(col[y]), b)].append(int(i))
    start = (int(col[edges[0][0]]), edges[0][1])
    stack: list[tuple[int, int]] = [start]
    estack: list[int] = []
    circuit: list[int] = []
    while stack:
        node = stack[-1]
        if adj[node]:
            e = adj[node].pop()
            y, b = edges[e]
            stack.append((b, int(bit[y])))
            estack.append(e)
        else:
            stack.pop()
            if estack:
                circuit.append(estack.pop())
    circuit.reverse()
    if len(circuit) != len(edges):  # pragma: no cover - the graph is always connected
        raise RuntimeError("slot graph is not connected")
    return [edges[e] for e in circuit]


@lru_cache(maxsize=64)
def _machine(seed: int) -> _Machine:
    rng = np.random.default_rng([seed, 0])
    v = N_VOCAB
    axis = np.zeros(v, dtype=np.int64)
    sign = np.ones(v, dtype=np.float64)
    bit = rng.integers(0, 2, size=v).astype(np.int64)
    col = np.zeros(v, dtype=np.int64)
    axis[_ACTIVE] = rng.permutation(_N_ACTIVE)
    sign[_ACTIVE] = rng.choice([-1.0, 1.0], size=_N_ACTIVE)
    # balanced (colour, bit) types make the slot graph Eulerian
    types = rng.permutation(np.arange(_N_ACTIVE) % 4)
    col[_ACTIVE] = types >> 1
    bit[_ACTIVE] = types & 1
    is_active = np.zeros(v, dtype=bool)
    is_active[_ACTIVE] = True
    alias = np.arange(v, dtype=np.int64)
    others = np.flatnonzero(~is_active)
    alias[others] = rng.choice(_ACTIVE, size=len(others))
    axis[others] = axis[alias[others]]
    sign[others] = sign[alias[others]]

    cycle = _euler_cycle(col, bit, rng)
    succ = np.full((v, 2), -1, dtype=np.int64)
    for i, (x, b) in enumerate(cycle):
        succ[x, b] = cycle[(i + 1) % len(cycle)][0]
    succ[others] = succ[alias[others]]
    assert (succ >= 0).all()

    rng_acc = np.random.default_rng([seed, 2])
    bad_order = rng_acc.permutation(_ACTIVE)
    partner = np.arange(v, dtype=np.int64)
    for x in _ACTIVE:
        while True:
            p = int(rng_acc.choice(_ACTIVE))
            if succ[p, 0] != succ[x, 0] and succ[p, 1] != succ[x, 1]:
                partner[x] = p
                break
    return _Machine(axis, sign, bit, col, succ, partner, bad_order)


def _check_tokens(tokens: Sequence[int]) -> list[int]:
    out = [int(t) for t in tokens]
    if not out:
        raise ValueError("need at least one token")
    if any(not 0 <= t < N_VOCAB for t in out):
        raise ValueError(f"token ids must be in [0, {N_VOCAB})")
    return out


def reference_continuation(prompt: Sequence[int], n_predict: int, *, seed: int = 0) -> list[int]:
    """The greedy continuation every kind produces for ``prompt`` (exact, no llama.cpp)."""
    m = _machine(seed)
    toks = _check_tokens(prompt)
    out: list[int] = []
    prev, cur = (toks[-2] if len(toks) > 1 else toks[-1]), toks[-1]
    for _ in range(n_predict):
        nxt = int(m.succ[cur, m.bit[prev]])
        out.append(nxt)
        prev, cur = cur, nxt
    return out


def _n_bad(acceptance: float) -> int:
    return round((1.0 - acceptance) * _N_ACTIVE)


def _mtp_succ(m: _Machine, acceptance: float) -> I64:
    succ = m.succ.copy()
    for x in m.bad_order[: _n_bad(acceptance)]:
        succ[x] = m.succ[m.partner[x]]
    return succ


def reference_draft(
    context: Sequence[int], n_draft: int, *, seed: int = 0, acceptance: float = 1.0
) -> list[int]:
    """The MTP head's greedy draft chain after ``context`` (``qwen35``/``mimo2``).

    ``context[-1]`` is the last token the target produced and ``context[-2]`` the one
    before (whose hidden state the MTP head receives with it); needs two tokens.
    With acceptance < 1 the head is wrong right after each of round((1-A)*120) active
    tokens, so a 1-step draft agrees with the target on about a fraction A of the steps.
    """
    toks = _check_tokens(context)
    if len(toks) < 2:
        raise ValueError("the MTP head needs the previous token's hidden state")
    m = _machine(seed)
    succ = _mtp_succ(m, _check_acceptance(acceptance))
    out: list[int] = []
    prev, cur = toks[-2], toks[-1]
    for _ in range(n_draft):
        nxt = int(succ[cur, m.bit[prev]])
        out.append(nxt)
        prev, cur = cur, nxt
    return out


def prev_token_score_gap(n_positions: int = 4096) -> float:
    """Smallest score gap of the previous-token head between distance 1 and any other."""
    theta = ROPE_BASE ** (-np.arange(HEAD_DIM // 2) * 2.0 / HEAD_DIM)
    w = np.array(_ROPE_SHARE) / sum(_ROPE_SHARE) * _PREV_SCORE
    d = np.arange(n_positions, dtype=np.float64) - 1.0
    score = np.cos(d[:, None] * theta[None, :]) @ w
    return float((score[1] - np.delete(score, 1)).min())


# ----------------------------------------------------------------------------- weights


def _check_acceptance(acceptance: float) -> float:
    a = float(acceptance)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance!r}")
    return a


class _Builder:
    """Collects tensors (numpy shapes, i.e. ggml shapes reversed) in writing order."""

    def __init__(self, kind: str, seed: int) -> None:
        self.rng = np.random.default_rng([seed, 1, KINDS.index(kind)])
        self.m = _machine(seed)
        self.kind = kind
        self.tensors: list[tuple[str, F32]] = []

    def add(self, name: str, arr: F64 | F32) -> None:
        self.tensors.append((name, np.ascontiguousarray(arr, dtype=np.float32)))

    def normal(self, scale: float, *shape: int) -> F64:
        return self.rng.normal(0.0, scale, size=shape)

    # -- shared pieces ----------------------------------------------------------------

    def embeddings(self, *, z_offset: float, wrong: Sequence[int] = ()) -> F64:
        m = self.m
        e = np.zeros((N_VOCAB, N_EMBD))
        e[:, _ONE] = _ONE_V
        e[:, _OWN] = np.where(m.bit == 1, _OWN_V, -_OWN_V)
        e[:, _Z] = z_offset
        axis, sign = m.axis.copy(), m.sign.copy()
        for x in wrong:
            axis[x], sign[x] = m.axis[m.partner[x]], m.sign[m.partner[x]]
        e[np.arange(N_VOCAB), _CODE0 + axis] = _CODE_V * sign
        return e

    def lm_head(self) -> F64:
        m = self.m
        w = np.zeros((N_VOCAB, N_EMBD))
        for x in _ACTIVE:
            for b in (0, 1):
                w[m.succ[x, b], _CODE0 + m.axis[x]] += m.sign[x] * _M * _R0 / _CODE_V
        w[_ACTIVE, _Z] = np.where(m.col[_ACTIVE] == 1, 1.0, -1.0) * _D * _R0 / _BETA
        w[_ACTIVE, _PERT0 : _PERT0 + _N_PERT] = self.normal(_PERT_LOGIT, _N_ACTIVE, _N_PERT)
        return w

    def content_proj(self, rows: int, scale: float) -> F64:
        """Rows reading the token code (and a little of everything else but z)."""
        w = np.zeros((rows, N_EMBD))
        w[:, _CODE0:] = self.normal(scale, rows, _N_ACTIVE)
        w[:, _PERT0 : _PERT0 + _N_PERT] = self.normal(scale, rows, _N_PERT)
        return w

    def to_pert(self, cols: int, scale: float) -> F64:
        """An output projection that only writes the history features."""
        w = np.zeros((N_EMBD, cols))
        w[_PERT0 : _PERT0 + _N_PERT] = self.normal(scale, _N_PERT, cols)
        return w

    def ffn(self, prefix: str) -> None:
        self.add(f"{prefix}.ffn_gate.weight", self.normal(1.0 / math.sqrt(N_EMBD), N_FF, N_EMBD))
        self.add(f"{prefix}.ffn_up.weight", self.normal(1.0 / math.sqrt(N_EMBD), N_FF, N_EMBD))
        self.add(f"{prefix}.ffn_down.weight", self.to_pert(N_FF, 0.3 / math.sqrt(N_FF)))

    def prev_token_qk(self, neox: bool, r_in: float) -> tuple[F64, F64]:
        """Columns on the constant dimension giving the previous-token head's q and k."""
        theta = ROPE_BASE ** (-np.arange(HEAD_DIM // 2) * 2.0 / HEAD_DIM)
        share = np.array(_ROPE_SHARE) / sum(_ROPE_SHARE)
        amp = np.sqrt(_PREV_SCORE * share * math.sqrt(HEAD_DIM))
        q = np.zeros(HEAD_DIM)
        k = np.zeros(HEAD_DIM)
        for i in range(HEAD_DIM // 2):
            a, b = (i, i + HEAD_DIM // 2) if neox else (2 * i, 2 * i + 1)
            q[a] = amp[i]
            k[a] = amp[i] * math.cos(theta[i])
            k[b] = amp[i] * math.sin(theta[i])
        scale = r_in / _ONE_V  # the normalised input carries _ONE_V / r_in there
        return q * scale, k * scale


def _rms(*values: float) -> float:
    return math.sqrt(sum(v * v for v in values) / N_EMBD)


# ---- llama / mimo2: attention only ---------------------------------------------------

_A_HEADS, _A_KV = 8, 4


def _attention_weights(
    bld: _Builder, *, prev_token: bool, neox: bool, r_in: float
) -> tuple[F64, F64, F64, F64]:
    """q, k, v, o for one attention layer of llama/mimo2 (8 heads, 4 kv heads, dim 16).

    With ``prev_token``, query head 0 / kv head 0 is the previous-token head writing the
    previous token's own bit into z, and query head 1 averages the own bits of the whole
    history (a long-range feature). Every other head is content-based and writes history
    features.
    """
    hd = HEAD_DIM
    wq = bld.content_proj(_A_HEADS * hd, 0.05)
    wk = bld.content_proj(_A_KV * hd, 0.05)
    wv = bld.content_proj(_A_KV * hd, 0.1)
    wo = bld.to_pert(_A_HEADS * hd, 0.025)
    if prev_token:
        q0, k0 = bld.prev_token_qk(neox, r_in)
        wq[: 2 * hd] = 0.0
        wk[:hd] = 0.0
        wv[:hd] = 0.0
        wq[:hd, _ONE] = q0
        wk[:hd, _ONE] = k0
        wv[0, _OWN] = r_in / _OWN_V  # v[0] = +-1
        wo[:, : 2 * hd] = 0.0
        wo[_Z, 0] = _BETA
        wo[_PERT0, hd] = 0.5
    return wq, wk, wv, wo


def _write_llama_like(bld: _Builder, arch: str, w: Any, acceptance: float) -> None:
    mtp = arch == "mimo2"
    n_trunk = 2
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(n_trunk + (1 if mtp else 0))
    w.add_feed_forward_length(N_FF)
    w.add_head_count(_A_HEADS)
    w.add_head_count_kv(_A_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(N_VOCAB)
    if mtp:
        w.add_nextn_predict_layers(1)
        w.add_expert_feed_forward_length(N_FF)
        w.add_sliding_window(32)
        w.add_sliding_window_pattern([True, False, False])
        w.add_rope_freq_base_swa(ROPE_BASE)

    emb = bld.embeddings(z_offset=0.0)
    bld.add("token_embd.weight", emb)
    bld.add("output_norm.weight", np.ones(N_EMBD))
    bld.add("output.weight", bld.lm_head())
    r_in = _rms(_ONE_V, _OWN_V, _CODE_V)
    for il in range(n_trunk):
        p = f"blk.{il}"
        wq, wk, wv, wo = _attention_weights(bld, prev_token=il == 0, neox=mtp, r_in=r_in)
        bld.add(f"{p}.attn_norm.weight", np.ones(N_EMBD))
        if mtp:
            bld.add(f"{p}.attn_qkv.weight", np.concatenate([wq, wk, wv]))
        else:
            bld.add(f"{p}.attn_q.weight", wq)
            bld.add(f"{p}.attn_k.weight", wk)
            bld.add(f"{p}.attn_v.weight", wv)
        bld.add(f"{p}.attn_output.weight", wo)
        bld.add(f"{p}.ffn_norm.weight", np.ones(N_EMBD))
        bld.ffn(p)
    if mtp:
        p = f"blk.{n_trunk}"
        wq, wk, wv, wo = _attention_weights(bld, prev_token=False, neox=True, r_in=r_in)
        bld.add(f"{p}.attn_norm.weight", np.ones(N_EMBD))
        bld.add(f"{p}.attn_qkv.weight", np.concatenate([wq, wk, wv]))
        bld.add(f"{p}.attn_output.weight", wo * 0.5)
        bld.add(f"{p}.ffn_norm.weight", np.ones(N_EMBD))
        bld.ffn(p)
        _add_nextn(bld, p, acceptance, z_offset=0.0)


# ---- qwen35: gated delta net + attention ----------------------------------------------

_Q_HEADS, _Q_KV = 4, 2
_SSM_STATE, _SSM_GROUPS, _SSM_RANK, _SSM_KERNEL = 16, 2, 2, 4
_SSM_INNER = _SSM_STATE * _SSM_RANK  # 32
_N_TRUNK_QWEN = 4  # layers 0-2 delta net, 3 attention (full_attention_interval = 4)


def _delta_net_layer(
    bld: _Builder, p: str, *, bit_head: bool, decays: tuple[float, float], r_in: float
) -> None:
    """One gated-delta-net block (2 groups, 2 value heads of dimension 16).

    Channel layout of attn_qkv / ssm_conv1d: q (2x16), k (2x16), v (2x16).
    Every head here is a decaying associative memory writing history features, except
    with ``bit_head``: head 0 then forgets everything each step (decay exp(-30)), has a
    constant unit q = k, and its value is the own bit of the previous token read through
    the conv at lag 1 (+ half the current one's, so the first position sees its own bit).
    The gated RMS norm makes the output a fixed pattern per bit; ssm_out maps the "bit 1"
    pattern to +2*beta in z, and the embedding carries -beta there, so z = +-beta.
    """
    s = _SSM_STATE
    n_conv = 2 * s * _SSM_GROUPS + _SSM_INNER  # 96
    q_off, k_off, v_off = 0, s * _SSM_GROUPS, 2 * s * _SSM_GROUPS
    qkv = np.zeros((n_conv, N_EMBD))
    qkv[q_off : q_off + 2 * s] = bld.content_proj(2 * s, 0.1)
    qkv[q_off : q_off + 2 * s, _ONE] = bld.normal(0.3, 2 * s)
    qkv[k_off : k_off + 2 * s] = bld.content_proj(2 * s, 0.1)
    qkv[v_off : v_off + 2 * s] = bld.content_proj(2 * s, 0.15)
    conv = np.zeros((n_conv, _SSM_KERNEL))
    conv[:, -1] = 1.0
    conv[:, :-1] = bld.normal(0.3, n_conv, _SSM_KERNEL - 1)
    gate = np.zeros((_SSM_INNER, N_EMBD))
    gate[:, _ONE] = 2.0 * r_in / _ONE_V  # silu(2): constant output gate
    beta = np.zeros((_SSM_RANK, N_EMBD))
    beta[:, _CODE0:] = bld.normal(0.02, _SSM_RANK, _N_ACTIVE)
    alpha = np.zeros((_SSM_RANK, N_EMBD))
    alpha[:, _CODE0:] = bld.normal(0.02, _SSM_RANK, _N_ACTIVE)
    dt_bias = np.zeros(_SSM_RANK)
    # decay per step = exp(-softplus(dt_bias) * -ssm_a) with dt_bias 0: softplus = ln 2
    ssm_a = np.array([math.log(d) / math.log(2.0) for d in decays])
    out = bld.to_pert(_SSM_INNER, 0.03)
    if bit_head:
        qkv[[*range(q_off, q_off + s), *range(k_off, k_off + s), *range(v_off, v_off + s)]] = 0.0
        qkv[q_off : q_off + s, _ONE] = r_in / _ONE_V
        qkv[k_off : k_off + s, _ONE] = r_in / _ONE_V
        half = s // 2
        qkv[v_off : v_off + half, _OWN] = 8.0 * r_in / _OWN_V
        qkv[v_off + half : v_off + s, _OWN] = -8.0 * r_in / _OWN_V
        conv[q_off : q_off + s] = [0.0, 0.0, 0.0, 1.0]
        conv[k_off : k_off + s] = [0.0, 0.0, 0.0, 1.0]
        conv[v_off : v_off + s] = [0.0, 0.0, 1.0, 0.5]
        beta[0] = 0.0
        beta[0, _ONE] = 10.0 * r_in / _ONE_V
        alpha[0] = 0.0
        dt_bias[0] = 10.0
        ssm_a[0] = -3.0  # gate = softplus(10) * -3 = -30 per step
        out[:, :s] = 0.0
        # normalised pattern: sqrt(2) on the first half, times silu(2) from the gate
        silu2 = 2.0 / (1.0 + math.exp(-2.0))
        out[_Z, :half] = 2.0 * _BETA / (half * math.sqrt(2.0) * silu2)
    bld.add(f"{p}.attn_qkv.weight", qkv)
    bld.add(f"{p}.attn_gate.weight", gate)
    bld.add(f"{p}.ssm_conv1d.weight", conv)
    bld.add(f"{p}.ssm_dt.bias", dt_bias)
    bld.add(f"{p}.ssm_a", ssm_a)
    bld.add(f"{p}.ssm_beta.weight", beta)
    bld.add(f"{p}.ssm_alpha.weight", alpha)
    bld.add(f"{p}.ssm_norm.weight", np.ones(s))
    bld.add(f"{p}.ssm_out.weight", out)


def _qwen_attention(bld: _Builder, p: str, out_scale: float) -> None:
    """Full attention with output gate and q/k norms; content-based, writes features."""
    hd = HEAD_DIM
    wq = bld.content_proj(2 * _Q_HEADS * hd, 0.1)
    for h in range(_Q_HEADS):  # the gate half of each head: sigmoid(~1)
        wq[(2 * h + 1) * hd : (2 * h + 2) * hd, _ONE] = 0.25
    bld.add(f"{p}.attn_q.weight", wq)
    bld.add(f"{p}.attn_k.weight", bld.content_proj(_Q_KV * hd, 0.1))
    bld.add(f"{p}.attn_v.weight", bld.content_proj(_Q_KV * hd, 0.1))
    bld.add(f"{p}.attn_output.weight", bld.to_pert(_Q_HEADS * hd, out_scale))
    bld.add(f"{p}.attn_q_norm.weight", np.ones(hd))
    bld.add(f"{p}.attn_k_norm.weight", np.ones(hd))


def _write_qwen35(bld: _Builder, w: Any, acceptance: float) -> None:
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(_N_TRUNK_QWEN + 1)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(_Q_HEADS)
    w.add_head_count_kv(_Q_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_dimension_sections([3, 3, 2, 0])
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_ssm_conv_kernel(_SSM_KERNEL)
    w.add_ssm_state_size(_SSM_STATE)
    w.add_ssm_group_count(_SSM_GROUPS)
    w.add_ssm_time_step_rank(_SSM_RANK)
    w.add_ssm_inner_size(_SSM_INNER)
    w.add_full_attention_interval(4)
    w.add_nextn_predict_layers(1)
    w.add_vocab_size(N_VOCAB)

    bld.add("token_embd.weight", bld.embeddings(z_offset=-_BETA))
    bld.add("output_norm.weight", np.ones(N_EMBD))
    bld.add("output.weight", bld.lm_head())
    r_in = _rms(_ONE_V, _OWN_V, _CODE_V, _BETA)
    decays = ((0.5, 0.9), (0.8, 0.95), (0.6, 0.9))  # head 0 of layer 0 is the bit head
    for il in range(_N_TRUNK_QWEN):
        p = f"blk.{il}"
        bld.add(f"{p}.attn_norm.weight", np.ones(N_EMBD))
        if il < 3:
            _delta_net_layer(bld, p, bit_head=il == 0, decays=decays[il], r_in=r_in)
        else:
            _qwen_attention(bld, p, 0.03)
        bld.add(f"{p}.post_attention_norm.weight", np.ones(N_EMBD))
        bld.ffn(p)
    p = f"blk.{_N_TRUNK_QWEN}"
    bld.add(f"{p}.attn_norm.weight", np.ones(N_EMBD))
    _qwen_attention(bld, p, 0.02)
    bld.add(f"{p}.post_attention_norm.weight", np.ones(N_EMBD))
    bld.ffn(p)
    _add_nextn(bld, p, acceptance, z_offset=-_BETA)


def _add_nextn(bld: _Builder, p: str, acceptance: float, *, z_offset: float) -> None:
    """eh_proj copies the token half (not z) and moves the hidden half's own bit into z."""
    eh = np.zeros((N_EMBD, 2 * N_EMBD))
    keep = [_ONE, _OWN, *range(_CODE0, N_EMBD)]
    eh[keep, keep] = 1.0
    r_e = _rms(_ONE_V, _OWN_V, _CODE_V, z_offset)
    # hidden half: own bit is +-_OWN_V / _R0 after hnorm; the token half is e / r_e
    eh[_Z, N_EMBD + _OWN] = _BETA * _R0 / (_OWN_V * r_e)
    bld.add(f"{p}.nextn.eh_proj.weight", eh)
    bld.add(f"{p}.nextn.enorm.weight", np.ones(N_EMBD))
    bld.add(f"{p}.nextn.hnorm.weight", np.ones(N_EMBD))
    wrong = bld.m.bad_order[: _n_bad(acceptance)].tolist()
    bld.add(f"{p}.nextn.embed_tokens.weight", bld.embeddings(z_offset=z_offset, wrong=wrong))


# ------------------------------------------------------------------------------ writing


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown test model kind {kind!r}; expected one of {KINDS}")
    return kind


def _check_seed(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return seed


def write_test_model(kind: str, path: Path, *, seed: int = 0, acceptance: float = 1.0) -> Path:
    """Write the ``kind`` test model for ``seed`` to ``path`` (same arguments, same bytes).

    ``acceptance`` (in [0, 1]) sets how often the MTP head's draft matches the target's
    next token; it is ignored for ``llama``, which has no MTP head.
    """
    import gguf  # here, not at the top: keeps importing this module cheap

    _check_kind(kind)
    _check_seed(seed)
    acceptance = _check_acceptance(acceptance)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bld = _Builder(kind, seed)
    w = gguf.GGUFWriter(path, kind)
    w.add_name(f"meshd-test-{kind}")
    w.add_file_type(0)  # ALL_F32
    w.add_uint32("meshd.testmodel.generator_version", GENERATOR_VERSION)
    w.add_uint32("meshd.testmodel.seed", seed)
    if kind != "llama":
        w.add_float32("meshd.testmodel.acceptance", acceptance)
    if kind == "qwen35":
        _write_qwen35(bld, w, acceptance)
    else:
        _write_llama_like(bld, kind, w, acceptance)
    tokens, types, merges = _vocab()
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
    return path


def _default_cache_dir() -> Path:
    env = os.environ.get("MESHD_TEST_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "meshd" / "test-models"


def test_model_path(
    kind: str, *, seed: int = 0, acceptance: float = 1.0, cache_dir: Path | None = None
) -> Path:
    """Path of the cached test model, building it (atomically) on first use.

    Cached by (kind, seed, acceptance, GENERATOR_VERSION) in ``cache_dir`` (default:
    ``$MESHD_TEST_MODEL_CACHE`` or ``~/.cache/meshd/test-models``). Import the module,
    not this function, into test files: pytest would collect a bare ``test_*`` name.
    """
    _check_kind(kind)
    _check_seed(seed)
    acceptance = 1.0 if kind == "llama" else _check_acceptance(acceptance)
    directory = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    path = directory / f"{kind}-seed{seed}-acc{acceptance!r}-v{GENERATOR_VERSION}.gguf"
    if path.is_file():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write_test_model(kind, tmp, seed=seed, acceptance=acceptance)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


test_model_path.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``python -m meshd.native.testmodels KIND OUT.gguf [--seed N] [--acceptance A]``."""
    parser = argparse.ArgumentParser(
        prog="meshd make-test-model",
        description="Write a tiny synthetic GGUF model with a known greedy behaviour.",
    )
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out", type=Path, help="output .gguf path")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--acceptance",
        type=float,
        default=1.0,
        help="share of steps where the MTP head's draft is right (qwen35, mimo2)",
    )
    args = parser.parse_args(argv)
    try:
        path = write_test_model(args.kind, args.out, seed=args.seed, acceptance=args.acceptance)
    except ValueError as exc:
        parser.error(str(exc))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
