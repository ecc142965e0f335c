"""Per-plugin configuration: the ``[speculation.plugins.NAME]`` tables.

Why one parser here: the same table enables and configures an in-process proposer
(its keys, minus the ones below, become the factory's options) and an out-of-process one
(``command`` spawns it, ``connect`` lets it connect to the daemon's socket), and the
daemon's rules for a plugin (deadline, fault limit, restart backoff, prompt-text
privacy) are read from it. Keys the daemon reads itself:

``enabled`` (default true), ``allow_prompt_text`` (default false: token ids only),
``command`` (argv list: spawn this plugin over a socketpair), ``connect`` (accept a
plugin of this name connecting to the daemon's socket), ``deadline_ms`` (default 50),
``max_faults`` (faults before quarantine, default 3), ``restart_backoff_s`` (first
quarantine/restart delay, doubled each time up to ``restart_backoff_max_s``), ``uid`` and
``gid`` (a user/group id or name: pin a connecting plugin to it, checked on the
connection's SO_PEERCRED; only a pinned connecting plugin may see the prompt's text).
Every other key is an option for the plugin itself.
"""

from __future__ import annotations

import grp
import pwd
from collections.abc import Mapping
from typing import Any

import attrs

#: Keys the daemon interprets; the rest of a table goes to the plugin as options.
HOST_KEYS = frozenset({
    "enabled", "allow_prompt_text", "command", "connect", "deadline_ms", "max_faults",
    "restart_backoff_s", "restart_backoff_max_s", "uid", "gid",
})


class PluginConfigError(ValueError):
    """A ``[speculation.plugins.NAME]`` table is malformed (message names the key)."""


@attrs.frozen
class PluginConfig:
    """One plugin's table, checked."""

    name: str
    enabled: bool = True
    allow_prompt_text: bool = False
    command: tuple[str, ...] | None = None
    connect: bool = False
    deadline_ms: float = 50.0
    max_faults: int = 3
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    #: A connecting plugin must run as this user / in this group (None: anyone).
    uid: int | None = None
    gid: int | None = None
    options: Mapping[str, object] = attrs.field(factory=dict)

    @property
    def out_of_process(self) -> bool:
        return self.command is not None or self.connect

    @property
    def pinned(self) -> bool:
        """Whether a connecting plugin is pinned to a uid and/or gid."""
        return self.uid is not None or self.gid is not None


def _get(table: Mapping[str, Any], name: str, key: str, kind: type | tuple[type, ...],
         default: Any) -> Any:
    value = table.get(key, default)
    if value is default:
        return value
    if isinstance(value, bool) and kind is not bool:
        raise PluginConfigError(f"speculation.plugins.{name}.{key}: expected a number")
    if not isinstance(value, kind):
        raise PluginConfigError(
            f"speculation.plugins.{name}.{key}: expected {getattr(kind, '__name__', kind)}, "
            f"got {type(value).__name__}")
    return value


def _id(table: Mapping[str, Any], name: str, key: str) -> int | None:
    """A ``uid``/``gid`` key: a non-negative id or a user/group name, resolved now so
    that ``meshd config check`` catches a name that does not exist."""
    value = table.get(key)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if not isinstance(value, str) or not value:
        raise PluginConfigError(
            f"speculation.plugins.{name}.{key}: expected a non-negative id or a name")
    if value.isdigit():
        return int(value)
    try:
        return pwd.getpwnam(value).pw_uid if key == "uid" else grp.getgrnam(value).gr_gid
    except KeyError:
        kind = "user" if key == "uid" else "group"
        raise PluginConfigError(
            f"speculation.plugins.{name}.{key}: no such {kind} {value!r}") from None


def parse_table(name: str, table: Mapping[str, Any]) -> PluginConfig:
    """Check one table; raises :class:`PluginConfigError` naming the bad key."""
    if not isinstance(table, Mapping):
        raise PluginConfigError(f"speculation.plugins.{name}: expected a table")
    command = table.get("command")
    if command is not None:
        if (isinstance(command, str) or not isinstance(command, list) or not command
                or not all(isinstance(a, str) for a in command)):
            raise PluginConfigError(
                f"speculation.plugins.{name}.command: expected a non-empty list of strings")
        command = tuple(command)
    deadline = float(_get(table, name, "deadline_ms", (int, float), 50.0))
    max_faults = int(_get(table, name, "max_faults", int, 3))
    backoff = float(_get(table, name, "restart_backoff_s", (int, float), 0.5))
    backoff_max = float(_get(table, name, "restart_backoff_max_s", (int, float), 30.0))
    if deadline <= 0 or max_faults < 1 or backoff < 0 or backoff_max < backoff:
        raise PluginConfigError(
            f"speculation.plugins.{name}: deadline_ms must be > 0, max_faults >= 1, "
            "0 <= restart_backoff_s <= restart_backoff_max_s")
    connect = bool(_get(table, name, "connect", bool, False))
    uid, gid = _id(table, name, "uid"), _id(table, name, "gid")
    if (uid is not None or gid is not None) and not connect:
        raise PluginConfigError(
            f"speculation.plugins.{name}: uid and gid pin a connecting plugin; "
            "they need connect = true")
    return PluginConfig(
        name=name,
        enabled=bool(_get(table, name, "enabled", bool, True)),
        allow_prompt_text=bool(_get(table, name, "allow_prompt_text", bool, False)),
        command=command,
        connect=connect,
        deadline_ms=deadline, max_faults=max_faults,
        restart_backoff_s=backoff, restart_backoff_max_s=backoff_max,
        uid=uid, gid=gid,
        options={k: v for k, v in table.items() if k not in HOST_KEYS},
    )


def parse_plugin_tables(document: Mapping[str, Any]) -> dict[str, PluginConfig]:
    """The ``speculation.plugins`` tables of a whole config document, by name."""
    speculation = document.get("speculation", {})
    if not isinstance(speculation, Mapping):
        raise PluginConfigError("speculation: expected a table")
    plugins = speculation.get("plugins", {})
    if not isinstance(plugins, Mapping):
        raise PluginConfigError("speculation.plugins: expected a table of tables")
    return {name: parse_table(name, table) for name, table in plugins.items()}
