"""Translation between wire messages (meshd.protocol) and engine types (meshd.daemon).

Why a module of pure functions: the protocol and the engine each have their own types
for the same ideas (sampling parameters, finish reasons, per-request statistics), and
keeping the conversion in one place, free of I/O, makes "what does ``done`` report"
readable and testable without a socket.
"""

from __future__ import annotations

from pathlib import Path

from meshd.daemon.engine.generation import TokenEvent
from meshd.daemon.engine.generation_stats import GenerationStats
from meshd.daemon.engine.sampling import SamplingParams
from meshd.daemon.models.runtime import ModelRuntime
from meshd.native.model import ModelInfo as NativeModelInfo
from meshd.policy.decision import FinishReason
from meshd.protocol import messages as wire

__all__ = ["done_message", "file_info", "model_info", "sampling_params", "speculation_stats",
           "token_message"]


def sampling_params(params: wire.SamplingParams) -> SamplingParams:
    """The engine's sampling parameters for a request's ``sampling`` object."""
    return SamplingParams(
        temperature=float(params.temperature), top_k=params.top_k, top_p=float(params.top_p),
        seed=params.seed, min_p=float(params.min_p), typical_p=float(params.typical_p),
        repeat_penalty=float(params.repeat_penalty), repeat_last_n=params.repeat_last_n,
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        logit_bias=tuple(sorted((int(k), float(v))
                                for k, v in (params.logit_bias or {}).items())),
    )


def model_info(runtime: ModelRuntime, *, name: str | None = None) -> wire.ModelInfo:
    """What ``welcome`` and ``models`` say about a loaded model (``name``: the name it
    is served by; default its file's stem)."""
    info = runtime.model.info
    return file_info(info, name=name or Path(info.path).stem or "model",
                     n_ctx=runtime.context.config.n_ctx_seq,
                     gpu_layers=runtime.model.gpu_layers)


def file_info(info: NativeModelInfo, *, name: str, n_ctx: int, gpu_layers: int = 0
              ) -> wire.ModelInfo:
    """A model's facts as the wire says them (``n_params``/``size_bytes``: None where
    not known, as from a file read without its weights)."""
    return wire.ModelInfo(
        name=name,
        architecture=info.architecture or None,
        n_ctx=n_ctx,
        n_vocab=info.n_vocab,
        n_params=info.n_params if info.n_params > 0 else None,
        size_bytes=info.size_bytes if info.size_bytes > 0 else None,
        has_mtp=info.has_mtp,
        has_chat_template=info.has_chat_template,
        gpu_layers=gpu_layers,
    )


def token_message(request_id: str, event: TokenEvent) -> wire.Token:
    """One committed-tokens event as a ``token`` frame."""
    return wire.Token(id=request_id, text=event.text, token_ids=event.tokens,
                      logprobs=event.logprobs or None)


def speculation_stats(stats: GenerationStats, proposer: str | None) -> wire.SpeculationStats:
    """The engine's per-request statistics in the wire's shape.

    ``target_forwards`` excludes the prefill, as the protocol defines it; counters the
    wire has no field for travel in ``extra``.
    """
    extra: dict[str, float] = {
        "prefill_forwards": stats.session.prefill_forwards,
        "prefill_tokens": stats.session.prefill_tokens,
        "trims": stats.session.trims,
        "propose_ms": stats.propose_ms,
        "proposals": stats.proposals,
    }
    for kind, count in stats.proposer_faults.items():
        extra[f"proposer_fault_{kind}"] = count
    for source, count in stats.source_drafted.items():  # which source drafted what
        extra[f"drafted_by_{source}"] = count
        extra[f"accepted_by_{source}"] = stats.source_accepted.get(source, 0)
    if stats.grammar_ms > 0.0:  # the request had an output constraint
        extra.update(forced_drafted=stats.forced_drafted,
                     forced_accepted=stats.forced_accepted,
                     copy_drafted=stats.copy_drafted, copy_accepted=stats.copy_accepted,
                     grammar_cut=stats.grammar_cut, grammar_ms=stats.grammar_ms,
                     grammar_masks=stats.grammar_masks)
    return wire.SpeculationStats(
        proposer=proposer,
        emitted=stats.emitted,
        target_forwards=stats.decode_forwards,
        verify_calls=stats.verify_calls,
        drafted=stats.drafted,
        accepted=stats.accepted,
        accepted_per_position=list(stats.accepted_per_position),
        rollbacks_in_place=stats.session.rollbacks_in_place,
        checkpoints=stats.session.checkpoints,
        checkpoint_bytes=stats.session.checkpoint_bytes,
        restores=stats.session.restores,
        wall_ms=max(0.0, stats.wall_ms),
        prefill_ms=max(0.0, stats.session.prefill_ms),
        decode_ms=max(0.0, stats.decode_ms),
        verify_ms=max(0.0, stats.session.verify_ms),
        refusals=dict(stats.refusals),
        extra=extra,
    )


def done_message(
    request_id: str,
    finish: FinishReason,
    stats: GenerationStats,
    proposer: str | None,
    *,
    prompt_tokens: int,
    error_message: str | None = None,
    sampling: SamplingParams | None = None,
    model: str | None = None,
) -> wire.Done:
    """The final ``done`` frame of a generation; it reports the seed ``sampling`` drew
    with (none for greedy decoding, where no seed plays a part) and the model that
    served it."""
    return wire.Done(
        id=request_id,
        finish_reason=finish,
        usage=wire.Usage(prompt_tokens=prompt_tokens, completion_tokens=stats.emitted),
        speculation=speculation_stats(stats, proposer),
        error_message=error_message or None,
        seed=None if sampling is None or sampling.greedy else sampling.seed,
        model=model,
    )
