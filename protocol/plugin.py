"""Plugin messages: the wire contract between the daemon and an out-of-process proposer.

Why a separate, small set of messages: a proposer plugin is not a client. It does not
generate; it is *asked* by the daemon, one decode step at a time, under a deadline. The
exchange (PROTOCOL.md, "Proposer plugins") is NDJSON like the client protocol, on either
a connection to the daemon's socket (first frame ``plugin_hello`` instead of ``hello``)
or a socketpair the daemon spawned the plugin with:

plugin -> daemon: ``plugin_hello``, ``tokenize`` (set-up only), ``ready``, ``proposal``,
``abstain``, ``plugin_error``;
daemon -> plugin: ``plugin_welcome``, ``tokenized``, ``begin``, ``propose``, ``outcome``,
``end``, ``plugin_reject``.

Decoding is strict (unknown op, missing or mistyped field: :class:`PluginProtocolError`),
because whatever a plugin sends is untrusted; semantic checks (vocabulary range, length,
step) are the daemon's, not the codec's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final

import attrs

__all__ = [
    "MAX_PLUGIN_FRAME",
    "PLUGIN_PROTOCOL_VERSION",
    "REJECT_CODES",
    "Abstain",
    "Begin",
    "End",
    "Outcome",
    "PluginError",
    "PluginHello",
    "PluginMessage",
    "PluginProtocolError",
    "PluginReject",
    "PluginWelcome",
    "Proposal",
    "Propose",
    "Ready",
    "Tokenize",
    "Tokenized",
    "decode_plugin",
    "encode_plugin",
]

PLUGIN_PROTOCOL_VERSION: Final = 1
"""Bumped on any incompatible change to the plugin messages."""

MAX_PLUGIN_FRAME: Final = 1 << 20
"""The longest line either side sends (a ``begin`` with a long prompt fits)."""


class PluginProtocolError(ValueError):
    """A plugin frame that is not valid JSON, not a known op, or has a bad field."""


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v: object) -> bool:
    return isinstance(v, list | tuple) and all(_is_int(x) for x in v)


def _str(v: object) -> bool:
    return isinstance(v, str)


def _opt_str(v: object) -> bool:
    return v is None or isinstance(v, str)


def _num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _obj(v: object) -> bool:
    return isinstance(v, dict)


def _strs(v: object) -> bool:
    return isinstance(v, list | tuple) and all(isinstance(x, str) for x in v)


def _lists_of_ints(v: object) -> bool:
    return isinstance(v, list | tuple) and all(_ints(x) for x in v)


_TUPLES: Final = {"tokens", "prompt", "committed", "eog", "texts", "tokenized"}


@attrs.frozen
class PluginHello:
    """First frame a plugin sends: who it is and what it can do."""

    OP: ClassVar[str] = "plugin_hello"
    name: str
    version: str = "0"
    plugin_protocol_version: int = PLUGIN_PROTOCOL_VERSION
    #: ``{"max_len": N}``: the longest draft it will offer.
    capabilities: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class PluginWelcome:
    """The daemon accepts the plugin: the model it serves and the plugin's options."""

    OP: ClassVar[str] = "plugin_welcome"
    plugin_protocol_version: int
    model: dict[str, Any]
    options: dict[str, Any] = attrs.field(factory=dict)


#: ``plugin_reject.code`` values: why the daemon refused a plugin, for programs.
REJECT_CODES: Final = (
    "not_configured",  # no table of that name allows connecting
    "peer_not_allowed",  # the table pins a uid/gid the connecting process does not have
    "name_in_use",  # a plugin of that name is already up
    "quarantined",  # the plugin faulted too often; connect again after the backoff
    "unsupported_version",  # another plugin protocol version
    "bad_setup",  # wrong name, bad or late set-up frames
    "refused",  # anything else (and a reject from a daemon that sends no code)
)


@attrs.frozen
class PluginReject:
    """The daemon refuses the plugin (then closes): why, in words and as a code."""

    OP: ClassVar[str] = "plugin_reject"
    message: str
    code: str = "refused"


@attrs.frozen
class Tokenize:
    """Set-up only (after ``plugin_welcome``, before ``ready``): tokenize texts with the
    model's tokenizer, e.g. a corpus the plugin drafts from."""

    OP: ClassVar[str] = "tokenize"
    texts: tuple[str, ...]


@attrs.frozen
class Tokenized:
    OP: ClassVar[str] = "tokenized"
    tokenized: tuple[tuple[int, ...], ...]


@attrs.frozen
class Ready:
    """The plugin is set up; the daemon may send requests."""

    OP: ClassVar[str] = "ready"


