"""Prometheus metrics (``GET /metrics``), read from the daemon's own statistics.

Why a collector and not prometheus_client's Counter objects: the scheduler's statistics
(``Scheduler.statistics()``, a frozen snapshot) and the service's error counters are the
one source of truth that the ``stats`` op also reads; a collector turns them into metric
families at scrape time, so the two can never disagree and nothing is counted twice.
Names follow vLLM's ``spec_decode_*`` counters with the ``meshd_`` prefix; label
``model`` on every figure of a model (a model's counters outlive its unloads, so they
never go backwards), ``proposer`` where it applies; ``meshd_model_state`` says which
models are loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from meshd.daemon.models.histogram import HistogramSnapshot
from meshd.daemon.models.model_set import ModelState
from meshd.daemon.models.statistics import SchedulerStatistics
from meshd.protocol import Stats

if TYPE_CHECKING:
    from meshd.daemon.requests.service import Service

__all__ = ["CONTENT_TYPE", "DaemonCollector", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition format."""

_ERROR_PREFIX = "errors_"
_PLUGIN_PREFIX, _FAULTS = "plugin.", ".faults."


class DaemonCollector(Collector):
    """Metric families for one daemon's ``Service`` (its scheduler, runtime, counters)."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        models = [(m.name, m.statistics()) for m in svc.models]
        state = GaugeMetricFamily(
            "meshd_model_state", "Each configured model's state (1 for the current one).",
            labels=["model", "state"])
        for served in svc.models:
            for each in ModelState:
                state.add_metric([served.name, each.value], float(served.state is each))
        yield state
        yield from _speculation(models)
        for name, doc, figure in _COUNTERS:
            counted = CounterMetricFamily(name, doc, labels=["model"])
            for model, st in models:
                counted.add_metric([model], figure(st))
            yield counted
        finished = CounterMetricFamily(
            "meshd_requests", "Requests that ended, by finish reason.",
            labels=["model", "finish_reason"])
        for model, st in models:
            for reason, n in sorted(st.finish_reasons.items()):
                finished.add_metric([model, reason], n)
        yield finished
        errors = CounterMetricFamily(
            "meshd_protocol_errors", "Requests refused with an error, by error code.",
            labels=["code"])
        # Error counts exactly as the ``stats`` op reports them.
        counters = svc.stats(Stats(id="metrics")).counters
        codes = {k.removeprefix(_ERROR_PREFIX): v for k, v in counters.items()
                 if k.startswith(_ERROR_PREFIX)}
        for code, count in sorted(codes.items()):
            errors.add_metric([code], count)
        yield errors
        yield from _plugin_faults(counters)
        for name, doc, snapshot in _HISTOGRAMS:
            histogram = HistogramMetricFamily(name, doc, labels=["model"])
            for model, st in models:
                snap = snapshot(st)
                histogram.add_metric([model], [(_bound(le), n) for le, n in snap.buckets],
                                     sum_value=snap.sum)
            yield histogram
        for name, doc, figure in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=["model"])
            for model, st in models:
                gauge.add_metric([model], figure(st))
            yield gauge


_Figure = Callable[[SchedulerStatistics], float]
_COUNTERS: Final[tuple[tuple[str, str, _Figure], ...]] = (
    ("meshd_target_forwards", "Forwards of the target model (prefill and decode).",
     lambda st: st.forwards),
    ("meshd_generation_tokens", "Tokens generated.", lambda st: st.tokens),
    ("meshd_prompt_tokens", "Prompt tokens of admitted requests (prefix-cache hits "
     "included).", lambda st: st.prompt_tokens),
)
_GAUGES: Final[tuple[tuple[str, str, _Figure], ...]] = (
    ("meshd_requests_active", "Requests decoding now.", lambda st: st.active),
    ("meshd_requests_queued", "Requests waiting for a slot.", lambda st: st.queued),
    ("meshd_prefix_cache_tokens", "Tokens held by the prefix cache.",
     lambda st: st.runtime.prefix_cache_tokens),
    ("meshd_checkpoint_bytes", "State checkpoints held by active sessions.",
     lambda st: st.runtime.checkpoint_bytes),
)


_HISTOGRAMS: Final[tuple[tuple[str, str, Callable[[SchedulerStatistics],
                                                  HistogramSnapshot]], ...]] = (
    ("meshd_verify_seconds", "One batched target forward over windows with drafts.",
     lambda st: st.verify_seconds),
    ("meshd_decode_seconds", "One batched plain decode forward (one row per sequence).",
     lambda st: st.decode_seconds),
    ("meshd_request_seconds", "From a request's submission to its end, queue wait included.",
     lambda st: st.request_seconds),
    ("meshd_step_host_seconds", "One decode step's time on the compute thread outside its "
     "forwards (the host gap between forwards).", lambda st: st.step_host_seconds),
    ("meshd_time_to_first_token_seconds", "From a request's submission to its first token.",
     lambda st: st.time_to_first_token_seconds),
    ("meshd_inter_token_latency_seconds", "Between tokens handed to a request's caller.",
     lambda st: st.inter_token_latency_seconds),
)


def _speculation(models: list[tuple[str, SchedulerStatistics]]) -> Iterator[Metric]:
    drafts = CounterMetricFamily(
        "meshd_spec_decode_num_drafts", "Verify windows that carried a draft.",
        labels=["model", "proposer"])
    draft_tokens = CounterMetricFamily(
        "meshd_spec_decode_num_draft_tokens", "Drafted tokens verified.",
        labels=["model", "proposer"])
    accepted = CounterMetricFamily(
        "meshd_spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
        labels=["model", "proposer"])
    per_pos = CounterMetricFamily(
        "meshd_spec_decode_num_accepted_tokens_per_pos",
        "Drafted tokens accepted at each draft position (0 is the first).",
        labels=["model", "proposer", "position"])
    for model, st in models:
        for name, tot in sorted(st.proposers.items()):
            drafts.add_metric([model, name], tot.drafts)
            draft_tokens.add_metric([model, name], tot.drafted)
            accepted.add_metric([model, name], tot.accepted)
            for pos, n in enumerate(tot.accepted_per_position):
                per_pos.add_metric([model, name, str(pos)], n)
    yield from (drafts, draft_tokens, accepted, per_pos)


def _plugin_faults(counters: Mapping[str, float]) -> Iterator[Metric]:
    """``plugin.NAME.faults.KIND`` of the ``stats`` op (out-of-process plugins and
    isolated in-process ones alike) as one family."""
    faults = CounterMetricFamily(
        "meshd_plugin_faults", "Proposer plugin faults (late, plugin_error, garbage, ...), "
        "by plugin and kind.", labels=["plugin", "kind"])
    for key, n in sorted(counters.items()):
        name, sep, kind = key.removeprefix(_PLUGIN_PREFIX).rpartition(_FAULTS)
        if key.startswith(_PLUGIN_PREFIX) and sep:
            faults.add_metric([name, kind], n)
    yield faults


def _bound(le: float) -> str:
    return "+Inf" if le == float("inf") else repr(le)


def render_metrics(service: Service) -> bytes:
    """The Prometheus text exposition of ``service``'s statistics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(service))
    return generate_latest(registry)
