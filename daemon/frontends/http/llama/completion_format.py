"""llama-server's ``/completion`` answers: the final object, the streamed partials, the
``generation_settings`` it reports, ``completion_probabilities`` and ``response_fields``.

Why apart from the request handling (:mod:`.llama_completion`): these are pure functions
of what a generation came to, testable without a model. Token texts follow llama-server:
a piece's ``token`` is its text with an unfinished UTF-8 character at its end left out
(``bytes`` has it whole), special tokens are shown as they are in ``content`` (not at
all). Post-sampling probabilities (``post_sampling_probs``) are meshd's own sampler's
(:class:`~meshd.daemon.requests.sampling.PostSampling`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import attrs

from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.daemon.engine.logprobs import TokenLogprob
from meshd.daemon.frontends.http.llama.timings_format import live_timings, timings
from meshd.daemon.requests.sampling import PostSampling, SamplingParams

__all__ = ["NO_SEED", "SAMPLERS", "Outcome", "Settings", "final_body", "partial_body",
           "pick_fields", "probabilities"]

NO_SEED: Final = 0xFFFFFFFF
"""llama-server's seed of a request that asked for none (``LLAMA_DEFAULT_SEED``)."""
SAMPLERS: Final = ("penalties", "top_k", "typ_p", "top_p", "min_p", "temperature")
"""meshd's sampler chain, in llama-server's names (``logit_bias`` applies first)."""

Piece = Callable[[int], bytes]


@attrs.frozen
class Settings:
    """What a request's ``generation_settings`` reports (the same for each prompt but
    the seed)."""

    n_predict: int
    sampling: SamplingParams
    """The engine's parameters (the seed is reported per answer)."""
    stop: tuple[str, ...]
    logit_bias: tuple[tuple[int, float], ...]
    ignore_eos: bool
    stream: bool
    n_probs: int
    min_keep: int
    grammar: str
    post_sampling_probs: bool
    timings_per_token: bool

    def to_json(self, seed: int | None) -> dict[str, Any]:
        p = self.sampling
        return {
            "seed": NO_SEED if seed is None else seed,
            "temperature": p.temperature, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
            "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "top_n_sigma": -1.0,
            "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": p.typical_p,
            "repeat_last_n": p.repeat_last_n, "repeat_penalty": p.repeat_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
            "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
            "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":", "\"", "*"],
            "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
            "adaptive_target": -1.0, "adaptive_decay": 0.9,
            "stop": list(self.stop), "max_tokens": self.n_predict, "n_predict": self.n_predict,
            "n_keep": 0, "n_discard": 0, "ignore_eos": self.ignore_eos, "stream": self.stream,
            # JSON has no -inf: llama-server writes a ban (bias false) as null.
            "logit_bias": [{"bias": b if math.isfinite(b) else None, "token": t}
                           for t, b in self.logit_bias],
            "n_probs": self.n_probs, "min_keep": self.min_keep, "grammar": self.grammar,
            "grammar_lazy": False, "grammar_triggers": [], "preserved_tokens": [],
            "chat_format": "Content-only", "reasoning_format": "none",
            "reasoning_in_content": False, "generation_prompt": "",
            "samplers": list(SAMPLERS), "speculative.types": "none",
            "timings_per_token": self.timings_per_token,
            "post_sampling_probs": self.post_sampling_probs, "backend_sampling": False,
            "lora": [],
        }


@attrs.define
class Outcome:
    """What one prompt's generation came to (or, with no ``stats``, a prompt answered
    without generating: an empty one)."""

    index: int
    prompt: tuple[int, ...]
    model: str
    seed: int | None
    id_slot: int = -1
    text: list[str] = attrs.field(factory=list)
    tokens: list[int] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    stats: GenerationStats | None = None
    stop_type: str = "none"
    stopping_word: str = ""
    truncated: bool = False
    hidden: bool = False
    """``n_predict`` 0: the prompt was evaluated (into the prefix cache), the token
    generated with it is not shown."""

    @property
    def content(self) -> str:
        return "" if self.hidden else "".join(self.text)

    @property
    def predicted(self) -> int:
        return 0 if self.hidden or self.stats is None else self.stats.emitted


