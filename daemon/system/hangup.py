"""Telling a client that half-closed its connection from one that went away.

Why: a client may send its requests and then shut its sending side
(``shutdown(SHUT_WR)``: ``nc -N``, scripts that pipe a request in) while it waits for
the answers, so end of stream alone does not mean the client is gone. A peer that
closed the connection entirely shows as a hang-up (``POLLHUP``): on a Unix socket at
once, on TCP once a write of ours has been answered with a reset (TCP cannot tell the
two apart before that). A socket that cannot be polled counts as hung up: there,
end of stream means gone.
"""

from __future__ import annotations

import select
import socket
from typing import Final

import anyio

__all__ = ["hung_up", "wait_hangup"]

POLL_INTERVAL_S: Final = 0.1
"""How often a half-closed connection is checked while its requests run."""


def hung_up(sock: socket.socket | None) -> bool:
    """Whether the peer has closed the connection entirely (not only its sending side)."""
    if sock is None or sock.fileno() < 0:
        return True
    poller = select.poll()
    poller.register(sock, select.POLLHUP)  # POLLHUP and POLLERR are always reported
    return any(events & (select.POLLHUP | select.POLLERR | select.POLLNVAL)
               for _, events in poller.poll(0))


async def wait_hangup(sock: socket.socket | None) -> None:
    """Return once :func:`hung_up` says the peer is gone (cancel to stop waiting)."""
    while not hung_up(sock):
        await anyio.sleep(POLL_INTERVAL_S)
