"""The protocol's messages: one attrs class per wire ``op``.

Why attrs classes rather than dicts: both ends (the daemon and every client) get one
typed definition of each frame, validated once at construction. Values are checked by
the classes themselves (``max_tokens >= 1``, ``0 < top_p <= 1`` ...), so a bad value is
rejected the same way whether it came off the wire (``decode_request`` turns it into a
``bad_request``) or was built locally by a client (``BadRequest`` is a ``ValueError``).

Each message class has a class-level ``OP`` (its ``op`` discriminator on the wire) and
an ``id`` field first. Requests are what a client sends (``REQUEST_TYPES``), responses
what the server sends (``RESPONSE_TYPES``); the codec keeps the two directions apart so
neither side accepts a frame that only the other may send.

Messages are frozen; :class:`SpeculationStats` is the exception, because the server fills
it in step by step while a generation runs and sends it in the final ``done``. The
messages about models (``ModelInfo``, ``models``, ``load``, ``unload``) are in
``model_messages.py`` and re-exported here.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Final, TypeAlias

import attrs
import attrs.validators as V

from meshd.policy.decision import FinishReason as FinishReason

from . import validators as check
from .chat_messages import MAX_TOOL_CALLS, MAX_TOOLS, TOOL_CHOICES
from .chat_messages import ChatMessage as ChatMessage
from .chat_messages import ToolCall as ToolCall
from .chat_messages import ToolFunction as ToolFunction
from .errors import BadRequest, ErrorCode, ProtocolError, error_from_code
from .model_messages import MODEL_STATES as MODEL_STATES
from .model_messages import Load as Load
from .model_messages import LoadReply as LoadReply
from .model_messages import ModelInfo as ModelInfo
from .model_messages import Models as Models
from .model_messages import ModelsReply as ModelsReply
from .model_messages import Unload as Unload
from .model_messages import UnloadReply as UnloadReply
from .stats_messages import ProposerStats as ProposerStats
from .stats_messages import SpeculationStats as SpeculationStats
from .stats_messages import Usage as Usage
from .validators import KEEP_ALIVE_FOREVER as KEEP_ALIVE_FOREVER
from .validators import MAX_GRAMMAR_LENGTH as MAX_GRAMMAR_LENGTH
from .validators import MAX_ID_LENGTH as MAX_ID_LENGTH
from .validators import MAX_KEEP_ALIVE_S as MAX_KEEP_ALIVE_S
from .validators import MAX_LOGIT_BIAS as MAX_LOGIT_BIAS
from .validators import MAX_LOOKBACK as MAX_LOOKBACK
from .validators import MAX_MESSAGES as MAX_MESSAGES
from .validators import MAX_PREDICTION_LENGTH as MAX_PREDICTION_LENGTH
from .validators import MAX_SEED as MAX_SEED
from .validators import MAX_STOP_LENGTH as MAX_STOP_LENGTH
from .validators import MAX_STOP_STRINGS as MAX_STOP_STRINGS
from .validators import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS

PROTOCOL_VERSION: Final = 4
"""The protocol version this package speaks; bumped on any incompatible change."""

DEFAULT_MAX_FRAME_SIZE: Final = 4 * 1024 * 1024
"""Default maximum frame size in bytes (the JSON line, newline excluded)."""

PROPOSER_OFF: Final = "off"
"""The proposer name that disables speculative decoding for one request."""

# The sampling defaults: the one definition used by the wire's SamplingParams, the
# daemon's engine and both command lines (``meshd generate``, ``meshctl``), so the same
# request gives the same tokens however it is sent. Greedy by default: output is
# reproducible and exactly verifiable, so speculation can run; top_k and top_p apply
# once a temperature above 0 is asked for.
DEFAULT_TEMPERATURE: Final = 0.0
"""0 means greedy (argmax)."""
DEFAULT_TOP_K: Final = 40
"""Keep the 40 most likely tokens when sampling."""
DEFAULT_TOP_P: Final = 0.95
"""Nucleus mass kept when sampling."""


class HealthStatus(enum.StrEnum):
    """Overall daemon state reported by ``health``. meshd reports ``ok``, ``degraded``
    (a remote worker is lost) and ``draining``; ``starting`` is reserved for servers
    that answer before their model is loaded, so clients must accept it."""

    OK = "ok"
    STARTING = "starting"
    DEGRADED = "degraded"
    DRAINING = "draining"


# ----------------------------------------------------------------------- shared parts


@attrs.frozen
class SamplingParams:
    """How the next token is chosen. ``temperature == 0`` means greedy."""

    temperature: float = attrs.field(default=DEFAULT_TEMPERATURE,
                                     validator=check.non_negative_number)
    top_k: int = attrs.field(default=DEFAULT_TOP_K, validator=check.integer(0))
    """Keep the ``top_k`` most likely tokens; 0 disables the filter."""
    top_p: float = attrs.field(
        default=DEFAULT_TOP_P,
        validator=check.rule("a number in (0, 1]", check.NUMBER, V.gt(0), V.le(1)),
    )
    """Nucleus sampling mass, in (0, 1]; 1 disables the filter."""
    seed: int | None = attrs.field(default=None, validator=check.seed)
    """RNG seed for reproducible sampling; ``None`` lets the server choose."""
    min_p: float = attrs.field(default=0.0, validator=check.number_in(0, 1))
    """Drop tokens less likely than ``min_p`` times the most likely one; 0 disables."""
    typical_p: float = attrs.field(default=1.0, validator=check.number_in(0, 1, low_open=True))
    """Locally typical sampling's mass; 1 disables."""
    repeat_penalty: float = attrs.field(default=1.0,
                                        validator=check.number_in(0, 100, low_open=True))
    """Divides (or, for negative logits, multiplies) the logit of each token in the last
    ``repeat_last_n``; 1 disables."""
    repeat_last_n: int = attrs.field(default=64, validator=check.integer(0, MAX_LOOKBACK))
    """How many of the latest tokens (prompt included) the penalties look at; 0: none."""
    presence_penalty: float = attrs.field(default=0.0, validator=check.number_in(-2, 2))
    """Subtracted once from the logit of each token in the last ``repeat_last_n``."""
    frequency_penalty: float = attrs.field(default=0.0, validator=check.number_in(-2, 2))
    """Subtracted from a token's logit once per time it is in the last ``repeat_last_n``."""
    logit_bias: dict[str, float] | None = attrs.field(default=None,
                                                      validator=check.logit_bias)
    """Added to the logits of the token ids (decimal strings) before anything else."""

    def __attrs_post_init__(self) -> None:
        for key in self.logit_bias or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise BadRequest.invalid_field(
                    "logit_bias", f"keys must be token ids (got {key[:32]!r})")


