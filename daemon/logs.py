"""structlog setup for the daemon: JSON lines by default, a readable console on a TTY.

Why JSON lines: the daemon runs under systemd/journald or a supervisor whose logs are
read by tools, so each event is one parseable object (``event``, ``level``, ``timestamp``
plus its fields). A person running ``meshd serve`` in a terminal gets the console
renderer instead. Events carry ids, codes and counts, never prompt or output text: that
is what a log line is allowed to contain at ``info``; request contents go nowhere.

Only ``meshd serve`` (and whoever else calls :func:`configure_logging`) changes the
global structlog configuration; library code just asks :func:`get_logger`.
"""

from __future__ import annotations

import logging
import sys
from typing import Final, TextIO

import structlog
from structlog.typing import FilteringBoundLogger, Processor

__all__ = ["LEVELS", "configure_logging", "get_logger"]

LEVELS: Final = ("debug", "info", "warning", "error")
"""The accepted ``--log-level`` values."""


def configure_logging(
    level: str = "info", *, stream: TextIO | None = None, json: bool | None = None
) -> None:
    """Send structlog events at ``level`` and above to ``stream`` (default stderr).

    ``json=None`` picks JSON lines unless ``stream`` is a terminal.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LEVELS)}")
    out = stream if stream is not None else sys.stderr
    if json is None:
        json = not _isatty(out)
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    renderer: Processor = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=_isatty(out))
    )
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str, **bound: object) -> FilteringBoundLogger:
    """A logger whose events carry ``logger_name=name`` and ``bound``."""
    logger: FilteringBoundLogger = structlog.get_logger().bind(logger_name=name, **bound)
    return logger


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
