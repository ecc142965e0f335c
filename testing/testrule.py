"""The designed token rule of the synthetic test models, and their vocabulary.

The rule is a small finite-state machine (see :mod:`meshd.testing.testmodels` for why it
looks the way it does): every token ``x`` has an *own bit* ``bit[x]``; every one of the
120 "active" tokens (printable ASCII, newline and 24 two-letter merges) has two
successors; the next token is ``succ[x_t, bit[x_{t-1}]]``. Everything here is exact and
needs no llama.cpp: :func:`reference_continuation` is what every kind generates greedily
and :func:`reference_draft` what its MTP head drafts.

Larger models (``--size``) append filler tokens to the vocabulary: tokens that no merge
produces and the rule never generates, which give the output head a realistic width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import numpy.typing as npt

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
ACTIVE = np.array(
    [0x0A, *range(0x20, 0x7F), *range(FIRST_MERGE_ID, FIRST_MERGE_ID + len(_MERGES))],
    dtype=np.int64,
)
N_ACTIVE = len(ACTIVE)  # 120
CYCLE_LENGTH = 2 * N_ACTIVE  # 240 (token, previous bit) states


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


def vocab() -> tuple[list[str], list[int], list[str]]:
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
class Machine:
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
    edges = [(int(y), b) for y in ACTIVE for b in (0, 1)]
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
def machine(seed: int) -> Machine:
    rng = np.random.default_rng([seed, 0])
    v = N_VOCAB
    axis = np.zeros(v, dtype=np.int64)
    sign = np.ones(v, dtype=np.float64)
    bit = rng.integers(0, 2, size=v).astype(np.int64)
    col = np.zeros(v, dtype=np.int64)
    axis[ACTIVE] = rng.permutation(N_ACTIVE)
    sign[ACTIVE] = rng.choice([-1.0, 1.0], size=N_ACTIVE)
    # balanced (colour, bit) types make the slot graph Eulerian
    types = rng.permutation(np.arange(N_ACTIVE) % 4)
    col[ACTIVE] = types >> 1
    bit[ACTIVE] = types & 1
    is_active = np.zeros(v, dtype=bool)
    is_active[ACTIVE] = True
    alias = np.arange(v, dtype=np.int64)
    others = np.flatnonzero(~is_active)
    alias[others] = rng.choice(ACTIVE, size=len(others))
    axis[others] = axis[alias[others]]
    sign[others] = sign[alias[others]]

    cycle = _euler_cycle(col, bit, rng)
    succ = np.full((v, 2), -1, dtype=np.int64)
    for i, (x, b) in enumerate(cycle):
        succ[x, b] = cycle[(i + 1) % len(cycle)][0]
    succ[others] = succ[alias[others]]
    assert (succ >= 0).all()

    rng_acc = np.random.default_rng([seed, 2])
    bad_order = rng_acc.permutation(ACTIVE)
    partner = np.arange(v, dtype=np.int64)
    for x in ACTIVE:
        while True:
            p = int(rng_acc.choice(ACTIVE))
            if succ[p, 0] != succ[x, 0] and succ[p, 1] != succ[x, 1]:
                partner[x] = p
                break
    return Machine(axis, sign, bit, col, succ, partner, bad_order)


def _check_tokens(tokens: Sequence[int]) -> list[int]:
    out = [int(t) for t in tokens]
    if not out:
        raise ValueError("need at least one token")
    if any(not 0 <= t < N_VOCAB for t in out):
        raise ValueError(f"token ids must be in [0, {N_VOCAB})")
    return out


def reference_continuation(prompt: Sequence[int], n_predict: int, *, seed: int = 0) -> list[int]:
    """The greedy continuation every kind produces for ``prompt`` (exact, no llama.cpp)."""
    m = machine(seed)
    toks = _check_tokens(prompt)
    out: list[int] = []
    prev, cur = (toks[-2] if len(toks) > 1 else toks[-1]), toks[-1]
    for _ in range(n_predict):
        nxt = int(m.succ[cur, m.bit[prev]])
        out.append(nxt)
        prev, cur = cur, nxt
    return out


def n_bad(acceptance: float) -> int:
    return round((1.0 - acceptance) * N_ACTIVE)


def mtp_succ(m: Machine, acceptance: float) -> I64:
    succ = m.succ.copy()
    for x in m.bad_order[: n_bad(acceptance)]:
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
    m = machine(seed)
    succ = mtp_succ(m, check_acceptance(acceptance))
    out: list[int] = []
    prev, cur = toks[-2], toks[-1]
    for _ in range(n_draft):
        nxt = int(succ[cur, m.bit[prev]])
        out.append(nxt)
        prev, cur = cur, nxt
    return out



def check_acceptance(acceptance: float) -> float:
    a = float(acceptance)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance!r}")
    return a



def filler_tokens(n_vocab: int) -> list[str]:
    """Texts of the tokens ``N_VOCAB..n_vocab-1``: three byte characters, no merge makes them.

    Unique and never produced by tokenizing text (BPE needs a merge to build them), so
    they only widen the embedding and the output head.
    """
    b2u = _bytes_to_unicode()
    chars = [b2u[b] for b in range(256)]
    return [chars[(i >> 16) & 0xFF] + chars[(i >> 8) & 0xFF] + chars[i & 0xFF]
            for i in range(n_vocab - N_VOCAB)]


def filler_alias(n_vocab: int) -> I64:
    """The active token each filler token behaves like as input (round robin)."""
    return ACTIVE[np.arange(n_vocab - N_VOCAB) % N_ACTIVE]

