"""Server-sent events as OpenAI streams them: ``data: JSON`` records, then ``[DONE]``."""

from __future__ import annotations

import json
from typing import Any, Final

__all__ = ["DONE", "event"]

DONE: Final = b"data: [DONE]\n\n"


def event(payload: Any) -> bytes:
    """One ``data:`` record (JSON has no raw newlines, so one line suffices)."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"
