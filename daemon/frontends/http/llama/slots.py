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

from meshd.daemon.frontends.http.completions import served_name
from meshd.daemon.frontends.http.responder import Responder, RouteContext
from meshd.daemon.requests.api_errors import JSON, ApiError, json_bytes
from meshd.daemon.requests.slots import Slots, model_slots

__all__ = ["slots", "slots_view"]


def slots_view(slots: Slots) -> list[dict[str, Any]]:
    """One entry per slot (a sequence of the shared context), in llama-server's shape
    (``next_token`` as it reports an idle slot: ``n_remain`` -1, ``n_decoded`` 0)."""
    return [{
        "id": slot.id,
        "n_ctx": slots.n_ctx,
        "speculative": slots.speculative,
        "is_processing": slot.processing,
        "next_token": [{
            "has_next_token": slot.has_next_token,
            "has_new_line": False,
            "n_remain": slot.n_remain,
            "n_decoded": slot.n_decoded,
        }],
    } for slot in slots.slots]


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
    now = model_slots(service.models.get(served_name(service, asked[0] if asked else None)))
    if params.get("fail_on_no_slot") and now.all_busy:
        raise ApiError(503, "no slot available", code="unavailable", kind="unavailable_error")
    await out.send(200, json_bytes(slots_view(now)), JSON)
