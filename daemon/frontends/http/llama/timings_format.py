"""llama-server's ``timings`` and ``prompt_progress`` blocks, as its clients read them."""

from __future__ import annotations

from meshd.daemon.engine.generation_stats import GenerationStats

__all__ = ["live_timings", "prompt_progress", "timings"]


def live_timings(*, prompt_n: int, cache_n: int, prompt_ms: float, predicted_n: int,
                 predicted_ms: float) -> dict[str, float | int]:
    """The prompt's and the generation's counts, times and rates. While a stream runs
    (``timings_per_token``) they are the figures so far, as the HTTP side sees them; the
    last chunks carry the engine's own, :func:`timings`."""
    prompt_ms, predicted_ms = max(0.0, prompt_ms), max(0.0, predicted_ms)
    return {
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
        "predicted_n": predicted_n,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
        "predicted_per_second": (1e3 * predicted_n / predicted_ms if predicted_ms > 0
                                 else 0.0),
    }


def timings(stats: GenerationStats) -> dict[str, float | int]:
    """A finished generation's block, with its drafts."""
    return {
        **live_timings(prompt_n=max(0, stats.prompt_tokens - stats.reused_prompt_tokens),
                       cache_n=stats.reused_prompt_tokens,
                       prompt_ms=stats.session.prefill_ms, predicted_n=stats.emitted,
                       predicted_ms=stats.wall_ms - stats.session.prefill_ms),
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
    }


def prompt_progress(*, total: int, cache: int, processed: int, time_ms: float
                    ) -> dict[str, float | int]:
    """``return_progress``: the prompt's tokens, those the prefix cache served, those in
    the sequence so far, and the time from the request's submission to that point (0 for
    the report before the prefill)."""
    return {"total": total, "cache": cache, "processed": processed,
            "time_ms": max(0.0, time_ms)}
