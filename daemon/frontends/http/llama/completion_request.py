"""llama-server's ``/completion`` request body: its fields, defaults and limits.

Why its own rules rather than :func:`.openai_api.parse_request`'s: llama-server reads
its body leniently (a number past a soft limit is clamped, an entry of an unexpected
shape in ``logit_bias`` skipped, a field it does not know ignored), and clients written
for it rely on that; meshd follows it, and refuses only what it cannot run or what would
take unbounded work (more than :data:`MAX_PROMPTS` generations, :data:`MAX_N_PROBS`
alternatives, ``MAX_LOGIT_BIAS`` biases). Its sampling defaults are llama-server's
(temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), not OpenAI's.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs

from meshd.daemon.frontends.http.openai.api import is_int
from meshd.daemon.frontends.http.request_fields import keep_alive_seconds
from meshd.daemon.requests.api_errors import ApiError, api_field, bad_field
from meshd.daemon.requests.spec import RequestSpec
from meshd.protocol import BadRequest
from meshd.protocol import messages as wire

__all__ = ["MAX_CANDIDATES", "MAX_N_PROBS", "MAX_PROMPTS", "BiasKey", "LlamaRequest", "Prompt",
           "parse_llama_request"]

MAX_PROMPTS: Final = 16
"""Most generations one request may ask for (prompts times ``n_cmpl``)."""
MAX_N_PROBS: Final = 100
"""Most alternatives ``n_probs`` may ask for with each token."""
MAX_CANDIDATES: Final = 256
"""Most tokens ``post_sampling_probs`` runs the sampler chain over (top-k's, if fewer)."""
MAX_RESPONSE_FIELDS: Final = 256
_INT32_MAX: Final = 2**31 - 1
_TOKEN_ID: Final = re.compile(r"\s*[+-]?\d+")

# llama-server's sampling defaults (common_params_sampling).
DEFAULT_TEMPERATURE: Final = 0.8
DEFAULT_TOP_K: Final = 40
DEFAULT_TOP_P: Final = 0.95
DEFAULT_MIN_P: Final = 0.05
_TINY: Final = 1e-9
"""A ``top_p`` or ``typical_p`` of 0 keeps the most likely token only, as llama.cpp's
does; meshd's parameters must be positive."""

Prompt = tuple[str | int, ...]
"""One prompt: strings (tokenized) and token ids, in order."""
BiasKey = int | str


@attrs.frozen
class LlamaRequest:
    """A validated ``/completion`` body."""

    prompts: tuple[Prompt, ...]
    sampling: wire.SamplingParams
    stop: tuple[str, ...]
    constraint: wire.Constraint | None
    keep_alive: float | None
    n_cmpl: int
    n_predict: int | None
    """None: not given (the server's default); -1: to the end of the context."""
    constraint_param: str
    grammar: str
    logit_bias: tuple[tuple[BiasKey, float], ...]
    ignore_eos: bool
    n_probs: int
    min_keep: int
    post_sampling_probs: bool
    stream: bool
    return_tokens: bool
    timings_per_token: bool
    response_fields: tuple[str, ...]
    model: str | None

    def spec(self, request_id: str, prompt: tuple[int, ...]) -> RequestSpec:
        """One prompt's request to the service (its token ids known): sampling, stop
        strings, the constraint, the keep-alive."""
        return RequestSpec(id=request_id, prompt_ids=prompt, sampling=self.sampling,
                           stop=self.stop, constraint=self.constraint,
                           keep_alive=self.keep_alive)


def _given(body: Mapping[str, Any], names: Sequence[str]) -> tuple[str, Any]:
    """The first of ``names`` with a value (llama-server treats null as absent)."""
    for name in names:
        if body.get(name) is not None:
            return name, body[name]
    return names[0], None


def _number(body: Mapping[str, Any], names: str | Sequence[str], default: float, *,
            lo: float | None = None, hi: float | None = None, hard: bool = False) -> float:
    """A number, clamped into [lo, hi] (``hard``: refused outside it), as llama-server
    reads its fields."""
    key, value = _given(body, (names,) if isinstance(names, str) else names)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value):
        raise bad_field(key, f"must be a number (got {str(value)[:64]!r})")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if hard:
            raise bad_field(key, f"must be between {lo:g} and {hi:g} (got {value!r})")
        value = min(max(value, lo if lo is not None else value),
                    hi if hi is not None else value)
    return value


