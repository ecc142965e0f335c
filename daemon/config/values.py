"""The configuration's values: the strict converter every key goes through, and the kinds
of value that are text with a grammar (durations, sizes, model names, ``-m NAME=PATH``).

Why a module of its own: :mod:`.config` declares the keys and :mod:`.model_specs` checks
the ``[models.NAME]`` tables; both must type-check and word their errors the same way,
so both take the rules from here.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Callable
from typing import Annotated, Any, Final

import attrs
import cattrs

from meshd.clients.argtypes import DURATION_HELP, SIZE_HELP, duration_seconds, size_bytes
from meshd.protocol.validators import MODEL_NAME_PATTERN

__all__ = [
    "DURATION",
    "MODEL_NAME_RULE",
    "Duration",
    "are_model_names",
    "converter",
    "duration",
    "first_error",
    "is_model_name",
    "model_name",
    "size",
    "split_model_arg",
]

converter: Final = cattrs.Converter(forbid_extra_keys=True)
"""TOML's types as they are: no string is taken for a number, no 1 for true."""


def _strict(kind: type[Any], check: Any, expected: str) -> None:
    def structure(value: Any, _type: Any) -> Any:
        if not check(value):
            raise ValueError(f"expected {expected}, got {value!r}")
        return kind(value)

    converter.register_structure_hook(kind, structure)


_strict(int, lambda x: type(x) is int, "an integer")
_strict(float, lambda x: type(x) in (int, float), "a number")
_strict(str, lambda x: type(x) is str, "a string")
_strict(bool, lambda x: type(x) is bool, "true or false")


def _structure_tuple(value: Any, kind: Any) -> tuple[Any, ...]:
    """A list key takes a list (cattrs would take ``"root"`` as ``("r", "o", "o", "t")``)."""
    if type(value) not in (list, tuple):
        raise ValueError(f"expected a list, got {value!r}")
    item = typing.get_args(kind)[0]
    return tuple(converter.structure(x, item) for x in value)


def _is_tuple(kind: Any) -> bool:
    origin: Any = typing.get_origin(kind)
    return origin is tuple


converter.register_structure_hook_func(_is_tuple, _structure_tuple)

DURATION: Final = "duration"
Duration = Annotated[str, DURATION]
"""A duration as written (``"5m"``, ``"300"``, ``"-1"``), a ``str`` to every reader; the
file may give a number of seconds, kept as its text so that every source yields the same
kind of value. (A key declares itself ``Annotated[str, DURATION]``, which linters see as the
immutable ``str`` it is.)"""


def _structure_duration(value: Any, _type: Any) -> str:
    if type(value) is str:
        return value
    if type(value) in (int, float):
        return repr(value)
    raise ValueError(f"expected a duration (a string like \"5m\" or a number of seconds), "
                     f"got {value!r}")


converter.register_structure_hook_func(lambda kind: kind == Duration, _structure_duration)


def _grammar(parse: Callable[[str], object], rule: str) -> Any:
    """An attrs validator from a parser: the message is the one attrs' own validators
    give (``'key' must be RULE: VALUE``), so :func:`first_error` names the key."""
    def check(_inst: object, attr: attrs.Attribute[Any], value: Any) -> None:
        if value is None:
            return
        try:
            parse(value)
        except ValueError:
            raise ValueError(f"'{attr.name}' must be {rule}: {value!r}") from None

    return check


def is_model_name(text: str) -> bool:
    """Whether ``text`` is a valid served model's name (the protocol's rule)."""
    return re.fullmatch(MODEL_NAME_PATTERN, text) is not None


def _model_name(text: str) -> None:
    if not is_model_name(text):
        raise ValueError(text)


MODEL_NAME_RULE: Final = ("a model name (a letter or digit, then letters, digits, '.', '_', "
                          "':' or '-', at most 64 characters)")
duration: Final = _grammar(duration_seconds, f"a duration ({DURATION_HELP})")
size: Final = _grammar(size_bytes, f"a size ({SIZE_HELP})")
model_name: Final = _grammar(_model_name, MODEL_NAME_RULE)


def are_model_names(_inst: object, attr: attrs.Attribute[Any], value: tuple[str, ...]
                    ) -> None:
    """A validator: every name in ``value`` is a valid model name."""
    for name in value:
        if not is_model_name(name):
            raise ValueError(f"'{attr.name}' must be {MODEL_NAME_RULE}: {name!r}")


def split_model_arg(text: str) -> tuple[str | None, str]:
    """``-m NAME=PATH`` as (NAME, PATH); ``-m PATH`` as (None, PATH). The part before the
    first ``=`` is a name only when it is a valid one, so a path with ``=`` still works."""
    name, sep, path = text.partition("=")
    return (name, path) if sep and is_model_name(name) else (None, text)


def first_error(exc: BaseException, path: str = "") -> str:
    """The first of cattrs' grouped errors as ``section.key: what is wrong``."""
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        extra = sorted(exc.extra_fields)
        where = f"{path}." if path else ""
        allowed = ", ".join(f.name for f in attrs.fields(exc.cl)) if exc.cl else ""
        return f"unknown key {where}{extra[0]} (known: {allowed})"
    if isinstance(exc, BaseExceptionGroup):
        for sub in exc.exceptions:
            note = next((n for n in getattr(sub, "__notes__", []) if "attribute" in n), "")
            name = note.rsplit(" ", 1)[-1] if note else ""
            sub_path = f"{path}.{name}" if name and path else (name or path)
            return first_error(sub, sub_path)
    message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    rule = re.match(r"'(\w+)' must be (.*?)(?:: (.*))?$", message)
    if rule:  # an attrs validator: "'slots' must be >= 1: 0"
        name, what, got = rule.groups()
        if not path.endswith("." + name):
            path = f"{path}.{name}" if path else name
        message = f"must be {what}" + (f" (got {got})" if got is not None else "")
    return f"{path}: {message}" if path else message
