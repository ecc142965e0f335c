"""Checks a model path before llama.cpp sees it, so a user gets a sentence, not C logs.

Why: handed a directory, a text file or a truncated download, llama.cpp prints its own
parser's lines (``gguf_init_from_reader: invalid magic ...``) and returns NULL, which
says nothing a user can act on. Reading the header's magic and version first (with the
``gguf`` package's constants) lets every entry point say "is a directory" or "not a
GGUF file" before any model is loaded or any daemon started.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf

from .errors import ModelLoadError

__all__ = ["check_model_file"]


def check_model_file(path: str | os.PathLike[str], *, what: str = "model") -> Path:
    """``path`` if it is a readable GGUF file; else :class:`ModelLoadError` saying why."""
    p = Path(path)
    if p.is_dir():
        raise ModelLoadError(f"{what} {p} is a directory, not a GGUF file")
    if not p.exists():
        raise ModelLoadError(f"{what} file not found: {p}")
    try:
        with p.open("rb") as f:
            header = f.read(8)
    except OSError as exc:
        raise ModelLoadError(f"cannot read {what} file {p}: {exc.strerror or exc}") from exc
    if len(header) < 8:
        raise ModelLoadError(f"{what} {p} is not a GGUF file (only {len(header)} bytes)")
    magic, version = struct.unpack("<II", header)
    if magic != gguf.GGUF_MAGIC:
        raise ModelLoadError(f"{what} {p} is not a GGUF file (it does not start with 'GGUF')")
    if not 2 <= version <= gguf.GGUF_VERSION:
        raise ModelLoadError(f"{what} {p} is GGUF version {version}; this llama.cpp reads "
                             f"versions 2 to {gguf.GGUF_VERSION}")
    return p
