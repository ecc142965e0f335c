"""A request's prompt and constraint, made once from its :class:`~.spec.RequestSpec`.

Why here, in one place: the prompt is rendered by the model's chat template (with the
tools it offers itself and the request's template variables, when it has them) and
tokenized exactly once, and the constraint is compiled exactly once: the request's own,
or the grammar of a call the template's syntax forces, or the lazy one that holds a call
the model opens to its schema. Both are blocking (templates, tokenizer, llguidance): call
them on a worker thread, with the model held.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from meshd.daemon.engine.constraint import ConstraintError
from meshd.daemon.engine.request_errors import PromptTooLong, RequestError
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.prompts.tool_calls import LAZY_SYNTAXES, forced_call_grammar, lazy_call_grammar
from meshd.daemon.requests.api_errors import ApiError
from meshd.daemon.requests.prompt_fit import prompt_tokens
from meshd.daemon.requests.spec import RequestSpec
from meshd.daemon.requests.template_tools import (
    call_syntax,
    knows_tools,
    offers_itself,
    opener_token,
    template_tools,
)

__all__ = ["Prompt", "spec_grammar", "spec_prompt"]


@attrs.frozen
class Prompt:
    """A request's prompt tokens, and whether the model's template offered its tools."""

    tokens: tuple[int, ...]
    own_offer: bool


def _template_variables(rt: ModelRuntime, spec: RequestSpec) -> Mapping[str, Any] | None:
    """The template variables ``spec`` sets (``chat_template_kwargs``, and a reasoning
    effort for templates that read one); ApiError (400) for an effort the model's
    template takes no notice of."""
    variables = spec.template_variables
    if spec.reasoning_effort is not None:
        if "reasoning_effort" not in (rt.model.chat_template or ""):
            raise ApiError(400, f"reasoning_effort: this model's chat template takes no "
                                f"reasoning effort (got {spec.reasoning_effort!r}; none turns "
                                "thinking off)", param="reasoning_effort")
        variables = {**(variables or {}), "reasoning_effort": spec.reasoning_effort}
    return variables


def spec_prompt(rt: ModelRuntime, spec: RequestSpec) -> Prompt:
    """The prompt's tokens: the token ids given, or the text, or the chat rendered by the
    model's template (with its own tool offer and the request's variables where those
    apply). Raises PromptTooLong (over the context, measured before tokenizing more than
    it holds), RequestError or ValueError (the template or tokenizer refused it), ApiError
    (a token id outside the vocabulary; the template refused the tools or variables)."""
    if spec.prompt_ids is not None:
        return Prompt(_checked_ids(rt, spec.prompt_ids), own_offer=False)
    variables = _template_variables(rt, spec)
    tools = spec.tools if spec.conversation is not None else None
    if tools is not None and offers_itself(rt, tools):
        assert spec.conversation is not None
        return Prompt(_rendered(rt, spec.conversation, "messages", tools=template_tools(tools),
                                variables=variables), own_offer=True)
    if spec.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in spec.messages]
        if variables is not None:
            return Prompt(_rendered(rt, messages, "chat_template_kwargs", variables=variables),
                          own_offer=False)
        return Prompt(tuple(prompt_tokens(rt, rt.render_chat(messages), chat=True)),
                      own_offer=False)
    assert spec.prompt is not None
    return Prompt(tuple(prompt_tokens(rt, spec.prompt, chat=False)), own_offer=False)


def spec_grammar(rt: ModelRuntime, spec: RequestSpec, prompt: Prompt) -> str | None:
    """The request's compiled constraint: a call the model's own template offers and the
    request forces, held to that template's syntax; else the request's ``constraint``;
    else, for ``tool_choice: auto``, the lazy constraint (free text, and a call once
    opened held to an offered function's schema). Raises ConstraintError for the
    request's own constraint, ApiError (400) for functions whose schemas do not compile."""
    tools = spec.tools if spec.conversation is not None else None
    syntax = call_syntax(rt)
    if prompt.own_offer and tools is not None and tools.choice != "auto" and syntax is not None:
        return _compiled(rt, forced_call_grammar(
            tools, syntax, opener=opener_token(rt, syntax)))
    if spec.constraint is not None:
        return rt.compile_constraint(spec.constraint.kind, spec.constraint.value)
    if tools is None or tools.choice != "auto":
        return None
    lazy = syntax if knows_tools(rt) else "hermes"
    if lazy not in LAZY_SYNTAXES:  # (calls in that syntax are read, not constrained)
        return None
    opener = opener_token(rt, lazy)
    special = opener if opener.startswith("<[") else None
    return _compiled(rt, lazy_call_grammar(tools, special_open=special, syntax=lazy))


def _rendered(rt: ModelRuntime, messages: Any, param: str, **options: Any) -> tuple[int, ...]:
    try:
        return tuple(prompt_tokens(rt, rt.render_chat(messages, **options), chat=True))
    except PromptTooLong:
        raise
    except RequestError as exc:
        raise ApiError(400, f"{param}: {exc}", param=param) from None


def _checked_ids(rt: ModelRuntime, ids: tuple[int, ...]) -> tuple[int, ...]:
    """A prompt given as token ids, once they are known to be in the vocabulary (whether
    it fits the context is ``prepare``'s one check, for every prompt)."""
    n_vocab = rt.model.info.n_vocab
    for i, token in enumerate(ids):
        if token >= n_vocab:
            raise ApiError(400, f"prompt[{i}]: must be a token id below the vocabulary "
                                f"size {n_vocab} (got {token})", param="prompt")
    return ids


def _compiled(rt: ModelRuntime, lark: str) -> str:
    try:
        return rt.compile_constraint("lark", lark)
    except ConstraintError as exc:
        raise ApiError(400, f"tools: the functions' schemas do not compile: {exc}",
                       param="tools") from None
