"""A loaded model's prompt tools: its chat template, its tokenizer, its grammars.

Why apart from the runtime: these read the model alone (never the context, the
proposers or the costs), and the request layer calls them once per request before
anything runs; they are made again with the model when it is reloaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from meshd.daemon.engine.constraint import compile_grammar
from meshd.daemon.engine.request_errors import PromptTooLong, RequestError, too_long_message
from meshd.daemon.engine.schema_checks import nesting_problem
from meshd.daemon.prompts.call_schema import closed_objects
from meshd.daemon.prompts.chat_template import ChatTemplateError, ModelChat
from meshd.native.grammar_vocab import GrammarVocab
from meshd.native.model import Model

__all__ = ["ModelPrompts"]


class ModelPrompts:
    """One model's template, tokenizer and grammar vocabulary."""

    def __init__(self, model: Model, reasoning: str) -> None:
        """``reasoning``: whether reasoning models think (auto | on | off)."""
        self.model = model
        #: llguidance's view of the vocabulary, for requests with a constraint.
        self.grammar_vocab = GrammarVocab(model)
        self._chat = ModelChat(model, reasoning)

    def compile_constraint(self, kind: str, value: object) -> str:
        """A request's constraint as llguidance's grammar, checked against this model's
        vocabulary (ConstraintError quotes llguidance). A JSON schema's objects that
        list their properties and say nothing of others take those only, as llama-server
        reads them and as a call's arguments are held (:func:`closed_objects`). Blocking;
        not on the event loop."""
        if kind == "json_schema" and isinstance(value, Mapping) \
                and nesting_problem(value) is None:  # (else compile_grammar says so)
            value = closed_objects(value)
        return compile_grammar(kind, value, self.grammar_vocab.tokenizer())

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """Render chat messages with the model's template (``chat_template.ModelChat``:
        ``add_generation_prompt``, ``tools``, ``variables``)."""
        try:
            return self._chat.render(messages, **options)
        except ChatTemplateError as exc:
            raise RequestError(str(exc)) from exc

    def prompt_too_long(self, n_prompt: int, n_ctx: int) -> PromptTooLong:
        """The error for a prompt of ``n_prompt`` tokens over a context of ``n_ctx``."""
        return PromptTooLong(too_long_message(n_prompt, n_ctx, self.model.info.n_ctx_train),
                             n_prompt=n_prompt, n_ctx=n_ctx)

    def tokenize(self, text: str, *, chat: bool, limit: int | None = None) -> list[int]:
        """A prompt's tokens: a rendered chat's special tokens parsed, a raw prompt's
        BOS added."""
        return self.model.tokenizer.tokenize(text, add_special=not chat, parse_special=chat,
                                             max_tokens=limit)
