"""Request bodies decoded from JSON, every failure of the decoder the client's 400.

Why one function for every JSON endpoint: Python's decoder refuses some valid-looking
bodies with exceptions other than ``JSONDecodeError``: nesting past its recursion limit
(``RecursionError``, about 1,000 levels) and integers past the interpreter's digit limit
(``ValueError``, 4,300 digits). Caught here, they are a 400 ``invalid_request_error``
logged at info, never a 500 with an error-level traceback that anyone can repeat to
flood the log. A body the decoder takes but that nests deeper than
:data:`MAX_BODY_DEPTH` is refused too, before any code that walks it by recursion
(schema compilers, validators, ``json.dumps`` in error messages) meets it; no request
meshd serves needs that depth (the JSON schemas of ``response_format`` and ``tools``
included).
"""

from __future__ import annotations

import json
from typing import Any, Final

from meshd.daemon.requests.api_errors import ApiError

__all__ = ["MAX_BODY_DEPTH", "json_object", "json_value"]

MAX_BODY_DEPTH: Final = 256
"""Deepest nesting of arrays and objects a request body may have (the body itself is
level 1)."""


def json_value(raw: bytes) -> Any:
    """A request body's JSON value, or ApiError (400) saying why it is not one."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if _deeper_than(value, MAX_BODY_DEPTH):
        raise _too_deep()
    return value


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or ApiError (400) saying why it is not one."""
    body = json_value(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _too_deep() -> ApiError:
    return ApiError(400, f"the request body is nested too deeply (at most {MAX_BODY_DEPTH} "
                         "levels of arrays and objects)")


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests arrays and objects more than ``limit`` deep (without
    recursion, so any depth the decoder returns is measured)."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False
