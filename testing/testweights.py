"""The weights of the synthetic test models: the designed rule as tensors, at any size.

:mod:`meshd.testing.testmodels` says why the weights look the way they do. This module
builds them. The design lives in a 128-wide hidden space (``DESIGN_EMBD``); a
:class:`Shape` says how large the written tensors are. A larger shape gives the model the
compute of a real one (hidden width, FFN width, attention heads, delta-net heads, trunk
layers, vocabulary) while the designed weights occupy the first slots of every tensor and
everything else is zero:

* the extra hidden dimensions stay exactly 0 in the residual stream, and every RMS norm's
  weight is scaled by sqrt(128 / width) so that the normalised design dimensions are what
  they are in the 128-wide model;
* extra heads, FFN units and whole extra layers read and write zeros, and extra tokens
  have zero rows in the output head (logit 0, far below the winner's ~15).

llama.cpp multiplies zeros like any other number, so a forward costs what the shapes say
and the designed logits (and margins) are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from .testrule import ACTIVE, N_ACTIVE, N_VOCAB, filler_alias, machine, n_bad

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
Arr = npt.NDArray[Any]

KINDS = ("llama", "qwen35", "mimo2")

# ------------------------------------------------------------------------ the design

#: Width of the designed hidden space (and of the tiny models).
DESIGN_EMBD = 128
N_EMBD = DESIGN_EMBD
N_FF = 128
HEAD_DIM = 16
CONTEXT_LENGTH = 2048
ROPE_BASE = 10000.0
RMS_EPS = 1e-6

# hidden-state layout
_ONE, _OWN, _Z = 0, 1, 2
_PERT0, _N_PERT = 3, 5
_CODE0 = 8
assert _CODE0 + N_ACTIVE == DESIGN_EMBD

# magnitudes in the residual stream (its RMS stays close to 1)
_ONE_V, _OWN_V, _CODE_V, _BETA = 4.0, 2.0, 10.0, 2.0
_R0 = math.sqrt((_ONE_V**2 + _OWN_V**2 + _CODE_V**2 + _BETA**2) / DESIGN_EMBD)
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

# designed head counts
_A_HEADS, _A_KV = 8, 4  # llama / mimo2
_Q_HEADS, _Q_KV = 4, 2  # qwen35 attention
_SSM_STATE, _SSM_GROUPS, _SSM_KERNEL = 16, 2, 4  # qwen35 delta net (value heads = groups)
_N_DESIGN_TRUNK = {"llama": 2, "mimo2": 2, "qwen35": 4}


def prev_token_score_gap(n_positions: int = 4096) -> float:
    """Smallest score gap of the previous-token head between distance 1 and any other."""
    theta = ROPE_BASE ** (-np.arange(HEAD_DIM // 2) * 2.0 / HEAD_DIM)
    w = np.array(_ROPE_SHARE) / sum(_ROPE_SHARE) * _PREV_SCORE
    d = np.arange(n_positions, dtype=np.float64) - 1.0
    score = np.cos(d[:, None] * theta[None, :]) @ w
    return float((score[1] - np.delete(score, 1)).min())


# ---------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """Sizes of the written tensors (the design fills the first slots of each).

    ``heads``/``kv_heads`` are attention heads of dimension 16 (a real width comes from
    many narrow heads: the projections cost the same as fewer wide ones);
    ``ssm_heads`` is the delta net's key groups and value heads (equal) of state 16.
    """

    n_embd: int
    n_ff: int
    n_vocab: int
    n_trunk: int
    heads: int
    kv_heads: int
    ssm_heads: int = _SSM_GROUPS
    f16: bool = False

    @property
    def norm_scale(self) -> float:
        """RMS-norm weight that keeps the normalised design dimensions as designed."""
        return math.sqrt(DESIGN_EMBD / self.n_embd)


def tiny_shape(kind: str) -> Shape:
    """The original tiny models: hidden 128, vocabulary 283, 2-4 trunk layers, F32."""
    heads, kv = (_Q_HEADS, _Q_KV) if kind == "qwen35" else (_A_HEADS, _A_KV)
    return Shape(N_EMBD, N_FF, N_VOCAB, _N_DESIGN_TRUNK[kind], heads, kv)


#: Realistic sizes: (hidden, FFN, trunk layers) per kind; vocabulary 32768, F16.
SIZES: dict[str, dict[str, tuple[int, int, int]]] = {
    "0.5b": {"qwen35": (1024, 3584, 24), "mimo2": (1024, 4096, 24), "llama": (1024, 4096, 24)},
    "1b": {"qwen35": (2048, 4864, 16), "mimo2": (2048, 5632, 16), "llama": (2048, 5632, 16)},
}
REAL_VOCAB = 32768


def sized_shape(kind: str, size: str) -> Shape:
    """The shape of a ``size`` model (``0.5b``, ``1b``) of ``kind``."""
    try:
        e, ff, trunk = SIZES[size][kind]
    except KeyError:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}") from None
    heads = e // HEAD_DIM
    return Shape(e, ff, REAL_VOCAB, trunk, heads, heads // 4, e // _SSM_STATE, f16=True)


# --------------------------------------------------------------------------- builder


class Builder:
    """Collects tensors (numpy shapes, i.e. ggml shapes reversed) in writing order."""

    def __init__(self, kind: str, seed: int, shape: Shape) -> None:
        self.rng = np.random.default_rng([seed, 1, KINDS.index(kind)])
        self.m = machine(seed)
        self.kind = kind
        self.shape = shape
        self.tensors: list[tuple[str, Arr]] = []

    def _dtype(self, name: str, ndim: int) -> type[np.floating[Any]]:
        small = ndim < 2 or name.endswith("ssm_conv1d.weight")
        return np.float16 if self.shape.f16 and not small else np.float32

    def add(self, name: str, arr: Arr, full: tuple[int, ...] | None = None) -> None:
        """Add ``arr``, zero-padded at the end of each axis to ``full`` when given."""
        dtype = self._dtype(name, arr.ndim)
        if full is None or tuple(full) == arr.shape:
            self.tensors.append((name, np.ascontiguousarray(arr, dtype=dtype)))
            return
        out = np.zeros(full, dtype=dtype)
        out[tuple(slice(0, n) for n in arr.shape)] = arr
        self.tensors.append((name, out))

    def zeros(self, name: str, full: tuple[int, ...]) -> None:
        """A tensor that costs its shape and contributes nothing (untouched zero pages)."""
        self.tensors.append((name, np.zeros(full, dtype=self._dtype(name, len(full)))))

    def rows(self, name: str, arr: Arr, n_rows: int) -> None:
        """A matrix reading the hidden state: design (r, 128) -> (n_rows, width)."""
        self.add(name, arr, (n_rows, self.shape.n_embd))

    def cols(self, name: str, arr: Arr, n_cols: int) -> None:
        """A matrix writing the hidden state: design (128, c) -> (width, n_cols)."""
        self.add(name, arr, (self.shape.n_embd, n_cols))

    def norm(self, name: str) -> None:
        self.add(name, np.full(self.shape.n_embd, self.shape.norm_scale))

    def normal(self, scale: float, *shape: int) -> F64:
        return self.rng.normal(0.0, scale, size=shape)

    # -- shared pieces ----------------------------------------------------------------

    def embeddings(self, name: str, *, z_offset: float, wrong: Sequence[int] = ()) -> None:
        m = self.m
        e = np.zeros((N_VOCAB, DESIGN_EMBD))
        e[:, _ONE] = _ONE_V
        e[:, _OWN] = np.where(m.bit == 1, _OWN_V, -_OWN_V)
        e[:, _Z] = z_offset
        axis, sign = m.axis.copy(), m.sign.copy()
        for x in wrong:
            axis[x], sign[x] = m.axis[m.partner[x]], m.sign[m.partner[x]]
        e[np.arange(N_VOCAB), _CODE0 + axis] = _CODE_V * sign
        if self.shape.n_vocab > N_VOCAB:  # filler tokens read like an active token
            e = np.concatenate([e, e[filler_alias(self.shape.n_vocab)]])
        self.rows(name, e, self.shape.n_vocab)

    def lm_head(self, name: str) -> None:
        m = self.m
        w = np.zeros((N_VOCAB, DESIGN_EMBD))
        for x in ACTIVE:
            for b in (0, 1):
                w[m.succ[x, b], _CODE0 + m.axis[x]] += m.sign[x] * _M * _R0 / _CODE_V
        w[ACTIVE, _Z] = np.where(m.col[ACTIVE] == 1, 1.0, -1.0) * _D * _R0 / _BETA
        w[ACTIVE, _PERT0 : _PERT0 + _N_PERT] = self.normal(_PERT_LOGIT, N_ACTIVE, _N_PERT)
        self.rows(name, w, self.shape.n_vocab)  # filler tokens: zero rows, logit 0

    def content_proj(self, rows: int, scale: float) -> F64:
        """Rows reading the token code (and a little of everything else but z)."""
        w = np.zeros((rows, DESIGN_EMBD))
        w[:, _CODE0:] = self.normal(scale, rows, N_ACTIVE)
        w[:, _PERT0 : _PERT0 + _N_PERT] = self.normal(scale, rows, _N_PERT)
        return w

    def to_pert(self, cols: int, scale: float) -> F64:
        """An output projection that only writes the history features."""
        w = np.zeros((DESIGN_EMBD, cols))
        w[_PERT0 : _PERT0 + _N_PERT] = self.normal(scale, _N_PERT, cols)
        return w

    def ffn(self, prefix: str) -> None:
        ff = self.shape.n_ff
        scale = 1.0 / math.sqrt(DESIGN_EMBD)
        self.rows(f"{prefix}.ffn_gate.weight", self.normal(scale, N_FF, DESIGN_EMBD), ff)
        self.rows(f"{prefix}.ffn_up.weight", self.normal(scale, N_FF, DESIGN_EMBD), ff)
        self.cols(f"{prefix}.ffn_down.weight", self.to_pert(N_FF, 0.3 / math.sqrt(N_FF)), ff)

    def zero_ffn(self, prefix: str) -> None:
        e, ff = self.shape.n_embd, self.shape.n_ff
        self.zeros(f"{prefix}.ffn_gate.weight", (ff, e))
        self.zeros(f"{prefix}.ffn_up.weight", (ff, e))
        self.zeros(f"{prefix}.ffn_down.weight", (e, ff))

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
    return math.sqrt(sum(v * v for v in values) / DESIGN_EMBD)


def _pad_rows(arr: F64, n: int) -> F64:
    return np.concatenate([arr, np.zeros((n - arr.shape[0], arr.shape[1]))]) \
        if n > arr.shape[0] else arr


# ---- llama / mimo2: attention only ---------------------------------------------------


def _attention_weights(
    bld: Builder, *, prev_token: bool, neox: bool, r_in: float
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


def _add_attention(bld: Builder, p: str, fused: bool, weights: tuple[F64, F64, F64, F64],
                   o_scale: float = 1.0) -> None:
    sh = bld.shape
    nq, nkv = sh.heads * HEAD_DIM, sh.kv_heads * HEAD_DIM
    wq, wk, wv, wo = weights
    if fused:
        qkv = np.concatenate([_pad_rows(wq, nq), _pad_rows(wk, nkv), _pad_rows(wv, nkv)])
        bld.rows(f"{p}.attn_qkv.weight", qkv, nq + 2 * nkv)
    else:
        bld.rows(f"{p}.attn_q.weight", wq, nq)
        bld.rows(f"{p}.attn_k.weight", wk, nkv)
        bld.rows(f"{p}.attn_v.weight", wv, nkv)
    bld.cols(f"{p}.attn_output.weight", wo * o_scale if o_scale != 1.0 else wo, nq)


def _zero_attention(bld: Builder, p: str, fused: bool) -> None:
    sh = bld.shape
    e, nq, nkv = sh.n_embd, sh.heads * HEAD_DIM, sh.kv_heads * HEAD_DIM
    if fused:
        bld.zeros(f"{p}.attn_qkv.weight", (nq + 2 * nkv, e))
    else:
        bld.zeros(f"{p}.attn_q.weight", (nq, e))
        bld.zeros(f"{p}.attn_k.weight", (nkv, e))
        bld.zeros(f"{p}.attn_v.weight", (nkv, e))
    bld.zeros(f"{p}.attn_output.weight", (e, nq))


def swa_pattern(n_trunk: int) -> list[bool]:
    """mimo2's sliding-window layers: 0 (the previous-token head) and then five in six."""
    return [True, False] + [i % 6 != 5 for i in range(2, n_trunk)] + [False]