CONSTRAINT_KINDS: Final = ("json_object", "json_schema", "lark", "regex", "gbnf")
"""What an output constraint may be: any JSON object, one JSON schema, or a grammar."""


@attrs.frozen
class Constraint:
    """What the generated text must match; every output token is chosen under it.

    ``json_object``: any JSON object. ``json_schema``: the JSON ``schema``. ``lark``,
    ``regex``, ``gbnf`` (llama.cpp's grammar format): the ``grammar`` text. The server
    compiles it before the request starts and refuses one it cannot compile
    (``bad_request``, quoting the grammar engine).
    """

    kind: str = attrs.field(validator=check.rule(
        f"one of {', '.join(CONSTRAINT_KINDS)}", check.STR, V.in_(CONSTRAINT_KINDS)))
    schema: dict[str, Any] | None = attrs.field(default=None, validator=check.rule(
        f"a JSON schema object of at most {MAX_GRAMMAR_LENGTH} characters as JSON",
        check.OBJECT, check.json_length(MAX_GRAMMAR_LENGTH), optional=True))
    grammar: str | None = attrs.field(default=None, validator=check.rule(
        f"a non-empty string of at most {MAX_GRAMMAR_LENGTH} chars",
        check.STR, V.min_len(1), V.max_len(MAX_GRAMMAR_LENGTH), optional=True))

    def __attrs_post_init__(self) -> None:
        wants_schema = self.kind == "json_schema"
        wants_grammar = self.kind in ("lark", "regex", "gbnf")
        if wants_schema != (self.schema is not None):
            raise BadRequest.invalid_field(
                "schema", "is required for kind json_schema" if wants_schema
                else f"is only for kind json_schema (kind is {self.kind})")
        if wants_grammar != (self.grammar is not None):
            raise BadRequest.invalid_field(
                "grammar", f"is required for kind {self.kind}" if wants_grammar
                else f"is only for kinds lark, regex and gbnf (kind is {self.kind})")

    @property
    def value(self) -> object:
        """The schema or the grammar text (None for ``json_object``)."""
        return self.schema if self.kind == "json_schema" else self.grammar


