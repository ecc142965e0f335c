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
(:func:`~meshd.daemon.requests.prompting.spec_grammar`).
"""

from __future__ import annotations

import json
from typing import Any

from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.prompts.tool_calls import (
    FORCED_SYNTAXES,
    ToolSpec,
    opener_of,
)

__all__ = ["call_syntax", "knows_tools", "offers_itself", "opener_token", "template_tools"]


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


def opener_token(rt: ModelRuntime, syntax: str) -> str:
    """The opener of a call in ``syntax``, as a Lark grammar writes it: the vocabulary's
    special token where it has one, else the text."""
    text = opener_of(syntax)
    ids = rt.model.tokenizer.tokenize(text, add_special=False, parse_special=True)
    plain = rt.model.tokenizer.tokenize(text, add_special=False, parse_special=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 and len(plain) > 1 else json.dumps(text)