def write_llama_like(bld: Builder, arch: str, w: Any, acceptance: float) -> None:
    sh = bld.shape
    mtp = arch == "mimo2"
    n_trunk = sh.n_trunk
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(sh.n_embd)
    w.add_block_count(n_trunk + (1 if mtp else 0))
    w.add_feed_forward_length(sh.n_ff)
    w.add_head_count(sh.heads)
    w.add_head_count_kv(sh.kv_heads)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_vocab_size(sh.n_vocab)
    if mtp:
        w.add_nextn_predict_layers(1)
        w.add_expert_feed_forward_length(sh.n_ff)
        w.add_sliding_window(32)
        w.add_sliding_window_pattern(swa_pattern(n_trunk))
        w.add_rope_freq_base_swa(ROPE_BASE)

    bld.embeddings("token_embd.weight", z_offset=0.0)
    bld.norm("output_norm.weight")
    bld.lm_head("output.weight")
    r_in = _rms(_ONE_V, _OWN_V, _CODE_V)
    for il in range(n_trunk):
        p = f"blk.{il}"
        bld.norm(f"{p}.attn_norm.weight")
        if il < _N_DESIGN_TRUNK[arch]:
            weights = _attention_weights(bld, prev_token=il == 0, neox=mtp, r_in=r_in)
            _add_attention(bld, p, mtp, weights)
            bld.norm(f"{p}.ffn_norm.weight")
            bld.ffn(p)
        else:
            _zero_attention(bld, p, mtp)
            bld.norm(f"{p}.ffn_norm.weight")
            bld.zero_ffn(p)
    if mtp:
        p = f"blk.{n_trunk}"
        weights = _attention_weights(bld, prev_token=False, neox=True, r_in=r_in)
        bld.norm(f"{p}.attn_norm.weight")
        _add_attention(bld, p, True, weights, o_scale=0.5)
        bld.norm(f"{p}.ffn_norm.weight")
        bld.ffn(p)
        add_nextn(bld, p, acceptance, z_offset=0.0)


