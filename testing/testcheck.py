"""Run a synthetic test model with llama.cpp: does it follow its rule, and by what margin?

Why: a sized model (:mod:`meshd.testing.testmodels`) is quantized by llama.cpp, and its
zero-padded tensors go through kernels the tiny F32 models never use; the rule must still
hold with a clear top-1 margin, or identity tests and benchmarks on it would measure
near-ties. :func:`check_rule` decodes the reference continuation token by token and
reports the smallest gap between the winning logit and the runner-up;
:func:`measure_head_cost` reports what the MTP head costs against a target decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np

from meshd.native.calibrate import MtpCosts, measure_mtp_costs
from meshd.native.context import ContextConfig, TargetContext
from meshd.native.model import Model
from meshd.native.session import SequenceSession

from .testrule import reference_continuation

#: "Hello, w": the prompt the rule checks start from.
CHECK_PROMPT = (72, 101, 108, 108, 111, 44, 32, 119)


@attrs.frozen
class RuleReport:
    """What :func:`check_rule` found."""

    path: str
    n_params: int
    size_bytes: int
    n_embd: int
    n_layer: int
    n_vocab: int
    checked: int
    #: Index of the first generated token that broke the rule (None: none did).
    first_mismatch: int | None
    #: Smallest (top-1 logit - runner-up) over the checked tokens.
    min_margin: float

    @property
    def follows_rule(self) -> bool:
        return self.first_mismatch is None

    def describe(self) -> str:
        verdict = ("follows the rule" if self.follows_rule
                   else f"BREAKS the rule at generated token {self.first_mismatch}")
        return (f"n_params={self.n_params} ({self.n_params / 1e9:.2f}B) "
                f"size={self.size_bytes / 2**20:.0f} MiB n_embd={self.n_embd} "
                f"layers={self.n_layer} vocab={self.n_vocab}: {verdict} over "
                f"{self.checked} greedy tokens, smallest top-1 margin {self.min_margin:.2f}")


def _margin(logits: np.ndarray) -> float:
    top2 = np.partition(logits, -2)[-2:]
    return float(top2[1] - top2[0])


def check_rule(path: str | Path, *, seed: int = 0, n_tokens: int = 200,
               prompt: Sequence[int] = CHECK_PROMPT, threads: int | None = None) -> RuleReport:
    """Decode the reference continuation of ``prompt`` one token at a time (greedy)."""
    expected = reference_continuation(prompt, n_tokens, seed=seed)
    margins: list[float] = []
    mismatch: int | None = None
    with Model.load(path) as model:
        config = ContextConfig(n_ctx_seq=len(prompt) + n_tokens + 8, n_threads=threads,
                               use_mtp=False, draft_max=1)
        with (TargetContext(model, config) as ctx,
              SequenceSession.open(ctx, mtp=False) as session):
            logits = session.prefill(list(prompt))
            for i, token in enumerate(expected):
                margins.append(_margin(logits))
                if int(np.argmax(logits)) != token:
                    mismatch = i
                    break
                if i + 1 < len(expected):
                    logits = session.decode(token)
        info = model.info
    return RuleReport(str(path), info.n_params, info.size_bytes, info.n_embd, info.n_layer,
                      info.n_vocab, len(margins), mismatch, min(margins))


def measure_head_cost(path: str | Path, *, threads: int | None = None,
                      steps: int = 15) -> MtpCosts | None:
    """The MTP head's catch-up share of a forward and one draft's cost in target decodes."""
    with Model.load(path) as model:
        config = ContextConfig(n_ctx_seq=256, n_threads=threads, draft_max=4)
        with TargetContext(model, config) as ctx:
            return measure_mtp_costs(ctx, steps=steps)
