"""OpenAI's completion and chat-completion shapes, mapped onto meshd's one request type.

Why functions without I/O: a request body becomes the same
:class:`~meshd.daemon.requests.spec.RequestSpec` a native ``generate`` becomes (so both
paths share validation, chat rendering, tokenization and the engine, and give the same
tokens), and the engine's results become OpenAI's response,
chunk and error objects, all testable without a socket (a response's id and ``created``
time come from ``uuid4`` and the clock, the only inputs not passed in). Fields OpenAI
clients commonly send and meshd ignores (``user``, ``presence_penalty`` of 0 ...) are
accepted; fields that would change the answer in a way meshd cannot honour are refused
with a 400 naming the field, never silently dropped (the table is
:mod:`.request_fields`). Errors are :mod:`.api_errors`'.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from typing import Any, Final

import attrs

from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.daemon.frontends.http.json_body import json_object
from meshd.daemon.frontends.http.llama.timings_format import timings
from meshd.daemon.frontends.http.logprobs_format import requested_logprobs
from meshd.daemon.frontends.http.output_format import FormatError, output_constraint
from meshd.daemon.frontends.http.request_fields import (
    LlamaSwitches,
    check_continuation,
    check_fields,
    ignored_fields,
    keep_alive_seconds,
    template_kwargs,
)
from meshd.daemon.models.mapping import speculation_stats
from meshd.daemon.prompts.tool_calls import (
    ToolError,
    ToolSpec,
    answer_calls,
    join_parts,
    offer_tools,
    parse_tools,
    past_calls,
    template_messages,
    tool_constraint,
)
from meshd.daemon.requests.api_errors import ApiError, api_field, bad_field
from meshd.daemon.requests.spec import RequestSpec
from meshd.protocol import (
    MAX_MESSAGES,
    MAX_STOP_STRINGS,
    BadRequest,
    ChatMessage,
)
from meshd.protocol import messages as wire

__all__ = [
    "CHAT_ROLES",
    "CompletionRequest",
    "chunk",
    "completion_response",
    "is_int",
    "json_object",
    "meshd_block",
    "parse_messages",
    "parse_request",
    "usage",
    "with_prompt",
]

#: Most choices (``n``) one request may ask for.
MAX_CHOICES: Final = 8
#: Most prompts one ``/v1/completions`` request may batch (LangChain sends up to 20).
MAX_PROMPTS: Final = 32
#: Most generations of a batch (prompts times ``n``): the scheduler's default queue.
MAX_BATCH_GENERATIONS: Final = 64
CHAT_ROLES: Final = ("system", "developer", "user", "assistant", "tool", "function")
"""OpenAI's roles; ``developer`` is rendered as ``system`` (as llama.cpp does), since
chat templates predate it."""
Prompt = str | tuple[int, ...]
"""One prompt of ``/v1/completions``: text, or token ids."""


@attrs.frozen
class CompletionRequest:
    """A validated request: the service's request to run and how to answer it."""

    spec: RequestSpec
    """The request as the service runs it (its prompt text, chat or token ids)."""
    chat: bool
    max_tokens_param: str
    """The field that set ``max_tokens`` (``max_tokens`` or ``max_completion_tokens``)."""
    tools: ToolSpec | None
    """The functions the model may call, and how (None: no tools)."""
    constraint_param: str
    """The field that constrained the output (``response_format``, llama-server's
    ``json_schema`` or ``grammar``), named in errors about the constraint."""
    stream: bool
    include_usage: bool
    model: str | None
    created: int
    logprobs: int | None = None
    """Alternatives to report with each token's log-probability (None: not asked)."""
    predicted: tuple[int, ...] | None = None
    """The request's predicted output as tokens (set once it is tokenized, while the
    model is held; None: no prediction)."""
    n: int = 1
    """Choices to generate (each its own sampling seed: the request's, plus its index)."""
    batch: tuple[Prompt, ...] = ()
    """``/v1/completions``' prompts when it sends several (the first is also
    ``spec``'s); empty for one."""
    llama: LlamaSwitches = attrs.field(factory=LlamaSwitches)
    """llama-server's answer switches (``timings_per_token``, ``verbose`` ...)."""
    template_messages: tuple[dict[str, Any], ...] | None = None
    """The chat as the template reads it, for tools it offers itself (``auto`` only)."""
    template_variables: dict[str, Any] | None = None
    """More variables for the chat template (``chat_template_kwargs``, and
    ``reasoning_effort``'s); None: none."""
    min_tokens: int = 0
    """vLLM's ``min_tokens``: no end-of-generation token before this many tokens."""
    reasoning_effort: str | None = None
    """A ``reasoning_effort`` other than none: the chat template's variable, for a
    template that reads it."""
    ignored: tuple[str, ...] = ()
    """The request's fields that changed nothing (the answer's ``meshd.ignored_fields``)."""


