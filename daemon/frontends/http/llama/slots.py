"""llama-server's ``GET /slots``: each slot of a model's shared context, busy or idle.

Why: llama.cpp's dashboards and clients poll it (is a slot processing, how far along is
its generation; ``?fail_on_no_slot=1`` answers 503 when every slot is busy, a cheap
readiness probe). It shows no prompt text, generated text or sampling parameters (what
llama-server adds there): another user's request is nobody else's business. Turned off
with ``--no-slots-endpoint`` (501, as llama-server's ``--no-slots``).
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from meshd.daemon.engine.generation import Generation
from meshd.daemon.frontends.http.completions import served_name
from meshd.daemon.frontends.http.responder import Responder, RouteContext
from meshd.daemon.requests.api_errors import JSON, ApiError, json_bytes

__all__ = ["slots", "slots_view"]


def slots_view(n_slots: int, n_ctx: int, running: list[Generation],
               speculative: bool) -> list[dict[str, Any]]:
    """One entry per slot (a sequence of the shared context), in llama-server's shape
    (``next_token`` as it reports an idle slot: ``n_remain`` -1, ``n_decoded`` 0)."""
    busy = {gen.session.seq_id: gen for gen in running}
    out: list[dict[str, Any]] = []
    for slot in range(n_slots):
        gen = busy.get(slot)
        decoded = len(gen.committed) if gen is not None else 0
        out.append({
            "id": slot,
            "n_ctx": n_ctx,
            "speculative": speculative,
            "is_processing": gen is not None,
            "next_token": [{
                "has_next_token": gen is not None and not gen.done,
                "has_new_line": False,
                "n_remain": gen.max_tokens - decoded if gen is not None else -1,
                "n_decoded": decoded,
            }],
        })
    return out


async def slots(routes: RouteContext, _body: bytes, out: Responder, *, query: str) -> None:
    """The default model's slots (``?model=NAME`` for another); a model not loaded has
    every slot idle."""
    service = routes.service
    if not service.config.http.slots_endpoint:
        raise ApiError(501, "this server does not serve /slots; start it without "
                            "--no-slots-endpoint", code="not_supported",
                       kind="not_supported_error")
    params = urllib.parse.parse_qs(query)
    asked = params.get("model")
    served = service.models.get(served_name(service, asked[0] if asked else None))
    rt, scheduler = served.runtime, served.scheduler
    if rt is not None and scheduler is not None:
        config = rt.context.config
        n_slots, n_ctx, running = config.n_seq_max, config.n_ctx_seq, scheduler.running()
    else:
        plan = served.plan.config
        n_slots, n_ctx, running = plan.n_seq_max, plan.n_ctx_seq, []
    speculative = (served.plan.config.default_proposer != "off"
                   and served.plan.config.draft_max > 0)
    if params.get("fail_on_no_slot") and len(running) >= n_slots:
        raise ApiError(503, "no slot available", code="unavailable", kind="unavailable_error")
    await out.send(200, json_bytes(slots_view(n_slots, n_ctx, running, speculative)), JSON)
