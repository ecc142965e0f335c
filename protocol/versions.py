"""Older protocol versions: what each one's frames look like, and the mapping to them.

Why this exists: versions grow by additions only, so the server need not drop a client
of an older version; it only has to show that client nothing its version lacks and
refuse, as that version did, what the client could not have meant. Each older version
is written down here once as its schema (the fields every object had then, the values
it knew), frozen forever, and two pure functions apply it to parsed JSON:
:func:`check_request` before a client's frame is structured, :func:`downgrade` after a
server's frame is unstructured. The current version needs neither (the messages are its
schema). A whitelist rather than a list of additions, so a field added later without a
version bump still never reaches an old client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, Literal

import attrs

from .errors import BadRequest, unknown_fields, unknown_op
from .messages import PROTOCOL_VERSION

__all__ = [
    "OLDEST_VERSION",
    "SCHEMAS",
    "Schema",
    "Shape",
    "Unrepresentable",
    "check_request",
    "downgrade",
    "speaks",
    "unsupported_message",
]

OLDEST_VERSION: Final = 1
"""The first protocol version; the server still speaks it (additions never drop one)."""

Nesting = Literal["object", "array", "map"]
"""How a field holds objects: one, an array of them, or a map of names to them."""


@attrs.frozen
class Shape:
    """The fields one object has in a version (in the order of its message class), the
    objects nested in it, defaults that version gave omitted fields where they differ
    from today's, and enum values it lacks mapped to the nearest it has."""

    fields: tuple[str, ...]
    nested: Mapping[str, tuple[Nesting, Shape]] = attrs.field(factory=dict)
    defaults: Mapping[str, object] = attrs.field(factory=dict)
    values: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)


@attrs.frozen
class Schema:
    """One older version: its requests and responses by ``op``."""

    requests: Mapping[str, Shape]
    responses: Mapping[str, Shape]


class Unrepresentable(ValueError):
    """The frame has no form in the peer's version (an ``op`` it did not have)."""


def _ids(*fields: str, **kw: Any) -> Shape:
    return Shape(("id", *fields), **kw)


_V1_MODEL: Final = Shape(("name", "architecture", "n_ctx", "n_vocab", "n_params",
                          "size_bytes", "has_mtp", "has_chat_template"))
_V1_SPECULATION: Final = Shape((
    "proposer", "emitted", "target_forwards", "verify_calls", "drafted", "accepted",
    "accepted_per_position", "rollbacks_in_place", "checkpoints", "checkpoint_bytes",
    "restores", "wall_ms", "prefill_ms", "decode_ms", "verify_ms", "refusals", "extra"))

V1: Final = Schema(
    requests={
        "hello": _ids("protocol_version", "client_name"),
        "generate": _ids(
            "prompt", "messages", "max_tokens", "sampling", "stop", "speculative",
            nested={
                "messages": ("array", Shape(("role", "content"))),
                # Version 1's default temperature was 0.8 (sampled); greedy came later.
                "sampling": ("object", Shape(("temperature", "top_k", "top_p", "seed"),
                                             defaults={"temperature": 0.8})),
                "speculative": ("object", Shape(("proposer", "draft_max"))),
            },
            defaults={"sampling": {}}),  # so an omitted sampling gets 0.8 as well
        "cancel": _ids(),
        "stats": _ids(),
        "health": _ids(),
        "models": _ids(),
        "tokenize": _ids("text", "add_special"),
        "detokenize": _ids("tokens"),
    },
    responses={
        "welcome": _ids("protocol_version", "server_version", "model", "capabilities",
                        "proposers", "max_frame_size", nested={"model": ("object", _V1_MODEL)}),
        "token": _ids("text", "token_ids"),
        "done": _ids("finish_reason", "usage", "speculation", "error_message",
                     nested={"usage": ("object", Shape(("prompt_tokens", "completion_tokens"))),
                             "speculation": ("object", _V1_SPECULATION)},
                     # What version 1 sent for a request its daemon's shutdown stopped.
                     values={"finish_reason": {"shutdown": "cancelled"}}),
        # A peer refused, or a model it cannot have named (version 1 had no
        # generate.model), is told its request cannot be served as sent: retrying is
        # no use (not busy) and nothing broke (not internal).
        "error": _ids("code", "message", values={"code": {"forbidden": "bad_request",
                                                          "unknown_model": "bad_request"}}),
        "stats_reply": _ids("uptime_s", "counters", "proposers", nested={"proposers": (
            "map", Shape(("requests", "drafted", "accepted", "accepted_per_position")))}),
        "health_reply": _ids("status", "uptime_s", "active_requests", "queued_requests"),
        "models_reply": _ids("models", nested={"models": ("array", _V1_MODEL)}),
        "tokenize_reply": _ids("tokens"),
        "detokenize_reply": _ids("text"),
    },
)
"""Version 1, as the first release defined it (``git show f2bc852^:protocol/messages.py``)."""

