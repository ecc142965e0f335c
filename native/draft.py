"""A second, smaller GGUF model as a draft source (classic draft-model speculation).

Why a separate context: the draft model runs its own forwards, one sequence per request
in its own llama.cpp context. Each proposal first brings the draft sequence in line with
the target's committed tokens (trim what was rejected, decode what is new), then drafts
greedily and trims its own drafted tokens again, so the next call starts clean.

A long prompt is caught up a slice at a time: each proposal prefills at most
:data:`CATCH_UP_S` of the draft model's forwards and offers nothing until the sequence has
caught up, so the step that holds the proposal (and every other request's next token)
never waits for a whole prompt's prefill on the draft model; the target decodes plainly
meanwhile.

Only attention-only draft models are accepted: their KV suffix trims exactly; a recurrent
draft model would need the checkpoint machinery for a proposer, which is not worth it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from .context import ContextConfig, TargetContext
from .errors import ModelLoadError
from .model import Model
from .prefill_chunks import PREFILL_CHUNK
from .session import SequenceSession

#: The longest one proposal spends catching the draft sequence up with a prompt (by the
#: last catch-up's time per row; one chunk always runs): the prefill slice a step may
#: take beside other requests' decodes.
CATCH_UP_S = 0.3


class VocabularyMismatch(ModelLoadError):
    """The draft model's tokens are not the target's: its drafts would be meaningless."""


def check_same_vocabulary(target: Model, draft: Model) -> None:
    """Raise VocabularyMismatch unless both models map every id to the same bytes."""
    nt, nd = target.info.n_vocab, draft.info.n_vocab
    if nt != nd:
        raise VocabularyMismatch(
            f"draft model {draft.info.path} has {nd} tokens, the target has {nt}"
        )
    tt, td = target.tokenizer, draft.tokenizer
    for i in range(nt):
        if tt.piece(i, special=True) != td.piece(i, special=True):
            raise VocabularyMismatch(
                f"draft model {draft.info.path} differs from the target at token {i}: "
                f"{td.piece(i, special=True)!r} vs {tt.piece(i, special=True)!r}"
            )


class DraftModel:
    """A loaded draft model with a context of ``n_seq_max`` sequences."""

    def __init__(self, path: str, *, target: Model, n_ctx_seq: int, n_seq_max: int,
                 n_threads: int | None = None) -> None:
        self.model = Model.load(path, load_mtp=False)
        try:
            if self.model.info.has_recurrent_state:
                raise ModelLoadError(
                    f"draft model {path} has recurrent state; draft models must be "
                    f"attention-only (their rejected drafts are trimmed from the KV)"
                )
            check_same_vocabulary(target, self.model)
            self.context = TargetContext(self.model, ContextConfig(
                n_ctx_seq=min(n_ctx_seq, self.model.info.n_ctx_train or n_ctx_seq),
                n_seq_max=n_seq_max, draft_max=8, n_threads=n_threads, use_mtp=False,
                # Drafts are only proposals, verified by the target: llama.cpp's default
                # cache (faster prefill) cannot change the output.
                cache_type_k="f16",
            ))
        except Exception:
            self.model.close()
            raise

    def open_sequence(self) -> DraftSequence:
        return DraftSequence(SequenceSession.open(self.context))

    def close(self) -> None:
        self.context.close()
        self.model.close()


class DraftSequence:
    """One request's sequence in the draft model's context."""

    def __init__(self, session: SequenceSession) -> None:
        self.session = session
        self.fed: list[int] = []  # tokens in the draft KV, in order
        #: Seconds per row of the last catch-up that ran whole chunks (None before).
        self._row_s: float | None = None

    def _catch_up_rows(self) -> int:
        """The most tokens one proposal prefills before it drafts (:data:`CATCH_UP_S`)."""
        if self._row_s is None:
            return PREFILL_CHUNK
        return max(PREFILL_CHUNK, int(CATCH_UP_S / self._row_s) // PREFILL_CHUNK * PREFILL_CHUNK)

    def draft(self, tokens: Sequence[int], k: int, *, probs: bool = False,
              ) -> tuple[list[int], list[float]]:
        """Greedy ``k`` tokens continuing ``tokens`` (prompt + committed), and with
        ``probs`` the draft model's probability of each (else an empty list: each is a
        softmax over the whole vocabulary)."""
        s = self.session
        if k <= 0 or not tokens:
            return [], []
        limit = s.context.config.n_ctx_seq - k - 1
        if len(tokens) > limit:
            return [], []  # the draft context is full: nothing to offer
        c = 0
        n = min(len(self.fed), len(tokens) - 1)  # keep >= 1 token to decode for logits
        while c < n and self.fed[c] == tokens[c]:
            c += 1
        if c < len(self.fed):
            s.trim(c)
            del self.fed[c:]
        new = list(tokens[c:])
        bound = self._catch_up_rows()
        if len(new) > bound:  # a long prompt: a slice of it now, drafts once caught up
            t0 = time.perf_counter()
            s.prefill(new[:bound])
            self._row_s = (time.perf_counter() - t0) / bound
            self.fed.extend(new[:bound])
            return [], []
        logits = s.prefill(new)
        self.fed.extend(new)
        out: list[int] = []
        chances: list[float] = []
        for i in range(k):
            t = int(np.argmax(logits))
            out.append(t)
            if probs:
                chances.append(float(1.0 / np.exp(logits - logits[t]).sum()))
            if i + 1 < k:
                logits = s.decode(t)
        s.trim(len(self.fed))
        return out, chances

    def close(self) -> None:
        self.session.close()
