"""The configuration as TOML text: the effective one (``meshd config check``) and the
example file (``meshd config example``), both from the key declarations in :mod:`.config`.

Why the example is generated: a hand-written example drifts from the defaults. Every
key, its default, its help and whether SIGHUP applies it come from one declaration, and a
test checks that the checked-in file is ``meshd config example``'s output; the only values
that differ from the defaults are the service's own (:data:`SERVICE_SETTINGS`).
Regenerate after adding or changing a key: ``meshd config example > systemd/meshd.toml``.
"""

from __future__ import annotations

import textwrap
from typing import Any, Final

import attrs

from .config import SECTIONS, Loaded
from .model_specs import ModelSpec

__all__ = ["SERVICE_SETTINGS", "render", "render_example", "render_models", "toml_value"]

SERVICE_SETTINGS: Final[dict[str, tuple[Any, str]]] = {
    "serve.allow_groups": (("meshd",), "the service lets the group meshd in "
                                       "(meshd.socket's SocketGroup=)"),
}
"""``section.key`` -> (value, why): where the systemd service differs from the defaults."""

_HEADER: Final = """\
# /etc/meshd/meshd.toml: meshd serve's configuration (read when it exists; --config FILE
# reads another). Written by `meshd config example` from the daemon's key declarations:
# every key is listed with its default, unset ones commented out with an example.
# Every key can also be set with an environment variable MESHD_<SECTION>_<KEY>
# (e.g. MESHD_SERVE_MAX_QUEUE=32) or a flag (--max-queue 32);
# precedence: flag > environment > this file > built-in default.
# `meshd config check` prints the effective values and where each came from, and checks
# what meshd serve would check (model file, socket directory, users and groups).
# `systemctl reload meshd` (SIGHUP) applies the keys marked "live"; the others need
# `systemctl restart meshd`.
"""

_PLUGINS: Final = """\
# Proposer plugins, one table each (plugins/README.md); the table's name is the plugin's
# name. The keys below are the daemon's, any other key is an option for the plugin.
# Read at start.
# [speculation.plugins.snippets]    # in-process (the meshd-snippets package)
# files = ["/srv/code"]
# [speculation.plugins.mine]        # out-of-process, spawned over a socketpair; the
#                                   # interpreter of meshd's venv sees its packages
# command = ["/opt/meshd/.venv/bin/python", "-m", "my_plugin"]
# deadline_ms = 50                  # answer within this or the step goes on without it
# max_faults = 3                    # faults before quarantine (restart after a backoff)
# allow_prompt_text = false         # token ids only
"""

_MODELS: Final = """\
# Several models (docs/configuration.md): one table each, named as requests name the
# model; a key not set in it is [model]'s, and path is required. Besides [model]'s keys:
# proposer (default: [speculation] proposer) and keep_alive (default: [serve]
# keep_alive). The first table is the default model unless [serve] default_model names
# another; meshd serve -m NAME=PATH models come first and replace a table of their name.
# Read at start.
# [models.chat]
# path = "/srv/models/chat.gguf"
# ctx = 8192
# keep_alive = -1                   # never unloaded
# [models.code]
# path = "/srv/models/code.gguf"
# proposer = "ngram"
# keep_alive = "30m"
"""

_WIDTH: Final = 88


def render_example() -> str:
    """The example file's text (``systemd/meshd.toml``)."""
    parts = [_HEADER]
    for section, cls in SECTIONS.items():
        parts.append(f"\n[{section}]")
        parts.extend(_key(section, field) for field in attrs.fields(cls))
        if section == "speculation":
            parts.append("\n" + _PLUGINS)
        if section == "model":
            parts.append("\n" + _MODELS)
    return "".join(parts)


def _key(section: str, field: attrs.Attribute[Any]) -> str:
    """One key: its help as a comment, then ``key = value`` (commented out if unset)."""
    meta = field.metadata
    text = meta["help"]
    options = getattr(field.validator, "options", None)
    if options is not None and " | " not in text:
        text += ": " + " | ".join(str(o) for o in options)
    if meta.get("live"):
        text = "live: " + text
    dotted = f"{section}.{field.name}"
    if dotted in SERVICE_SETTINGS:
        value, why = SERVICE_SETTINGS[dotted]
        text += f"; {why} (the default is {toml_value(field.default)})"
        line = f"{field.name} = {toml_value(value)}"
    elif field.default is None:
        example = meta.get("example")
        shown = "(unset)" if example is None else toml_value(example)
        line = f"# {field.name} = {shown}"
    else:
        line = f"{field.name} = {toml_value(field.default)}"
    comment = textwrap.wrap(text, _WIDTH - 2, break_on_hyphens=False)
    return "\n" + "".join(f"# {c}\n" for c in comment) + line + "\n"


def render(loaded: Loaded) -> str:
    """The effective configuration as TOML, each key commented with its source."""
    lines = [f"# meshd configuration (file: {loaded.path or 'none'}); precedence: "
             "flag > MESHD_<SECTION>_<KEY> > file > default", ""]
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        body = getattr(loaded.config, section)
        for f in attrs.fields(cls):
            value = getattr(body, f.name)
            source = loaded.sources[f"{section}.{f.name}"]
            live = "" if f.metadata.get("live") else ", restart to change"
            text = f"{f.name} = {toml_value(value)}" if value is not None \
                else f"# {f.name} = (unset)"
            lines.append(f"{text:<48} # {source}{live}")
        lines.append("")
    for name, plugin in sorted(loaded.plugins.items()):
        lines.append(f"[speculation.plugins.{name}]                   # {loaded.path}, "
                     "restart to change")
        table = {"enabled": plugin.enabled, "allow_prompt_text": plugin.allow_prompt_text,
                 "command": plugin.command, "connect": plugin.connect,
                 "deadline_ms": plugin.deadline_ms, "max_faults": plugin.max_faults,
                 "restart_backoff_s": plugin.restart_backoff_s,
                 "restart_backoff_max_s": plugin.restart_backoff_max_s,
                 "uid": plugin.uid, "gid": plugin.gid, **plugin.options}
        lines.extend(f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None)
        lines.append("")
    for name, own in loaded.models.items():
        lines.append(f"{'[models.' + name + ']':<48} # {loaded.path}, restart to change")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in own.items())
        lines.append("")
    return "\n".join(lines)


def render_models(specs: list[ModelSpec]) -> str:
    """The models ``serve`` would serve, default first, as comments (so that ``config
    check``'s output stays a configuration file)."""
    lines = ["# models served (requests that name none get the first):"]
    for spec in specs:
        path = spec.model.path or "the embedded default model"
        lines.append(f"#   {spec.name} = {path}  ({spec.source})")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """``value`` as TOML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in value.items()) + "}"
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'