@attrs.frozen
class SpeculativeOverrides:
    """Per-request speculative-decoding settings; ``None`` keeps the server's default."""

    proposer: str | None = attrs.field(default=None, validator=check.optional_name)
    """Name of the proposer to draft with, or ``"off"`` to disable speculation."""
    draft_max: int | None = attrs.field(
        default=None, validator=check.integer(1, 1024, optional=True)
    )
    """Upper bound on drafted tokens per verify step."""
    options: dict[str, Any] | None = attrs.field(default=None, validator=check.rule(
        f"an object of at most {check.MAX_OPTIONS} keys",
        V.deep_mapping(key_validator=check.STR, mapping_validator=check.OBJECT),
        V.max_len(check.MAX_OPTIONS),
        optional=True,
    ))
    """The proposer's options for this request, over its ``[speculation.plugins.NAME]``
    config table."""


# -------------------------------------------------------------------------- requests


@attrs.frozen
class Hello:
    """First frame a client sends; the server answers ``welcome`` or ``error``."""

    OP: ClassVar[str] = "hello"
    id: str = attrs.field(validator=check.request_id)
    protocol_version: int = attrs.field(validator=check.integer(0))
    client_name: str = attrs.field(validator=check.name)


@attrs.frozen
class Generate:
    """Generate text from ``prompt`` or chat ``messages`` (exactly one of them).

    The server answers with ``token`` frames and ends with one ``done`` (or one
    ``error`` if the request is refused before it starts).
    """

    OP: ClassVar[str] = "generate"
    id: str = attrs.field(validator=check.request_id)
    prompt: str | None = attrs.field(default=None, validator=check.optional_non_empty_string)
    messages: tuple[ChatMessage, ...] | None = attrs.field(default=None, validator=check.rule(
        f"a non-empty array of at most {check.MAX_MESSAGES} chat messages",
        V.instance_of(ChatMessage), each="a ChatMessage", container="array", non_empty=True,
        max_items=check.MAX_MESSAGES, optional=True,
    ))
    max_tokens: int | None = attrs.field(default=None, validator=check.integer(1, optional=True))
    """Most tokens to generate; ``None`` means the server's default / the context end."""
    sampling: SamplingParams = attrs.field(
        factory=SamplingParams, validator=check.instance(SamplingParams)
    )
    stop: tuple[str, ...] = attrs.field(default=(), validator=check.stop_strings)
    """Stop strings (at most ``MAX_STOP_STRINGS``, each at most ``MAX_STOP_LENGTH``
    characters): the text ends before the first one to appear."""
    speculative: SpeculativeOverrides = attrs.field(
        factory=SpeculativeOverrides, validator=check.instance(SpeculativeOverrides)
    )
    constraint: Constraint | None = attrs.field(
        default=None, validator=check.rule("a Constraint", V.instance_of(Constraint),
                                           optional=True))
    """What the text must match (a JSON schema, a grammar); ``None``: free text."""
    logprobs: int | None = attrs.field(default=None,
                                       validator=check.integer(0, MAX_TOP_LOGPROBS,
                                                               optional=True))
    """Send each token's log-probability with this many alternatives (``token.logprobs``)."""
    prediction: str | None = attrs.field(default=None, validator=check.rule(
        f"a string of at most {MAX_PREDICTION_LENGTH} chars", check.STR,
        V.max_len(MAX_PREDICTION_LENGTH), optional=True))
    """The text the client expects back (OpenAI's Predicted Outputs), drafted from by
    the ``prediction`` proposer unless the request names another."""
    model: str | None = attrs.field(default=None, validator=check.optional_model_name)
    """The model that serves the request, by name; ``None``: the daemon's default."""
    keep_alive: float | None = attrs.field(default=None, validator=check.keep_alive)
    """Seconds the model stays loaded once idle after this request (-1: until unloaded,
    0: unloaded after it); ``None`` keeps the model's current setting."""
    tools: tuple[ToolFunction, ...] | None = attrs.field(default=None, validator=check.rule(
        f"a non-empty array of at most {MAX_TOOLS} ToolFunctions", V.instance_of(ToolFunction),
        each="a ToolFunction", container="array", non_empty=True, max_items=MAX_TOOLS,
        optional=True))
    """Functions the model may call (chat ``messages`` only); the calls come in
    ``done.tool_calls``."""
    tool_choice: str = attrs.field(default="auto", validator=check.rule(
        f"one of {', '.join(TOOL_CHOICES)}", check.STR, V.in_(TOOL_CHOICES)))
    """``auto``: the model decides; ``none``: no calls; ``required``: only calls."""
    tool_name: str | None = attrs.field(default=None, validator=check.optional_non_empty_string)
    """With ``required``: the one function the answer calls."""
    parallel_tool_calls: bool = attrs.field(default=True, validator=check.rule(
        "true or false", V.instance_of(bool)))

    def __attrs_post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise BadRequest("exactly one of prompt and messages must be given")
        names = {f.name for f in self.tools or ()}
        if self.tools is not None and self.messages is None:
            raise BadRequest.invalid_field("tools", "are offered to chat messages only")
        if len(names) != len(self.tools or ()):
            raise BadRequest.invalid_field("tools", "must name each function once")
        if self.tool_choice == "required" and self.tools is None:
            raise BadRequest.invalid_field("tool_choice", "required needs tools")
        if self.tool_name is not None and (self.tool_choice != "required"
                                           or self.tool_name not in names):
            raise BadRequest.invalid_field(
                "tool_name", "must name one of tools, with tool_choice required")


