"""A GGUF's own chat template, rendered the way llama-cpp-python and llama.cpp render it.

Why a module of its own: chat templates are small programs written by model vendors
against Hugging Face's Jinja environment, and they use its extras: ``{% break %}`` /
``{% continue %}`` (the ``loopcontrols`` extension), ``strftime_now`` for today's date
(Llama 3.2, Mistral Small), ``raise_exception`` to refuse a conversation (Gemma's role
alternation), ``tojson`` that keeps non-ASCII text as is, and the ``{% generation %}``
tag. A template that meets a plain environment fails, so the request would fail with
nothing to say why. This environment matches llama-cpp-python's ``Jinja2ChatFormatter``
(sandboxed, ``trim_blocks``, ``lstrip_blocks``) and passes the same variables.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from meshd.native.model import Model

__all__ = ["ChatTemplate", "ChatTemplateError"]


class ChatTemplateError(ValueError):
    """The template refused the conversation (``raise_exception``) or failed on it."""


class _IgnoreGenerationTags(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (Hugging Face's marker for training
    masks) renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API declares a plain set

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    return datetime.datetime.now().strftime(fmt)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


class ChatTemplate:
    """One compiled template; :meth:`render` turns messages into the prompt text."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
            extensions=[_IgnoreGenerationTags, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the model's chat template does not compile: {exc}") \
                from exc
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt for ``messages``; raises ChatTemplateError when the template
        refuses them or fails on them."""
        try:
            return str(self._template.render(
                messages=[dict(m) for m in messages],
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
                raise_exception=_raise_exception,
                strftime_now=_strftime_now,
                functions=None,
                function_call=None,
                tools=list(tools) if tools is not None else None,
                tool_choice=None,
            ))
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError,
                AttributeError) as exc:
            raise ChatTemplateError(
                f"chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc


def model_template(model: Model) -> ChatTemplate:
    """The GGUF's own template with the model's BOS and EOS texts; ChatTemplateError
    when the model has none or it does not compile."""
    source = model.chat_template
    if source is None:
        raise ChatTemplateError("this model has no chat template; send a plain prompt")
    tok, info = model.tokenizer, model.info
    bos = tok.piece(info.bos_token, special=True).decode() if info.bos_token is not None else ""
    eos = tok.piece(info.eos_token, special=True).decode() if info.eos_token is not None else ""
    return ChatTemplate(source, bos_token=bos, eos_token=eos)
