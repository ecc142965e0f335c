"""The daemon's configuration: one typed object from a TOML file, the environment and flags.

Why one object: ``meshd serve`` is configured in ``/etc/meshd/meshd.toml``, per host with
environment variables and per run with flags, and every setting must mean the same in
all three. Each key is declared once, below, as a field of its section with its default,
its help and whether it can change while serving; from that come the file key, the
environment variable (``MESHD_SERVE_MAX_QUEUE``), the flag, the type check, ``meshd
config check``'s listing and SIGHUP's live/restart split. Precedence: flag > environment
> file > default. Values are strictly typed, and a bad value or unknown key is an error
naming the key and its source. Proposer plugins' ``[speculation.plugins.NAME]`` tables
are checked by :mod:`meshd.plugins.config`, ``[models.NAME]`` ones by :mod:`.model_specs`.
Adding a key: add a :func:`key` field to its section, use it in :mod:`.serve`, and
regenerate ``systemd/meshd.toml`` with ``meshd config example`` (a test compares them).
"""

from __future__ import annotations

import argparse
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Final, Union

import attrs
from attrs import validators as v

from meshd.clients.argtypes import comma_list
from meshd.daemon.config import options as opt
from meshd.daemon.config.http import HttpConfig
from meshd.daemon.config.server import DEFAULT_SHUTDOWN_GRACE_S, ServerConfig
from meshd.daemon.config.values import (
    DURATION,
    are_model_names,
    converter,
    duration,
    first_error,
    model_name,
    size,
    split_model_arg,
)
from meshd.daemon.system.logs import DEFAULT_LLAMA_LOG_LEVEL, FORMATS, LEVELS, LLAMA_LEVELS
from meshd.daemon.system.peercred import PeerPolicy
from meshd.native.context import CACHE_TYPES_K, DEFAULT_DRAFT_MAX
from meshd.native.cpus import DEFAULT_THREAD_WAIT, THREAD_WAITS
from meshd.native.rpc import parse_endpoints
from meshd.plugins.config import PluginConfig, PluginConfigError, parse_plugin_tables
from meshd.plugins.history import BYTES_PER_TOKEN, DEFAULT_HISTORY_TOKENS

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "Config",
    "ConfigError",
    "Loaded",
    "ShownDefault",
    "add_config_flags",
    "explicit_flags",
    "live_changes",
    "load",
    "restart_needed",
    "server_config",
]

DEFAULT_CONFIG_PATH: Final = "/etc/meshd/meshd.toml"
"""Read when it exists and ``--config`` is not given."""

