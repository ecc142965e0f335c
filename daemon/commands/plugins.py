"""``meshd plugins list``: every proposer this installation can use, and why not.

Why a command: a plugin that fails to import, claims a taken name or is disabled in the
config must be visible without starting a daemon and reading its log. It lists what the
``meshd.proposers`` entry points provide (where each comes from, whether it loaded and the
error if not, its declared resources and capabilities) and the plugins configured in the
daemon's configuration file (``[speculation.plugins.NAME]``); nothing is started.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from meshd.daemon.config.settings import DEFAULT_CONFIG_PATH, ConfigError, load
from meshd.plugins.config import PluginConfig
from meshd.plugins.registry import Registry, default_registry

__all__ = ["add_parser", "describe", "run"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plugins", help="proposer plugins: list what is installed/configured")
    action = p.add_subparsers(dest="plugins_command", required=True)
    ls = action.add_parser("list", help="every discovered proposer and configured plugin")
    ls.add_argument("-C", "--config", metavar="FILE", default=None,
                    help=f"the daemon's TOML configuration file (default: "
                         f"{DEFAULT_CONFIG_PATH} if it exists)")
    ls.add_argument("--json", action="store_true", help="print one JSON array")


def describe(registry: Registry, configs: dict[str, PluginConfig]) -> list[dict[str, Any]]:
    """One record per proposer: name, origin, loaded, error, enabled, needs, capabilities."""
    rows: list[dict[str, Any]] = []
    for entry in registry.entries():
        config = configs.get(entry.name)
        caps = entry.capabilities
        rows.append({
            "name": entry.name, "origin": entry.origin, "loaded": entry.loaded,
            "error": entry.error, "enabled": config.enabled if config else True,
            "needs": sorted(n.value for n in entry.needs),
            "capabilities": None if caps is None else {
                "max_len": caps.max_len, "needs_mtp_head": caps.needs_mtp_head,
                "decides_length": caps.decides_length},
        })
    for name, config in sorted(configs.items()):
        if not config.out_of_process or name in registry:
            continue
        how = []
        if config.command is not None:
            how.append("spawned: " + " ".join(config.command))
        if config.connect:
            how.append("connects to the daemon's socket")
        rows.append({
            "name": name, "origin": "out-of-process (" + "; ".join(how) + ")",
            "loaded": None, "error": None, "enabled": config.enabled,
            # An unpinned connecting plugin never gets the text (plugins/README.md).
            "needs": ["prompt_text"] if config.allow_prompt_text and (
                config.command is not None or config.pinned) else [],
            "capabilities": None,
        })
    return sorted(rows, key=lambda r: r["name"])


def run(args: argparse.Namespace) -> int:
    try:
        configs = load(args.config, environ={}).plugins
    except ConfigError as exc:
        print(f"meshd plugins: {exc}", file=sys.stderr)
        return 2
    rows = describe(default_registry(), configs)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        if row["loaded"] is False:
            state = f"FAILED: {row['error']}"
        elif not row["enabled"]:
            state = "disabled"
        elif row["loaded"] is None:
            state = "configured"
        else:
            state = "ok"
        print(f"{row['name']:<16} {state}")
        print(f"  from: {row['origin']}")
        if row["needs"]:
            print(f"  needs: {', '.join(row['needs'])}")
        if row["capabilities"]:
            caps = ", ".join(f"{k}={v}" for k, v in row["capabilities"].items())
            print(f"  capabilities: {caps}")
    return 0
