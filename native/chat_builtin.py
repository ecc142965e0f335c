"""llama.cpp's built-in chat formats (``chatml``, ``llama3``, ``command-r`` ...), named as
``--chat-template NAME`` names them in llama-server.

Why llama.cpp's own formatter: these are C++ formats, not Jinja sources, so the only
faithful rendering is the one llama.cpp ships (``llama_chat_apply_template``). It takes
roles and text only: no tools, no template variables.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

from .llama import lc

__all__ = ["apply_builtin", "builtin_names"]

_MAX_NAMES = 256


@functools.cache
def builtin_names() -> frozenset[str]:
    """The names llama.cpp's formatter knows."""
    out = (ctypes.c_char_p * _MAX_NAMES)()
    n = lc.llama_chat_builtin_templates(out, _MAX_NAMES)
    names = (out[i] for i in range(min(n, _MAX_NAMES)))
    return frozenset(name.decode() for name in names if name)


def apply_builtin(name: str, messages: Sequence[tuple[str, str]], *,
                  add_generation_prompt: bool) -> str:
    """``messages`` ((role, text) pairs) in the built-in format ``name``; ValueError when
    llama.cpp refuses them."""
    keep = [(role.encode(), text.encode()) for role, text in messages]
    chat = (lc.llama_chat_message * max(1, len(keep)))()
    for i, (role, text) in enumerate(keep):
        chat[i].role, chat[i].content = role, text
    size = 2 * sum(len(r) + len(t) for r, t in keep) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = lc.llama_chat_apply_template(name.encode(), chat, len(keep),
                                         add_generation_prompt, buf, size)
        if n < 0:
            raise ValueError(f"llama.cpp's {name} format cannot render these messages")
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n
    raise ValueError(f"llama.cpp's {name} format gave no stable length")
