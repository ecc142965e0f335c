"""Checks and bounds on a constraint before llguidance compiles it.

Why: llguidance compiles what it is given, and three kinds of input it takes would make a
bad answer rather than a clear error.

- A schema or grammar whose language is empty (a cyclic ``$ref`` with no way out,
  ``root ::= "a" root``) compiles, and the answer is then an empty ``stop``, or a
  never-ending one. Clients trust ``stop`` to mean "matches", so such a constraint is
  refused up front: a JSON schema's ``$ref``\\ s and a GBNF grammar's rules are checked for
  a finite value (:func:`schema_problem`, :func:`gbnf_problem`); what no check here sees
  (a Lark grammar) is caught by the first token mask (:mod:`.constraint`).
- Nesting: a schema nested a thousand levels deep overflows the encoder's recursion
  (llguidance's own JSON reader stops at 128), so documents deeper than
  :data:`MAX_NESTING` are refused with that bound, by a walk that does not recurse.
- Numbers: JSON Schema sets no length on an integer, and a small model writes digits
  until ``max_tokens``. As llama.cpp's schema-to-grammar bounds them (an integral part of
  at most 16 digits), a typed integer or number the schema leaves unbounded gets bounds
  llguidance enforces (:func:`bounded_numbers`); llguidance has no option for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

__all__ = ["FRACTION_DIGITS", "MAX_INTEGER", "MAX_NESTING", "bounded_numbers", "gbnf_problem",
           "nesting_problem", "schema_problem"]

#: The deepest JSON a schema may nest (objects and arrays), and the deepest a grammar's
#: parentheses may: llguidance reads schemas with a 128-level limit, and a call's schema
#: nests a few levels inside the call's own.
MAX_NESTING: Final = 100
#: An unbounded integer's bound: 2^53 - 1, I-JSON's interoperable range (every client
#: reads it exactly, llguidance's bounds are doubles) and 16 digits, as llama.cpp's
#: ``integral-part``. A number's integral part is held to 16 digits (below 10^16) and its
#: fraction to :data:`FRACTION_DIGITS` digits (llguidance's finest ``multipleOf``).
MAX_INTEGER: Final = 2**53 - 1
FRACTION_DIGITS: Final = 10


def nesting_problem(value: object, limit: int = MAX_NESTING) -> str | None:
    """Why ``value`` (decoded JSON) nests too deep, or None. Iterative: the document
    may be nested beyond Python's recursion limit."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Iterator[object] = iter(item.values())
        elif isinstance(item, list | tuple):
            children = iter(item)
        else:
            continue
        if depth > limit:
            return f"nests deeper than {limit} levels"
        stack.extend((child, depth + 1) for child in children)
    return None


# -- Finite values --------------------------------------------------------------------

_ALL_OF: Final = ("allOf",)
_ANY_OF: Final = ("anyOf", "oneOf")
#: How many passes the fixpoint takes at most (a schema not settled by then is not
#: refused; real schemas settle in a few).
_PASSES: Final = 50


