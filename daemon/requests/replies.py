"""The daemon's answers that are not generations: the welcome, a model's description,
health and statistics.

Why apart from the request lifecycle: these are read from counters and the models'
states only, never wait for a model, and are the same on every connection; each is a
function of what it reads, handed in by the service.
"""

from __future__ import annotations

import collections
import functools
import importlib.metadata

import attrs

from meshd.daemon.models.model_set import ModelSet, ModelState, ServedModel
from meshd.daemon.models.statistics import SchedulerStatistics
from meshd.protocol import (
    Health,
    HealthReply,
    HealthStatus,
    Hello,
    ModelInfo,
    ProposerStats,
    Stats,
    StatsReply,
    UnsupportedVersion,
    Welcome,
)
from meshd.protocol.versions import speaks, unsupported_message

__all__ = ["health", "model_info", "server_version", "statistics", "stats", "welcome"]


def server_version() -> str:
    """meshd's installed version (``0+unknown`` when run from an uninstalled tree)."""
    try:
        return importlib.metadata.version("meshd")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def model_info(models: ModelSet, served: ServedModel) -> ModelInfo:
    """What ``welcome`` and ``models`` say of a model: measured while it is loaded,
    remembered after, configured before its first load."""
    base = served.info or ModelInfo(name=served.name,
                                    n_ctx=served.plan.config.n_ctx_seq,
                                    size_bytes=served.plan.size_bytes or None)
    rt = served.runtime
    if rt is not None and served.state is ModelState.LOADED:  # (plugins come and go)
        base = attrs.evolve(base, proposers=tuple(rt.usable_proposers()))
    return attrs.evolve(base, loaded=served.state is ModelState.LOADED,
                        state=served.state.value, default=served is models.default,
                        keep_alive_s=models.keep_alive_of(served))


def welcome(hello: Hello, default: ModelInfo, max_frame_size: int) -> Welcome:
    """The handshake answer (``default``: the default model's description), in the
    hello's protocol version when the server speaks it (every version from the first to
    the current: an older client is answered as its version defines, which the protocol
    connection sees to from then on); raises UnsupportedVersion for any other."""
    if not speaks(hello.protocol_version):
        raise UnsupportedVersion(unsupported_message(hello.protocol_version),
                                 request_id=hello.id)
    capabilities = ["speculation", "tokenize", "models"]
    if default.has_chat_template:
        capabilities.insert(0, "chat")
    return Welcome(
        id=hello.id,
        protocol_version=hello.protocol_version,
        server_version=server_version(),
        model=default,
        capabilities=tuple(capabilities),
        proposers=default.proposers,
        max_frame_size=max_frame_size,
    )


def health(request: Health, models: ModelSet, *, draining: bool, uptime_s: float
           ) -> HealthReply:
    """Answered from counters only: never waits for a model."""
    loaded = [m for m in models.loaded() if m.runtime is not None]
    degraded = any(m.runtime.degraded for m in loaded if m.runtime is not None)
    return HealthReply(
        id=request.id,
        status=(HealthStatus.DRAINING if draining
                else HealthStatus.DEGRADED if degraded else HealthStatus.OK),
        uptime_s=uptime_s,
        active_requests=sum(m.scheduler.active for m in loaded if m.scheduler),
        queued_requests=sum(m.scheduler.queued for m in loaded if m.scheduler),
        models={m.name: m.state.value for m in models},
    )


def statistics(models: ModelSet) -> SchedulerStatistics:
    """Every model's figures together."""
    return functools.reduce(SchedulerStatistics.plus, (m.statistics() for m in models))


def stats(request: Stats, models: ModelSet, counters: collections.Counter[str], *,
          open_connections: int, uptime_s: float) -> StatsReply:
    """The ``stats`` reply: every model's figures, the service's ``counters`` and the
    plugins' counters added in."""
    st = statistics(models)
    out: dict[str, float] = {
        "requests_total": st.requests,
        "requests_completed": st.completed,
        "requests_cancelled": st.cancelled,
        "requests_failed": st.failed,
        "tokens_generated": st.tokens,
        "prompt_tokens": st.prompt_tokens,
        "forwards": st.forwards,
        "steps": st.steps,
        "active_requests": st.active,
        "queued_requests": st.queued,
        "idle_slots": st.runtime.idle_slots,
        "cached_sessions": st.runtime.cached_sessions,
        "connections_open": open_connections,
        # Every busy refusal is counted where its answer is sent (the connection),
        # the scheduler's queue-full ones included.
        "errors_busy": 0,
        "prefix_cache_tokens": st.runtime.prefix_cache_tokens,
        "checkpoint_bytes": st.runtime.checkpoint_bytes,
    }
    for reason, n in st.finish_reasons.items():
        out[f"finish_{reason}"] = n
    for name, snap in (("verify_seconds", st.verify_seconds),
                       ("decode_seconds", st.decode_seconds),
                       ("request_seconds", st.request_seconds),
                       ("step_host_seconds", st.step_host_seconds),
                       ("time_to_first_token_seconds", st.time_to_first_token_seconds),
                       ("inter_token_latency_seconds", st.inter_token_latency_seconds)):
        out[f"{name}_count"] = snap.count
        out[f"{name}_sum"] = snap.sum
    for key, value in sorted(counters.items()):
        out[key] = out.get(key, 0) + value
    for served in models.loaded():
        if served.runtime is not None:
            for key, value in served.runtime.plugin_counters().items():
                out[key] = out.get(key, 0) + value
    proposers = {
        name: ProposerStats(
            requests=tot.requests, drafted=tot.drafted, accepted=tot.accepted,
            accepted_per_position=tuple(tot.accepted_per_position),
        )
        for name, tot in st.proposers.items()
    }
    return StatsReply(id=request.id, uptime_s=uptime_s, counters=out, proposers=proposers)