@attrs.frozen
class Cancel:
    """Cancel the running request whose id is ``id``.

    The target's stream ends with ``done`` whose ``finish_reason`` is ``cancelled``.
    Cancelling an unknown or finished id changes nothing. Without ``ack`` there is no
    reply; with it the server answers ``cancel_reply`` (id ``ack``) saying whether a
    request was found and told to stop, so a tool can report an unknown id.
    """

    OP: ClassVar[str] = "cancel"
    id: str = attrs.field(validator=check.request_id)
    ack: str | None = attrs.field(default=None, validator=check.optional_request_id)


@attrs.frozen
class Stats:
    """Ask for daemon-wide counters; answered by ``stats_reply``."""

    OP: ClassVar[str] = "stats"
    id: str = attrs.field(validator=check.request_id)


@attrs.frozen
class Health:
    """Ask whether the daemon is serving; answered by ``health_reply``."""

    OP: ClassVar[str] = "health"
    id: str = attrs.field(validator=check.request_id)


@attrs.frozen
class Tokenize:
    """Tokenize ``text`` with the model's tokenizer; answered by ``tokenize_reply``."""

    OP: ClassVar[str] = "tokenize"
    id: str = attrs.field(validator=check.request_id)
    text: str = attrs.field(validator=check.string)
    add_special: bool = attrs.field(default=True, validator=check.boolean)
    """Whether to add the model's special tokens (BOS ...) as for a prompt."""


@attrs.frozen
class Detokenize:
    """Turn token ids back into text; answered by ``detokenize_reply``."""

    OP: ClassVar[str] = "detokenize"
    id: str = attrs.field(validator=check.request_id)
    tokens: tuple[int, ...] = attrs.field(validator=check.int_items(0))


# ------------------------------------------------------------------------- responses