def _mentions_ref(value: object) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            if "$ref" in item:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _pointer(root: object, ref: str) -> object | None:
    """The sub-document a local ``$ref`` (``#`` or ``#/a/b``) points at, or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


class _Finite:
    """Which schemas have a finite JSON value, as a least fixpoint over ``$ref`` targets
    (a target counts as valueless until shown otherwise; each pass re-evaluates them).
    An estimate that errs towards "has a value": only what has none for certain (every
    way through it returns to itself) is refused; llguidance reports the rest."""

    def __init__(self, root: object) -> None:
        self.root = root
        self.known: dict[int, bool] = {}
        self.targets: dict[int, object] = {}
        self.refs: dict[int, str] = {}

    def of(self, schema: object) -> bool:
        if schema is True or schema is False:
            return bool(schema)
        if not isinstance(schema, Mapping):
            return True
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = _pointer(self.root, ref)
            if target is not None:
                key = id(target)
                self.targets.setdefault(key, target)
                self.refs.setdefault(key, ref)
                if not self.known.get(key, False):
                    return False
        if any(not self.of(sub) for k in _ALL_OF for sub in _list(schema.get(k))):
            return False
        for k in _ANY_OF:
            options = _list(schema.get(k))
            if options and not any(self.of(sub) for sub in options):
                return False
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not isinstance(kinds, list) or not kinds:
            kinds = ["null"]  # (untyped: any value, null among them)
        return any(self._kind(kind, schema) for kind in kinds)

    def _kind(self, kind: object, schema: Mapping[str, Any]) -> bool:
        if kind == "object":
            properties = schema.get("properties")
            properties = properties if isinstance(properties, Mapping) else {}
            extra = schema.get("additionalProperties", True)
            return all(self.of(properties.get(key, extra))
                       for key in _list(schema.get("required")) if isinstance(key, str))
        if kind == "array":
            least = schema.get("minItems", 0)
            if not isinstance(least, int) or least <= 0:
                return True
            prefix = _list(schema.get("prefixItems"))
            items = schema.get("items", True)
            if isinstance(items, list):  # (draft 4-2019: items as a tuple)
                prefix, items = items, schema.get("additionalItems", True)
            if not all(self.of(sub) for sub in prefix[:least]):
                return False
            return least <= len(prefix) or self.of(items)
        return True

    def solve(self) -> bool:
        """Whether the root has a finite value."""
        for _ in range(_PASSES):
            changed = False
            root = self.of(self.root)
            for key, target in list(self.targets.items()):
                if not self.known.get(key, False) and self.of(target):
                    self.known[key] = changed = True
            if root:
                return True
            if not changed:
                return False
        return True  # (not settled within the passes: not refused)

    def culprit(self) -> str:
        """A ``$ref`` with no finite value, to name in the error."""
        for key, ref in self.refs.items():
            if not self.known.get(key, False):
                return ref
        return "#"


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def schema_problem(schema: object) -> str | None:
    """Why ``schema`` cannot be held to (too deep, or no finite value), or None."""
    problem = nesting_problem(schema)
    if problem is not None:
        return f"the schema {problem}"
    if not _mentions_ref(schema):
        return None  # (no $ref: llguidance itself finds what has no value)
    finite = _Finite(schema)
    if finite.solve():
        return None
    return (f"the schema allows no finite value: \"$ref\": {json.dumps(finite.culprit())} refers "
            "back to itself with no way out (a cyclic $ref)")


# -- GBNF -----------------------------------------------------------------------------

def _paren_depth(text: str) -> int:
    """The deepest nesting of parentheses in GBNF ``text`` (outside literals, character
    classes and comments)."""
    depth = deepest = 0
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            i += 1
            while i < n and text[i] != close:
                i += 2 if text[i] == "\\" else 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def gbnf_problem(text: str) -> str | None:
    """Why a GBNF grammar cannot be held to (nested too deep, or a ``root`` that derives
    no finite text), or None; a grammar that does not parse is left to the converter."""
    if _paren_depth(text) > MAX_NESTING:
        return f"the grammar nests parentheses deeper than {MAX_NESTING} levels"
    from llguidance import gbnf_to_lark as gbnf  # (its parser; the module is pure Python)

    try:
        rules = gbnf.GrammarParser().parse(text)
        names = {id(rule): name for name, rule in rules.items()}
        gbnf.resolve(rules)
    except Exception:  # (the converter reports it, with its position)
        return None
    finite: dict[int, bool] = {}

    def derives(node: Any) -> bool:
        if isinstance(node, gbnf.RuleRefNode):
            return node.target is not None and finite.get(id(node.target), False)
        if isinstance(node, gbnf.SequenceNode):
            return all(derives(child) for child in node.nodes)
        if isinstance(node, gbnf.AlternativeNode):
            return any(derives(child) for child in node.alternatives)
        if isinstance(node, gbnf.RepetitionNode):
            return node.min_times == 0 or derives(node.node)
        return True  # a literal or a character class

    changed = True
    while changed:
        changed = False
        for rule in rules.values():
            if not finite.get(id(rule), False) and derives(rule.alternatives):
                finite[id(rule)] = changed = True
    start = rules.get("start")
    if start is None or finite.get(id(start), False):
        return None
    stuck = [names.get(id(rule), rule.name) for rule in sorted(rules.values(),
                                                               key=lambda r: r.order)
             if not finite.get(id(rule), False)]
    return ("the grammar allows no finite text: rule " + ", ".join(stuck[:5])
            + (" never ends" if len(stuck) == 1 else " never end")
            + " (every alternative refers back to a rule that never ends)")


# -- Numbers --------------------------------------------------------------------------

#: Keywords whose sub-schemas each restrict a value the whole must hold: a bound added
#: there only narrows what the schema allows. Not ``not`` or ``if`` (a bound there would
#: widen it).
_EACH: Final = ("additionalProperties", "items", "additionalItems", "contains", "then",
                "else", "unevaluatedProperties", "unevaluatedItems")
_LISTS: Final = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_MAPS: Final = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")


def _has(node: Mapping[str, Any], *keys: str) -> bool:
    return any(key in node for key in keys)


def bounded_numbers(schema: Any) -> Any:
    """``schema`` with every integer and number it leaves unbounded bounded as llama.cpp
    bounds them: an integer within ±(2^53 - 1), a number's integral part to 16 digits
    and its fraction to 10 (no exponent). Every value allowed is one the schema allows;
    a schema with an ``enum`` or ``const``, or a bound beyond these, keeps its own."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _EACH:
        if isinstance(out.get(key), dict):
            out[key] = bounded_numbers(out[key])
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_numbers(item) for item in out[key]]
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: bounded_numbers(sub) for name, sub in out[key].items()}
    kinds = out.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list) or _has(out, "enum", "const"):
        return out
    if "number" in kinds:
        _bound_side(out, "minimum", "exclusiveMinimum", -1e16, exclusive=True)
        _bound_side(out, "maximum", "exclusiveMaximum", 1e16, exclusive=True)
        if "multipleOf" not in out:
            out["multipleOf"] = 10.0 ** -FRACTION_DIGITS
    elif "integer" in kinds:
        _bound_side(out, "minimum", "exclusiveMinimum", -MAX_INTEGER, exclusive=False)
        _bound_side(out, "maximum", "exclusiveMaximum", MAX_INTEGER, exclusive=False)
    return out


def _bound_side(node: dict[str, Any], inclusive: str, exclusive_key: str,
                value: float | int, *, exclusive: bool) -> None:
    """Bound one side of ``node`` at ``value`` unless the schema bounds it already, or
    the other side lies beyond ``value`` (the bound would leave nothing)."""
    if inclusive in node or exclusive_key in node:
        return
    other = ("maximum", "exclusiveMaximum") if inclusive == "minimum" else (
        "minimum", "exclusiveMinimum")
    below = value < 0
    for key in other:
        limit = node.get(key)
        if isinstance(limit, int | float) and not isinstance(limit, bool) and (
                limit <= value if below else limit >= value):
            return
    node[exclusive_key if exclusive else inclusive] = value

