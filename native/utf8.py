"""UTF-8-safe streaming of token pieces (no llama.cpp).

Why the assembler: one token's bytes can end in the middle of a multi-byte character
(byte-level BPE splits emoji and CJK text across tokens). A stream that decodes each
token on its own emits replacement characters; we hold the incomplete tail back until
the next token completes it, so a client never sees half a code point.
"""

from __future__ import annotations

import codecs

__all__ = ["Utf8Assembler"]


class Utf8Assembler:
    """Feed token bytes, get text that never ends in half a code point."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, data: bytes) -> str:
        """Text completed by ``data``; an incomplete trailing sequence is held back."""
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        """Whatever is held back at the end (an unfinished sequence becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
