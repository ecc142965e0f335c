"""Field validators for the protocol's messages, built from ``attrs.validators``.

Why one wrapper: attrs' validators (``instance_of``, ``ge``, ``min_len`` ...) already say
what a value must be; what the wire needs on top is one error shape. :func:`rule` runs
them and turns whatever they raise into a :class:`~meshd.protocol.errors.BadRequest`
naming the field and the rule it broke (``top_p: must be a number in (0, 1] (got 2)``),
which the codec then places under the frame's path (``generate.sampling.top_p``).
Python types are checked too, because messages built locally bypass the codec's strict
structuring: the codec checks JSON types, these check values and Python types.

The size limits below are part of the same rules. The frame (or HTTP body) limit bounds
what a request may weigh; these bound what the daemon would build from it, so a field
whose cost grows faster than its size (stop strings, chat turns) is refused before
anything is made of it, with an error that names the limit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, TypeAlias

import attrs
import attrs.validators as V

from .errors import BadRequest

MAX_ID_LENGTH: Final = 256
"""Longest accepted request id, in characters; ids are labels, not payloads."""

MAX_SEED: Final = 2**64 - 1

MAX_NAME_LENGTH: Final = 4096
"""Longest proposer or client name, in characters (a ``draft:PATH`` name holds a path)."""
MAX_STOP_STRINGS: Final = 16
"""Most stop strings one request may give."""
MAX_STOP_LENGTH: Final = 1024
"""Longest stop string, in characters."""
MAX_MESSAGES: Final = 4096
"""Most chat messages one request may give."""
MAX_ROLE_LENGTH: Final = 64
"""Longest chat role, in characters (``system``, ``user``, ``tool`` ...)."""
MAX_OPTIONS: Final = 64
"""Most keys in a request's proposer options."""
MAX_LOOKBACK: Final = 1 << 20
"""Longest ``repeat_last_n`` (llama-server's -1, the whole context, is sent as this)."""
MAX_PREDICTION_LENGTH: Final = 1 << 20
"""Longest predicted output (OpenAI's Predicted Outputs), in characters."""
MAX_TOP_LOGPROBS: Final = 20
"""Most alternatives a request may ask for with each token's log-probability."""
MAX_LOGIT_BIAS: Final = 4096
"""Most token ids one request may bias."""
MAX_GRAMMAR_LENGTH: Final = 256 * 1024
"""Longest output constraint (a grammar, or a JSON schema as JSON text), in characters."""
MODEL_NAME_PATTERN: Final = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}"
"""A served model's name (``generate.model``, the config's ``[models.NAME]``, ``-m
NAME=PATH``): a letter or digit, then letters, digits, ``.``, ``_``, ``:`` or ``-``; at
most 64 characters (Ollama-style ``qwen2.5:1b`` fits; ``=`` and ``/`` never appear)."""
KEEP_ALIVE_FOREVER: Final = -1
"""A ``keep_alive`` that keeps the model loaded until it is unloaded (Ollama's -1)."""
MAX_KEEP_ALIVE_S: Final = 10 * 365 * 24 * 3600
"""Longest finite ``keep_alive``, in seconds (ten years: longer is a typo, not a plan)."""


_Check: TypeAlias = Callable[[Any, "attrs.Attribute[Any]", Any], Any]

STR: Final = V.instance_of(str)


