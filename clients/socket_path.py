"""Where the daemon's socket is: one definition for ``meshd serve``, which creates it,
and for every client, which looks for it.

Why a search order and not one default: a daemon run by a user listens under that
user's runtime directory, the systemd service under ``/run/meshd``; a client cannot know
which one runs, so it takes the first of them that exists (:func:`find_socket`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["SYSTEM_SOCKET_PATH", "default_socket_path", "find_socket", "socket_candidates"]

SYSTEM_SOCKET_PATH = "/run/meshd/meshd.sock"
"""The systemd service's socket (``RuntimeDirectory=meshd``). A module variable, not a
constant, so tests can stand a temporary directory in for ``/run``."""


def default_socket_path(environ: Mapping[str, str] | None = None) -> str:
    """Where ``meshd serve`` listens when nobody says: ``$RUNTIME_DIRECTORY/meshd.sock``
    under systemd (``RuntimeDirectory=meshd``, so ``/run/meshd/meshd.sock``), else
    ``$XDG_RUNTIME_DIR/meshd/meshd.sock``, else ``/run/meshd/meshd.sock`` for root and
    ``/tmp/meshd-$UID/meshd.sock`` for others."""
    env = os.environ if environ is None else environ
    service_dir = env.get("RUNTIME_DIRECTORY")
    if service_dir:  # a colon-separated list when the unit names several; ours is first
        return os.path.join(service_dir.split(":")[0], "meshd.sock")
    runtime_dir = env.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return os.path.join(runtime_dir, "meshd", "meshd.sock")
    if os.getuid() == 0:  # /tmp is private to a service with PrivateTmp=
        return SYSTEM_SOCKET_PATH
    return os.path.join("/tmp", f"meshd-{os.getuid()}", "meshd.sock")


def socket_candidates(environ: Mapping[str, str] | None = None) -> list[str]:
    """The paths a client tries when neither ``--socket`` nor ``$MESHD_SOCKET`` names
    one, in order: this user's default (:func:`default_socket_path`), then the systemd
    service's (:data:`SYSTEM_SOCKET_PATH`)."""
    paths = [default_socket_path(environ), SYSTEM_SOCKET_PATH]
    return list(dict.fromkeys(paths))


def find_socket(explicit: str | None = None,
                environ: Mapping[str, str] | None = None) -> str:
    """The socket a client talks to: ``explicit`` (``--socket``), else
    ``$MESHD_SOCKET``, else the first of :func:`socket_candidates` that exists, else the
    first of them (so that "no daemon at PATH" names the user's own default).

    A ``unix:`` prefix is dropped. A path given explicitly or by the environment is used
    whether it exists or not: the user chose it.
    """
    env = os.environ if environ is None else environ
    chosen = explicit or env.get("MESHD_SOCKET")
    if not chosen:
        candidates = socket_candidates(env)
        chosen = next((p for p in candidates if os.path.exists(p)), candidates[0])
    return chosen.removeprefix("unix:")
