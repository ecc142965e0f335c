"""structlog setup for the daemon: one stream of events, whoever emitted them.

Why JSON lines: under systemd/journald or a supervisor logs are read by tools, so each
event is one parseable object (a terminal gets the console renderer instead). Events
carry ids, codes and counts, never prompt or output text. Stdlib loggers (llama.cpp's
lines on ``meshd.llama``) and Python warnings are routed through structlog, so nothing
is printed raw or twice. Under journald each line starts with its syslog priority
(``<3>`` ... ``<7>``) and carries no timestamp (journald stamps it). llama.cpp has its
own level (``--llama-log-level``, default ``warn``) because loading a model prints
thousands of info lines; both levels are read at every event, so SIGHUP can change them
(:func:`set_levels`). Only :func:`configure_logging` changes the global configuration;
library code just asks :func:`get_logger`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, Final, TextIO

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

__all__ = [
    "DEFAULT_LLAMA_LOG_LEVEL",
    "FORMATS",
    "LEVELS",
    "LLAMA_LEVELS",
    "LLAMA_LOGGER",
    "configure_logging",
    "get_logger",
    "set_levels",
    "under_journald",
]

LEVELS: Final = ("debug", "info", "warning", "error")
"""The accepted ``--log-level`` values."""

LLAMA_LEVELS: Final = ("debug", "info", "warn", "error", "none")
"""The accepted ``--llama-log-level`` values (llama.cpp's own names; none: drop them all)."""

DEFAULT_LLAMA_LOG_LEVEL: Final = "warn"

LLAMA_LOGGER: Final = "meshd.llama"
"""The stdlib logger llama.cpp's lines arrive on (:mod:`meshd.native.llama`)."""

_NUMBERS: Final = {"debug": logging.DEBUG, "info": logging.INFO, "warn": logging.WARNING,
                   "warning": logging.WARNING, "error": logging.ERROR,
                   "critical": logging.CRITICAL, "none": logging.CRITICAL + 10}

FORMATS: Final = ("auto", "json", "console", "journal")
"""``--log-format``: auto picks journal under journald, console on a terminal, else JSON."""

_PRIORITY: Final = {"critical": 2, "exception": 3, "error": 3, "warning": 4, "warn": 4,
                    "info": 6, "debug": 7}


def under_journald(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` is connected to journald (``$JOURNAL_STREAM`` is its dev:inode)."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def configure_logging(
    level: str = "info", *, stream: TextIO | None = None, json: bool | None = None,
    format: str | None = None, llama_level: str = DEFAULT_LLAMA_LOG_LEVEL,
) -> None:
    """Send every event at ``level`` and above to ``stream`` (default stderr), and
    llama.cpp's lines at ``llama_level`` and above (whatever ``level`` is).

    ``format`` is one of :data:`FORMATS` (``json=True/False`` is the older spelling of
    ``json``/``console``). Also routes stdlib logging and Python warnings into structlog.
    """
    _check_levels(level, llama_level)
    out = stream if stream is not None else sys.stderr
    if format is None:
        format = "auto" if json is None else ("json" if json else "console")
    if format not in FORMATS:
        raise ValueError(f"unknown log format {format!r}; expected one of {', '.join(FORMATS)}")
    journal = under_journald(out)
    if format == "auto":
        format = "journal" if journal else ("console" if _isatty(out) else "json")
    processors: list[Processor] = [
        structlog.processors.add_log_level,
        _gate,
        structlog.contextvars.merge_contextvars,
    ]
    if format != "journal":
        processors.append(structlog.processors.TimeStamper(fmt="iso", utc=True))
    processors.append(structlog.processors.format_exc_info)
    renderer: Processor
    if format == "json":
        renderer = structlog.processors.JSONRenderer()
    elif format == "journal":
        renderer = structlog.processors.LogfmtRenderer(key_order=["event"], drop_missing=True)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=_isatty(out))
    if journal or format == "journal":
        renderer = _Prioritised(renderer)
    structlog.configure(
        processors=[*processors, renderer],
        # No filtering here: a bound logger keeps the wrapper it was made with, so the
        # levels are applied by _gate, which reads them at each event (SIGHUP).
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    _route_stdlib()
    set_levels(level, llama_level)


def set_levels(level: str, llama_level: str = DEFAULT_LLAMA_LOG_LEVEL) -> None:
    """Change the daemon's and llama.cpp's levels at once, for every logger (live)."""
    _check_levels(level, llama_level)
    _thresholds[""] = _NUMBERS[level]
    _thresholds[LLAMA_LOGGER] = _NUMBERS[llama_level]
    logging.getLogger().setLevel(_NUMBERS[level])
    # Its own level: llama.cpp's lines below it are not even formatted (native.llama).
    logging.getLogger(LLAMA_LOGGER).setLevel(_NUMBERS[llama_level])


def _check_levels(level: str, llama_level: str) -> None:
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LEVELS)}")
    if llama_level not in LLAMA_LEVELS:
        raise ValueError(f"unknown llama.cpp log level {llama_level!r}; expected one of "
                         f"{', '.join(LLAMA_LEVELS)}")


_thresholds: dict[str, int] = {"": logging.INFO, LLAMA_LOGGER: logging.WARNING}
"""Least severe level logged: ``""`` for every event, else by ``logger_name``."""


def _gate(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    """Drop an event below its logger's current level (after ``add_log_level``)."""
    threshold = _thresholds.get(str(event_dict.get("logger_name", "")), _thresholds[""])
    if _NUMBERS.get(str(event_dict.get("level")), logging.INFO) < threshold:
        raise structlog.DropEvent
    return event_dict


def get_logger(name: str, **bound: object) -> FilteringBoundLogger:
    """A logger whose events carry ``logger_name=name`` and ``bound``."""
    logger: FilteringBoundLogger = structlog.get_logger().bind(logger_name=name, **bound)
    return logger


class _Prioritised:
    """Wraps a renderer: ``<priority>`` first, and one physical line per event (a
    traceback's newlines would otherwise become separate journal entries)."""

    def __init__(self, inner: Processor) -> None:
        self.inner = inner

    def __call__(self, logger: WrappedLogger, name: str, event_dict: EventDict) -> str:
        priority = _PRIORITY.get(str(event_dict.get("level", name)), 6)
        text = str(self.inner(logger, name, event_dict))
        return f"<{priority}>" + text.replace("\n", "\\n")


class _ToStructlog(logging.Handler):
    """A stdlib handler that re-emits each record as a structlog event."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.name == "py.warnings":  # "file:line: Category: text\n  source"
                message = message.strip().splitlines()[0]
            fields: dict[str, Any] = {"logger_name": record.name}
            if record.exc_info:
                fields["exc_info"] = record.exc_info
            structlog.get_logger().log(record.levelno, message, **fields)
        except Exception:
            self.handleError(record)


def _route_stdlib() -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _ToStructlog):
            root.removeHandler(handler)
    root.addHandler(_ToStructlog())
    logging.captureWarnings(True)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