ENV_PREFIX: Final = "MESHD_"


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the key and its source."""


def key(default: Any, help: str, *, flag: str | None = None, live: bool = False,
        validator: Any = None, env: tuple[str, ...] = (), example: Any = None) -> Any:
    """One configuration key. ``flag``: the argparse dest of an existing option (None: a
    ``--SECTION-KEY`` flag is generated); ``live``: SIGHUP applies it while serving;
    ``env``: older variables for it (below ``MESHD_SECTION_KEY``); ``example``: what the
    example file shows for a key whose default is None."""
    metadata = {"help": help, "flag": flag, "live": live, "env": env, "example": example}
    return attrs.field(default=default, metadata=metadata, validator=validator)


_SERVER = attrs.fields(ServerConfig)
_positive = v.optional(v.ge(1))
_non_negative = v.ge(0)
_non_negative_float = v.ge(0.0)


def _endpoints(_inst: object, _attr: object, value: tuple[str, ...]) -> None:
    if value:
        parse_endpoints(",".join(value))  # ValueError naming the bad address


def _split_weights(_inst: object, _attr: object, value: tuple[float, ...]) -> None:
    if value and (any(w < 0 for w in value) or not any(value)):
        raise ValueError(f"weights must be >= 0 and not all 0 (got {list(value)})")


@attrs.frozen
class ModelSection:
    path: str | None = key(None, "GGUF model file (default: the embedded SmolLM2-135M); "
                           "under systemd not below /home, which ProtectHome=yes hides",
                           flag="model", live=True, example="/srv/models/model.gguf")
    ctx: int = key(opt.DEFAULT_CTX, "context length per session in tokens", flag="ctx", live=True,
                   validator=_positive)
    threads: int | None = key(None, "CPU threads for llama.cpp (default: the CPUs this "
                              "process may use)", flag="threads", live=True,
                              validator=_positive, example=2)
    thread_wait: str = key(DEFAULT_THREAD_WAIT, "how llama.cpp's threads wait between "
                           "operations: spin (a short while, then sleep: fastest where "
                           "meshd has its cores) | sleep (at once: for machines shared with "
                           "other busy processes)", flag="thread_wait",
                           validator=v.in_(THREAD_WAITS))
    cache_type_k: str = key("auto", "attention K cache type: auto (f16, the CPU's attention "
                            "kernel pinned so that speculation's text is plain decoding's; "
                            "bf16 on a runtime without meshd's patch) | f16 | bf16",
                            flag="cache_type_k", live=True, validator=v.in_(CACHE_TYPES_K))
    chat_template_file: str | None = key(None, "a Jinja chat template used instead of the "
                                         "model's own (as llama-server's "
                                         "--chat-template-file)", flag="chat_template_file",
                                         live=True, example="/srv/models/template.jinja")
    chat_template: str | None = key(None, "a chat template instead of the model's: one of "
                                    "llama.cpp's built-in formats by name (roles and text "
                                    "only) or Jinja source", flag="chat_template", live=True,
                                    example="chatml")
    reasoning: str = key("auto", "whether reasoning models think: auto | on (the chat "
                         "template gets enable_thinking true) | off (false, and an open "
                         "thinking block is closed)", flag="reasoning", live=True,
                         validator=v.in_(opt.REASONING_MODES))
    aliases: tuple[str, ...] = key((), "other names requests may give the model (OpenAI's "
                                   "model, generate.model); a [models.NAME] table has its "
                                   "own", flag="alias", live=True, validator=are_model_names)
    tags: tuple[str, ...] = key((), "labels /v1/models lists with the model (a table has its "
                                "own)", flag="tags", live=True)
    draft_models: tuple[str, ...] = key((), "GGUF files requests may name as draft:PATH",
                                  flag="draft_model", live=True)
    gpu_layers: int | None = key(None, "layers offloaded to the GPU and workers, -1 for all "
                                 "(default: all; a CPU-only build runs everything here)",
                                 flag="gpu_layers", live=True, validator=v.optional(v.ge(-1)),
                                 example=-1)
    rpc: tuple[str, ...] = key((), "remote workers (meshd worker, HOST:PORT) the model's "
                               "layers are split across (the RPC protocol has no "
                               "authentication: private networks only)", flag="rpc", live=True,
                               validator=_endpoints)
    tensor_split: tuple[float, ...] = key((), "weights of the layer split, one per device "
                                          "(each worker's, then local GPUs; default: by free "
                                          "memory)", flag="tensor_split", live=True,
                                          validator=_split_weights)


@attrs.frozen
class SpeculationSection:
    proposer: str = key(opt.DEFAULT_PROPOSER, "default proposer: off | auto | mtp | ngram | "
                        "composite | draft:PATH | a plugin", flag="proposer", live=True)
    draft_max: int = key(DEFAULT_DRAFT_MAX, "longest draft per step; 0 turns speculation off",
                         flag="draft_max", live=True, validator=_non_negative)
    fixed_k: bool = key(False, "always draft draft_max tokens (no cost model, no calibration)",
                        flag="fixed_k", live=True)
    rollback_snapshots: str = key("auto", "recurrent models' in-place rollback snapshots "
                                  "(they slow every forward): auto (kept while requests "
                                  "speculate) | always | never",
                                  live=True, validator=v.in_(("auto", "always", "never")))
    history_tokens: int = key(DEFAULT_HISTORY_TOKENS, "tokens of earlier answers kept per "
                              "model for history lookup to draft from (memory only, about "
                              f"{BYTES_PER_TOKEN} bytes a token at most, the oldest "
                              "evicted, never written to disk); 0 keeps none",
                              validator=_non_negative)
    history_shared: bool = key(False, "history lookup drafts from every peer's answers (by "
                               "default only from the same peer's: its uid on the Unix "
                               "socket, its API key over TCP)")
    history_prompts: bool = key(False, "history keeps each request's prompt with its answer "
                                "(by default the answer only)")


@attrs.frozen
class ServeSection:
    socket: str | None = key(None, "socket path, unix:PATH or fd://N (default: the "
                             "socket-activated one, else $RUNTIME_DIRECTORY/meshd.sock, "
                             "...); $MESHD_SOCKET is another name for $MESHD_SERVE_SOCKET",
                             flag="socket", env=("MESHD_SOCKET",),
                             example="/run/meshd/meshd.sock")
    http: str | None = key(None, "also serve HTTP on tcp:127.0.0.1:PORT or fd://N, or on "
                           "several separated by commas (under systemd: see "
                           "systemd/README.md for the sandbox changes)",
                           flag="http", example="tcp:127.0.0.1:8080")
    backend: str = key(opt.DEFAULT_BACKEND, "event loop: asyncio | trio", flag="backend",
                       validator=v.in_(("asyncio", "trio")))
    slots: int = key(opt.DEFAULT_SLOTS, "generations decoded together", flag="slots", live=True,
                     validator=_positive)
    max_queue: int = key(opt.DEFAULT_MAX_QUEUE, "requests waiting for a slot before new ones "
                         "are answered busy", flag="max_queue", live=True,
                         validator=_non_negative)
    stream_interval_ms: int = key(opt.DEFAULT_STREAM_INTERVAL_MS, "stream tokens in batches "
                                  "at most this far apart (0: each step's tokens as soon "
                                  "as they are committed)", flag="stream_interval_ms",
                                  live=True, validator=_non_negative)
    max_tokens: int | None = key(None, "max_tokens of a request that does not say (default: "
                                 "until the model stops or the context ends, as "
                                 "llama-server; set, it caps such requests)",
                                 flag="max_tokens", live=True, validator=_positive,
                                 example=1024)
    seed: int | None = key(None, "the seed of sampled requests that send none, so equal "
                           "requests give equal answers (default: a random one per "
                           "request, reported in its answer)", flag="seed", live=True,
                           validator=v.optional(v.and_(v.ge(0), v.lt(1 << 64))),
                           example="42")
    max_tokens_limit: int | None = key(None, "largest max_tokens accepted (default: the "
                                       "context length)", flag="max_tokens_limit", live=True,
                                       validator=_positive, example=4096)
    shutdown_grace: float = key(DEFAULT_SHUTDOWN_GRACE_S, "seconds running requests may "
                                "finish after SIGTERM", flag="shutdown_grace", live=True,
                                validator=_non_negative_float)
    allow_users: tuple[str, ...] = key((), "users (names or uids) allowed to connect; root and "
                                 "the daemon's own user always are", flag="allow_user",
                                 live=True)
    allow_groups: tuple[str, ...] = key((), "groups (names or gids) allowed to connect",
                                  flag="allow_group", live=True)
    max_connections: int = key(_SERVER.max_connections.default, "open connections at once; "
                               "one more is answered busy and closed", flag="max_connections",
                               live=True, validator=_positive)
    idle_timeout: float = key(_SERVER.idle_timeout_s.default, "seconds a connection with "
                              "nothing in flight may stay silent", flag="idle_timeout",
                              live=True, validator=v.gt(0.0))
    frame_timeout: float = key(_SERVER.frame_timeout_s.default, "seconds a frame that has "
                               "begun may take to end", flag="frame_timeout", live=True,
                               validator=v.gt(0.0))
    backlog: int | None = key(_SERVER.backlog.default, "listen backlog (default: the "
                              "system maximum)", flag="backlog", validator=_positive, example=4096)
    prefix_cache_tokens: int | None = key(None, "tokens of finished requests kept for "
                                          "prompts that share their start (default: every "
                                          "slot's context; 0: off)",
                                          flag="prefix_cache_tokens", live=True,
                                          validator=v.optional(_non_negative), example=0)
    keep_alive: Annotated[str, DURATION] = key(
        opt.DEFAULT_KEEP_ALIVE, "how long a model stays loaded after its last "
        "request: seconds, or 30s, 5m, 1h; 0 unloads it after each request, -1 keeps it (the "
        "file may give a number of seconds; a [models.NAME] table its own)",
        flag="keep_alive", live=True, validator=duration)
    max_loaded: int | None = key(None, "most models loaded at once (default: no limit)",
                                 flag="max_loaded", live=True, validator=_positive, example=2)
    memory_limit: str | None = key(None, "most bytes of model files loaded at once, e.g. 8G "
                                   "(K, M, G, T and KiB, MiB, GiB, TiB are powers of 1024; KB, "
                                   "MB, GB, TB of 1000; default: no limit)",
                                   flag="memory_limit", live=True, validator=size, example="8G")
    default_model: str | None = key(None, "the model of requests that name none, among the "
                                    "[models.NAME] tables and -m NAME=PATH models (default: "
                                    "the first -m, else the first table)",
                                    flag="default_model", live=True, validator=model_name,
                                    example="chat")


_HTTP = attrs.fields(HttpConfig)


@attrs.frozen
class HttpSection:
    max_header_bytes: int = key(_HTTP.max_header_bytes.default, "request line plus headers; "
                                "more is answered 431", live=True, validator=_positive)
    max_body_bytes: int = key(_HTTP.max_body_bytes.default, "larger bodies are answered 413",
                              live=True, validator=_positive)
    request_timeout_s: float = key(_HTTP.request_timeout_s.default, "seconds from a "
                                   "request's first byte to its last", live=True,
                                   validator=_non_negative_float)
    idle_timeout_s: float = key(_HTTP.idle_timeout_s.default, "seconds a connection may be "
                                "idle between requests", live=True,
                                validator=_non_negative_float)
    api_key: str | None = key(None, "Bearer key the TCP listener asks of every request but "
                              "/health (the Unix socket checks its peer instead)",
                              flag="api_key", live=True, example="a-long-random-string")
    cors_origins: tuple[str, ...] = key((), "web origins whose pages may read the HTTP "
                                        "answers (CORS; * for any, localhost for any "
                                        "loopback page)", flag="cors_origins",
                                        live=True)
    slots_endpoint: bool = key(True, "serve llama-server's GET /slots (each slot's state, "
                               "no prompt text)", flag="slots_endpoint", live=True)
    verbose_responses: bool = key(False, "non-streamed chat and completion answers carry "
                                  "llama-server's __verbose block (the prompt as the model "
                                  "read it: the chat template's output) unless a request "
                                  "says verbose: false", flag="verbose_responses", live=True)


@attrs.frozen
class LogSection:
    level: str = key(opt.DEFAULT_LOG_LEVEL, "least severe events logged", flag="log_level",
                     live=True, validator=v.in_(LEVELS))
    format: str = key("auto", "auto | json | console | journal", flag="log_format",
                      validator=v.in_(FORMATS))
    llama_level: str = key(DEFAULT_LLAMA_LOG_LEVEL, "least severe llama.cpp messages logged, "
                           "whatever level is: debug | info | warn | error | none",
                           flag="llama_log_level", live=True, validator=v.in_(LLAMA_LEVELS))


@attrs.frozen
class Config:
    """Everything ``meshd serve`` is configured with."""

    model: ModelSection = attrs.field(factory=ModelSection)
    speculation: SpeculationSection = attrs.field(factory=SpeculationSection)
    serve: ServeSection = attrs.field(factory=ServeSection)
    http: HttpSection = attrs.field(factory=HttpSection)
    log: LogSection = attrs.field(factory=LogSection)


SECTIONS: Final[dict[str, type[Any]]] = {
    f.name: typing.get_type_hints(Config)[f.name] for f in attrs.fields(Config)
}


def _keys() -> list[tuple[str, attrs.Attribute[Any], type[Any]]]:
    """Every (section, field, resolved type)."""
    out: list[tuple[str, attrs.Attribute[Any], type[Any]]] = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        out.extend((section, f, hints[f.name]) for f in attrs.fields(cls))
    return out


def _flag_dest(section: str, field: attrs.Attribute[Any]) -> str:
    return field.metadata.get("flag") or f"{section}_{field.name}"


# ---------------------------------------------------------------------- strict converter

def _structure(data: Mapping[str, Any]) -> Config:
    try:
        return converter.structure(dict(data), Config)
    except Exception as exc:  # cattrs groups errors; report the first, by key
        raise ConfigError(first_error(exc)) from None


# ---------------------------------------------------------------------- sources


@attrs.frozen
class Loaded:
    """The effective configuration and where each key's value came from."""

    config: Config
    sources: dict[str, str]
    """``section.key`` -> ``default``, the file's path, ``$MESHD_...`` or ``--flag``."""
    path: str | None
    """The file read (None: none)."""
    flags: dict[str, Any] = attrs.field(factory=dict)
    plugins: dict[str, PluginConfig] = attrs.field(factory=dict)
    """The file's ``[speculation.plugins.NAME]`` tables (see :mod:`meshd.plugins.config`)."""
    models: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    """The file's ``[models.NAME]`` tables as written, in file order; checked, with
    ``[model]`` under them, by :func:`meshd.daemon.config.model_specs.model_specs`."""
    command_line_models: tuple[str, ...] = ()
    """``serve``'s ``-m`` values (``PATH`` or ``NAME=PATH``) in order: ``flags["models"]``."""


