"""llama-server's stream routes: ``GET /v1/stream`` (replay and follow), ``DELETE
/v1/stream`` (the client's Stop) and ``POST /v1/streams/lookup`` (which of these
conversations have streams), over :mod:`.stream_sessions`. Each sees only the streams of
``owner`` (the peer asking); another's stream is answered as one that does not exist."""

from __future__ import annotations

import urllib.parse
from typing import Any

from meshd.daemon.frontends.http.json_body import json_object
from meshd.daemon.frontends.http.responder import Responder
from meshd.daemon.frontends.http.stream_sessions import (
    MAX_ID_LENGTH,
    MAX_SESSIONS,
    OffsetLost,
    StreamSessions,
)
from meshd.daemon.requests.api_errors import JSON, ApiError, json_bytes

__all__ = ["delete_stream", "follow_stream", "lookup_streams"]


def _conversation(query: str) -> str:
    values = urllib.parse.parse_qs(query).get("conv_id") or [""]
    if not values[0] or len(values[0]) > MAX_ID_LENGTH:
        raise ApiError(400, f"conv_id: a conversation id of 1 to {MAX_ID_LENGTH} characters "
                            "is required", param="conv_id")
    return values[0]


async def follow_stream(sessions: StreamSessions, owner: str, query: str,
                        out: Responder) -> None:
    """The stream's bytes from ``from`` (0 by default), then what follows until it ends."""
    session = sessions.get(owner, _conversation(query))
    if session is None:
        raise ApiError(404, "stream not found or expired", code="not_found")
    raw = (urllib.parse.parse_qs(query).get("from") or ["0"])[0]
    if not raw.isdigit():
        raise ApiError(400, f"from: must be a byte offset (got {raw[:32]!r})", param="from")
    offset = int(raw)
    try:
        data = session.read(offset)
    except OffsetLost:
        raise ApiError(400, "from: the stream's bytes before it were dropped; start again",
                       param="from") from None
    if not await out.start(200, "text/event-stream", [("Cache-Control", "no-cache")]):
        return
    while True:
        if data and not await out.write(data):
            return
        offset += len(data)
        if session.done and offset >= session.total:
            await out.end()
            return
        if offset >= session.total:
            await session.changed()
        try:
            data = session.read(offset)
        except OffsetLost:  # fell behind by more than the stream keeps: the reader ends
            await out.end()
            return


async def delete_stream(sessions: StreamSessions, owner: str, query: str,
                        out: Responder) -> None:
    """Stop the conversation's generation and forget its stream: 204, or 404 when
    ``owner`` has no stream of that id (another's is not touched)."""
    if not sessions.stop(owner, _conversation(query)):
        raise ApiError(404, "stream not found or expired", code="not_found")
    await out.send(204, b"", JSON)


async def lookup_streams(sessions: StreamSessions, owner: str, body: bytes,
                         out: Responder) -> None:
    """``owner``'s streams of the ``conversation_ids`` asked for (and their ``ID::MODEL``
    ones)."""
    asked: Any = json_object(body or b"{}").get("conversation_ids", [])
    if not isinstance(asked, list) or len(asked) > MAX_SESSIONS:
        raise ApiError(400, f"conversation_ids: must be an array of at most {MAX_SESSIONS} "
                            "ids", param="conversation_ids")
    ids = [c for c in asked if isinstance(c, str) and c]
    await out.send(200, json_bytes([
        {"conversation_id": s.conversation, "is_done": s.done, "total_bytes": s.total,
         "started_at": int(s.started_at),
         "completed_at": None if s.completed_at is None else int(s.completed_at)}
        for s in sessions.lookup(owner, ids)]), JSON)