_V2_MODEL: Final = Shape(("name", "architecture", "n_ctx", "n_vocab", "n_params",
                          "size_bytes", "has_mtp", "has_chat_template", "gpu_layers"))
# Version 2's speculation figures are version 1's (``_V1_SPECULATION``), unchanged.

V2: Final = Schema(
    requests={
        "hello": _ids("protocol_version", "client_name"),
        "generate": _ids(
            "prompt", "messages", "max_tokens", "sampling", "stop", "speculative",
            "constraint", "logprobs", "prediction",
            nested={
                "messages": ("array", Shape(("role", "content"))),
                "sampling": ("object", Shape((
                    "temperature", "top_k", "top_p", "seed", "min_p", "typical_p",
                    "repeat_penalty", "repeat_last_n", "presence_penalty",
                    "frequency_penalty", "logit_bias"))),
                "speculative": ("object", Shape(("proposer", "draft_max", "options"))),
                "constraint": ("object", Shape(("kind", "schema", "grammar"))),
            }),
        "cancel": _ids("ack"),
        "stats": _ids(),
        "health": _ids(),
        "models": _ids(),
        "tokenize": _ids("text", "add_special"),
        "detokenize": _ids("tokens"),
    },
    responses={
        "welcome": _ids("protocol_version", "server_version", "model", "capabilities",
                        "proposers", "max_frame_size", nested={"model": ("object", _V2_MODEL)}),
        "token": _ids("text", "token_ids", "logprobs", nested={
            "logprobs": ("array", Shape(("token", "logprob", "top")))}),
        "done": _ids("finish_reason", "usage", "speculation", "error_message", "seed",
                     nested={"usage": ("object", Shape(("prompt_tokens", "completion_tokens"))),
                             "speculation": ("object", _V1_SPECULATION)}),
        # Version 2 had no generate.model, load or unload, so its client names no model;
        # should it get unknown_model all the same, the request cannot be served as sent.
        "error": _ids("code", "message", values={"code": {"unknown_model": "bad_request"}}),
        "stats_reply": _ids("uptime_s", "counters", "proposers", nested={"proposers": (
            "map", Shape(("requests", "drafted", "accepted", "accepted_per_position")))}),
        "health_reply": _ids("status", "uptime_s", "active_requests", "queued_requests"),
        "models_reply": _ids("models", nested={"models": ("array", _V2_MODEL)}),
        "tokenize_reply": _ids("tokens"),
        "detokenize_reply": _ids("text"),
        "cancel_reply": _ids("cancelled"),
    },
)
"""Version 2, as its last release defined it (``git show 405622d:protocol/messages.py``)."""

V3: Final = Schema(
    requests={
        "hello": _ids("protocol_version", "client_name"),
        "generate": _ids(
            "prompt", "messages", "max_tokens", "sampling", "stop", "speculative",
            "constraint", "logprobs", "prediction", "model", "keep_alive",
            nested={"messages": ("array", Shape(("role", "content")))}),
        "cancel": _ids("ack"),
        "stats": _ids(),
        "health": _ids(),
        "models": _ids(),
        "tokenize": _ids("text", "add_special"),
        "detokenize": _ids("tokens"),
        "load": _ids("model", "keep_alive"),
        "unload": _ids("model"),
    },
    responses={
        "welcome": _ids("protocol_version", "server_version", "model", "capabilities",
                        "proposers", "max_frame_size"),
        "token": _ids("text", "token_ids", "logprobs"),
        "done": _ids("finish_reason", "usage", "speculation", "error_message", "seed",
                     "model"),
        "error": _ids("code", "message"),
        "stats_reply": _ids("uptime_s", "counters", "proposers"),
        "health_reply": _ids("status", "uptime_s", "active_requests", "queued_requests",
                             "models"),
        "models_reply": _ids("models"),
        "tokenize_reply": _ids("tokens"),
        "detokenize_reply": _ids("text"),
        "cancel_reply": _ids("cancelled"),
        "load_reply": _ids("model"),
        "unload_reply": _ids("model", "unloaded"),
    },
)
"""Version 3, as its last release defined it (``git show 5aae02a:protocol/messages.py``):
objects it shares unchanged with today (the sampling, the models, the statistics) are
not spelled out."""