def _read_file(path: str) -> tuple[dict[str, Any], dict[str, PluginConfig],
                                   dict[str, dict[str, Any]]]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such configuration file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    models = _model_tables(path, data)
    for section, body in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}] "
                              f"(known: {', '.join(SECTIONS)})")
        if not isinstance(body, dict):
            raise ConfigError(f"{path}: {section} must be a table ([{section}])")
    plugins = _plugin_tables(path, data)
    try:
        _structure(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return data, plugins, models


def _model_tables(path: str, data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Take the ``[models.NAME]`` tables out of ``data``: their keys are checked later,
    over ``[model]`` as the environment and flags leave it."""
    tables = data.pop("models", {})
    if not isinstance(tables, dict):
        raise ConfigError(f"{path}: models must be tables ([models.NAME])")
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: models.{name} must be a table ([models.{name}] "
                              "with the model's keys)")
    return tables


def _plugin_tables(path: str, data: dict[str, Any]) -> dict[str, PluginConfig]:
    """Take the ``[speculation.plugins.NAME]`` tables out of ``data``, checked: each is
    a plugin's own table (its keys are the plugin's), not keys of this module."""
    speculation = data.get("speculation")
    if not isinstance(speculation, dict) or "plugins" not in speculation:
        return {}
    tables = speculation.pop("plugins")
    try:
        return parse_plugin_tables({"speculation": {"plugins": tables}})
    except PluginConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _env_value(text: str, kind: Any) -> Any:
    """An environment string as a value of the key's type (TOML-like strictness)."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (Union, types.UnionType) and type(None) in args:
        if text == "":
            return None
        kind = next(a for a in args if a is not type(None))
    if typing.get_origin(kind) is tuple:
        parts = list(comma_list(text))
        item = typing.get_args(kind)[0]
        return [_env_value(part, item) for part in parts] if item in (int, float) else parts
    if kind is bool:
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if kind is int:
        try:
            return int(text, 10)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    return text


def _read_env(environ: Mapping[str, str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    known = {(s, f.name): t for s, f, t in _keys()}
    data: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}
    for name, text in sorted(environ.items()):
        section = next((s for s in SECTIONS if name.startswith(f"{ENV_PREFIX}{s.upper()}_")),
                       None)
        if section is None:
            continue
        field_name = name[len(ENV_PREFIX) + len(section) + 1:].lower()
        if (section, field_name) not in known:
            keys = ", ".join(f"{ENV_PREFIX}{section.upper()}_{n.upper()}"
                             for s, n in known if s == section)
            raise ConfigError(f"${name}: unknown key {section}.{field_name} (known: {keys})")
        data.setdefault(section, {})[field_name] = _env_checked(
            name, text, section, field_name, known[(section, field_name)])
        names[f"{section}.{field_name}"] = f"${name}"
    for section, f, kind in _keys():  # older names, where the canonical one is not set
        alias = next((a for a in f.metadata.get("env", ()) if a in environ), None)
        if alias is not None and f.name not in data.get(section, {}):
            data.setdefault(section, {})[f.name] = _env_checked(
                alias, environ[alias], section, f.name, kind)
            names[f"{section}.{f.name}"] = f"${alias}"
    return data, names


def _env_checked(name: str, text: str, section: str, field_name: str, kind: Any) -> Any:
    """The value of variable ``name`` for ``section.field_name``, type-checked."""
    try:
        value = _env_value(text, kind)
        _structure({section: {field_name: value}})
    except (ValueError, ConfigError) as exc:
        detail = str(exc).split(": ", 1)[-1]
        raise ConfigError(f"${name}: {section}.{field_name}: {detail}") from None
    return value


def load(path: str | None = None, *, environ: Mapping[str, str] | None = None,
         flags: Mapping[str, Any] | None = None,
         default_path: str | None = DEFAULT_CONFIG_PATH) -> Loaded:
    """The effective configuration: ``flags`` (argparse dests given on the command line)
    over ``environ`` (default ``os.environ``) over the file over the defaults.

    ``path`` None reads ``default_path`` if it exists. Raises ConfigError.
    """
    env = os.environ if environ is None else environ
    chosen = path if path is not None else (
        default_path if default_path and os.path.exists(default_path) else None)
    file_data, plugins, models = _read_file(chosen) if chosen is not None else ({}, {}, {})
    env_data, env_names = _read_env(env)
    flag_values = dict(flags or {})
    merged: dict[str, dict[str, Any]] = {s: dict(file_data.get(s, {})) for s in SECTIONS}
    sources: dict[str, str] = {}
    for section, f, _ in _keys():
        dotted = f"{section}.{f.name}"
        sources[dotted] = chosen if (chosen and f.name in file_data.get(section, {})) \
            else "default"
        if f.name in env_data.get(section, {}):
            merged[section][f.name] = env_data[section][f.name]
            sources[dotted] = env_names[dotted]
        dest = _flag_dest(section, f)
        if dest in flag_values:
            value = flag_values[dest]
            merged[section][f.name] = list(value) if isinstance(value, list | tuple) else value
            sources[dotted] = "--" + dest.replace("_", "-")
    return Loaded(_structure(merged), sources, chosen, flag_values, plugins, models,
                  tuple(flag_values.get("models", ())))


# ---------------------------------------------------------------------- flags


class ShownDefault:
    """A flag's default as argparse sees it: shown in ``--help`` like the value, but
    recognisable afterwards as "not given", so the file and environment can decide."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __eq__(self, other: object) -> bool:
        return bool(self.value == (other.value if isinstance(other, ShownDefault) else other))

    def __hash__(self) -> int:
        return hash(self.value)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``-C/--config``, a ``--SECTION-KEY`` flag for every key without a flag, and
    defaults that yield to the file and environment."""
    parser.add_argument("-C", "--config", metavar="FILE", default=None,
                        help=f"TOML configuration file (default: {DEFAULT_CONFIG_PATH} if "
                             "it exists); flags override MESHD_<SECTION>_<KEY> variables, "
                             "which override the file")
    dests = {a.dest for a in parser._actions}
    group = parser.add_argument_group("configuration keys without a shorter flag")
    for section, f, kind in _keys():
        dest = _flag_dest(section, f)
        if dest in dests:
            continue
        base = kind if kind in (int, float, str) else str
        group.add_argument("--" + dest.replace("_", "-"), dest=dest, type=base, default=None,
                           metavar=f.name.split("_")[-1].upper(),
                           help=f"{f.metadata['help']} (default: {f.default})")
    for action in parser._actions:
        if action.dest in {_flag_dest(s, f) for s, f, _ in _keys()} and \
                action.default not in (None, False, []) and \
                not isinstance(action.default, ShownDefault):
            action.default = ShownDefault(action.default)


def explicit_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The configuration flags given on the command line (argparse dest -> value).

    ``serve``'s repeatable ``-m`` (a list) comes back as ``models``, every value in order;
    one plain ``-m PATH`` is also ``model`` (``[model] path``), as before several models."""
    out: dict[str, Any] = {}
    models = getattr(args, "model", None)
    if isinstance(models, list) and models:
        out["models"] = list(models)
        if len(models) == 1 and split_model_arg(models[0])[0] is None:
            out["model"] = models[0]
    for section, f, _ in _keys():
        dest = _flag_dest(section, f)
        value = getattr(args, dest, None)
        if dest == "model" and isinstance(value, list):
            continue
        # A store_true flag left out reads False; a key whose default is True has an
        # on/off flag (default None), whose False was given.
        if value is None or (value is False and f.default is not True) or value == [] \
                or isinstance(value, ShownDefault):
            continue
        out[dest] = value
    return out


# ---------------------------------------------------------------------- use


def server_config(config: Config) -> ServerConfig:
    """The live part of the configuration as the server's settings (ValueError: an
    allow-list names a user or group that does not exist)."""
    s, h = config.serve, config.http
    return ServerConfig(
        max_tokens_default=s.max_tokens, max_tokens_limit=s.max_tokens_limit, seed=s.seed,
        max_queue=s.max_queue, stream_interval_s=s.stream_interval_ms / 1000,
        shutdown_grace_s=s.shutdown_grace,
        peers=PeerPolicy.from_names(s.allow_users, s.allow_groups),
        max_connections=s.max_connections, idle_timeout_s=s.idle_timeout,
        frame_timeout_s=s.frame_timeout, backlog=s.backlog,
        http=HttpConfig(max_header_bytes=h.max_header_bytes, max_body_bytes=h.max_body_bytes,
                        request_timeout_s=h.request_timeout_s,
                        idle_timeout_s=h.idle_timeout_s, api_key=h.api_key,
                        cors_origins=h.cors_origins, slots_endpoint=h.slots_endpoint,
                        verbose_responses=h.verbose_responses),
    )


def restart_needed(old: Config, new: Config) -> list[str]:
    """Keys that changed but only take effect after a restart."""
    return _changed(old, new, live=False)


def live_changes(old: Config, new: Config) -> list[str]:
    """Keys that changed and take effect at once (what a reload reports as applied)."""
    return _changed(old, new, live=True)


def _changed(old: Config, new: Config, *, live: bool) -> list[str]:
    return [f"{section}.{f.name}" for section, f, _ in _keys()
            if bool(f.metadata.get("live")) == live
            and getattr(getattr(old, section), f.name) != getattr(getattr(new, section), f.name)]