@attrs.frozen
class Begin:
    """A request starts: its prompt's token ids (text only where the config allows)."""

    OP: ClassVar[str] = "begin"
    request: str
    prompt: tuple[int, ...]
    n_vocab: int
    eog: tuple[int, ...] = ()
    prompt_text: str | None = None
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Propose:
    """Continue the sequence: ``committed`` tokens follow the prompt so far, of which
    ``tokens`` are the ones not sent before; answer before ``deadline`` (the host's
    ``CLOCK_MONOTONIC`` in seconds, i.e. Python's ``time.monotonic()``)."""

    OP: ClassVar[str] = "propose"
    request: str
    step: int
    committed: int
    tokens: tuple[int, ...]
    max_tokens: int
    deadline: float


@attrs.frozen
class Proposal:
    """The plugin's draft for ``step`` (at most ``max_tokens`` ids in the vocabulary)."""

    OP: ClassVar[str] = "proposal"
    request: str
    step: int
    tokens: tuple[int, ...]


@attrs.frozen
class Abstain:
    """Nothing to offer for ``step`` (not a fault)."""

    OP: ClassVar[str] = "abstain"
    request: str
    step: int


@attrs.frozen
class PluginError:
    """The plugin's own code failed for ``step`` (counted as a fault)."""

    OP: ClassVar[str] = "plugin_error"
    request: str
    step: int
    message: str = ""


@attrs.frozen
class Outcome:
    """What verification did with the last proposal of ``step``."""

    OP: ClassVar[str] = "outcome"
    request: str
    step: int
    proposed: int
    accepted: int
    committed: tuple[int, ...]


@attrs.frozen
class End:
    """The request is over; forget it."""

    OP: ClassVar[str] = "end"
    request: str


PluginMessage = (
    PluginHello | PluginWelcome | PluginReject | Tokenize | Tokenized | Ready | Begin
    | Propose | Proposal | Abstain | PluginError | Outcome | End
)

_CHECKS: Final[dict[str, Callable[[object], bool]]] = {
    "name": _str, "version": _str, "plugin_protocol_version": _is_int, "capabilities": _obj,
    "model": _obj, "options": _obj, "message": _str, "code": _str, "texts": _strs,
    "tokenized": _lists_of_ints, "request": _str, "prompt": _ints, "n_vocab": _is_int,
    "eog": _ints, "prompt_text": _opt_str, "step": _is_int, "committed": _is_int,
    "max_tokens": _is_int, "deadline": _num, "tokens": _ints, "proposed": _is_int,
    "accepted": _is_int,
}

_TYPES: Final[dict[str, type[Any]]] = {
    cls.OP: cls for cls in (PluginHello, PluginWelcome, PluginReject, Tokenize, Tokenized,
                            Ready, Begin, Propose, Proposal, Abstain, PluginError, Outcome, End)
}


def encode_plugin(message: PluginMessage) -> bytes:
    """One NDJSON line, ``op`` first."""
    body: dict[str, Any] = {"op": message.OP}
    for field in attrs.fields(type(message)):
        value = getattr(message, field.name)
        if isinstance(value, tuple):
            value = [list(v) if isinstance(v, tuple) else v for v in value]
        body[field.name] = value
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def decode_plugin(line: bytes | str | Mapping[str, Any]) -> PluginMessage:
    """Parse one frame; raises :class:`PluginProtocolError` with the reason."""
    if isinstance(line, Mapping):
        obj: Any = line
    else:
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise PluginProtocolError(f"invalid JSON: {str(exc)[:120]}") from None
    if not isinstance(obj, dict):
        raise PluginProtocolError("a frame must be a JSON object")
    op = obj.get("op")
    cls = _TYPES.get(op) if isinstance(op, str) else None
    if cls is None:
        raise PluginProtocolError(f"unknown plugin op {str(op)[:40]!r}")
    kwargs: dict[str, Any] = {}
    for field in attrs.fields(cls):
        if field.name not in obj:
            if field.default is attrs.NOTHING:
                raise PluginProtocolError(f"{op}: missing field {field.name!r}")
            continue
        value = obj[field.name]
        check = _ints if (op, field.name) == ("outcome", "committed") else _CHECKS[field.name]
        if not check(value):
            raise PluginProtocolError(f"{op}.{field.name}: wrong type")
        if field.name == "tokenized":
            value = tuple(tuple(v) for v in value)
        elif field.name in _TUPLES and not (op == "propose" and field.name == "committed"):
            value = tuple(value)
        kwargs[field.name] = value
    result: PluginMessage = cls(**kwargs)
    return result
