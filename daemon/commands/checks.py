"""Checks of command-line values that parsing alone cannot do, run before anything starts.

Why: loading a model and calibrating it take seconds; a typo in ``--model`` or a
``draft:PATH`` that is not a GGUF file must be reported before that (and before
``meshd demo`` starts a daemon), in a sentence that says what is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshd.native.gguf_file import check_model_file

__all__ = ["check_model_args"]


def check_model_args(model: str | None, proposer: str | None = None,
                     draft_models: Sequence[str] = ()) -> None:
    """Raise ``ModelLoadError`` naming the first model file that cannot be used."""
    if model:
        check_model_file(model)
    for path in draft_models:
        check_model_file(path, what="draft model")
    if proposer and proposer.startswith("draft:"):
        check_model_file(proposer.partition(":")[2], what="draft model")