def _integer(body: Mapping[str, Any], names: str | Sequence[str], default: int, *,
             lo: int | None = None, hi: int | None = None, hard: bool = False) -> int:
    """An integer (a fraction is cut, as llama-server's JSON reader does)."""
    return int(_number(body, names, default, lo=lo, hi=hi, hard=hard))


def _flag(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_field(name, "must be true or false")
    return value


def _subprompt(value: object, param: str, *, nested: bool = False) -> Prompt:
    """One prompt: a string, token ids, strings and token ids mixed, or
    ``{"prompt_string": ...}`` (``multimodal_data`` is refused: no model meshd serves
    reads images)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) or is_int(v) for v in value) \
            and (not value or any(is_int(v) for v in value)):
        for i, v in enumerate(value):
            if is_int(v) and v < 0:
                raise bad_field(f"{param}[{i}]", f"must be a token id (got {v})")
        return tuple(value)
    if isinstance(value, Mapping) and "prompt_string" in value and not nested:
        if value.get("multimodal_data") is not None:
            raise bad_field(param, "multimodal data provided, but the model does not support "
                              "multimodal requests")
        return _subprompt(value["prompt_string"], f"{param}.prompt_string", nested=True)
    raise bad_field(param, "must be a string, an array of token ids, an array of strings and "
                      "token ids, or an object with a prompt_string")


def _prompts(value: object) -> tuple[Prompt, ...]:
    """llama-server's ``prompt``: one prompt, or an array of several (an array without
    token ids at its top level), each answered in turn."""
    if isinstance(value, list) and not any(is_int(v) for v in value):
        if not value:
            raise bad_field("prompt", "must not be empty")
        if len(value) > MAX_PROMPTS:
            raise bad_field("prompt", f"at most {MAX_PROMPTS} prompts per request "
                                 f"(got {len(value)})")
        return tuple(_subprompt(v, f"prompt[{i}]") for i, v in enumerate(value))
    return (_subprompt(value, "prompt"),)


def _bias_value(value: object) -> float | None:
    """A bias: a number, or ``false`` (never); anything else is skipped."""
    if value is False:
        return -math.inf
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _logit_bias(value: object) -> tuple[tuple[BiasKey, float], ...]:
    """llama-server's forms: ``[[token id or text, bias], ...]`` or ``{"token id or
    text": bias}``; entries of another shape are skipped, as llama-server skips them.
    Text is tokenized once the model is known (each of its tokens gets the bias)."""
    if value is None:
        return ()
    items: list[tuple[object, object]]
    if isinstance(value, list):
        items = [(e[0], e[1]) for e in value if isinstance(e, list) and len(e) == 2]
    elif isinstance(value, Mapping):
        items = [(k if not _TOKEN_ID.fullmatch(k) else int(k), v) for k, v in value.items()]
    else:
        return ()
    if len(items) > wire.MAX_LOGIT_BIAS:
        raise bad_field("logit_bias", f"at most {wire.MAX_LOGIT_BIAS} entries (got {len(items)})")
    out: list[tuple[BiasKey, float]] = []
    for key, raw in items:
        bias = _bias_value(raw)
        if bias is not None and (is_int(key) or isinstance(key, str)):
            assert isinstance(key, int | str)
            out.append((key, bias))
    return tuple(out)


def _stop(value: object) -> tuple[str, ...]:
    """A string or an array of strings; empty ones are left out."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_field("stop", "must be a string or an array of strings")
    kept = tuple(s for s in items if s)
    if len(kept) > wire.MAX_STOP_STRINGS:
        raise bad_field("stop", f"at most {wire.MAX_STOP_STRINGS} stop strings (got {len(kept)})")
    return kept


