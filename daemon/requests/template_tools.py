"""Tools offered by the model's own chat template, as llama-server ``--jinja`` offers them.

Why: a model answers best in the words it was trained on. Where the chat template takes
``tools`` (Llama 3.x, Mistral, Qwen 2.5-3.5, Hermes ...), a request with
``tool_choice: auto`` is rendered by it: the tools in its ``tools`` variable, earlier
calls as structured ``tool_calls`` (arguments as objects, as llama.cpp gives them) and
results as ``tool`` turns; the answer is read in whichever syntax the family writes
(:mod:`.tool_syntax`), and a call the request forces (``required`` or a named function)
is held by a grammar to the syntax the template teaches (Hermes, Llama 3.x, Mistral,
Qwen 3.5's XML, GLM's tags). A template that knows no tools, or teaches a syntax no
forced grammar here writes, gets the generic offer of :mod:`.tool_calls` and its Hermes
grammar. With ``auto``, a call is held to its schema from where the model opens it
(:func:`with_lazy_calls`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from meshd.daemon.engine.constraint import ConstraintError
from meshd.daemon.engine.request_errors import PromptTooLong, RequestError
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.models.scheduler import GenerationRequest
from meshd.daemon.prompts.tool_calls import (
    FORCED_SYNTAXES,
    LAZY_SYNTAXES,
    ToolSpec,
    forced_call_grammar,
    lazy_call_grammar,
    opener_of,
)
from meshd.daemon.requests.api_errors import ApiError
from meshd.daemon.requests.prompt_fit import prompt_tokens
from meshd.protocol import ModelError

__all__ = ["call_syntax", "knows_tools", "offers_itself", "template_tools", "with_lazy_calls",
           "with_template_tools"]


def knows_tools(rt: ModelRuntime) -> bool:
    """Whether the model's chat template (Jinja) offers tools itself."""
    source = rt.model.chat_template
    return source is not None and "tools" in source and "{%" in source


def template_tools(spec: ToolSpec) -> list[dict[str, Any]]:
    """The request's functions as OpenAI tool objects, the ``tools`` templates read."""
    return [{"type": "function", "function": {"name": name, "description": description,
                                              "parameters": schema}}
            for name, description, schema in spec.functions]


def call_syntax(rt: ModelRuntime) -> str | None:
    """The call syntax the model's template teaches (:data:`FORCED_SYNTAXES` or ``xml``),
    read from the template's own words; None when it knows no tools."""
    if not knows_tools(rt):
        return None
    source = rt.model.chat_template or ""
    if "[TOOL_CALLS]" in source:
        return "mistral_args" if "[ARGS]" in source else "mistral_list"
    if '"parameters": dictionary of argument name' in source:
        return "llama"
    if "<function=" in source:
        return "xml"
    if "<arg_key>" in source:
        return "glm"
    return "hermes" if "<tool_call>" in source else None


def offers_itself(rt: ModelRuntime, spec: ToolSpec) -> bool:
    """Whether the model's template offers ``spec``'s tools (else the generic offer): it
    takes tools, and a forced call's syntax is one a grammar here writes."""
    return knows_tools(rt) and (spec.choice == "auto" or call_syntax(rt) in FORCED_SYNTAXES)


def with_template_tools(rt: ModelRuntime, gen: GenerationRequest,
                        messages: Sequence[Mapping[str, Any]], spec: ToolSpec
                        ) -> GenerationRequest:
    """``gen`` prompted by the model's template with the tools in it; a forced call
    (``required`` or a named function) is then held to the syntax that template teaches
    (:func:`~.tool_calls.forced_call_grammar`). Unchanged where the template knows no
    tools, or a forced call's syntax has no grammar here (the generic offer and its
    Hermes grammar stay). Blocking; raises ModelError for a prompt over the
    context and ApiError (400) when the template refuses the conversation."""
    if not offers_itself(rt, spec):
        return gen
    try:
        text = rt.render_chat(messages, tools=template_tools(spec))
        ids = prompt_tokens(rt, text, chat=True)
    except PromptTooLong as exc:
        raise ModelError(str(exc)) from exc
    except RequestError as exc:
        raise ApiError(400, f"messages: {exc}", param="messages") from None
    gen = attrs.evolve(gen, prompt=tuple(ids))
    syntax = call_syntax(rt)
    if spec.choice == "auto" or syntax is None:  # (a forced call's syntax is known)
        return gen
    opener = _token_or_text(rt, opener_of(syntax))
    return attrs.evolve(gen, grammar=_compiled(
        rt, forced_call_grammar(spec, syntax, opener=opener)))


def _token_or_text(rt: ModelRuntime, text: str) -> str:
    """``text`` in a Lark grammar: the vocabulary's special token where it has one."""
    ids = rt.model.tokenizer.tokenize(text, add_special=False, parse_special=True)
    plain = rt.model.tokenizer.tokenize(text, add_special=False, parse_special=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 and len(plain) > 1 else json.dumps(text)


def _compiled(rt: ModelRuntime, lark: str) -> str:
    try:
        return rt.compile_constraint("lark", lark)
    except ConstraintError as exc:
        raise ApiError(400, f"tools: the functions' schemas do not compile: {exc}",
                       param="tools") from None


def with_lazy_calls(rt: ModelRuntime, gen: GenerationRequest, spec: ToolSpec
                    ) -> GenerationRequest:
    """``gen`` under the lazy call constraint, for ``tool_choice: auto`` in the syntax the
    model is offered (the generic offer's Hermes JSON, or the one its template teaches):
    free text, and a call once opened held to an offered function's schema. Unchanged
    where the answer already has a constraint (``response_format``) or the template
    teaches a syntax with no grammar here (its calls are read, not constrained).
    Blocking (compiles)."""
    syntax = call_syntax(rt) if knows_tools(rt) else "hermes"
    if spec.choice != "auto" or gen.grammar is not None or syntax not in LAZY_SYNTAXES:
        return gen
    opener = _token_or_text(rt, opener_of(syntax))
    special = opener if opener.startswith("<[") else None
    return attrs.evolve(gen, grammar=_compiled(
        rt, lazy_call_grammar(spec, special_open=special, syntax=syntax)))