# ---- qwen35: gated delta net + attention ----------------------------------------------


def _delta_net_layer(
    bld: Builder, p: str, *, bit_head: bool, decays: tuple[float, float], r_in: float
) -> None:
    """One gated-delta-net block (2 groups, 2 value heads of dimension 16 designed).

    Channel layout of attn_qkv / ssm_conv1d: q (G x 16), k (G x 16), v (G x 16); the
    design uses the first two heads of each part.
    Every head here is a decaying associative memory writing history features, except
    with ``bit_head``: head 0 then forgets everything each step (decay exp(-30)), has a
    constant unit q = k, and its value is the own bit of the previous token read through
    the conv at lag 1 (+ half the current one's, so the first position sees its own bit).
    The gated RMS norm makes the output a fixed pattern per bit; ssm_out maps the "bit 1"
    pattern to +2*beta in z, and the embedding carries -beta there, so z = +-beta.
    """
    s, g = _SSM_STATE, _SSM_GROUPS
    inner = s * g  # 32 designed value channels
    n_conv = 2 * s * g + inner  # 96
    q_off, k_off, v_off = 0, s * g, 2 * s * g
    qkv = np.zeros((n_conv, DESIGN_EMBD))
    qkv[q_off : q_off + 2 * s] = bld.content_proj(2 * s, 0.1)
    qkv[q_off : q_off + 2 * s, _ONE] = bld.normal(0.3, 2 * s)
    qkv[k_off : k_off + 2 * s] = bld.content_proj(2 * s, 0.1)
    qkv[v_off : v_off + 2 * s] = bld.content_proj(2 * s, 0.15)
    conv = np.zeros((n_conv, _SSM_KERNEL))
    conv[:, -1] = 1.0
    conv[:, :-1] = bld.normal(0.3, n_conv, _SSM_KERNEL - 1)
    gate = np.zeros((inner, DESIGN_EMBD))
    gate[:, _ONE] = 2.0 * r_in / _ONE_V  # silu(2): constant output gate
    beta = np.zeros((g, DESIGN_EMBD))
    beta[:, _CODE0:] = bld.normal(0.02, g, N_ACTIVE)
    alpha = np.zeros((g, DESIGN_EMBD))
    alpha[:, _CODE0:] = bld.normal(0.02, g, N_ACTIVE)
    dt_bias = np.zeros(g)
    # decay per step = exp(-softplus(dt_bias) * -ssm_a) with dt_bias 0: softplus = ln 2
    ssm_a = np.array([math.log(d) / math.log(2.0) for d in decays])
    out = bld.to_pert(inner, 0.03)
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
    heads = bld.shape.ssm_heads
    wide = s * heads
    if heads != g:  # scatter the q, k, v parts to their offsets in the wider layout
        qkv, conv = (_scatter_qkv(a, s * g, wide) for a in (qkv, conv))
    bld.rows(f"{p}.attn_qkv.weight", qkv, 3 * wide)
    bld.rows(f"{p}.attn_gate.weight", gate, wide)
    bld.add(f"{p}.ssm_conv1d.weight", conv, (3 * wide, _SSM_KERNEL))
    bld.add(f"{p}.ssm_dt.bias", dt_bias, (heads,))
    bld.add(f"{p}.ssm_a", ssm_a, (heads,))
    bld.rows(f"{p}.ssm_beta.weight", beta, heads)
    bld.rows(f"{p}.ssm_alpha.weight", alpha, heads)
    bld.add(f"{p}.ssm_norm.weight", np.ones(s))
    bld.cols(f"{p}.ssm_out.weight", out, wide)