def _constraint(body: Mapping[str, Any]) -> tuple[wire.Constraint | None, str, str]:
    """``grammar`` (GBNF; it wins over ``json_schema``, as in llama-server) or
    ``json_schema`` (``{}``: any JSON object): the constraint, its field, its text."""
    grammar = body.get("grammar")
    schema = body.get("json_schema")
    try:
        if grammar is not None:
            if not isinstance(grammar, str):
                raise bad_field("grammar", "must be a GBNF grammar (a string)")
            if grammar:
                return wire.Constraint(kind="gbnf", grammar=grammar), "grammar", grammar
            return None, "grammar", ""
        if schema is not None:
            if not isinstance(schema, dict):
                raise bad_field("json_schema", "must be a JSON schema object")
            if not schema:
                return wire.Constraint(kind="json_object"), "json_schema", ""
            return (wire.Constraint(kind="json_schema", schema=schema), "json_schema",
                    json.dumps(schema))
    except BadRequest as exc:
        param = "grammar" if grammar is not None else "json_schema"
        raise bad_field(param, exc.message.partition(": ")[2] or exc.message) from None
    return None, "grammar", ""


def _seed(body: Mapping[str, Any]) -> int | None:
    """-1 (or none): a seed meshd chooses; another negative one wraps as llama-server's
    unsigned 32-bit seed does."""
    value = body.get("seed")
    if value is None:
        return None
    if not is_int(value) or value > wire.MAX_SEED:
        raise bad_field("seed", f"must be an integer from -1 to {wire.MAX_SEED}")
    if value == -1:
        return None
    return int(value) % 2**32 if value < 0 else int(value)


def _sampling(body: Mapping[str, Any]) -> wire.SamplingParams:
    """The sampling fields, with llama-server's defaults and its clamping; values meshd
    cannot run are refused (a ``repeat_penalty`` of 0, penalties past ±2 ...)."""
    top_p = _number(body, "top_p", DEFAULT_TOP_P, lo=0.0, hi=1.0)
    typical_p = _number(body, "typical_p", 1.0)
    repeat_last_n = _integer(body, "repeat_last_n", 64, lo=-1, hi=_INT32_MAX, hard=True)
    try:
        return wire.SamplingParams(
            temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, lo=0.0),
            top_k=_integer(body, "top_k", DEFAULT_TOP_K, lo=0, hi=_INT32_MAX),
            top_p=max(top_p, _TINY), seed=_seed(body),
            min_p=_number(body, "min_p", DEFAULT_MIN_P, lo=0.0, hi=1.0),
            typical_p=min(max(typical_p, _TINY), 1.0),
            repeat_penalty=_number(body, "repeat_penalty", 1.0),
            repeat_last_n=wire.MAX_LOOKBACK if repeat_last_n == -1
            else min(repeat_last_n, wire.MAX_LOOKBACK),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
        )
    except BadRequest as exc:
        message, param = api_field(exc.message, exc.field)
        raise ApiError(400, message, param=param) from None


def _one_seed(sampling: wire.SamplingParams, default: int | None) -> wire.SamplingParams:
    """Sampling without a seed gets the daemon's ``--seed`` or one chosen here, for all
    of the request's prompts (as llama-server's server-wide seed serves them all), so
    equal prompts give equal answers; ``n_cmpl``'s copies add their index to it."""
    if sampling.seed is not None or sampling.temperature == 0.0:
        return sampling
    return attrs.evolve(sampling, seed=secrets.randbits(63) if default is None else default)


def _response_fields(value: object) -> tuple[str, ...]:
    """A list of field paths; anything else means all fields (llama-server ignores a
    value of another type)."""
    if not isinstance(value, list) or not all(isinstance(f, str) for f in value):
        return ()
    if len(value) > MAX_RESPONSE_FIELDS:
        raise bad_field("response_fields", f"at most {MAX_RESPONSE_FIELDS} fields")
    return tuple(value)