@attrs.frozen
class Welcome:
    """The server's answer to a compatible ``hello``."""

    OP: ClassVar[str] = "welcome"
    id: str = attrs.field(validator=check.request_id)
    protocol_version: int = attrs.field(validator=check.integer(0))
    server_version: str = attrs.field(validator=check.non_empty_string)
    model: ModelInfo = attrs.field(validator=check.instance(ModelInfo))
    """The default model: the one a ``generate`` naming no model uses."""
    capabilities: tuple[str, ...] = attrs.field(default=(), validator=check.string_items)
    """Optional features the server offers (e.g. ``"chat"``, ``"speculation"``)."""
    proposers: tuple[str, ...] = attrs.field(default=(), validator=check.string_items)
    """Proposer names a ``generate`` may ask for."""
    max_frame_size: int = attrs.field(default=DEFAULT_MAX_FRAME_SIZE, validator=check.integer(1))
    """The largest frame the server accepts; clients must not send larger ones."""


@attrs.frozen
class TokenLogprob:
    """A committed token's log-probability at the row that committed it (under the
    request's constraint), and the most likely tokens there."""

    token: int = attrs.field(validator=check.integer(0))
    logprob: float = attrs.field(validator=check.rule("a finite number <= 0", check.NUMBER,
                                                      V.le(0)))
    top: tuple[tuple[int, float], ...] = attrs.field(default=())
    """``[token id, log-probability]`` pairs, most likely first."""


@attrs.frozen
class Token:
    """A streamed piece of a generation.

    ``text`` may be empty when the tokens end inside a multi-byte character; the server
    sends that text with a later token, so concatenating ``text`` gives valid UTF-8.
    """

    OP: ClassVar[str] = "token"
    id: str = attrs.field(validator=check.request_id)
    text: str = attrs.field(validator=check.string)
    token_ids: tuple[int, ...] = attrs.field(validator=check.int_items(0))
    logprobs: tuple[TokenLogprob, ...] | None = attrs.field(default=None, validator=check.rule(
        "an array of TokenLogprob", V.instance_of(TokenLogprob), each="a TokenLogprob",
        container="array", optional=True))
    """One per token of ``token_ids``, when the ``generate`` asked (``logprobs``)."""


@attrs.frozen
class Done:
    """The last frame of a generation."""

    OP: ClassVar[str] = "done"
    id: str = attrs.field(validator=check.request_id)
    finish_reason: FinishReason = attrs.field(validator=check.instance(FinishReason))
    usage: Usage = attrs.field(factory=Usage, validator=check.instance(Usage))
    speculation: SpeculationStats = attrs.field(
        factory=SpeculationStats, validator=check.instance(SpeculationStats)
    )
    error_message: str | None = attrs.field(default=None, validator=check.optional_non_empty_string)
    """Why the generation failed, when ``finish_reason`` is ``error``."""
    seed: int | None = attrs.field(default=None, validator=check.seed)
    """The seed the tokens were sampled with (the request's, or one the daemon chose for
    an unseeded sampled request, so it can be replayed); ``None`` for greedy decoding."""
    model: str | None = attrs.field(default=None, validator=check.optional_non_empty_string)
    """The name of the model that served the request."""
    tool_calls: tuple[ToolCall, ...] | None = attrs.field(default=None, validator=check.rule(
        f"an array of at most {MAX_TOOL_CALLS} ToolCalls", V.instance_of(ToolCall),
        each="a ToolCall", container="array", max_items=MAX_TOOL_CALLS, optional=True))
    """The calls the answer made, when the request offered ``tools`` and the answer ended
    on its own: whole calls to offered functions (OpenAI's ``finish_reason:
    "tool_calls"``). The token frames carry them as the model wrote them."""


@attrs.frozen
class ErrorMessage:
    """An ``error`` frame. ``id`` is ``None`` when the offending frame had no usable id."""

    OP: ClassVar[str] = "error"
    id: str | None = attrs.field(validator=check.optional_request_id)
    code: ErrorCode = attrs.field(validator=check.instance(ErrorCode))
    message: str = attrs.field(validator=check.string)

    @classmethod
    def from_error(cls, error: ProtocolError) -> ErrorMessage:
        """The ``error`` frame that reports ``error`` to the peer."""
        return cls(id=error.request_id, code=error.code, message=error.message)

    def to_error(self) -> ProtocolError:
        """The exception a receiver raises for this frame (the class of its code)."""
        return error_from_code(self.code, self.message, self.id)