def _from_protocol(exc: BadRequest) -> ApiError:
    """A value the protocol's rules refused (``stop[0]: must be ...``), as a 400."""
    message, param = api_field(exc.message, exc.field)
    return ApiError(400, message, param=param)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not _is_number(value) or not lo <= value <= hi:
        raise bad_field(key, f"must be a number between {lo:g} and {hi:g} (got {value!r})")
    return float(value)


def _content(value: object, param: str, *, continued: bool = False) -> str:
    """Message content: a string, null, or a list of text parts (joined as
    :func:`~.tool_calls.join_parts` joins them)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts: list[str] = []
        for i, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_field(f"{param}[{i}]", "only text parts ({'type': 'text', 'text': ...}) "
                                            "are supported")
            parts.append(part["text"])
        return join_parts(parts, continued=continued)
    raise bad_field(param, "must be a string or a list of text parts")


def parse_messages(value: object) -> tuple[ChatMessage, ...]:
    """The chat turns; their number is checked before any is built (the protocol's
    limit, as on the native socket). A role OpenAI does not define is refused (a
    template would render it as text the model was never trained on), and so is a
    turn with no content (an assistant's may be null)."""
    if not isinstance(value, list) or not value:
        raise bad_field("messages", "must be a non-empty array of messages")
    if len(value) > MAX_MESSAGES:
        raise bad_field("messages", f"must be an array of at most {MAX_MESSAGES} messages "
                               f"(got {len(value)})")
    out: list[ChatMessage] = []
    for i, msg in enumerate(value):
        if not isinstance(msg, Mapping) or not msg:
            raise bad_field(f"messages[{i}]", "must be an object with role and content (got "
                                         f"{json.dumps(msg)[:64]})")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise bad_field(f"messages[{i}].role", "must be a non-empty string")
        if role not in CHAT_ROLES:
            raise bad_field(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)} "
                                              f"(got {role[:64]!r})")
        if "content" not in msg and role != "assistant":
            raise bad_field(f"messages[{i}].content", f"a {role} message needs content")
        try:
            content = _content(msg.get("content"), f"messages[{i}].content",
                               continued=role == "assistant" and i == len(value) - 1)
            if role == "assistant" and msg.get("tool_calls"):
                content += past_calls(msg["tool_calls"], f"messages[{i}].tool_calls")
            out.append(ChatMessage(role="system" if role == "developer" else role,
                                   content=content))
        except BadRequest as exc:
            raise _from_protocol(exc.under(f"messages[{i}]")) from None
        except ToolError as exc:
            raise bad_field(exc.param, exc.message) from None
    return tuple(out)


def _offered(messages: tuple[ChatMessage, ...], tools: ToolSpec | None
             ) -> tuple[ChatMessage, ...]:
    """The chat with the request's tools offered in its system turn."""
    if tools is None:
        return messages
    offered = offer_tools([{"role": m.role, "content": m.content} for m in messages], tools)
    return tuple(ChatMessage(role=m["role"], content=m["content"]) for m in offered)


def with_prompt(spec: RequestSpec, prompt: Prompt) -> RequestSpec:
    """``spec`` with ``prompt`` (text or token ids) as its prompt."""
    if isinstance(prompt, str):
        return attrs.evolve(spec, prompt=prompt, prompt_ids=None)
    return attrs.evolve(spec, prompt=None, prompt_ids=prompt)