_OFF: Final[dict[str, Callable[[Any], bool]]] = {
    # llama-server's samplers meshd does not have: accepted only switched off.
    "mirostat": lambda v: v == 0,
    "dynatemp_range": lambda v: v == 0,
    "dry_multiplier": lambda v: v == 0,
    "xtc_probability": lambda v: v == 0,
    "top_n_sigma": lambda v: isinstance(v, int | float) and v < 0,
    "adaptive_target": lambda v: isinstance(v, int | float) and v < 0,
    "n_indent": lambda v: v == 0,
    "min_keep": lambda v: v in (0, 1),  # (meshd's filters keep at least one token)
    "lora": lambda v: v == [],
}


def _refused(body: Mapping[str, Any]) -> ApiError | None:
    """A sampler meshd does not have, switched on: refused rather than ignored, as the
    OpenAI endpoints refuse it, so an answer is never silently other than asked."""
    for key, off in _OFF.items():
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or not off(value)):
            return bad_field(key, f"is not supported by meshd (got {str(value)[:64]}; only its "
                             "off value is accepted)")
    return None


def parse_llama_request(body: Mapping[str, Any], *, seed: int | None = None) -> LlamaRequest:
    """Validate a ``/completion`` body; raises ApiError (400) naming the first bad field.
    Fields this does not read are accepted and ignored, as llama-server accepts them."""
    if "prompt" not in body:
        raise bad_field("prompt", "is required")
    prompts = _prompts(body["prompt"])
    refused = _refused(body)
    if refused is not None:
        raise refused
    n_cmpl = _integer(body, ("n_cmpl", "n"), 1, lo=1, hi=MAX_PROMPTS, hard=True)
    if len(prompts) * n_cmpl > MAX_PROMPTS:
        raise bad_field("n_cmpl", f"at most {MAX_PROMPTS} completions per request (prompts times "
                             f"n_cmpl; got {len(prompts) * n_cmpl})")
    key, n_predict = _given(body, ("n_predict", "max_completion_tokens", "max_tokens"))
    if n_predict is not None:
        n_predict = _integer(body, key, -1, lo=-1, hi=_INT32_MAX, hard=True)
    n_probs = _integer(body, ("n_probs", "logprobs"), 0, lo=0)
    if n_probs > MAX_N_PROBS:
        raise bad_field("n_probs", f"must be at most {MAX_N_PROBS} (got {n_probs})")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_field("model", "must be a string")
    constraint, constraint_param, grammar = _constraint(body)
    try:
        keep_alive = keep_alive_seconds(body)
    except ValueError as exc:
        raise bad_field("keep_alive", str(exc)) from None
    sampling, stop = _one_seed(_sampling(body), seed), _stop(body.get("stop"))
    try:
        RequestSpec.check_fields(sampling=sampling, stop=stop, constraint=constraint,
                                 keep_alive=keep_alive)
    except BadRequest as exc:
        message, param = api_field(exc.message, exc.field)
        raise ApiError(400, message, param=param) from None
    return LlamaRequest(
        prompts=prompts, sampling=sampling, stop=stop, constraint=constraint,
        keep_alive=keep_alive, n_cmpl=n_cmpl, n_predict=n_predict,
        constraint_param=constraint_param, grammar=grammar,
        logit_bias=_logit_bias(body.get("logit_bias")),
        ignore_eos=_flag(body, "ignore_eos"), n_probs=n_probs,
        min_keep=_integer(body, "min_keep", 0, lo=0, hi=1),
        post_sampling_probs=_flag(body, "post_sampling_probs"),
        stream=_flag(body, "stream"), return_tokens=_flag(body, "return_tokens"),
        timings_per_token=_flag(body, "timings_per_token"),
        response_fields=_response_fields(body.get("response_fields")),
        model=model,
    )