def _text(piece: bytes) -> str:
    """A piece as llama-server writes it: without an unfinished UTF-8 character at the
    end (``validate_utf8``), anything else invalid replaced."""
    end = len(piece)
    for i in range(1, min(4, end) + 1):
        c = piece[end - i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3) \
                or (c & 0xF8 == 0xF0 and i < 4):
            end -= i
            break
    return piece[:end].decode("utf-8", "replace")


def _token(token: int, piece: Piece, key: str, value: float) -> dict[str, Any]:
    raw = piece(token)
    return {"id": token, "token": _text(raw), "bytes": list(raw), key: value}


def probabilities(lps: Sequence[TokenLogprob], piece: Piece, n_probs: int, *,
                  post_sampling: PostSampling | None = None, history: Sequence[int] = (),
                  n_vocab: int = 0) -> list[dict[str, Any]]:
    """``completion_probabilities`` for these tokens: each with ``logprob`` and its
    ``top_logprobs``, or (``post_sampling``: the request's sampler) ``prob`` and
    ``top_probs``; ``history``: the tokens before the first of them (prompt included)."""
    out: list[dict[str, Any]] = []
    if post_sampling is None:
        for lp in lps:
            entry = _token(lp.token, piece, "logprob", lp.logprob)
            entry["top_logprobs"] = [_token(t, piece, "logprob", v)
                                     for t, v in lp.top[:n_probs]]
            out.append(entry)
        return out
    seen = list(history)
    for lp in lps:
        prob, top = post_sampling.probs(lp, seen, n_vocab, n_probs)
        entry = _token(lp.token, piece, "prob", prob)
        entry["top_probs"] = [_token(t, piece, "prob", p) for t, p in top]
        out.append(entry)
        seen.append(lp.token)
    return out


def pick_fields(body: Mapping[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """llama-server's ``response_fields``: only the listed fields, a nested one
    (``generation_settings/n_predict``) moved to the top under its path; a missing one
    left out. No fields: the whole body."""
    if not fields:
        return dict(body)
    out: dict[str, Any] = {}
    for path in fields:
        current: Any = body
        for key in path.split("/"):
            if not isinstance(current, Mapping) or key not in current:
                break
            current = current[key]
        else:
            out[path] = current
    return out


def _timings(outcome: Outcome) -> dict[str, Any]:
    if outcome.stats is None:
        return live_timings(prompt_n=0, cache_n=0, prompt_ms=0.0, predicted_n=0,
                            predicted_ms=0.0)
    out = timings(outcome.stats)
    if outcome.hidden:
        out.update(predicted_n=0, predicted_ms=0.0, predicted_per_token_ms=0.0,
                   predicted_per_second=0.0)
    return out


def final_body(outcome: Outcome, settings: Settings, prompt_text: str, *, stream: bool,
               return_tokens: bool, probs: list[dict[str, Any]] | None,
               fields: Sequence[str]) -> dict[str, Any]:
    """The answer (or a stream's last event: its text and tokens were streamed, so
    ``content`` is empty, and it has no probabilities)."""
    emitted = 0 if outcome.stats is None else outcome.stats.emitted
    content = outcome.content
    body: dict[str, Any] = {
        "index": outcome.index,
        "content": "" if stream else content,
        "tokens": list(outcome.tokens) if return_tokens and not stream and not outcome.hidden
        else [],
        "id_slot": outcome.id_slot,
        "stop": True,
        "model": outcome.model,
        "tokens_predicted": outcome.predicted,
        "tokens_evaluated": len(outcome.prompt),
        "generation_settings": settings.to_json(outcome.seed),
        "prompt": prompt_text,
        "has_new_line": "\n" in content,
        "truncated": outcome.truncated,
        "stop_type": outcome.stop_type,
        "stopping_word": outcome.stopping_word,
        "tokens_cached": len(outcome.prompt) + max(0, emitted - 1),
        "timings": _timings(outcome),
    }
    if not stream and probs:
        body["completion_probabilities"] = probs
    return pick_fields(body, fields)


def partial_body(index: int, text: str, tokens: Sequence[int], *, id_slot: int,
                 predicted: int, evaluated: int, probs: list[dict[str, Any]] | None
                 ) -> dict[str, Any]:
    """One streamed event: the text and token(s) of one step of the generation."""
    body: dict[str, Any] = {"index": index, "content": text, "tokens": list(tokens),
                            "stop": False, "id_slot": id_slot, "tokens_predicted": predicted,
                            "tokens_evaluated": evaluated}
    if probs:
        body["completion_probabilities"] = probs
    return body
