"""meshd-snippets: draft tokens from files of code snippets (or the repository you edit).

When the text being generated repeats something in your snippet files (boilerplate,
the function you are refactoring, a licence header, a config block), the continuation
is already written down: this proposer finds the longest recent run of generated
tokens that also occurs in the snippets and proposes what follows it there. meshd
verifies every drafted token, so a wrong guess costs a little time and never changes
the output.

Options (the ``[speculation.plugins.snippets]`` table, or per request):

- ``files``: list of files or directories to read (directories: the files with one of
  ``extensions`` below them, at most ``max_bytes`` in all);
- ``extensions``: default ``[".py", ".md", ".txt", ".toml", ".json", ".rs", ".c", ".h"]``;
- ``max_bytes``: default 4 MiB; ``min_match``: n-gram length to match, default 3.

In-process it is the ``snippets`` entry point; out-of-process run
``python -m meshd_snippets --socket PATH`` (or let the daemon spawn it with
``command = ["python", "-m", "meshd_snippets"]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from meshd.plugins import sdk

__all__ = ["SnippetIndex", "factory", "main", "plugin", "propose", "read_snippets"]

DEFAULT_EXTENSIONS = (".py", ".md", ".txt", ".toml", ".json", ".rs", ".c", ".h")


def _list(value: object, key: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"option {key!r} must be a list of strings")
    return list(value)


def read_snippets(options: Mapping[str, Any]) -> list[str]:
    """The texts named by the ``files`` option (see the module docstring)."""
    extensions = tuple(_list(options.get("extensions", DEFAULT_EXTENSIONS), "extensions"))
    budget = int(options.get("max_bytes", 4 << 20))
    texts: list[str] = []
    for entry in _list(options.get("files", []), "files"):
        path = Path(entry).expanduser()
        paths = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in extensions) \
            if path.is_dir() else [path]
        for p in paths:
            try:
                data = p.read_bytes()[: max(0, budget)]
            except OSError:
                continue
            budget -= len(data)
            texts.append(data.decode("utf-8", "replace"))
            if budget <= 0:
                return texts
    return texts


class SnippetIndex:
    """Every ``n``-gram of the tokenized snippets -> where it last occurs."""

    def __init__(self, corpus: Sequence[Sequence[int]], n: int) -> None:
        self.n = n
        self.docs = [list(doc) for doc in corpus]
        self.where: dict[tuple[int, ...], tuple[int, int]] = {}
        for d, doc in enumerate(self.docs):
            for i in range(len(doc) - n):
                self.where[tuple(doc[i:i + n])] = (d, i + n)

    def continuation(self, tokens: Sequence[int], k: int) -> list[int]:
        """What follows the last ``n`` tokens in the snippets (up to ``k``), if anything."""
        if len(tokens) < self.n or k <= 0:
            return []
        hit = self.where.get(tuple(tokens[-self.n:]))
        if hit is None:
            return []
        doc, pos = hit
        return self.docs[doc][pos:pos + k]


#: Built once per tokenized corpus; the corpus is kept with its index so its id is
#: never reused for another one.
_indexes: dict[tuple[int, int], tuple[object, SnippetIndex]] = {}


def propose(ctx: sdk.Context) -> list[int]:
    """The SDK function: continue from the snippets, or offer nothing."""
    if not ctx.corpus:
        return []
    n = int(ctx.options.get("min_match", 3))
    key = (id(ctx.corpus), n)
    entry = _indexes.get(key)
    if entry is None:
        entry = _indexes[key] = (ctx.corpus, SnippetIndex(ctx.corpus, n))
    return entry[1].continuation(ctx.tokens, ctx.max_tokens)


plugin = sdk.Plugin("snippets", propose, version="1.0.0", max_len=16, corpus=read_snippets)
#: The ``meshd.proposers`` entry point.
factory = plugin.factory


def main(argv: Sequence[str] | None = None) -> int:
    """Run out-of-process (``--socket PATH``, or spawned by the daemon)."""
    return plugin.main(argv)
