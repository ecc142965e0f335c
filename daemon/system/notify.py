"""systemd's notify protocol (``sd_notify``) with the standard library.

Why our own twenty lines instead of a binding: the protocol is one datagram of
``KEY=VALUE`` lines to the socket named by ``$NOTIFY_SOCKET``, and a C dependency would
have to be installed on every machine, also those that never run under systemd. Without
``$NOTIFY_SOCKET`` every call is a no-op, so the daemon calls it unconditionally.

Addresses: a path (``/run/systemd/notify``) or a Linux abstract socket written with a
leading ``@`` (the ``@`` stands for the NUL byte). ``vsock:`` addresses (VMs) are not
supported and make the notifier a no-op with a warning logged by the caller.

The watchdog: under ``WatchdogSec=`` systemd sets ``$WATCHDOG_USEC`` (and
``$WATCHDOG_PID``); :func:`watchdog_interval` returns half of it, the interval at which
``WATCHDOG=1`` must be sent so a single late ping does not kill a healthy daemon.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import Final

__all__ = ["Notifier", "monotonic_usec", "watchdog_interval"]

_ENV_SOCKET: Final = "NOTIFY_SOCKET"


class Notifier:
    """Sends notify messages to systemd (or nowhere when not started by it)."""

    def __init__(self, address: str | None = None) -> None:
        """``address`` defaults to ``$NOTIFY_SOCKET``; ``None``/empty means no-op."""
        address = os.environ.get(_ENV_SOCKET) if address is None else address
        self._sock: socket.socket | None = None
        #: Why the last send failed, or the address is unusable (None: no problem); for
        #: the caller's log.
        self.last_error: str | None = None
        self.address: str | bytes | None = None
        if address:
            try:
                self.address = _parse_address(address)
            except ValueError as exc:
                self.last_error = str(exc)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """Send one message, e.g. ``send(READY=1, STATUS="serving")``.

        Returns whether it was sent (False when disabled or the send failed; the reason
        is kept in :attr:`last_error`). Never raises: systemd being unreachable must not
        take the daemon down.
        """
        if self.address is None:
            return False
        payload = "\n".join(f"{k}={_clean(v)}" for k, v in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self.address)
        except OSError as exc:
            self.last_error = f"{exc.strerror or exc}"
            return False
        self.last_error = None
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def stopping(self, status: str = "stopping") -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def reloading(self) -> bool:
        """``RELOADING=1`` with ``MONOTONIC_USEC`` (required by ``Type=notify-reload``)."""
        return self.send(RELOADING=1, MONOTONIC_USEC=monotonic_usec(), STATUS="reloading")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, the clock systemd compares reload times on."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``$WATCHDOG_USEC``), or None when no
    watchdog is configured for this process (unset, zero, or meant for another pid)."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


def _parse_address(text: str) -> str | bytes:
    if text.startswith("@"):
        return b"\0" + text[1:].encode()
    if text.startswith("/"):
        return text
    raise ValueError(f"unsupported NOTIFY_SOCKET address {text!r} (expected a path or @name)")


def _clean(value: str | int) -> str:
    # One field per line: a newline inside a value would start a new (bogus) field.
    return str(value).replace("\n", " ")
