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
import secrets
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from meshd.native.chat_builtin import apply_builtin, builtin_names
from meshd.native.errors import ModelLoadError
from meshd.native.model import Model

__all__ = ["CHATML_SOURCE", "BuiltinTemplate", "ChatTemplate", "ChatTemplateError",
           "ModelChat", "close_thinking", "continues_final", "fallback_template",
           "model_template", "template_source", "thinking_of"]

#: The markers reasoning models open and close their thinking with.
_THINKING_TAGS: Final = (("<think>", "</think>"), ("<|START_THINKING|>", "<|END_THINKING|>"))


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
                      separators=separators, sort_keys=sort_keys, default=_json_sequence)


def _json_sequence(value: Any) -> list[Any]:
    """What Jinja's ``map``/``select`` filters give (generators) serialized as lists."""
    if isinstance(value, Iterable):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _strftime_now(fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    return datetime.datetime.now().strftime(fmt)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def thinking_of(reasoning: str) -> bool:
    """The ``enable_thinking`` a ``reasoning`` setting gives templates. ``auto`` passes
    true, as llama.cpp does: templates written for it read an undefined value as off."""
    return reasoning != "off"


def close_thinking(prompt: str, source: str) -> str:
    """``prompt`` with its thinking block closed, for a turn that skips thinking.

    Templates that honour ``enable_thinking`` (Qwen3) close it themselves; others open
    the block in their generation prompt (DeepSeek-R1, QwQ: ``<think>``) or expect the
    model to (Command R7B), so an empty block is closed or added here, as llama-server
    does with ``--reasoning off``.
    """
    stripped = prompt.rstrip()
    for open_tag, close_tag in _THINKING_TAGS:
        if stripped.endswith(open_tag):
            return prompt + close_tag
        if open_tag in source and not stripped.endswith(close_tag):
            return prompt + open_tag + close_tag
    return prompt


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
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               thinking: bool | None = None,
               variables: Mapping[str, Any] | None = None,
               continue_final: bool = False) -> str:
        """The prompt for ``messages``; raises ChatTemplateError when the template
        refuses them or fails on them.

        ``thinking``: the ``enable_thinking`` of reasoning templates (None: theirs; False
        also closes the thinking block, :func:`close_thinking`). ``variables``: more
        template variables (a request's ``chat_template_kwargs``). ``continue_final``:
        the prompt ends inside the final (assistant) message, right after its text, so
        the model goes on writing it (a prefill: vLLM's ``continue_final_message``).
        """
        extra = dict(variables or {})
        if thinking is not None:
            extra["enable_thinking"] = thinking
        if continue_final:
            return self._continuation(messages, tools, extra)
        prompt = self._render(messages, add_generation_prompt, tools, extra)
        if extra.get("enable_thinking") is False and add_generation_prompt:
            prompt = close_thinking(prompt, self.source)
        return prompt

    def _continuation(self, messages: Sequence[Mapping[str, Any]],
                      tools: Sequence[Mapping[str, Any]] | None,
                      extra: Mapping[str, Any]) -> str:
        """The conversation rendered with a mark after the final message's text, cut at
        the mark: whatever the template puts after a message (its end-of-turn) is gone."""
        *before, last = messages
        marked = {**last, "content": f"{last.get('content') or ''}{_CONTINUE_MARK}"}
        prompt = self._render([*before, marked], False, tools, extra)
        cut = prompt.rfind(_CONTINUE_MARK)
        if cut < 0:
            raise ChatTemplateError("the chat template does not show the final message's "
                                    "text, so it cannot be continued")
        return prompt[:cut]

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                tools: Sequence[Mapping[str, Any]] | None, extra: Mapping[str, Any]) -> str:
        # A request's own variables never replace those the template is given here.
        context = {**extra, **dict(
            messages=[dict(m) for m in messages],
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            add_generation_prompt=add_generation_prompt,
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            # Meta's Llama 3.x templates print it ("Today Date"), and FireFunction's
            # ``datetime``, as llama.cpp passes them.
            date_string=datetime.date.today().strftime("%d %b %Y"),
            datetime=datetime.date.today().strftime("%b %d %Y"),
            # (a string: FireFunction's template appends it to its system prompt)
            functions="",
            function_call=None,
            tools=list(tools) if tools is not None else None,
            tool_choice=None,
        )}
        try:
            return str(self._template.render(context))
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError,
                AttributeError) as exc:
            raise ChatTemplateError(
                f"chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc


def template_source(inline: str | None, path: str | None) -> str | None:
    """The chat template given instead of the model's (inline, else a file's), checked
    to compile unless it names a built-in format; ModelLoadError naming it otherwise (a
    configured template that cannot work stops the load). None: none given."""
    if inline is not None and path is not None:
        raise ModelLoadError("give a chat template or a chat template file, not both")
    where = "--chat-template"
    source = inline
    if path is not None:
        where = f"chat template file {path}"
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{where}: {getattr(exc, 'strerror', None) or exc}") \
                from None
    if source is None or source in builtin_names():
        return source
    try:
        ChatTemplate(source)
    except ChatTemplateError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None
    return source


class BuiltinTemplate(ChatTemplate):
    """One of llama.cpp's built-in formats by name (``--chat-template command-r``):
    rendered by llama.cpp's formatter, which takes roles and text only."""

    def __init__(self, name: str) -> None:  # (no Jinja to compile)
        self.source, self.bos_token, self.eos_token = name, "", ""

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                tools: Sequence[Mapping[str, Any]] | None, extra: Mapping[str, Any]) -> str:
        if tools is not None:
            raise ChatTemplateError(f"the built-in {self.source} format cannot offer tools; "
                                    "give the model a Jinja template (--chat-template-file)")
        # C strings end at a NUL: a continuation's mark travels as a random one.
        nonce = f"meshd-{secrets.token_hex(12)}"
        pairs = [(str(m.get("role", "")),
                  str(m.get("content") or "").replace(_CONTINUE_MARK, nonce))
                 for m in messages]
        try:
            text = apply_builtin(self.source, pairs,
                                 add_generation_prompt=add_generation_prompt)
        except ValueError as exc:
            raise ChatTemplateError(str(exc)) from None
        return text.replace(nonce, _CONTINUE_MARK)


