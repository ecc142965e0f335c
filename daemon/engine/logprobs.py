"""Log-probabilities of committed tokens, for requests that ask (OpenAI's ``logprobs``).

Why from the verify rows: the row that committed a token holds the target's logits for
that position whether the token was drafted or the target's own, so a speculative
request reports the same values plain decoding would (to float noise between a batched
and a single-row forward). A constraint's mask applies first: a token the grammar
forbids has probability 0. The softmax over the whole vocabulary runs only for requests
that ask.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from meshd.daemon.engine.sampling import FloatArray
from meshd.protocol.messages import MAX_TOP_LOGPROBS, TokenLogprob

__all__ = ["MAX_TOP_LOGPROBS", "TokenLogprob", "token_logprob"]


def token_logprob(row: FloatArray, token: int, top_n: int,
                  mask: npt.NDArray[np.bool_] | None = None) -> TokenLogprob:
    """``token``'s log-softmax in ``row`` (under ``mask``), with the ``top_n`` best."""
    x = np.asarray(row, dtype=np.float64)
    if mask is not None:
        x = np.where(mask, x, -np.inf)
    peak = float(np.max(x))
    logz = peak + float(np.log(np.sum(np.exp(x - peak))))
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        n = min(top_n, x.shape[0])
        best = np.argpartition(-x, n - 1)[:n]
        best = best[np.lexsort((best, -x[best]))]
        top = tuple((int(t), float(x[t] - logz)) for t in best if np.isfinite(x[t]))
    return TokenLogprob(token=token, logprob=min(0.0, float(x[token] - logz)), top=top)