def _scatter_qkv(arr: F64, part: int, wide: int) -> F64:
    """Move the designed q, k, v parts (``part`` rows each) to offsets 0, wide, 2*wide."""
    out = np.zeros((3 * wide, arr.shape[1]))
    for i in range(3):
        out[i * wide : i * wide + part] = arr[i * part : (i + 1) * part]
    return out


def _zero_delta_net(bld: Builder, p: str) -> None:
    e, heads = bld.shape.n_embd, bld.shape.ssm_heads
    wide = _SSM_STATE * heads
    bld.zeros(f"{p}.attn_qkv.weight", (3 * wide, e))
    bld.zeros(f"{p}.attn_gate.weight", (wide, e))
    bld.zeros(f"{p}.ssm_conv1d.weight", (3 * wide, _SSM_KERNEL))
    bld.zeros(f"{p}.ssm_dt.bias", (heads,))
    bld.add(f"{p}.ssm_a", np.full(heads, -1.0))
    bld.zeros(f"{p}.ssm_beta.weight", (heads, e))
    bld.zeros(f"{p}.ssm_alpha.weight", (heads, e))
    bld.add(f"{p}.ssm_norm.weight", np.ones(_SSM_STATE))
    bld.zeros(f"{p}.ssm_out.weight", (e, wide))


