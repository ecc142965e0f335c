"""The value-copy proposer: inside a JSON string, what followed the value so far in the
prompt, as a draft.

Why: an answer held to a JSON schema often copies its values out of the prompt (an
order number, an address, an e-mail). Prompt lookup by tokens misses most of them: in
the prompt's prose a value follows a space (`` Ingrid``), in JSON a quote (``"In``,
``grid``), so the token n-grams differ until several tokens into the value, and a match
of one or two tokens is too weak to draft on in general. Matched by bytes, from the
string's opening quote on, a value of a few characters already finds its source; the
source's continuation, tokenized, is the draft. Verification keeps the output what
plain decoding gives; the engine gates these drafts on their own acceptance.

Only for constraints that hold the whole answer to one JSON document, where an
unescaped quote opens or closes a string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .base import Capabilities, Outcome, Proposal, ProposalRequest

__all__ = ["COPY_PRIOR", "ValueCopyProposer"]

#: Acceptance assumed for these drafts until a request has measured its own: once a
#: value's first bytes are found in the prompt it is mostly copied to its end.
COPY_PRIOR = 0.8
#: The shortest value (bytes after the opening quote) looked up in the prompt.
MIN_BYTES = 2
#: The longest tail of the value looked up (a longer value is matched by its end).
MAX_KEY_BYTES = 64
#: Bytes of the source's continuation tokenized into a draft.
MAX_COPY_BYTES = 64
#: Occurrences of a whole value inside words skipped before giving up (bounds a
#: step's search in a long prompt full of a short value's bytes).
MAX_SKIPS = 32
_QUOTE, _BACKSLASH = 0x22, 0x5C


class ValueCopyProposer:
    """Drafts the prompt's continuation of the JSON string value being written.

    ``piece``: a token's bytes; ``tokenize``: text to token ids (no special tokens).
    The answer's bytes are kept as tokens are committed, so a step costs the new
    tokens' pieces and one search of the prompt."""

    name = "value-copy"
    capabilities = Capabilities(max_len=32)

    def __init__(self, prompt: Sequence[int], piece: Callable[[int], bytes],
                 tokenize: Callable[[str], list[int]]) -> None:
        self._piece = piece
        self._tokenize = tokenize
        self._source = b"".join(piece(t) for t in prompt)
        self._answer = bytearray()
        self._seen = len(prompt)
        #: Whether the answer ends inside a string, where that string's bytes begin in
        #: the answer, and whether its last byte was an escaping backslash: kept
        #: current as tokens are committed.
        self._inside = False
        self._start = 0
        self._escape = False
        #: The draft for the sequence length it was made at (asked twice per step).
        self._cached: tuple[int, tuple[int, ...]] = (-1, ())

    def _sync(self, tokens: Sequence[int]) -> None:
        for token in tokens[self._seen:]:
            for byte in self._piece(token):
                self._answer.append(byte)
                if self._escape:
                    self._escape = False
                elif self._inside and byte == _BACKSLASH:
                    self._escape = True
                elif byte == _QUOTE:
                    self._inside = not self._inside
                    self._start = len(self._answer)
        self._seen = len(tokens)

    def draft(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """The copy for the sequence ``tokens`` (prompt + committed), or ()."""
        if self._cached[0] == len(tokens):
            return self._cached[1]
        self._sync(tokens)
        got = self._copy(tokens) if self._inside else ()
        self._cached = (len(tokens), got)
        return got

    def ready(self, tokens: Sequence[int]) -> bool:
        """Whether there is a copy to draft after ``tokens``."""
        return bool(self.draft(tokens))

    def _copy(self, tokens: Sequence[int]) -> tuple[int, ...]:
        value = bytes(self._answer[self._start:])
        if len(value) < MIN_BYTES:  # (inside a string: the answer has tokens)
            return ()
        key = value[-MAX_KEY_BYTES:]
        escape = key.rfind(b"\\")
        if escape >= 0:  # JSON escapes are not the prompt's bytes: match what follows
            key = key[escape + 2:]
            if len(key) < MIN_BYTES:
                return ()
        at = self._find(key, whole=len(key) == len(value))
        if at < 0:
            return ()
        tail = self._source[at + len(key):at + len(key) + MAX_COPY_BYTES]
        text = tail.decode("utf-8", "ignore")
        if not text:
            return ()
        last = tokens[-1]
        last_piece = self._piece(last)
        if last_piece and value.endswith(last_piece):
            # The value's last token and the copy, tokenized together: the split the
            # model would see (a copy that starts mid-word merges with that token).
            merged = self._tokenize(last_piece.decode("utf-8", "ignore") + text)
            if merged and merged[0] == last:
                return tuple(merged[1:])
        return tuple(self._tokenize(text))

    def _find(self, key: bytes, *, whole: bool) -> int:
        """The first occurrence of ``key`` in the prompt; for a whole value, the first
        that starts a word there (a value copied from prose starts where a word does:
        ``"grid`` is no copy of ``Ingrid``)."""
        source, at = self._source, self._source.find(key)
        skips = 0
        while whole and at > 0 and source[at - 1:at].isalnum():
            skips += 1
            if skips > MAX_SKIPS:
                return -1
            at = source.find(key, at + 1)
        return at

    def propose(self, request: ProposalRequest) -> Proposal | None:
        tokens = self.draft(request.tokens)[: request.max_len]
        return Proposal(tokens) if tokens else None

    def observe(self, outcome: Outcome) -> None:
        """Nothing to learn here: the engine's gate keeps these drafts' acceptance."""

    def close(self) -> None:
        """Holds nothing but bytes."""
