"""The single import point of llama-cpp-python's low-level bindings.

Why: the backend must be initialised exactly once per process and llama.cpp's logging
(which goes straight to stderr from C) must be routed through Python; both are process
wide, so they live here and nowhere else. We use only ``llama_cpp.llama_cpp`` and
``llama_cpp.llama_cpp_ext``: the high-level ``llama_cpp.Llama`` never sets ``load_mtp`` or
``n_rs_seq`` and ignores ``seq_rm`` failures, which corrupts recurrent models silently.

The bindings load on first use (``lc.<name>``), not on import: importing meshd.native
loads no shared library, so the layers above it, and their tests against the fake
runtime of ``meshd.testing``, import without llama.cpp.
"""

from __future__ import annotations

import collections
import ctypes
import importlib
import logging
import os
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "ATTN_BY_WIDTH",
    "ATTN_ROW",
    "ATTN_TILED",
    "attn_kernel_pinnable",
    "ensure_backend",
    "float_rows",
    "last_error",
    "lc",
    "lcx",
    "route_logs",
    "set_attn_kernel",
]


class _Bindings:
    """One module of llama-cpp-python's bindings, imported on the first attribute read;
    each name read is then kept on this object (later reads are plain attributes)."""

    def __init__(self, module: str) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name != "__file__":
            raise AttributeError(name)  # copy, inspect and friends probe: no load for them
        value = getattr(importlib.import_module(self._module), name)
        setattr(self, name, value)
        return value


#: ``llama_cpp.llama_cpp`` and ``llama_cpp.llama_cpp_ext``, loaded on first use.
lc: Any = _Bindings("llama_cpp.llama_cpp")
lcx: Any = _Bindings("llama_cpp.llama_cpp_ext")

_log = logging.getLogger("meshd.llama")
_init_lock = threading.Lock()
_initialised = False
# ggml_log_level (ggml.h): 0 NONE, 1 DEBUG, 2 INFO, 3 WARN, 4 ERROR, 5 CONT (continuation).
# Each keeps its level: the daemon gives this logger a level of its own
# (--llama-log-level, default warn), so a model load's info lines stay out of its log.
_LEVELS = {0: logging.DEBUG, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING,
           4: logging.ERROR}
#: llama.cpp's latest error lines, so a failed call can say why (they are logged too).
_recent_errors: collections.deque[str] = collections.deque(maxlen=4)


_CONT = 5
#: The ctypes callback llama.cpp logs through, made by ensure_backend (kept alive here).
_log_callback: Any = None
_pending: list[str] = []  # a line llama.cpp has not finished yet
_pending_level = logging.DEBUG
_pending_lock = threading.Lock()


def _on_log(level: int, text: bytes, _user: Any) -> None:
    # llama.cpp prints lines in pieces (progress dots, CONT-level continuations); one
    # log record per finished line keeps the daemon's log one event per line.
    global _pending_level
    chunk = text.decode("utf-8", "replace")
    with _pending_lock:
        if level != _CONT:
            _pending_level = _LEVELS.get(level, logging.DEBUG)
        _pending.append(chunk)
        if not chunk.endswith("\n"):
            return
        lines = "".join(_pending).splitlines()
        _pending.clear()
        pylevel = _pending_level
    if pylevel >= logging.ERROR:
        _recent_errors.extend(line.strip() for line in lines if line.strip())
    if _log.isEnabledFor(pylevel):
        for line in lines:
            if line.strip():
                _log.log(pylevel, "%s", line.rstrip())


def ensure_backend() -> None:
    """Initialise llama.cpp once per process and route its logs to ``meshd.llama``."""
    global _initialised, _log_callback
    with _init_lock:
        if _initialised:
            return
        lc.llama_backend_init()
        if not os.environ.get("MESHD_LLAMA_LOG_STDERR"):
            _log_callback = lc.llama_log_callback(_on_log)  # kept: llama.cpp holds it
            route_logs()
        _initialised = True


def route_logs() -> None:
    """Point llama.cpp's log lines at ``meshd.llama`` again (:func:`ensure_backend` does
    it once per process; code that pointed them elsewhere hands them back with this)."""
    if _log_callback is not None:
        lc.llama_log_set(_log_callback, ctypes.c_void_p(0))


def last_error() -> str | None:
    """llama.cpp's most recent error line (and forget it), or None."""
    try:
        return _recent_errors.pop() or None
    except IndexError:
        return None
    finally:
        _recent_errors.clear()


def float_rows(ptr: Any, n_rows: int, width: int) -> npt.NDArray[np.float32]:
    """A *view* of ``n_rows x width`` floats at a llama.cpp pointer (copy before next call)."""
    if not ptr:
        raise ValueError("llama.cpp returned a NULL float pointer")
    return np.ctypeslib.as_array(ptr, shape=(n_rows, width))


#: ``llama_set_attn_kernel``'s kernels (meshd's runtime patch, native/patches): ggml-cpu's
#: flash attention chosen by batch width (llama.cpp's own rule), the per-row kernel at
#: every width, or the tiled kernel at every width (meshd pins the last, see
#: :data:`~.primitives.ATTN_KERNEL`; the others are the patch's, for comparisons).
ATTN_BY_WIDTH, ATTN_ROW, ATTN_TILED = 0, 1, 2


def _bind_attn_kernel() -> Any:
    """``llama_set_attn_kernel`` from the loaded libllama, or None on a runtime built
    without meshd's patch (then a context keeps llama.cpp's own kernel choice)."""
    try:
        fn = lc._lib.llama_set_attn_kernel
    except AttributeError:
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    fn.restype = None
    return fn


_UNBOUND = object()
_set_attn_kernel: Any = _UNBOUND


def _attn_kernel_fn() -> Any:
    global _set_attn_kernel
    if _set_attn_kernel is _UNBOUND:
        _set_attn_kernel = _bind_attn_kernel()
    return _set_attn_kernel


def attn_kernel_pinnable() -> bool:
    """Whether this runtime can pin the attention kernel (:func:`set_attn_kernel`)."""
    return _attn_kernel_fn() is not None


def set_attn_kernel(ctx: Any, kernel: int) -> None:
    """Pin ``ctx``'s CPU flash-attention kernel for its forwards from now on (a no-op
    on a runtime without meshd's patch: :func:`attn_kernel_pinnable` tells)."""
    fn = _attn_kernel_fn()
    if fn is not None:
        fn(ctx, kernel)
