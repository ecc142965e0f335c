"""llama-server's extra endpoints: ``/tokenize``, ``/detokenize``, ``/apply-template``
and ``GET /props``, in its shapes.

Why: tools written for llama-server (token counters, prompt builders, web UIs) call
these beside the OpenAI API. Tokenizing and rendering run on a worker thread, as the
native ``tokenize`` op does (the vocabulary is read-only and needs no context lock; a
multi-megabyte text must not stall the event loop), and every reply is bounded by the
same limit as the native reply: no more token ids than a frame could carry, no text
larger than a frame.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import anyio.to_thread

from meshd.daemon.engine.request_errors import RequestError
from meshd.daemon.frontends.http.identity import build_info
from meshd.daemon.frontends.http.openai.api import json_object, parse_messages
from meshd.daemon.frontends.http.responder import Responder
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.prompts.tool_calls import ToolError, offer_tools, parse_tools, template_messages
from meshd.daemon.requests import tokens
from meshd.daemon.requests.api_errors import JSON, ApiError, json_bytes
from meshd.daemon.requests.service import Service
from meshd.daemon.requests.template_tools import offers_itself, template_tools

__all__ = ["apply_template", "detokenize", "props", "tokenize"]


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"{key}: must be true or false", param=key)
    return value


def _piece(data: bytes) -> str | list[int]:
    """A token's text, or its bytes when they are not whole UTF-8 (as llama-server)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


async def tokenize(service: Service, raw: bytes, out: Responder) -> None:
    """``{"content", "add_special"?, "parse_special"?, "with_pieces"?}`` -> ``{"tokens"}``
    (llama-server's defaults: no BOS, special tokens parsed)."""
    body = json_object(raw)
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError(400, "content: must be a string", param="content")
    found = await tokens.tokenize(
        service, content, add_special=_flag(body, "add_special", False),
        parse_special=_flag(body, "parse_special", True),
        with_pieces=_flag(body, "with_pieces", False))
    shown = [t if isinstance(t, int) else {"id": t[0], "piece": _piece(t[1])} for t in found]
    await out.send(200, json_bytes({"tokens": shown}), JSON)


async def detokenize(service: Service, raw: bytes, out: Responder) -> None:
    """``{"tokens": [...]}`` -> ``{"content"}``, special tokens written out (as
    llama-server does)."""
    ids = json_object(raw).get("tokens")
    if not isinstance(ids, list):
        raise ApiError(400, "tokens: must be an array of token ids", param="tokens")
    text = await tokens.detokenize(service, ids)
    await out.send(200, json_bytes({"content": text}), JSON)


async def apply_template(service: Service, raw: bytes, out: Responder) -> None:
    """``{"messages": [...], "tools": [...]}`` -> ``{"prompt"}``: the text
    ``/v1/chat/completions`` would generate from, rendered by the model's chat template
    (with the tools offered as a chat request offers them)."""
    body = json_object(raw)
    messages = [{"role": m.role, "content": m.content}
                for m in parse_messages(body.get("messages"))]
    try:
        tools = parse_tools(body)
    except ToolError as exc:
        raise ApiError(400, exc.message, param=exc.param) from None
    generation_prompt = _flag(body, "add_generation_prompt", True)
    try:
        async with service.holding(None, None) as rt:
            if rt.model.chat_template is None:
                raise ApiError(400, "this model has no chat template", param="messages")
            offered: dict[str, Any] = {}
            if tools is not None and offers_itself(rt, tools):  # as a chat request does
                messages = template_messages(body["messages"])
                offered["tools"] = template_tools(tools)
            elif tools is not None:
                messages = offer_tools(messages, tools)
            prompt = await anyio.to_thread.run_sync(functools.partial(
                rt.render_chat, messages, add_generation_prompt=generation_prompt,
                **offered))
    except RequestError as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from None
    await out.send(200, json_bytes({"prompt": prompt}), JSON)


async def props(service: Service, _raw: bytes, out: Responder) -> None:
    """The part of llama-server's ``GET /props`` that holds for meshd: the context per
    slot, the default ``max_tokens`` and seed, the slots, the model file and its
    template."""
    async with service.holding(None, None) as rt:
        await _props(service, rt, out)


async def _props(service: Service, rt: ModelRuntime, out: Responder) -> None:
    config = rt.context.config
    # -1 (llama-server's): no limit of the server's, on to the end of the context
    n_predict = service.config.max_tokens_default or -1
    await out.send(200, json_bytes({
        "default_generation_settings": {
            "n_ctx": config.n_ctx_seq,
            "params": {"n_predict": n_predict, "max_tokens": n_predict,
                       # --seed, else -1 (llama-server's: a random seed per request)
                       "seed": -1 if service.config.seed is None else service.config.seed},
        },
        "total_slots": config.n_seq_max,
        "model_path": rt.model.info.path,
        "chat_template": rt.model.chat_template or "",
        "modalities": {"vision": False, "audio": False},
        "build_info": build_info(),
        "is_sleeping": False,
    }), JSON)
