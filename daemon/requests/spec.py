"""The one request type both front ends hand to the service.

Why one: the NDJSON and HTTP front ends read different bytes but ask for the same thing,
a generation. Each turns its bytes into a :class:`RequestSpec` (the native ``generate``
message, plus what only some APIs can say: a prompt as token ids, the conversation a
template offers tools in, template variables, llama-server's switches), and
:meth:`~meshd.daemon.requests.service.Service.prepare` turns that into the engine's
:class:`~meshd.daemon.models.scheduler.GenerationRequest` in one pass: the prompt
rendered and tokenized once, every check made once, the constraint compiled once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from meshd.daemon.prompts.tool_calls import ToolSpec
from meshd.protocol import Generate

__all__ = ["RequestSpec"]


@attrs.frozen
class RequestSpec:
    """A generation as a front end asks for it (see the module docstring)."""

    generate: Generate
    """The native message: the prompt (text or messages), sampling, limits, stop strings,
    constraint, speculation, prediction, log probabilities, model and keep-alive."""
    prompt_ids: tuple[int, ...] | None = None
    """A prompt sent as token ids (HTTP's ``prompt: [ids]``): it is the prompt, and
    ``generate``'s text is not read."""
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
    """Biases by token id, replacing ``generate``'s (llama-server's resolved form)."""
    logprobs: int | None = None
    """Alternatives reported per token, replacing ``generate``'s when set."""
    n_predict: int | None = None
    """llama-server's limit, replacing ``generate.max_tokens`` when set: -1 the context,
    otherwise at least one token and at most the server's limit (clamped, not refused)."""
    seed_offset: int = 0
    """Added to a given seed (llama-server's ``n_cmpl`` copies each sample their own)."""