def _token_ids(value: list[Any]) -> tuple[int, ...] | None:
    """``value`` as token ids, or None when it is not an array of integers."""
    if not value or not all(is_int(t) and t >= 0 for t in value):
        return None
    return tuple(value)


def _prompts(value: object, n: int) -> tuple[Prompt, ...]:
    """OpenAI's prompt forms: a string, an array of token ids, or an array of several of
    either (a batch: each prompt gets its ``n`` choices). Their number is checked before
    any is read."""
    if not (isinstance(value, list) and value and not all(is_int(t) for t in value)):
        return (_prompt(value, "prompt"),)
    if len(value) > MAX_PROMPTS:
        raise bad_field("prompt", f"at most {MAX_PROMPTS} prompts per request (got "
                                  f"{len(value)})")
    if len(value) * n > MAX_BATCH_GENERATIONS:
        raise bad_field("n", f"at most {MAX_BATCH_GENERATIONS} completions per request "
                             f"(prompts times n; got {len(value)} x {n})")
    return tuple(_prompt(p, f"prompt[{i}]" if len(value) > 1 else "prompt")
                 for i, p in enumerate(value))


def _prompt(value: object, name: str) -> Prompt:
    """One prompt as text or token ids (``name``: how the error names it; its field is
    ``prompt``)."""
    if isinstance(value, list):
        ids = _token_ids(value)
        if ids is None:
            raise ApiError(400, f"{name}: must be a non-empty array of token ids "
                                "(non-negative integers)", param="prompt")
        return ids
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{name}: must be a non-empty string, an array of token ids, or "
                            "an array of several of either", param="prompt")
    return value


def _logit_bias(value: object) -> dict[str, float] | None:
    """OpenAI's ``{"token id": bias}``, or llama-server's ``[[id, bias], ...]`` where a
    bias of ``false`` bans the token (as -100 does)."""
    if value is None or value == {} or value == []:
        return None
    if isinstance(value, dict):
        return value
    if not isinstance(value, list) or len(value) > wire.MAX_LOGIT_BIAS:
        raise bad_field("logit_bias", "must be an object of token ids to numbers in [-100, 100] "
                                 "(or an array of [token id, bias] pairs)")
    out: dict[str, float] = {}
    for i, pair in enumerate(value):
        if (not isinstance(pair, list) or len(pair) != 2 or not is_int(pair[0])
                or pair[0] < 0 or not (_is_number(pair[1]) or pair[1] is False)):
            raise bad_field(f"logit_bias[{i}]", "must be a [token id, bias or false] pair")
        out[str(pair[0])] = -100.0 if pair[1] is False else float(pair[1])
    return out


