"""llama-server's token counters: ``POST /v1/chat/completions/input_tokens`` and
``POST /v1/responses/input_tokens`` (and their un-prefixed aliases).

Why through ``Service.prepare``: the body is the chat (or Responses) request a client
would send, validated by the same parser, and its prompt is rendered and tokenized by
the same ``prepare`` a generation goes through (the model's chat template, the tools
offered in the system turn, the same limits), so the count is exactly the
``usage.prompt_tokens`` that request would report. Nothing is generated: the model is
held for the count and released.
"""

from __future__ import annotations

import attrs

from meshd.daemon.frontends.http.completions import request_spec, served_name
from meshd.daemon.frontends.http.openai.api import CompletionRequest, parse_request
from meshd.daemon.frontends.http.openai.responses_format import parse_responses_request
from meshd.daemon.frontends.http.responder import Responder, RouteContext
from meshd.daemon.requests.api_errors import JSON, ApiError, context_exceeded, json_bytes
from meshd.daemon.requests.service import InFlightGeneration
from meshd.protocol import ModelError, ProtocolError

__all__ = ["chat_input_tokens", "responses_input_tokens"]


async def chat_input_tokens(routes: RouteContext, body: bytes, out: Responder) -> None:
    """A chat completion request's body -> ``{"object": "response.input_tokens",
    "input_tokens": N}``: the prompt's tokens after the chat template."""
    await _count(routes, parse_request(body, chat=True), out)


async def responses_input_tokens(routes: RouteContext, body: bytes, out: Responder) -> None:
    """The same for a Responses API request (errors name its fields: ``input[1]``)."""
    req = parse_responses_request(body)
    try:
        await _count(routes, req.completion, out)
    except ApiError as exc:
        raise req.renamed(exc) from None


async def _count(routes: RouteContext, req: CompletionRequest, out: Responder) -> None:
    service = routes.service
    entry = InFlightGeneration(req.spec.id)
    service.register(entry)  # (a shutdown waits for it, as for a generation)
    try:
        spec = attrs.evolve(request_spec(req), model=served_name(service, req.model))
        try:
            gen = await service.prepare(spec, entry)
        except ModelError as exc:  # (a prompt over the context)
            raise context_exceeded(exc, "messages" if req.chat else "prompt") from None
        except ProtocolError as exc:
            raise ApiError.from_protocol(exc, max_tokens_param=req.max_tokens_param,
                                         constraint_param=req.constraint_param) from None
    finally:
        service.unregister(entry)
    await out.send(200, json_bytes({"object": "response.input_tokens",
                                    "input_tokens": len(gen.prompt)}), JSON)