def not_bool(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
    """Refuses ``True``/``False``, which Python counts as integers and JSON does not
    (``attrs.validators.not_(instance_of(bool))`` says the same, raising an exception
    inside for every valid integer)."""
    if isinstance(value, bool):
        raise TypeError("a boolean is not a number")


INT: Final[_Check] = V.and_(V.instance_of(int), not_bool)
NUMBER: Final[_Check] = V.and_(
    V.instance_of(int | float), not_bool, V.gt(-math.inf), V.lt(math.inf)
)
"""A finite integer or float (NaN fails both bounds)."""
OBJECT: Final = V.instance_of(dict)


def _shown(value: object) -> str:
    """The offending value as an error shows it: short, with the size of a long one
    (never the repr of a whole large value, which could be megabytes)."""
    if isinstance(value, str) and len(value) > 40:
        return f"{value[:40]!r}... ({len(value)} chars)"
    if isinstance(value, list | tuple) and len(value) > 8:
        return f"an array of {len(value)} items"
    if isinstance(value, dict) and len(value) > 8:
        return f"an object of {len(value)} keys"
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def rule(
    requirement: str,
    *checks: _Check,
    optional: bool = False,
    each: str | None = None,
    container: str | None = None,
    non_empty: bool = False,
    max_items: int | None = None,
    all_valid: Callable[[Any], bool] | None = None,
) -> Any:
    """The one wrapper from attrs validators to the wire's errors.

    The field must pass every check in ``checks`` (``None`` passes too if ``optional``),
    else BadRequest "``field``: must be ``requirement`` (got ...)". With ``each``, the
    value must be an array (``container="array"``) or object (``"object"``) described by
    ``requirement``, and every item must pass ``checks``; a bad item is named by its
    index or key: "``tokens[3]``: must be ``each`` (got -1)"; ``non_empty`` refuses an
    empty one, ``max_items`` one with more items (before any item is checked).
    ``all_valid``, for arrays that can be long (a tokenizer's answer runs to millions of
    ids, and messages are built on the event loop), is a quick test of the whole array:
    when it passes, the items are not checked one by one; it may only say yes for an
    array that every check would pass.
    """

    def fail(field: str, what: str, value: object) -> BadRequest:
        return BadRequest.invalid_field(field, f"must be {what} (got {_shown(value)})")

    def validate(inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is None and optional:
            return
        name = attribute.name
        if each is None:
            try:
                for check in checks:
                    check(inst, attribute, value)
            except (TypeError, ValueError):
                raise fail(name, requirement, value) from None
            return
        items: Iterable[tuple[object, object]]
        if container == "object" and isinstance(value, dict):
            items = value.items()
        elif container == "array" and isinstance(value, tuple | list):
            items = enumerate(value)
        else:
            raise fail(name, requirement, value)
        if (non_empty and not value) or (max_items is not None and len(value) > max_items):
            raise fail(name, requirement, value)
        if all_valid is not None and all_valid(value):
            return
        for key, item in items:
            try:
                if container == "object" and not isinstance(key, str):
                    raise TypeError("object keys must be strings")
                for check in checks:
                    check(inst, attribute, item)
            except (TypeError, ValueError):
                where = f"[{key!r}]" if container == "object" else f"[{key}]"
                raise fail(f"{name}{where}", each, item) from None

    return validate


def json_length(limit: int) -> _Check:
    """A value whose compact JSON text is at most ``limit`` characters."""

    def check(_inst: object, _attribute: attrs.Attribute[Any], value: object) -> None:
        if len(json.dumps(value, separators=(",", ":"))) > limit:
            raise ValueError(f"longer than {limit} characters as JSON")

    return check


def integer(minimum: int, maximum: int | None = None, *, optional: bool = False) -> Any:
    """An integer within ``[minimum, maximum]``."""
    bounds: list[_Check] = [V.ge(minimum)]
    requirement = f"an integer >= {minimum}"
    if maximum is not None:
        requirement = f"an integer in [{minimum}, {maximum}]"
        bounds.append(V.le(maximum))
    if optional:
        requirement += " or null"
    return rule(requirement, INT, *bounds, optional=optional)


def instance(cls: type) -> Any:
    """An instance of ``cls`` (a nested message or an enum member)."""
    return rule(f"a {cls.__name__}", V.instance_of(cls))


request_id: Final = rule(
    f"a non-empty string of at most {MAX_ID_LENGTH} chars",
    STR, V.min_len(1), V.max_len(MAX_ID_LENGTH),
)
optional_request_id: Final = rule(
    f"a non-empty string of at most {MAX_ID_LENGTH} chars",
    STR, V.min_len(1), V.max_len(MAX_ID_LENGTH), optional=True,
)
string: Final = rule("a string", STR)
name: Final = rule(f"a non-empty string of at most {MAX_NAME_LENGTH} chars",
                   STR, V.min_len(1), V.max_len(MAX_NAME_LENGTH))
optional_name: Final = rule(f"a non-empty string of at most {MAX_NAME_LENGTH} chars",
                            STR, V.min_len(1), V.max_len(MAX_NAME_LENGTH), optional=True)
stop_strings: Final = rule(
    f"an array of at most {MAX_STOP_STRINGS} stop strings", STR, V.min_len(1),
    V.max_len(MAX_STOP_LENGTH), each=f"a non-empty string of at most {MAX_STOP_LENGTH} chars",
    container="array", max_items=MAX_STOP_STRINGS,
)
role: Final = rule(f"a non-empty string of at most {MAX_ROLE_LENGTH} chars",
                   STR, V.min_len(1), V.max_len(MAX_ROLE_LENGTH))
non_empty_string: Final = rule("a non-empty string", STR, V.min_len(1))
optional_non_empty_string: Final = rule(
    "a non-empty string", STR, V.min_len(1), optional=True
)
seed: Final = integer(0, MAX_SEED, optional=True)
model_name: Final = rule(
    "a model name: a letter or digit, then letters, digits, '.', '_', ':' or '-', at most "
    "64 characters", STR, V.matches_re(MODEL_NAME_PATTERN))
optional_model_name: Final = rule(
    "a model name: a letter or digit, then letters, digits, '.', '_', ':' or '-', at most "
    "64 characters", STR, V.matches_re(MODEL_NAME_PATTERN), optional=True)


def _keep_alive_seconds(_inst: object, _attribute: attrs.Attribute[Any], value: float) -> None:
    if value != KEEP_ALIVE_FOREVER and not 0 <= value <= MAX_KEEP_ALIVE_S:
        raise ValueError("out of range")


keep_alive: Final = rule(
    f"-1 (stay loaded) or a number of seconds in [0, {MAX_KEEP_ALIVE_S}]", NUMBER,
    _keep_alive_seconds, optional=True)
boolean: Final = rule("a boolean", V.instance_of(bool))
non_negative_number: Final = rule("a finite number >= 0", NUMBER, V.ge(0))
def number_in(low: float, high: float, *, low_open: bool = False) -> Any:
    """A finite number within ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    return rule(f"a number in {'(' if low_open else '['}{low:g}, {high:g}]", NUMBER,
                V.gt(low) if low_open else V.ge(low), V.le(high))


logit_bias: Final = rule(
    f"an object of at most {MAX_LOGIT_BIAS} token ids (as strings) to numbers in "
    "[-100, 100]", NUMBER, V.ge(-100), V.le(100), each="a number in [-100, 100]",
    container="object", max_items=MAX_LOGIT_BIAS, optional=True)
counters: Final = rule("an object of counters", NUMBER, V.ge(0),
                         each="a finite number >= 0", container="object")
string_items: Final = rule("an array of strings", STR, each="a string", container="array")


def int_items(minimum: int) -> Any:
    """An array of integers, each >= ``minimum``."""

    def all_valid(value: Sequence[Any]) -> bool:
        # ``type(x) is int`` leaves out bools (and int subclasses, checked one by one).
        return all(type(x) is int for x in value) and min(value, default=minimum) >= minimum

    return rule("an array of integers", INT, V.ge(minimum), each=f"an integer >= {minimum}",
                container="array", all_valid=all_valid)