def _prediction(value: object) -> str | None:
    """OpenAI's ``prediction: {"type": "content", "content": text or text parts}``."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("type") != "content":
        raise bad_field("prediction", "must be {'type': 'content', 'content': ...}")
    return _content(value.get("content"), "prediction.content") or None


def _stop(value: object) -> tuple[str, ...]:
    """One stop string or an array of them; their number is checked here, their
    length by ``Generate`` (the protocol's limits, as on the native socket)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS:
        got = f" (got {len(items)})" if isinstance(items, list) else ""
        raise bad_field("stop", f"must be a non-empty string or an array of at most "
                           f"{MAX_STOP_STRINGS} of them{got}")
    return tuple(items)


def _max_tokens(body: Mapping[str, Any]) -> tuple[int | None, str]:
    """The limit and the field that set it (named in errors about it)."""
    for key in ("n_predict", "max_completion_tokens", "max_tokens"):  # (llama-server's first)
        value = body.get(key)
        if value is None or (key == "n_predict" and value == -1):  # (-1: no limit of its own)
            continue
        if not is_int(value) or value < 1:
            raise bad_field(key, f"must be a positive integer (got {value!r})")
        return int(value), key
    return None, "max_tokens"


def _speculative(value: object) -> wire.SpeculativeOverrides:
    """meshd's extension: ``{"proposer": NAME, "draft_max": K, "enabled": bool}``."""
    if value is None:
        return wire.SpeculativeOverrides()
    if not isinstance(value, Mapping):
        raise bad_field("speculative", "must be an object (proposer, draft_max, enabled)")
    unknown = set(value) - {"proposer", "draft_max", "enabled"}
    if unknown:
        raise bad_field("speculative", f"unknown field(s) {sorted(unknown)}")
    enabled = value.get("enabled", True)
    if not isinstance(enabled, bool):
        raise bad_field("speculative.enabled", "must be true or false")
    proposer = value.get("proposer")
    if proposer is not None and (not isinstance(proposer, str) or not proposer):
        raise bad_field("speculative.proposer", "must be a proposer name")
    draft_max = value.get("draft_max")
    if draft_max is not None and (not is_int(draft_max) or not 1 <= draft_max <= 1024):
        raise bad_field("speculative.draft_max", "must be an integer from 1 to 1024")
    return wire.SpeculativeOverrides(proposer="off" if not enabled else proposer,
                                     draft_max=draft_max)


def parse_request(raw: bytes, *, chat: bool) -> CompletionRequest:
    """Validate a ``/v1/completions`` (or, with ``chat``, ``/v1/chat/completions``) body;
    raises ApiError (400) naming the first bad field."""
    body = json_object(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_field("model", "must be a string")
    n = body.get("n", 1)
    if not is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise bad_field("n", f"must be an integer from 1 to {MAX_CHOICES}")
    refused = check_fields(body, chat=chat) or (check_continuation(body) if chat else None)
    if refused is not None:
        raise bad_field(*refused)
    try:
        constraint, constraint_param = output_constraint(body)
    except BadRequest as exc:
        raise _from_protocol(exc.under("response_format")) from None
    except FormatError as exc:
        raise bad_field(exc.param, exc.message) from None
    try:
        tools = parse_tools(body) if chat else None
    except ToolError as exc:
        raise bad_field(exc.param, exc.message) from None
    if not chat and body.get("tools"):
        raise bad_field("tools", "tools are for /v1/chat/completions")
    if tools is not None and n > 1:
        raise bad_field("n", "tools are served with n=1 only")
    if tools is not None and constraint is not None and tool_constraint(tools) is not None:
        raise bad_field("tool_choice", f"a forced tool call and {constraint_param} cannot both "
                                  "constrain the answer")
    if tools is not None and constraint is None:
        constraint, constraint_param = tool_constraint(tools), "tools"
    logprobs, why = requested_logprobs(body, chat=chat)
    if why is not None:
        raise bad_field(why.partition(":")[0], why.partition(": ")[2])
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_field("stream", "must be true or false")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, Mapping) or not isinstance(
                options.get("include_usage", False), bool):
            raise bad_field("stream_options", "must be an object like {'include_usage': true}")
        include_usage = bool(options.get("include_usage", False))
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not 0 <= seed <= wire.MAX_SEED):
        raise bad_field("seed", f"must be an integer from 0 to {wire.MAX_SEED}")
    top_k = body.get("top_k", 0)
    if not is_int(top_k) or top_k < 0:
        raise bad_field("top_k", "must be a non-negative integer")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad_field("top_p", "must be greater than 0")
    repeat_last_n = body.get("repeat_last_n", 64)
    if not is_int(repeat_last_n) or repeat_last_n < -1:
        raise bad_field("repeat_last_n", "must be an integer >= -1 (-1: the whole context)")
    typical_p = _number(body, "typical_p", 1.0, 0.0, 1.0)
    if typical_p == 0.0:
        raise bad_field("typical_p", "must be greater than 0")
    repeat_penalty, repeat_last_n = _repeat_penalty(body, repeat_last_n)
    try:
        sampling = wire.SamplingParams(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_k=top_k,
            top_p=top_p, seed=seed, min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
            typical_p=typical_p, repeat_penalty=repeat_penalty,
            repeat_last_n=wire.MAX_LOOKBACK if repeat_last_n == -1 else repeat_last_n,
            presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
            logit_bias=_logit_bias(body.get("logit_bias")),
        )
    except BadRequest as exc:
        raise _from_protocol(exc) from None
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    prompts = () if chat else _prompts(body.get("prompt"), n)
    max_tokens, max_tokens_param = _max_tokens(body)
    try:
        keep_alive = keep_alive_seconds(body)
    except ValueError as exc:
        raise bad_field("keep_alive", str(exc)) from None
    min_tokens = body.get("min_tokens", 0)
    if min_tokens is None:
        min_tokens = 0
    if not is_int(min_tokens) or not 0 <= min_tokens <= (max_tokens or _MAX_MIN_TOKENS):
        raise bad_field("min_tokens", "must be an integer from 0 to max_tokens "
                                      f"({max_tokens or _MAX_MIN_TOKENS})")
    variables, effort = _template_variables(body, chat=chat)
    ignored = ignored_fields(body)
    if not chat and body.get("reasoning_effort") == "none":
        ignored += ("reasoning_effort",)
    try:
        spec = RequestSpec(
            id=rid,
            prompt=prompts[0] if prompts and isinstance(prompts[0], str) else None,
            prompt_ids=prompts[0] if prompts and isinstance(prompts[0], tuple) else None,
            messages=_offered(parse_messages(body.get("messages")), tools) if chat else None,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=_stop(body.get("stop")),
            prediction=_prediction(body.get("prediction")),
            speculative=_speculative(body.get("speculative")),
            constraint=constraint,
            logprobs=logprobs,
            keep_alive=keep_alive,
        )
    except BadRequest as exc:
        raise _from_protocol(exc) from None
    return CompletionRequest(spec=spec, chat=chat,
                             max_tokens_param=max_tokens_param,
                             constraint_param=constraint_param, logprobs=logprobs,
                             tools=tools, n=n,
                             stream=stream,
                             include_usage=include_usage, model=model,
                             created=int(time.time()),
                             llama=LlamaSwitches.of(body),
                             template_messages=None if tools is None
                             else tuple(template_messages(body["messages"])),
                             template_variables=variables, reasoning_effort=effort,
                             min_tokens=min_tokens, ignored=ignored,
                             batch=prompts if len(prompts) > 1 else ())


