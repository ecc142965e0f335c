"""Benchmark workloads: the prompts ``meshd bench`` runs, shipped or the user's own files.

Why a file format rather than code: a workload is data (chat messages plus whether a
good answer copies the prompt), so users can benchmark their own prompts with
``meshd bench --workload FILE.json`` in exactly the shape the shipped ones use::

    {"name": "...", "description": "...", "copies": true,
     "messages": [{"role": "user", "content": "..."}]}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import attrs

WORKLOAD_DIR = Path(__file__).with_name("workloads")


class BenchError(Exception):
    """The benchmark cannot run as asked (unknown model or workload, failed quantize)."""


@attrs.frozen
class Workload:
    """One prompt kept in the repository, as chat messages ``(role, content)``."""

    name: str
    description: str
    messages: tuple[tuple[str, str], ...]
    #: Whether a good answer mostly copies the prompt (where prompt lookup should pay).
    copies: bool = False

    @property
    def plain_text(self) -> str:
        """The prompt for models without a chat template: the contents, one per paragraph."""
        return "\n\n".join(content for _, content in self.messages) + "\n"


def _read_workload(path: Path) -> Workload:
    """One workload file (the shipped format: name, description, copies, messages)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        messages = tuple((str(m["role"]), str(m["content"])) for m in raw["messages"])
        name = str(raw.get("name") or path.stem)
        description = str(raw.get("description", ""))
        copies = bool(raw.get("copies", False))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"workload file {path}: {exc!r}; expected a JSON object with "
                         "'messages': [{'role': ..., 'content': ...}, ...]") from exc
    if not messages:
        raise BenchError(f"workload file {path}: 'messages' is empty")
    return Workload(name, description, messages, copies)


def is_workload_file(name: str) -> bool:
    """Whether ``--workload`` names a file (a ``.json`` path) rather than a shipped one."""
    return name.endswith(".json") or "/" in name


def load_workloads(names: Sequence[str] | None = None) -> list[Workload]:
    """The shipped workloads, in file-name order, or the ones named (in that order).

    A name ending in ``.json`` (or containing ``/``) is read as a workload file in the
    shipped format, so users can benchmark their own prompts.
    """
    found: dict[str, Workload] = {}
    for path in sorted(WORKLOAD_DIR.glob("*.json")):
        w = _read_workload(path)
        found[w.name] = w
    if not found:
        raise BenchError(f"no workloads found in {WORKLOAD_DIR}")
    if not names:
        return list(found.values())
    missing = [n for n in names if n not in found and not is_workload_file(n)]
    if missing:
        raise BenchError(f"unknown workload(s) {', '.join(missing)}; available: "
                         f"{', '.join(found)} (or a FILE.json)")
    out = [_read_workload(Path(n)) if is_workload_file(n) else found[n] for n in names]
    seen: set[str] = set()
    for w in out:
        if w.name in seen:
            raise BenchError(f"two workloads are named {w.name!r}")
        seen.add(w.name)
    return out


