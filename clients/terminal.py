"""What the command line shows a person: the stats line, formatted numbers, progress.

Why one module: ``meshd generate``, ``meshctl`` and ``meshd demo`` print the same stats
line, and every slow step (model load, calibration, quantizing) reports progress the same
way, so their look cannot drift. Progress is drawn only when stderr is a terminal (or
``force=True``): in logs and pipes it would be noise.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import TextIO

__all__ = ["Progress", "format_count", "stats_line", "wants_notes", "wants_progress"]


def format_count(value: float) -> str:
    """``134515008`` -> ``134.5M``; small numbers stay exact (``42``, ``3.5``)."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale * 10 or (abs(value) >= scale and suffix != "k"):
            return f"{value / scale:.1f}{suffix}"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.2f}"


def stats_line(*, finish: str, tokens: int, prompt: int, wall_ms: float,
               proposer: str | None, forwards: int, drafted: int, accepted: int,
               refusals: Mapping[str, int], extra: Mapping[str, str] | None = None) -> str:
    """One ``key=value`` line after a generation (stderr), the same in every command.

    ``forwards``: decode-phase target forwards (prefill excluded); ``refusals``: why
    drafting was turned down, by reason.
    """
    rate = tokens / (wall_ms / 1e3) if wall_ms > 0 else 0.0
    fields = {
        "finish": finish,
        "tokens": str(tokens),
        "prompt": str(prompt),
        "tok/s": f"{rate:.1f}",
        "proposer": proposer or "off",
        "forwards": str(forwards),
        "accepted": f"{accepted}/{drafted}",
        "refused": ",".join(f"{k}:{v}" for k, v in sorted(refusals.items())) or "-",
    }
    fields.update(extra or {})
    return "--\n" + " ".join(f"{k}={v}" for k, v in fields.items())


def wants_progress(stream: TextIO | None = None) -> bool:
    """Whether to draw progress: on a terminal, unless ``MESHD_PROGRESS=0``
    (``MESHD_PROGRESS=1`` forces it, e.g. under a pseudo-terminal-less wrapper)."""
    forced = os.environ.get("MESHD_PROGRESS")
    if forced in ("0", "1"):
        return forced == "1"
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def wants_notes(stream: TextIO | None = None) -> bool:
    """Whether to print advice meant for a person (e.g. "sent as raw text"): only when
    stderr is a terminal; a script that calls meshctl in a loop would get it every time."""
    stream = stream or sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """A one-line progress display on stderr: ``meshd: loading model... 42%``.

    ``update(fraction)`` redraws (at most every 0.1 s), ``done()`` ends the line with the
    time taken. Silent unless :func:`wants_progress` (or ``force``).
    """

    def __init__(self, what: str, *, stream: TextIO | None = None,
                 force: bool | None = None) -> None:
        self.what = what
        self.stream = stream or sys.stderr
        self.enabled = wants_progress(self.stream) if force is None else force
        self._t0 = time.monotonic()
        self._last = 0.0
        if self.enabled:
            self._write(f"meshd: {what}...")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(f"\r\x1b[K{text}")
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False

    def update(self, fraction: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < 0.1 and fraction < 1.0:
            return
        self._last = now
        self._write(f"meshd: {self.what}... {min(max(fraction, 0.0), 1.0):.0%}")

    def done(self, result: str = "done") -> None:
        if not self.enabled:
            return
        self._write(f"meshd: {self.what}: {result} ({time.monotonic() - self._t0:.1f}s)\n")
        self.enabled = False
