"""The model's vocabulary as llguidance sees it (its tokenizer, built once per model).

Why here: llguidance reads every token's bytes and attributes through llama.cpp's vocab
(about a second for a 150k vocabulary), so it is built once, on first use, and kept with
the model. End-of-generation tokens are the grammar's end: a complete grammar allows
exactly those.
"""

from __future__ import annotations

import threading
import warnings

from llguidance import LLTokenizer

from .model import Model

__all__ = ["GrammarVocab"]


class GrammarVocab:
    """llguidance's tokenizer for one model, built on first use (thread-safe)."""

    def __init__(self, model: Model) -> None:
        self._model = model
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()

    def tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                # Here, not at the top: llguidance's llama.cpp binding imports llama_cpp,
                # which meshd.native loads on first use only (see .llama).
                from llguidance.llamacpp import lltokenizer_from_vocab

                info = self._model.info
                with warnings.catch_warnings():  # a deprecated binding, once per token
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._tokenizer = lltokenizer_from_vocab(
                        self._model.tokenizer.vocab, n_vocab=info.n_vocab,
                        eos_token=sorted(info.eog_tokens) or None)
            return self._tokenizer