#: The most ``min_tokens`` a request without ``max_tokens`` may ask for (the server's
#: limits cut the answer before it anyway).
_MAX_MIN_TOKENS: Final = 1 << 31


def _repeat_penalty(body: Mapping[str, Any], repeat_last_n: int) -> tuple[float, int]:
    """llama-server's ``repeat_penalty`` over ``repeat_last_n`` tokens, or vLLM's
    ``repetition_penalty``: the same penalty (a logit divided, or multiplied when
    negative), over the prompt and the whole output as vLLM applies it, unless
    ``repeat_last_n`` says otherwise. Both given, they must agree."""
    repeat_penalty = _number(body, "repeat_penalty", 1.0, 0.0, 100.0)
    if repeat_penalty == 0.0:
        raise bad_field("repeat_penalty", "must be greater than 0")
    if body.get("repetition_penalty") is None:
        return repeat_penalty, repeat_last_n
    vllm = _number(body, "repetition_penalty", 1.0, 0.0, 100.0)
    if vllm == 0.0:
        raise bad_field("repetition_penalty", "must be greater than 0")
    if body.get("repeat_penalty") is not None and vllm != repeat_penalty:
        raise bad_field("repetition_penalty", "differs from repeat_penalty (vLLM's name and "
                                              "llama.cpp's for one penalty: send one)")
    return vllm, repeat_last_n if body.get("repeat_last_n") is not None else -1


def _template_variables(body: Mapping[str, Any], *, chat: bool
                        ) -> tuple[dict[str, Any] | None, str | None]:
    """The chat template's variables (``chat_template_kwargs``; ``reasoning_effort:
    none`` sets ``enable_thinking`` false, as llama-server does), and a
    ``reasoning_effort`` other than none, for a template that reads it (checked once
    the model is known)."""
    effort = body.get("reasoning_effort")
    if not chat:
        if effort not in (None, "none"):
            raise bad_field("reasoning_effort", "only none is served on /v1/completions "
                                                "(a prompt has no chat template to tell)")
        return None, None
    try:
        variables = template_kwargs(body.get("chat_template_kwargs"))
    except ValueError as exc:
        raise bad_field("chat_template_kwargs", str(exc)) from None
    if effort == "none":
        variables = {**(variables or {}), "enable_thinking": False}
    return variables, None if effort in (None, "none") else effort


