"""Benchmark workloads: the prompts ``meshd bench`` runs, shipped or the user's own files.

Why a file format rather than code: a workload is data (chat messages plus whether a
good answer copies the prompt), so users can benchmark their own prompts with
``meshd bench --workload FILE.json`` in exactly the shape the shipped ones use::

    {"name": "...", "description": "...", "copies": true,
     "messages": [{"role": "user", "content": "..."}],
     "response_format": {"type": "json_schema", "json_schema": {"name": "...",
                                                                "schema": {...}}}}

A *family* of requests (``meshd bench-e2e`` only) adds ``"variants": ["...", ...]``:
each request puts one of them where a message says ``{variant}`` (chosen by its tag, so
every arm of a repetition gets the same one), and ``"warm_up": N`` requests of other
variants go to every server first: agent loops, SQL over one schema, one edit over many
files, where answers repeat one another more than their prompts (meshd's history lookup,
llama-server's ``ngram-mod``), and a varied control (``story-control``) where they do not.

``response_format`` is optional and goes into the OpenAI requests of ``meshd bench-e2e``
as OpenAI defines it (``text``, ``json_object`` or ``json_schema``), so every server is
held to the same constraint. The in-process benchmarks (``meshd bench``, the replay)
apply no constraint, so the shipped constrained workloads (``schema-*``) are not in
their default set; named, they run their prompt unconstrained.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

WORKLOAD_DIR = Path(__file__).with_name("workloads")
#: ``response_format`` types OpenAI (and so meshd and llama-server) accept.
FORMAT_TYPES: Final = ("text", "json_object", "json_schema")


class BenchError(Exception):
    """The benchmark cannot run as asked (unknown model or workload, failed quantize)."""


class ArmUnavailable(Exception):
    """This arm does not apply to this model (e.g. ``meshd-mtp`` without an MTP head)."""


@attrs.frozen
class Workload:
    """One prompt kept in the repository, as chat messages ``(role, content)``."""

    name: str
    description: str
    messages: tuple[tuple[str, str], ...]
    #: Whether a good answer mostly copies the prompt (where prompt lookup should pay).
    copies: bool = False
    #: OpenAI's ``response_format``, sent verbatim to chat endpoints (None: none sent).
    #: Not hashed: a dict is not hashable, and the name identifies a workload anyway.
    response_format: Mapping[str, Any] | None = attrs.field(default=None, hash=False)
    #: OpenAI's predicted output (``prediction.content``): the text the client expects.
    prediction: str | None = None
    #: A family's texts for ``{variant}`` (empty: one request shape, sent as it is).
    variants: tuple[str, ...] = ()
    #: Requests of the family each server gets before the measured ones.
    warm_up: int = 0

    def for_tag(self, tag: str, index: int | None = None) -> Workload:
        """This workload as the request tagged ``tag`` sends it: a family's variant put
        in place of ``{variant}`` (the same for every arm, another for another tag;
        ``index``: the measured request's place in the run, so that consecutive ones
        ask different questions)."""
        if not self.variants:
            return self
        # The warm-up takes the first variants, in order; measured requests the others
        # (so none repeats a warm-up question word for word), in turn or by the tag's hash.
        warm = self.warm_up_tags()
        if tag in warm:
            variant = self.variants[warm.index(tag) % len(self.variants)]
        else:
            rest = self.variants[self.warm_up:] or self.variants
            at = zlib.crc32(tag.encode()) if index is None else index
            variant = rest[at % len(rest)]
        return attrs.evolve(self, messages=tuple(
            (role, content.replace("{variant}", variant)) for role, content in self.messages))

    def warm_up_tags(self) -> list[str]:
        """The tags of the family's warm-up requests (each its own variant)."""
        return [f"[warm-up.{i + 1}]" for i in range(self.warm_up)]

    @property
    def plain_text(self) -> str:
        """The prompt for models without a chat template: the contents, one per paragraph."""
        return "\n\n".join(content for _, content in self.messages) + "\n"

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer is held to (``json_object``: any object), or None
        when the output is free text; what a request without ``response_format`` (a
        plain completion to llama-server) has to send instead."""
        fmt = self.response_format
        if fmt is None or fmt["type"] == "text":
            return None
        if fmt["type"] == "json_schema":
            return dict(fmt["json_schema"]["schema"])
        return dict(fmt.get("schema") or {"type": "object"})

    @property
    def constrained(self) -> bool:
        """Whether the answer is held to a schema (``text`` constrains nothing)."""
        return self.schema is not None


def _read_workload(path: Path) -> Workload:
    """One workload file (the shipped format: name, description, copies, messages and
    an optional response_format)."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        messages = tuple((str(m["role"]), str(m["content"])) for m in raw["messages"])
        name = str(raw.get("name") or path.stem)
        description = str(raw.get("description", ""))
        copies = bool(raw.get("copies", False))
        response_format = raw.get("response_format")
        prediction = raw.get("prediction")
        if prediction is not None and not isinstance(prediction, str):
            raise TypeError("'prediction' must be the expected text (a string)")
        variants = tuple(raw.get("variants", ()))
        if not all(isinstance(v, str) for v in variants):
            raise TypeError("'variants' must be a list of strings")
        if variants and not any("{variant}" in m[1] for m in messages):
            raise ValueError("'variants' given, but no message says {variant}")
        warm_up = raw.get("warm_up", 0)
        if not isinstance(warm_up, int) or isinstance(warm_up, bool) or not 0 <= warm_up <= 64:
            raise TypeError("'warm_up' must be a number of requests, 0 to 64")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"workload file {path}: {exc!r}; expected a JSON object with "
                         "'messages': [{'role': ..., 'content': ...}, ...]") from exc
    if not messages:
        raise BenchError(f"workload file {path}: 'messages' is empty")
    if response_format is not None:
        why = _bad_response_format(response_format)
        if why is not None:
            raise BenchError(f"workload file {path}: 'response_format' {why}")
    return Workload(name, description, messages, copies, response_format, prediction,
                    variants, warm_up)


def _bad_response_format(value: object) -> str | None:
    """Why ``value`` is not a ``response_format`` both servers take, or None if it is.

    Checked here so a typo fails before any server starts, not as a warm-up error."""
    if not isinstance(value, dict):
        return "must be an object like {'type': 'json_object'}"
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        return f"has type {kind!r}; expected one of {', '.join(FORMAT_TYPES)}"
    if kind == "json_object" and not isinstance(value.get("schema", {}), dict):
        return "'schema' must be a JSON schema object"
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            return "of type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}"
    return None


def is_workload_file(name: str) -> bool:
    """Whether ``--workload`` names a file (a ``.json`` path) rather than a shipped one."""
    return name.endswith(".json") or "/" in name


def load_workloads(names: Sequence[str] | None = None) -> list[Workload]:
    """The shipped workloads, in file-name order, or the ones named (in that order).

    A name ending in ``.json`` (or containing ``/``) is read as a workload file in the
    shipped format, so users can benchmark their own prompts. With no names, the
    constrained, predicted and family ones are left out: the in-process benchmarks that
    run the default set apply neither a ``response_format`` nor a ``prediction``, and
    send no family's warm-up.
    """
    found: dict[str, Workload] = {}
    for path in sorted(WORKLOAD_DIR.glob("*.json")):
        w = _read_workload(path)
        found[w.name] = w
    if not found:
        raise BenchError(f"no workloads found in {WORKLOAD_DIR}")
    if not names:
        return [w for w in found.values()
                if not w.constrained and w.prediction is None and not w.variants]
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


