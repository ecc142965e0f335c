"""Tokenizer over a loaded model's vocabulary (the UTF-8-safe streaming of its pieces is
:mod:`.utf8`'s, its refusal :mod:`.records`', both re-exported here)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

from .llama import lc
from .records import TooManyTokens as TooManyTokens
from .utf8 import Utf8Assembler as Utf8Assembler


class Tokenizer:
    """Text <-> token ids for one model. Thread-safe (llama.cpp's vocab is read-only)."""

    def __init__(self, vocab: Any, n_vocab: int, add_bos: bool) -> None:
        self._vocab = vocab
        self.n_vocab = n_vocab
        self.add_bos = add_bos
        self._pieces: dict[tuple[int, bool], bytes] = {}
        self._lock = threading.Lock()
        self._max_piece_bytes: int | None = None

    @property
    def vocab(self) -> Any:
        if self._vocab is None:
            raise ValueError("the model of this tokenizer has been closed")
        return self._vocab

    def close(self) -> None:
        """Called when the model is freed: any later use raises instead of crashing."""
        self._vocab = None

    def tokenize(self, text: str, *, add_special: bool = True,
                 parse_special: bool = False, max_tokens: int | None = None) -> list[int]:
        """Token ids of ``text`` (with BOS etc. when ``add_special``).

        ``max_tokens``: raise TooManyTokens (with the full count, which llama.cpp
        reports without storing the tokens) rather than build a longer list, so a
        caller's limit bounds the memory taken, not only the answer.
        """
        vocab = self.vocab
        data = text.encode("utf-8")
        cap = len(data) + 8 if max_tokens is None else min(len(data) + 8, max_tokens)
        buf = (lc.llama_token * cap)()
        n = lc.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            if max_tokens is not None and -n > max_tokens:
                raise TooManyTokens(-n, max_tokens)
            cap = -n
            buf = (lc.llama_token * cap)()
            n = lc.llama_tokenize(vocab, data, len(data), buf, cap, add_special, parse_special)
            if n < 0:
                raise ValueError(f"tokenization failed ({n}) for a text of {len(data)} bytes")
        return list(buf[:n])

    @property
    def max_piece_bytes(self) -> int:
        """The most bytes of text one token stands for (special tokens written out).

        Why: a text of B bytes needs at least B / max_piece_bytes tokens, so a prompt
        too long for the context can be refused before it is tokenized. Read from the
        vocabulary once (a fraction of a second), on first use.
        """
        if self._max_piece_bytes is None:
            vocab = self.vocab
            size = 256
            buf = ctypes.create_string_buffer(size)
            longest = 1
            for token in range(self.n_vocab):
                n = lc.llama_token_to_piece(vocab, token, buf, size, 0, True)
                longest = max(longest, n if n >= 0 else -n)
            self._max_piece_bytes = longest
        return self._max_piece_bytes

    def piece(self, token: int, *, special: bool = False) -> bytes:
        """The raw bytes of one token (may be an incomplete UTF-8 sequence)."""
        key = (token, special)
        cached = self._pieces.get(key)
        if cached is not None:
            return cached
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} outside the vocabulary [0, {self.n_vocab})")
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_token_to_piece(self.vocab, token, buf, size, 0, special)
            if n >= 0:
                out = buf.raw[:n]
                break
            size = -n
        with self._lock:
            self._pieces[key] = out
        return out

    def detokenize(self, tokens: Sequence[int], *, special: bool = False) -> str:
        """Text of a token sequence (invalid UTF-8 becomes U+FFFD)."""
        return b"".join(self.piece(t, special=special) for t in tokens).decode(
            "utf-8", "replace"
        )