def finish_reason(value: str) -> str:
    """OpenAI's finish reasons: an end-of-generation token or a stop string is ``stop``;
    ``length``, ``cancelled``, ``shutdown`` and ``error`` keep meshd's names."""
    return "stop" if value == "eog" else value


def usage(prompt_tokens: int, stats: GenerationStats,
          prediction: dict[str, int] | None = None) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens the prefix cache served (not recomputed)
    and, for a request with a predicted output, ``completion_tokens_details``: how many
    of the prediction's tokens the answer holds and how many it does not
    (:func:`.prediction.prediction_details`)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens, "completion_tokens": stats.emitted,
        "total_tokens": prompt_tokens + stats.emitted,
        "prompt_tokens_details": {"cached_tokens": stats.reused_prompt_tokens}}
    if prediction is not None:
        out["completion_tokens_details"] = dict(prediction)
    return out


def meshd_block(stats: GenerationStats, proposer: str | None, seed: int | None,
                ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """meshd's own speculation statistics (the native ``done`` frame's ``speculation``)
    and the seed sampling drew with (``None`` for greedy decoding), as ``done`` has it;
    ``ignored_fields``: the request's fields that changed nothing, where there were any
    (:func:`.request_fields.ignored_fields`)."""
    block = attrs.asdict(speculation_stats(stats, proposer))
    block["seed"] = seed
    if ignored:
        block["ignored_fields"] = list(ignored)
    return block


def object_name(req: CompletionRequest, *, stream: bool) -> str:
    if req.chat:
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


def completion_response(req: CompletionRequest, model: str, fingerprint: str, text: str,
                        finish: str, stats: GenerationStats, proposer: str | None,
                        prompt_tokens: int, seed: int | None,
                        logprobs: dict[str, Any] | None = None,
                        prediction: dict[str, int] | None = None) -> dict[str, Any]:
    """The whole (non-streamed) answer (``prediction``: its prediction counters)."""
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs,
                              "finish_reason": finish_reason(finish)}
    if req.chat:
        content, calls = tool_answer(req, text, finish)
        choice["message"] = {"role": "assistant", "content": content}
        if calls:
            choice["message"]["tool_calls"] = calls
            if choice["finish_reason"] == "stop":  # (a cut keeps ``length``)
                choice["finish_reason"] = "tool_calls"
    else:
        choice["text"] = text
    return {
        "id": req.spec.id, "object": object_name(req, stream=False), "created": req.created,
        "model": model, "system_fingerprint": fingerprint, "choices": [choice],
        "usage": usage(prompt_tokens, stats, prediction),
        "timings": timings(stats), "meshd": meshd_block(stats, proposer, seed, req.ignored),
    }


def tool_answer(req: CompletionRequest, text: str, finish: str
                ) -> tuple[str | None, list[dict[str, Any]]]:
    """The chat answer's content and tool calls (none unless the request offered tools;
    an answer cut short keeps its whole calls, :func:`answer_calls`)."""
    if req.tools is None:
        return text, []
    return answer_calls(text, req.tools, finished=finish in ("eog", "stop"))


def chunk(req: CompletionRequest, model: str, fingerprint: str, *, text: str | None = None,
          role: bool = False, finish: str | None = None,
          logprobs: dict[str, Any] | None = None,
          tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One streamed chunk: text (or, for chat, the opening role with null content, or
    the tool calls) and/or the finish. A chat delta carries ``content`` only when there
    is text (a chunk of logprobs alone has an empty delta)."""
    choice: dict[str, Any] = {"index": 0, "logprobs": logprobs,
                              "finish_reason": finish_reason(finish) if finish else None}
    if req.chat:
        delta: dict[str, Any] = {}
        if role:  # (its content is null, as OpenAI's and llama-server's first chunk)
            delta["role"] = "assistant"
            delta["content"] = None
        if text:  # (never an empty content delta)
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(tool_calls)]
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": req.spec.id, "object": object_name(req, stream=True),
            "created": req.created, "model": model, "system_fingerprint": fingerprint,
            "choices": [choice]}
