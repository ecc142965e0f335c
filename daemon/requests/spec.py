"""The one request type both front ends hand to the service.

Why one: the NDJSON and HTTP front ends read different bytes but ask for the same thing,
a generation. Each turns its bytes into a :class:`RequestSpec` (the native ``generate``
message's fields, plus what only some APIs can say: a prompt as token ids, the
conversation a template offers tools in, template variables, llama-server's switches),
and :meth:`~meshd.daemon.requests.service.Service.prepare` turns that into the engine's
:class:`~meshd.daemon.models.scheduler.GenerationRequest` in one pass: the prompt
rendered and tokenized once, every check made once, the constraint compiled once.

Its fields are held to the same rules as ``generate``'s (the protocol's validators, so
the errors read the same), and its prompt is exactly one of text, chat messages or token
ids: a token-id prompt needs no text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import attrs.validators as V

from meshd.daemon.prompts.tool_calls import ToolSpec
from meshd.protocol import (
    BadRequest,
    ChatMessage,
    Constraint,
    Generate,
    SpeculativeOverrides,
)
from meshd.protocol import messages as wire
from meshd.protocol import validators as check

__all__ = ["RequestSpec"]


@attrs.frozen
class RequestSpec:
    """A generation as a front end asks for it (see the module docstring)."""

    id: str = attrs.field(validator=check.request_id)
    prompt: str | None = attrs.field(default=None, validator=check.optional_non_empty_string)
    """A text prompt (tokenized as it is)."""
    messages: tuple[ChatMessage, ...] | None = attrs.field(default=None, validator=check.rule(
        f"a non-empty array of at most {check.MAX_MESSAGES} chat messages",
        V.instance_of(ChatMessage), each="a ChatMessage", container="array", non_empty=True,
        max_items=check.MAX_MESSAGES, optional=True))
    """A chat, rendered by the model's template."""
    prompt_ids: tuple[int, ...] | None = attrs.field(
        default=None, validator=V.optional(check.int_items(0)))
    """A prompt sent as token ids (HTTP's ``prompt: [ids]``, llama-server's prompts)."""
    max_tokens: int | None = attrs.field(default=None, validator=check.integer(1, optional=True))
    """Most tokens to generate; None: the server's default / the context end."""
    sampling: wire.SamplingParams = attrs.field(factory=wire.SamplingParams,
                                                validator=check.instance(wire.SamplingParams))
    stop: tuple[str, ...] = attrs.field(default=(), validator=check.stop_strings)
    speculative: SpeculativeOverrides = attrs.field(
        factory=SpeculativeOverrides, validator=check.instance(SpeculativeOverrides))
    constraint: Constraint | None = attrs.field(default=None, validator=check.rule(
        "a Constraint", V.instance_of(Constraint), optional=True))
    logprobs: int | None = attrs.field(default=None, validator=check.integer(0, optional=True))
    """Alternatives reported with each token's log-probability (None: none); each front
    end bounds it (``generate``'s limit, llama-server's ``n_probs``)."""
    prediction: str | None = attrs.field(default=None, validator=check.rule(
        f"a string of at most {check.MAX_PREDICTION_LENGTH} chars", check.STR,
        V.max_len(check.MAX_PREDICTION_LENGTH), optional=True))
    """The text the client expects back (Predicted Outputs)."""
    model: str | None = attrs.field(default=None, validator=check.optional_model_name)
    """The model that serves it, by name; None: the daemon's default."""
    keep_alive: float | None = attrs.field(default=None, validator=check.keep_alive)
    """Seconds the model stays loaded once idle after it; None: the model's setting."""
    tools: ToolSpec | None = None
    """The functions offered, where the model's own chat template may offer them."""
    conversation: tuple[Mapping[str, Any], ...] | None = None
    """The chat as templates read it (earlier calls structured), for that offer."""
    template_variables: Mapping[str, Any] | None = None
    """More variables for the chat template (``chat_template_kwargs``)."""
    reasoning_effort: str | None = None
    """A ``reasoning_effort`` for templates that read that variable (none: off)."""
    min_tokens: int = 0
    """No end-of-generation token before this many (vLLM's ``min_tokens``)."""
    logit_bias_ids: tuple[tuple[int, float], ...] | None = None
    """Biases by token id, replacing ``sampling``'s (llama-server's resolved form)."""
    n_predict: int | None = None
    """llama-server's limit, replacing ``max_tokens`` when set: -1 the context,
    otherwise at least one token and at most the server's limit (clamped, not refused)."""
    seed_offset: int = 0
    """Added to a given seed (llama-server's ``n_cmpl`` copies each sample their own)."""

    def __attrs_post_init__(self) -> None:
        given = sum(form is not None for form in (self.prompt, self.messages, self.prompt_ids))
        if given != 1:
            raise BadRequest("exactly one of prompt and messages must be given")
        if self.prompt_ids == ():
            raise BadRequest.invalid_field("prompt", "must hold at least one token id")

    @classmethod
    def of(cls, generate: Generate, **extras: Any) -> RequestSpec:
        """The native ``generate`` as the service's request (its tools, if any, given
        separately in ``extras`` once offered)."""
        return cls(
            id=generate.id, prompt=generate.prompt, messages=generate.messages,
            max_tokens=generate.max_tokens, sampling=generate.sampling, stop=generate.stop,
            speculative=generate.speculative, constraint=generate.constraint,
            logprobs=generate.logprobs, prediction=generate.prediction, model=generate.model,
            keep_alive=generate.keep_alive, **extras)

    @staticmethod
    def check_fields(**fields: Any) -> None:
        """Hold ``fields`` to their rules before the request's prompt is known (llama-
        server's prompts are tokenized with the model, after the body is checked);
        raises BadRequest as building the request would."""
        for name, value in fields.items():
            attribute = getattr(attrs.fields(RequestSpec), name)
            if attribute.validator is not None:
                attribute.validator(None, attribute, value)