SCHEMAS: Final[Mapping[int, Schema]] = {1: V1, 2: V2, 3: V3}
"""Every version the server speaks besides the current one."""


def speaks(version: int) -> bool:
    """Whether the server answers a ``hello`` of this version."""
    return OLDEST_VERSION <= version <= PROTOCOL_VERSION


def unsupported_message(version: int) -> str:
    """What ``unsupported_version`` says to a client of a version not spoken."""
    return (f"server speaks protocol versions {OLDEST_VERSION} to {PROTOCOL_VERSION}, "
            f"not {version}")


def check_request(obj: Mapping[str, Any], version: int) -> Mapping[str, Any]:
    """A client's parsed frame as today's decoder should read it: an ``op`` or a field
    its version lacks is refused as that version refused any unknown one (``BadRequest``
    naming it, with that version's list of ops), and a field omitted gets that version's
    default. Anything else wrong is left for the decoder to report."""
    if version == PROTOCOL_VERSION:
        return obj
    op = obj.get("op")
    if not isinstance(op, str):
        return obj
    schema = SCHEMAS[version]
    shape = schema.requests.get(op)
    if shape is None:
        raise BadRequest(unknown_op(op, schema.requests, schema.responses, "request"))
    return _checked(obj, shape, op, top=True)


def _checked(obj: Mapping[str, Any], shape: Shape, path: str, *, top: bool = False
             ) -> dict[str, Any]:
    extra = [key for key in obj if key not in shape.fields and not (top and key == "op")]
    if extra:
        raise BadRequest(f"{path}: {unknown_fields(extra, shape.fields)}")
    out = {**shape.defaults, **obj}
    for name, (nesting, inner) in shape.nested.items():
        value = out.get(name)
        if nesting == "object" and isinstance(value, Mapping):
            out[name] = _checked(value, inner, f"{path}.{name}")
        elif nesting == "array" and isinstance(value, list):
            out[name] = [_checked(item, inner, f"{path}.{name}[{i}]")
                         if isinstance(item, Mapping) else item
                         for i, item in enumerate(value)]
    return out


def downgrade(obj: Mapping[str, Any], version: int) -> dict[str, Any]:
    """A server's unstructured frame as a client of ``version`` must see it: fields the
    version lacks left out, values it lacks mapped to the nearest it has. Raises
    :class:`Unrepresentable` for an ``op`` the version lacks."""
    if version == PROTOCOL_VERSION:
        return dict(obj)
    op = obj["op"]
    shape = SCHEMAS[version].responses.get(op)
    if shape is None:
        raise Unrepresentable(f"protocol version {version} has no {op!r} frame")
    return {"op": op, **_shaped(obj, shape)}


def _shaped(obj: Mapping[str, Any], shape: Shape) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in shape.fields:
        if name not in obj:
            continue
        value = obj[name]
        mapped = shape.values.get(name)
        if mapped is not None and isinstance(value, str):
            value = mapped.get(value, value)
        nest = shape.nested.get(name)
        if nest is not None:
            value = _nested(value, *nest)
        out[name] = value
    return out


def _nested(value: Any, nesting: Nesting, shape: Shape) -> Any:
    if nesting == "object" and isinstance(value, Mapping):
        return _shaped(value, shape)
    if nesting == "array" and isinstance(value, list | tuple):
        return [_shaped(v, shape) if isinstance(v, Mapping) else v for v in value]
    if nesting == "map" and isinstance(value, Mapping):
        return {k: _shaped(v, shape) if isinstance(v, Mapping) else v
                for k, v in value.items()}
    return value
