"""A function's JSON schema nested inside another (a call's ``arguments``), its
``$defs`` kept reachable.

Why: tool schemas written by pydantic and most SDKs keep their types in ``$defs`` and
point at them with ``$ref: "#/$defs/NAME"``, a pointer from the document's root. Nested
as a call's ``arguments`` (beside other functions' schemas), those pointers would miss;
each function's definitions move to the root under a name of its own and its pointers
follow them.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["hoist_defs"]

_DEF_KEYS: Final = ("$defs", "definitions")


def _renamed(value: Any, prefix: str) -> Any:
    """``value`` with every ``$ref`` into ``#/$defs/`` or ``#/definitions/`` pointing at
    the definition's new name (``#/$defs/<prefix><NAME>``)."""
    if isinstance(value, list):
        return [_renamed(item, prefix) for item in value]
    if not isinstance(value, dict):
        return value
    out = {key: _renamed(item, prefix) for key, item in value.items()}
    ref = value.get("$ref")
    if isinstance(ref, str):
        for key in _DEF_KEYS:
            if ref.startswith(f"#/{key}/"):
                out["$ref"] = f"#/$defs/{prefix}{ref.removeprefix(f'#/{key}/')}"
    return out


def hoist_defs(schema: dict[str, Any], prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``schema`` without its definitions, its pointers renamed, and the definitions
    (renamed ``<prefix><NAME>``) to put in the root's ``$defs``."""
    defs: dict[str, Any] = {}
    for key in _DEF_KEYS:
        found = schema.get(key)
        if isinstance(found, dict):
            defs.update({prefix + name: _renamed(sub, prefix) for name, sub in found.items()})
    if not defs:
        return schema, {}
    body = {key: value for key, value in schema.items() if key not in _DEF_KEYS}
    return _renamed(body, prefix), defs
