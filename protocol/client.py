"""Clients for the meshd socket, under the names they have always had.

The async client lives in ``async_client.py`` (anyio; one reader task per connection,
driving a sans-I/O ``ClientConnection``), the blocking one in ``sync_client.py`` (the
async client on an event loop in a helper thread). This module gathers both, so
``from meshd.protocol.client import Client, SyncClient`` keeps working.
"""

from __future__ import annotations

from .async_client import DEFAULT_CLIENT_NAME, Client, Completion, GenerationStream, connect_unix
from .sync_client import SyncClient, SyncGenerationStream, connect_sync

__all__ = [
    "DEFAULT_CLIENT_NAME",
    "Client",
    "Completion",
    "GenerationStream",
    "SyncClient",
    "SyncGenerationStream",
    "connect_sync",
    "connect_unix",
]