#: llama-server's template for a model without one (``CHATML_TEMPLATE_SRC`` of llama.cpp's
#: ``common/chat.cpp``), as its Jinja source, so a request's tools are offered as with
#: any Jinja template.
CHATML_SOURCE: Final = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}")

#: Architectures (``general.architecture``) whose every chat model speaks one of
#: llama.cpp's built-in formats. Only unambiguous ones: an architecture shared by
#: families of different formats (``llama``, ``phi3``, ``deepseek2``, ``chatglm``) is
#: left to chatml, as llama-server leaves every architecture.
_ARCHITECTURE_FORMATS: Final = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
    "orion": "orion", "command-r": "command-r", "llama4": "llama4", "gpt-oss": "gpt-oss",
    "exaone": "exaone3", "exaone4": "exaone4", "exaone-moe": "exaone-moe",
    "granite": "granite", "granitemoe": "granite", "granitehybrid": "granite-4.0",
    "hunyuan-moe": "hunyuan-moe", "hunyuan-dense": "hunyuan-dense", "seed_oss": "seed_oss",
    "bailingmoe": "bailing", "bailingmoe2": "bailing2", "rwkv6": "rwkv-world",
    "rwkv7": "rwkv-world", "pangu-embedded": "pangu-embedded",
}


def fallback_template(model: Model) -> tuple[str, str]:
    """The chat template a model whose file has none is served with, and which one it
    is (for the log), as llama-server chooses (``common_chat_templates_init``): the
    file's ``tool_use`` template if it has that one; else llama.cpp's built-in format
    of the model's architecture, where every model of it speaks one; else chatml.

    Why not refuse chat: users bring GGUFs converted without their template (a Gemma 3
    file, a fine-tune) and their clients only speak chat; llama-server answers them.
    (llama.cpp itself already names ``mistral-v7-tekken`` for Mistral Small 2503 files,
    which reaches meshd as the model's template.)"""
    tool_use = model.meta("tokenizer.chat_template.tool_use")
    if tool_use:
        return tool_use, "tool_use"
    name = _ARCHITECTURE_FORMATS.get(model.info.architecture)
    if name is not None and name in builtin_names():
        return name, name
    return CHATML_SOURCE, "chatml"


def model_template(model: Model, source: str | None = None) -> ChatTemplate:
    """``source`` (default: the GGUF's own template, or the one given instead) with the
    model's BOS and EOS texts; a name of llama.cpp's built-in formats is that format.
    ChatTemplateError when the model has none or it does not compile."""
    source = source if source is not None else model.chat_template
    if source is None:
        raise ChatTemplateError("this model has no chat template; send a plain prompt")
    if source in builtin_names():
        return BuiltinTemplate(source)
    tok, info = model.tokenizer, model.info
    bos = tok.piece(info.bos_token, special=True).decode() if info.bos_token is not None else ""
    eos = tok.piece(info.eos_token, special=True).decode() if info.eos_token is not None else ""
    return ChatTemplate(source, bos_token=bos, eos_token=eos)


#: Marks where a continued message's text ends (never in a message: it holds NULs).
_CONTINUE_MARK: Final = "\x00meshd-continue\x00"


def continues_final(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a conversation asks to be continued rather than answered: it ends with an
    assistant message (a prefill, as llama-server and Anthropic's API take it).
    ChatTemplateError for two assistant messages at the end (which one goes on?)."""
    if not messages or messages[-1].get("role") != "assistant":
        return False
    if len(messages) >= 2 and messages[-2].get("role") == "assistant":
        raise ChatTemplateError("the conversation ends with two assistant messages; "
                                "only a final one can be continued")
    return True


class ModelChat:
    """A model's chat template, compiled on first use, thinking as ``--reasoning`` says
    unless a request's variables (``chat_template_kwargs``) set ``enable_thinking``."""

    def __init__(self, model: Model, reasoning: str) -> None:
        self._model, self._reasoning = model, reasoning
        self._template: ChatTemplate | None = None

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt (a conversation ending with an assistant message is continued:
        :func:`continues_final`); ChatTemplateError when the model has no template or it
        fails."""
        if self._template is None:
            self._template = model_template(self._model)
        given = dict(variables or {})
        thinking = given.pop("enable_thinking", thinking_of(self._reasoning))
        return self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, thinking=bool(thinking), variables=given,
                                     continue_final=continues_final(messages))
