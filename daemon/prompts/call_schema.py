"""A function's JSON schema as a call's grammar holds it.

Why: two things in the schemas tools are declared with would break a call the grammar
writes, though the schema is right.

- ``$defs``: pydantic and most SDKs keep their types there and point at them with
  ``$ref: "#/$defs/NAME"``, a pointer from the document's root. Nested as a call's
  ``arguments`` (beside other functions' schemas) those pointers would miss, so each
  function's definitions move to the root under a name of its own
  (:func:`hoist_defs`).
- Open objects: most declarations leave ``additionalProperties`` unsaid, which JSON
  Schema reads as "any other key too", and a small model then writes invented keys until
  ``max_tokens``. A call's arguments are the function's parameters, so an object that
  lists its ``properties`` and says nothing more takes those only, as llama.cpp's
  schema-to-grammar reads it (:func:`closed_objects`). Every call it allows is valid
  under the schema as declared.
"""

from __future__ import annotations

from typing import Any, Final

__all__ = ["closed_objects", "hoist_defs"]

_DEF_KEYS: Final = ("$defs", "definitions")
#: Keywords whose sub-schemas each hold a value the whole must hold (closing an object
#: there only refuses more). Not among them: ``allOf`` (its parts describe one object
#: together, and closing one part would refuse the others' keys), and ``not``, ``if``
#: and ``oneOf`` (a closed negation, condition or rival alternative would let through
#: what the schema refuses).
_EACH_SCHEMA: Final = ("items", "additionalItems", "contains", "then", "else")
_SCHEMA_LISTS: Final = ("anyOf", "prefixItems")
_SCHEMA_MAPS: Final = ("properties", "patternProperties")
_UNSOUND: Final = ("not", "if", "oneOf")


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


def _mentions(value: Any, keys: tuple[str, ...]) -> bool:
    if isinstance(value, list):
        return any(_mentions(item, keys) for item in value)
    return isinstance(value, dict) and (any(k in value for k in keys) or any(
        _mentions(item, keys) for item in value.values()))


def closed_objects(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` (every required key among
    them) and leaves ``additionalProperties`` (and ``patternProperties``,
    ``unevaluatedProperties``, ``allOf``) unsaid taking only those properties. Its
    ``$defs`` are closed too unless the schema says ``not``, ``if`` or ``oneOf`` anywhere
    (a ``$ref`` from there would reach a closed definition)."""
    return _closed(schema, defs=not _mentions(schema, _UNSOUND))


def _closed(schema: Any, *, defs: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _EACH_SCHEMA:
        if key in out:
            out[key] = _closed(out[key], defs=defs)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed(item, defs=defs) for item in out[key]]
    for key in (*_SCHEMA_MAPS, *(("$defs", "definitions") if defs else ())):
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub, defs=defs) for name, sub in out[key].items()}
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = _closed(out["additionalProperties"], defs=defs)
    listed = out.get("properties")
    required = out.get("required")
    if isinstance(listed, dict) and not any(k in out for k in (
            "additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")) \
            and all(key in listed for key in (required if isinstance(required, list) else ())):
        out["additionalProperties"] = False
    return out
