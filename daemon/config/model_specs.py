"""The models one daemon serves, by name: ``-m NAME=PATH`` values and ``[models.NAME]``
tables, each ``[model]`` with its own keys changed.

Why checked here and not in :mod:`.config`: a key there has one value, while a table
inherits ``[model]`` as the environment and flags leave it, so it can only be checked
once they are merged; the same converter and rules (:mod:`.config_values`) make a bad
value the same error, naming ``models.NAME.key`` and the file. Without named models the
daemon serves ``[model]`` alone, named by its file as before; its file is checked by
:func:`meshd.daemon.commands.serve_checks.check_before_start` as before (exit 3), while a named
model's missing file is a configuration error naming its table or flag.

Order: the command line's models first, in their order, then the tables in file order; the
first is the default unless ``[serve] default_model`` names another. A ``-m NAME=PATH``
replaces a table of the same name (the command line wins; the table is still
type-checked, so ``meshd config check`` finds its mistakes).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Final

import attrs

from meshd.clients.argtypes import duration_seconds
from meshd.daemon.config.settings import ConfigError, Loaded, ModelSection
from meshd.daemon.config.values import (
    MODEL_NAME_RULE,
    Duration,
    converter,
    first_error,
    is_model_name,
    split_model_arg,
)
from meshd.native.default_model import FILE as DEFAULT_MODEL_FILE

__all__ = ["TABLE_KEYS", "ModelSpec", "model_name_from_path", "model_specs"]

_MODEL_KEYS: Final = tuple(f.name for f in attrs.fields(ModelSection))
TABLE_KEYS: Final = (*_MODEL_KEYS, "proposer", "keep_alive")
"""The keys of a ``[models.NAME]`` table: ``[model]``'s, its proposer and keep_alive."""


@attrs.frozen
class ModelSpec:
    """One served model, as configured (nothing is loaded or opened)."""

    name: str
    """What requests name it by (``generate.model``, OpenAI's ``model``)."""
    model: ModelSection
    """``[model]``'s keys with this model's own applied."""
    proposer: str
    """Its default proposer: its table's ``proposer``, else ``[speculation] proposer``."""
    keep_alive_s: float | None
    """Its own keep_alive in seconds (-1: forever); None: ``[serve] keep_alive``."""
    source: str
    """Where it was defined, for messages: ``[models.chat] in FILE``, ``-m chat=PATH``,
    ``[model]``."""


def model_name_from_path(path: str | None) -> str:
    """A model's name from its file's stem, as :func:`meshd.daemon.models.mapping.model_info`
    names the one model (None: the embedded default), made valid where the stem is not:
    other characters become ``-``, a leading ``.``/``_``/``-`` goes, 64 at most."""
    stem = Path(path if path is not None else DEFAULT_MODEL_FILE).stem
    name = re.sub(r"[^A-Za-z0-9._:-]", "-", stem).lstrip("._:-")[:64]
    return name or "model"


def model_specs(loaded: Loaded) -> list[ModelSpec]:
    """The models to serve, the default first. Raises ConfigError naming the table,
    flag or key at fault."""
    c = loaded.config
    given = [(*split_model_arg(text), f"-m {text}") for text in loaded.command_line_models]
    named = len(given) > 1 or any(name is not None for name, _, _ in given)
    if not named and not loaded.models:
        specs = [ModelSpec(model_name_from_path(c.model.path), c.model,
                           c.speculation.proposer, None, "[model]")]
    else:
        specs = _named(loaded, given)
    return _default_first(specs, c.serve.default_model, loaded.sources["serve.default_model"])


def _named(loaded: Loaded, given: list[tuple[str | None, str, str]]) -> list[ModelSpec]:
    c = loaded.config
    specs: list[ModelSpec] = []
    sources: dict[str, str] = {}
    for name, path, source in given:
        name = name or model_name_from_path(path)
        if name in sources:
            raise ConfigError(f"{source}: the model name {name} is given twice (also by "
                              f"{sources[name]})")
        sources[name] = source
        model = attrs.evolve(c.model if not specs else _unnamed(c.model), path=path)
        specs.append(ModelSpec(name, model, c.speculation.proposer, None, source))
    for name, table in loaded.models.items():
        spec = _table(loaded, name, table, replaced=name in sources)
        if name not in sources:
            specs.append(spec)
    for spec in specs:
        _check_file(spec)
    _check_aliases(specs)
    return specs


def _unnamed(model: ModelSection) -> ModelSection:
    """``[model]`` without its aliases and tags: they name one model, not every one."""
    return attrs.evolve(model, aliases=(), tags=())


def _check_aliases(specs: list[ModelSpec]) -> None:
    """Every name and alias requests may use picks one model."""
    taken = {spec.name: spec.source for spec in specs}
    for spec in specs:
        for alias in spec.model.aliases:
            if alias in taken and alias != spec.name:
                raise ConfigError(f"{spec.source}: the alias {alias} also names the model of "
                                  f"{taken[alias]}")
            taken[alias] = spec.source


def _table(loaded: Loaded, name: str, table: dict[str, Any], *, replaced: bool) -> ModelSpec:
    """``[models.NAME]`` over ``[model]``, type-checked like ``[model]`` itself."""
    c, file = loaded.config, loaded.path
    if not is_model_name(name):
        raise ConfigError(f"{file}: [models.{name}]: {name!r} is not {MODEL_NAME_RULE}")
    unknown = sorted(set(table) - set(TABLE_KEYS))
    if unknown:
        raise ConfigError(f"{file}: unknown key models.{name}.{unknown[0]} (known: "
                          f"{', '.join(TABLE_KEYS)})")
    if "path" not in table and not replaced:
        raise ConfigError(f"{file}: [models.{name}] has no path (every model table names "
                          "its GGUF file)")
    where = f"models.{name}"
    try:
        own = {k: v for k, v in table.items() if k in _MODEL_KEYS}
        model = converter.structure({**attrs.asdict(_unnamed(c.model)), **own}, ModelSection)
        where = f"models.{name}.proposer"
        proposer = converter.structure(table.get("proposer", c.speculation.proposer), str)
        where = f"models.{name}.keep_alive"
        keep_alive = duration_seconds(converter.structure(table["keep_alive"], Duration)) \
            if "keep_alive" in table else None
    except Exception as exc:  # cattrs groups errors; report the first, by key
        raise ConfigError(f"{file}: {first_error(exc, where)}") from None
    return ModelSpec(name, model, proposer, keep_alive, f"[models.{name}] in {file}")


def _check_file(spec: ModelSpec) -> None:
    path = spec.model.path
    if path is None or not os.path.exists(path):
        raise ConfigError(f"{spec.source}: model file not found: {path}")
    if not os.path.isfile(path):
        raise ConfigError(f"{spec.source}: {path} is not a file")


def _default_first(specs: list[ModelSpec], default: str | None,
                   source: str) -> list[ModelSpec]:
    if default is None:
        return specs
    chosen = next((spec for spec in specs if spec.name == default), None)
    if chosen is None:
        names = ", ".join(spec.name for spec in specs)
        raise ConfigError(f"serve.default_model (from {source}): no model is named {default} "
                          f"(the models: {names})")
    return [chosen, *(spec for spec in specs if spec is not chosen)]
