"""Where the daemon's socket is when nobody says: one definition for ``meshd serve``,
which creates it, and for the clients, which look for it there."""

from __future__ import annotations

import os

__all__ = ["default_socket_path"]


def default_socket_path() -> str:
    """``$RUNTIME_DIRECTORY/meshd.sock`` under systemd (``RuntimeDirectory=meshd``, so
    ``/run/meshd/meshd.sock``), else ``$XDG_RUNTIME_DIR/meshd/meshd.sock``, else
    ``/run/meshd/meshd.sock`` for root and ``/tmp/meshd-$UID/meshd.sock`` for others."""
    service_dir = os.environ.get("RUNTIME_DIRECTORY")
    if service_dir:  # a colon-separated list when the unit names several; ours is first
        return os.path.join(service_dir.split(":")[0], "meshd.sock")
    runtime_dir = os.environ.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return os.path.join(runtime_dir, "meshd", "meshd.sock")
    if os.getuid() == 0:  # /tmp is private to a service with PrivateTmp=
        return "/run/meshd/meshd.sock"
    return os.path.join("/tmp", f"meshd-{os.getuid()}", "meshd.sock")