def _qwen_attention(bld: Builder, p: str, out_scale: float | None) -> None:
    """Full attention with output gate and q/k norms; content-based, writes features.

    ``out_scale`` None: a filler layer (all projections zero).
    """
    hd = HEAD_DIM
    sh = bld.shape
    nq, nkv = 2 * sh.heads * hd, sh.kv_heads * hd
    if out_scale is None:
        bld.zeros(f"{p}.attn_q.weight", (nq, sh.n_embd))
        bld.zeros(f"{p}.attn_k.weight", (nkv, sh.n_embd))
        bld.zeros(f"{p}.attn_v.weight", (nkv, sh.n_embd))
        bld.zeros(f"{p}.attn_output.weight", (sh.n_embd, nq // 2))
    else:
        wq = bld.content_proj(2 * _Q_HEADS * hd, 0.1)
        for h in range(_Q_HEADS):  # the gate half of each head: sigmoid(~1)
            wq[(2 * h + 1) * hd : (2 * h + 2) * hd, _ONE] = 0.25
        bld.rows(f"{p}.attn_q.weight", wq, nq)
        bld.rows(f"{p}.attn_k.weight", bld.content_proj(_Q_KV * hd, 0.1), nkv)
        bld.rows(f"{p}.attn_v.weight", bld.content_proj(_Q_KV * hd, 0.1), nkv)
        bld.cols(f"{p}.attn_output.weight", bld.to_pert(_Q_HEADS * hd, out_scale), nq // 2)
    bld.add(f"{p}.attn_q_norm.weight", np.ones(hd))
    bld.add(f"{p}.attn_k_norm.weight", np.ones(hd))


def write_qwen35(bld: Builder, w: Any, acceptance: float) -> None:
    sh = bld.shape
    n_trunk = sh.n_trunk
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(sh.n_embd)
    w.add_block_count(n_trunk + 1)
    w.add_feed_forward_length(sh.n_ff)
    w.add_head_count(sh.heads)
    w.add_head_count_kv(sh.kv_heads)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_dimension_sections([3, 3, 2, 0])
    w.add_rope_freq_base(ROPE_BASE)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_ssm_conv_kernel(_SSM_KERNEL)
    w.add_ssm_state_size(_SSM_STATE)
    w.add_ssm_group_count(sh.ssm_heads)
    w.add_ssm_time_step_rank(sh.ssm_heads)
    w.add_ssm_inner_size(_SSM_STATE * sh.ssm_heads)
    w.add_full_attention_interval(4)
    w.add_nextn_predict_layers(1)
    w.add_vocab_size(sh.n_vocab)

    bld.embeddings("token_embd.weight", z_offset=-_BETA)
    bld.norm("output_norm.weight")
    bld.lm_head("output.weight")
    r_in = _rms(_ONE_V, _OWN_V, _CODE_V, _BETA)
    decays = ((0.5, 0.9), (0.8, 0.95), (0.6, 0.9))  # head 0 of layer 0 is the bit head
    designed = _N_DESIGN_TRUNK["qwen35"]
    for il in range(n_trunk):
        p = f"blk.{il}"
        bld.norm(f"{p}.attn_norm.weight")
        recurrent = (il + 1) % 4 != 0
        if il < designed and recurrent:
            _delta_net_layer(bld, p, bit_head=il == 0, decays=decays[il], r_in=r_in)
        elif recurrent:
            _zero_delta_net(bld, p)
        else:
            _qwen_attention(bld, p, 0.03 if il < designed else None)
        bld.norm(f"{p}.post_attention_norm.weight")
        if il < designed:
            bld.ffn(p)
        else:
            bld.zero_ffn(p)
    p = f"blk.{n_trunk}"
    bld.norm(f"{p}.attn_norm.weight")
    _qwen_attention(bld, p, 0.02)
    bld.norm(f"{p}.post_attention_norm.weight")
    bld.ffn(p)
    add_nextn(bld, p, acceptance, z_offset=-_BETA)


def add_nextn(bld: Builder, p: str, acceptance: float, *, z_offset: float) -> None:
    """eh_proj copies the token half (not z) and moves the hidden half's own bit into z."""
    d, e = DESIGN_EMBD, bld.shape.n_embd
    eh = np.zeros((d, 2 * d))
    keep = [_ONE, _OWN, *range(_CODE0, d)]
    eh[keep, keep] = 1.0
    r_e = _rms(_ONE_V, _OWN_V, _CODE_V, z_offset)
    # hidden half: own bit is +-_OWN_V / _R0 after hnorm; the token half is e / r_e
    eh[_Z, d + _OWN] = _BETA * _R0 / (_OWN_V * r_e)
    if e != d:  # the hidden half starts at column e in the wide layout
        wide = np.zeros((d, 2 * e))
        wide[:, :d] = eh[:, :d]
        wide[:, e : e + d] = eh[:, d:]
        eh = wide
    bld.add(f"{p}.nextn.eh_proj.weight", eh, (e, 2 * e))
    bld.norm(f"{p}.nextn.enorm.weight")
    bld.norm(f"{p}.nextn.hnorm.weight")
    wrong = bld.m.bad_order[: n_bad(acceptance)].tolist()
    bld.embeddings(f"{p}.nextn.embed_tokens.weight", z_offset=z_offset, wrong=wrong)