def error_message(error: ProtocolError) -> ErrorMessage:
    """The ``error`` frame that reports ``error`` to the peer."""
    return ErrorMessage.from_error(error)


def error_from_message(msg: ErrorMessage) -> ProtocolError:
    """Turn a received ``error`` frame into the exception to raise."""
    return msg.to_error()


@attrs.frozen
class StatsReply:
    """Daemon-wide counters and per-proposer acceptance.

    ``counters`` is deliberately a flexible mapping (``requests_total``,
    ``tokens_generated``, ...) so the daemon can add counters without a protocol bump.
    """

    OP: ClassVar[str] = "stats_reply"
    id: str = attrs.field(validator=check.request_id)
    uptime_s: float = attrs.field(validator=check.non_negative_number)
    counters: dict[str, float] = attrs.field(factory=dict, validator=check.counters)
    proposers: dict[str, ProposerStats] = attrs.field(factory=dict, validator=check.rule(
        "an object mapping names to proposer stats", V.instance_of(ProposerStats),
        each="a ProposerStats", container="object",
    ))


@attrs.frozen
class HealthReply:
    """Liveness and load."""

    OP: ClassVar[str] = "health_reply"
    id: str = attrs.field(validator=check.request_id)
    status: HealthStatus = attrs.field(validator=check.instance(HealthStatus))
    uptime_s: float = attrs.field(validator=check.non_negative_number)
    active_requests: int = attrs.field(validator=check.integer(0))
    queued_requests: int = attrs.field(validator=check.integer(0))
    models: dict[str, str] = attrs.field(factory=dict, validator=check.rule(
        "an object mapping model names to their states", V.in_(MODEL_STATES),
        each="a model state", container="object"))
    """Each model's state (version 3; a server that does not say sends none)."""


@attrs.frozen
class TokenizeReply:
    """The token ids of a ``tokenize`` request."""

    OP: ClassVar[str] = "tokenize_reply"
    id: str = attrs.field(validator=check.request_id)
    tokens: tuple[int, ...] = attrs.field(validator=check.int_items(0))


@attrs.frozen
class DetokenizeReply:
    """The text of a ``detokenize`` request."""

    OP: ClassVar[str] = "detokenize_reply"
    id: str = attrs.field(validator=check.request_id)
    text: str = attrs.field(validator=check.string)


@attrs.frozen
class CancelReply:
    """The answer to a ``cancel`` that asked for one (``id`` is the cancel's ``ack``)."""

    OP: ClassVar[str] = "cancel_reply"
    id: str = attrs.field(validator=check.request_id)
    cancelled: bool = attrs.field(validator=check.boolean)
    """Whether a request with that id was in flight and is now told to stop."""


Request: TypeAlias = (
    Hello | Generate | Cancel | Stats | Health | Models | Tokenize | Detokenize | Load | Unload
)
"""Any frame a client may send."""

Response: TypeAlias = (
    Welcome
    | Token
    | Done
    | ErrorMessage
    | StatsReply
    | HealthReply
    | ModelsReply
    | TokenizeReply
    | DetokenizeReply
    | CancelReply
    | LoadReply
    | UnloadReply
)
"""Any frame a server may send."""

Message: TypeAlias = Request | Response

REQUEST_TYPES: Final[dict[str, type[Request]]] = {
    cls.OP: cls for cls in (Hello, Generate, Cancel, Stats, Health, Models, Tokenize, Detokenize,
                            Load, Unload)
}
"""Request classes by ``op``."""

RESPONSE_TYPES: Final[dict[str, type[Response]]] = {
    cls.OP: cls
    for cls in (
        Welcome,
        Token,
        Done,
        ErrorMessage,
        StatsReply,
        HealthReply,
        ModelsReply,
        TokenizeReply,
        DetokenizeReply,
        CancelReply,
        LoadReply,
        UnloadReply,
    )
}
"""Response classes by ``op``."""
