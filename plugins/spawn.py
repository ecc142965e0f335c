"""Starting a spawned plugin's process: which interpreter, and where its stderr goes.

Why here: a plugin's command is written once in the daemon's config, usually as
``python -m my_plugin``. Run as written, ``python`` is whatever the daemon's ``PATH``
finds, not the virtual environment meshd (and the plugin package) is installed in, and
the plugin dies with ``No module named my_plugin``. So a bare ``python`` or ``python3``
means the daemon's own interpreter. And a plugin's stderr (its traceback, that very
``No module named``) is read line by line and logged as ``plugin_stderr`` events under
the plugin's name, so it is found in the daemon's structured log with the plugin's other
events instead of as loose lines on the daemon's stderr.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

from structlog.typing import FilteringBoundLogger

__all__ = ["MAX_STDERR_LINE", "PYTHON_ALIASES", "StderrTail", "resolve_command", "spawn"]

#: First command words that mean "the interpreter the daemon runs on".
PYTHON_ALIASES = frozenset({"python", "python3"})
#: A stderr line is logged up to this many characters (the rest is cut).
MAX_STDERR_LINE = 4096


def resolve_command(command: Sequence[str]) -> list[str]:
    """``command`` with a bare ``python``/``python3`` replaced by ``sys.executable``."""
    argv = list(command)
    if argv and argv[0] in PYTHON_ALIASES and sys.executable:
        argv[0] = sys.executable
    return argv


class StderrTail:
    """Logs each stderr line of a plugin process and keeps the last one (the reason a
    plugin that failed to start gives, typically ``No module named ...``)."""

    def __init__(self, stream: IO[bytes], log: FilteringBoundLogger) -> None:
        self.last: str | None = None
        self._log = log
        self._thread = threading.Thread(target=self._forward, args=(stream,), daemon=True,
                                         name="plugin-stderr")
        self._thread.start()

    def wait(self, timeout: float) -> str | None:
        """The last line, once the stream ended (or ``timeout`` passed)."""
        self._thread.join(timeout)
        return self.last

    def _forward(self, stream: IO[bytes]) -> None:
        with contextlib.closing(stream):
            while True:
                try:
                    raw = stream.readline(MAX_STDERR_LINE + 1)
                except (OSError, ValueError):
                    return
                if not raw:
                    return
                cut = len(raw) > MAX_STDERR_LINE and not raw.endswith(b"\n")
                line = raw[:MAX_STDERR_LINE].decode("utf-8", "replace").rstrip("\r\n")
                while cut and raw and not raw.endswith(b"\n"):  # skip the rest of it
                    raw = stream.readline(MAX_STDERR_LINE + 1)
                if line.strip():
                    self.last = line
                    self._log.info("plugin_stderr", line=line, **({"cut": True} if cut else {}))


def spawn(command: Sequence[str], *, env: Mapping[str, str], pass_fds: Sequence[int],
          log: FilteringBoundLogger) -> tuple[subprocess.Popen[bytes], StderrTail]:
    """Start a plugin process; its stderr lines go to ``log`` as ``plugin_stderr``.

    Raises OSError when the command cannot be run.
    """
    proc = subprocess.Popen(resolve_command(command), pass_fds=tuple(pass_fds), env=dict(env),
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    return proc, StderrTail(proc.stderr, log)
