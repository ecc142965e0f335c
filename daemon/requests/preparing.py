"""A request checked and made into its engine request, once.

Why one pass: both front ends hand the service a :class:`~.spec.RequestSpec`; here the
model is held, every check is made once (limits, proposer, biases, sampling), the prompt
is rendered and tokenized once and the constraint compiled once (:mod:`.prompting`), and
a prediction tokenized for its proposer, so the engine request both front ends make of
one request is the same.
"""

from __future__ import annotations

import functools
from typing import Any

import anyio.to_thread
import attrs

from meshd.daemon.config.server import ServerConfig
from meshd.daemon.engine.constraint import ConstraintError
from meshd.daemon.engine.request_errors import RequestError
from meshd.daemon.engine.sampling import SamplingParams, with_chosen_seed
from meshd.daemon.models.mapping import sampling_params
from meshd.daemon.models.model_set import ModelSet
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.models.scheduler import GenerationRequest
from meshd.daemon.requests.holding import hold
from meshd.daemon.requests.inflight import InFlightGeneration
from meshd.daemon.requests.prompt_fit import PromptTooLong
from meshd.daemon.requests.prompting import spec_grammar, spec_prompt
from meshd.daemon.requests.spec import RequestSpec
from meshd.native.records import TooManyTokens
from meshd.protocol import PROPOSER_OFF, BadRequest, Generate, ModelError

__all__ = ["max_tokens_limit", "prepare"]


def max_tokens_limit(config: ServerConfig, runtime: ModelRuntime) -> int:
    """The most tokens a request may ask of ``runtime``'s model: the operator's limit,
    else the context."""
    limit = config.max_tokens_limit
    return limit if limit is not None else runtime.context.config.n_ctx_seq


async def prepare(models: ModelSet, config: ServerConfig, spec: RequestSpec | Generate,
                  entry: InFlightGeneration) -> GenerationRequest:
    """Check a request and turn it into an engine request for its model, which
    ``entry`` then holds until it is unregistered: every check made once, the prompt
    rendered and tokenized once, the constraint compiled once (:mod:`.prompting`).

    Raises BadRequest (limits, unknown proposer, no chat template), UnknownModel,
    ServerBusy (no room for the model), ModelError (the prompt does not fit the
    context, the model did not load), attributed to the request's id; ApiError for
    what only HTTP can ask (token-id prompts, template variables, tools the
    template offers).
    """
    if isinstance(spec, Generate):
        spec = RequestSpec.of(spec)
    rid = spec.id
    served = await hold(models, spec.model, rid)
    entry.model, entry.holds, entry.keep_alive = served, True, spec.keep_alive
    rt, scheduler = served.runtime, served.scheduler
    assert rt is not None and scheduler is not None
    limit = max_tokens_limit(config, rt)
    if spec.n_predict is not None:  # (llama-server's: -1 the context, clamped)
        max_tokens = limit if spec.n_predict == -1 else max(1, min(spec.n_predict, limit))
    else:
        # A request that sets no limit goes on until the model stops or the context
        # ends (the engine stops there), as llama-server's; the operator may cap it.
        max_tokens = spec.max_tokens or config.max_tokens_default or limit
        if spec.max_tokens is not None and spec.max_tokens > limit:
            raise BadRequest.invalid_field(
                "generate.max_tokens", f"must be at most {limit} (got {spec.max_tokens})"
            ).with_request_id(rid)
        max_tokens = min(max_tokens, limit)
    proposer = spec.speculative.proposer
    if proposer is not None and proposer != PROPOSER_OFF:
        problem = rt.proposer_problem(proposer)
        if problem is not None:
            raise BadRequest.invalid_field(
                "generate.speculative.proposer", problem).with_request_id(rid)
    n_vocab = rt.model.info.n_vocab
    for key in spec.sampling.logit_bias or {}:
        if int(key) >= n_vocab:
            raise BadRequest.invalid_field(
                "generate.sampling.logit_bias",
                f"token id {key} is not below the vocabulary size {n_vocab}"
            ).with_request_id(rid)
    try:
        # Unseeded sampling gets a daemon-chosen seed (reported in ``done``), so it
        # can be verified exactly and speculation runs for API clients by default.
        sampling = with_chosen_seed(sampling_params(spec.sampling), config.seed)
    except ValueError as exc:
        raise BadRequest(f"generate.sampling: {exc}", request_id=rid) from exc
    sampling = _with_spec_sampling(sampling, spec)
    try:
        with scheduler.preparing():  # admissions wait a moment for it
            prompt = await anyio.to_thread.run_sync(spec_prompt, rt, spec)
    except PromptTooLong as exc:
        raise ModelError(str(exc), request_id=rid) from exc
    except (RequestError, ValueError) as exc:
        field = "generate.messages" if spec.messages is not None else "generate.prompt"
        raise BadRequest(f"{field}: {exc}", request_id=rid) from exc
    try:
        grammar = await anyio.to_thread.run_sync(spec_grammar, rt, spec, prompt)
    except ConstraintError as exc:
        kind = spec.constraint.kind if spec.constraint is not None else "grammar"
        raise BadRequest.invalid_field(
            "generate.constraint", f"the {kind} does not compile: {exc}"
        ).with_request_id(rid) from exc
    n_ctx = rt.context.config.n_ctx_seq
    if not prompt.tokens:
        raise BadRequest("generate.prompt: tokenizes to no tokens", request_id=rid)
    if len(prompt.tokens) + 1 > n_ctx:
        too_long = rt.prompt_too_long(len(prompt.tokens))
        raise ModelError(str(too_long), request_id=rid) from too_long
    options = spec.speculative.options
    if spec.prediction and proposer in (None, "auto", "prediction"):
        # Predicted Outputs: drafted from by the prediction proposer (a request
        # that names another proposer keeps it).
        try:
            predicted = await anyio.to_thread.run_sync(functools.partial(
                rt.model.tokenizer.tokenize, spec.prediction,
                add_special=False, max_tokens=n_ctx))
        except TooManyTokens as exc:
            raise BadRequest.invalid_field("generate.prediction", str(exc)
                                           ).with_request_id(rid) from exc
        proposer, options = "prediction", {**(options or {}), "tokens": predicted}
    return GenerationRequest(
        prompt=prompt.tokens, max_tokens=max_tokens, sampling=sampling,
        stop=tuple(spec.stop), proposer=proposer,
        draft_max=spec.speculative.draft_max,
        proposer_options=options, grammar=grammar,
        logprobs=spec.logprobs,
        owner=entry.owner,  # (whose earlier answers history lookup may draft from)
    )


def _with_spec_sampling(sampling: SamplingParams, spec: RequestSpec) -> SamplingParams:
    """``sampling`` with what a front end adds beyond ``generate``'s: biases by token id,
    a seed offset (``n_cmpl`` copies), ``min_tokens``."""
    changes: dict[str, Any] = {}
    if spec.logit_bias_ids is not None:
        changes["logit_bias"] = spec.logit_bias_ids
    if spec.seed_offset and spec.sampling.seed is not None \
            and sampling.seed is not None:
        changes["seed"] = (sampling.seed + spec.seed_offset) % (1 << 64)
    if spec.min_tokens:
        changes["min_tokens"] = spec.min_tokens
    return attrs.evolve(sampling, **changes) if changes else sampling
