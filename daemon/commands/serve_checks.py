"""What ``meshd serve`` checks before it loads the model, shared with ``meshd config check``.

Why one function: ``config check`` must fail where ``serve`` would (a model file that does
not exist, a socket directory that cannot be used, a user in an allow-list who does not
exist, a proposer nobody installed), which parsing alone does not see. Each problem names
the configuration key it comes from, so the operator knows what to edit; ``serve`` logs it
as its event and exit code.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import attrs

from meshd.daemon.commands.checks import check_model_args
from meshd.daemon.config import options as opt
from meshd.daemon.config import settings as cfg
from meshd.daemon.config.server import ServerConfig
from meshd.daemon.frontends.http.tcp import HttpAddressError, check_http_address
from meshd.daemon.system.listener import ListenerError, preflight
from meshd.daemon.system.peercred import PeerPolicy
from meshd.native.default_model import default_model_path
from meshd.native.errors import NativeError

__all__ = ["Checked", "StartupProblem", "check_before_start"]


class StartupProblem(Exception):
    """A configuration ``serve`` cannot start with."""

    def __init__(self, key: str, message: str, *, event: str, exit_code: int) -> None:
        super().__init__(message)
        self.key = key
        """The configuration key at fault (``model.path``)."""
        self.message = message
        self.event = event
        """The event ``serve`` logs it as (``model_load_failed``)."""
        self.exit_code = exit_code
        """``serve``'s exit code for it: 1 socket, 2 usage, 3 model."""


@attrs.frozen
class Checked:
    """What the checks resolved, for ``serve`` to start with."""

    proposer: str
    server_config: ServerConfig


def default_proposer(loaded: cfg.Loaded) -> str:
    """``[speculation] proposer``, checked: a known name (an out-of-process plugin's
    from the file), and a ``draft:PATH`` among the draft models. Raises StartupProblem."""
    c = loaded.config
    try:
        remote = loaded.plugins.get(c.speculation.proposer)
        proposer = c.speculation.proposer if remote is not None and remote.out_of_process \
            else opt.proposer_name(c.speculation.proposer)  # out-of-process: from the file
    except argparse.ArgumentTypeError as exc:
        raise StartupProblem("speculation.proposer", f"speculation.proposer: {exc}",
                             event="bad_config", exit_code=2) from None
    if proposer.startswith("draft:") and \
            proposer.partition(":")[2] not in c.model.draft_models:
        message = (f"proposer {proposer} names a draft model that is not among the "
                   f"draft models; add --draft-model {proposer.partition(':')[2]}")
        raise StartupProblem("speculation.proposer", message, event="bad_usage", exit_code=2)
    return proposer


def check_before_start(loaded: cfg.Loaded, *, bind: str | None, http: str | None,
                       checking: bool = False) -> Checked:
    """Raise :class:`StartupProblem` for the first thing ``serve`` could not start with.

    ``bind``/``http``: the addresses serve would use (None: not known here, e.g. the
    socket systemd will pass). ``checking``: ``meshd config check``, not a start: the
    daemon may be running already, and root checks for the daemon's own user (see
    :func:`meshd.daemon.system.listener.preflight`)."""
    c = loaded.config
    drafts = list(c.model.draft_models)
    proposer = default_proposer(loaded)
    checks: list[tuple[str, Callable[[], object]]] = [
        ("model.path", lambda: _model(c.model.path)),
        ("model.draft_models", lambda: check_model_args(None, None, drafts)),
        ("speculation.proposer", lambda: check_model_args(None, proposer)),
    ]
    for key, check in checks:
        try:
            check()
        except NativeError as exc:
            raise StartupProblem(key, str(exc), event="model_load_failed",
                                 exit_code=3) from None
    if bind is not None:
        try:
            preflight(bind, other_user=checking and os.geteuid() == 0,
                      listening_ok=checking)
        except ListenerError as exc:
            raise StartupProblem("serve.socket", str(exc), event="listen_failed",
                                 exit_code=1) from None
    try:
        server_config = cfg.server_config(c)
    except ValueError as exc:  # a user or group that does not exist: say which list
        try:
            PeerPolicy.from_names(c.serve.allow_users, ())
            key = "serve.allow_groups"
        except ValueError:
            key = "serve.allow_users"
        raise StartupProblem(key, str(exc), event="bad_config", exit_code=2) from None
    if http is not None:
        try:
            check_http_address(http)
        except HttpAddressError as exc:  # malformed or not loopback: a usage error
            raise StartupProblem("serve.http", str(exc), event="bad_usage",
                                 exit_code=2) from None
        except ListenerError as exc:
            raise StartupProblem("serve.http", str(exc), event="listen_failed",
                                 exit_code=1) from None
    return Checked(proposer, server_config)


def _model(path: str | None) -> None:
    """The model file, or the embedded default's package when none is given."""
    if path:
        check_model_args(path)
    else:
        default_model_path()
