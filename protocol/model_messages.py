"""The messages about the models a daemon serves: what a model is (``ModelInfo``), and
the requests that list, load and unload them.

Why a module of their own: a daemon may serve several models, loading and unloading
them on demand, and everything a client can ask or learn about that lives here, apart
from the generation messages in ``messages.py`` (which re-exports these, so every import
from there keeps working). Same conventions as there: a class-level ``OP``, ``id`` first,
values checked at construction.
"""

from __future__ import annotations

from typing import ClassVar, Final

import attrs
import attrs.validators as V

from . import validators as check
from .errors import BadRequest

MODEL_STATES: Final = ("loading", "loaded", "unloading", "unloaded")
"""Where a model is in its life: ``loading`` (not serving yet), ``loaded`` (serving; also
while an ``unload`` waits for its running requests), ``unloading`` (the unload itself is
running), ``unloaded``. Version 3 of the protocol added them."""


@attrs.frozen
class ModelInfo:
    """Describes a model the daemon serves, loaded or not (an unloaded one carries what
    the daemon knows without loading it: its name, file size and configured context)."""

    name: str = attrs.field(validator=check.non_empty_string)
    architecture: str | None = attrs.field(default=None, validator=check.optional_non_empty_string)
    n_ctx: int = attrs.field(default=0, validator=check.integer(0))
    """Context window the server runs with (tokens)."""
    n_vocab: int = attrs.field(default=0, validator=check.integer(0))
    n_params: int | None = attrs.field(default=None, validator=check.integer(0, optional=True))
    size_bytes: int | None = attrs.field(default=None, validator=check.integer(0, optional=True))
    has_mtp: bool = attrs.field(default=False, validator=check.boolean)
    """Whether the model carries a multi-token-prediction head usable for drafting."""
    has_chat_template: bool = attrs.field(default=False, validator=check.boolean)
    """Whether ``generate`` accepts ``messages`` for this model."""
    gpu_layers: int = attrs.field(default=0, validator=check.integer(0))
    """Layers offloaded to accelerators or remote workers (0: all run on this CPU)."""
    loaded: bool = attrs.field(default=True, validator=check.boolean)
    """Whether the model is loaded: state ``loaded`` (``False`` while it loads or
    unloads), when a state is given."""
    state: str | None = attrs.field(default=None, validator=check.rule(
        f"one of {', '.join(MODEL_STATES)}", check.STR, V.in_(MODEL_STATES), optional=True))
    """One of :data:`MODEL_STATES`; ``None`` from a daemon that does not say."""
    default: bool = attrs.field(default=False, validator=check.boolean)
    """Whether a ``generate`` that names no model is served by this one."""
    proposers: tuple[str, ...] = attrs.field(default=(), validator=check.string_items)
    """The proposer names a ``generate`` on this model may ask for."""
    keep_alive_s: float | None = attrs.field(default=None, validator=check.keep_alive)
    """Seconds it stays loaded once idle (-1: until unloaded); ``None``: not said."""

    def __attrs_post_init__(self) -> None:
        if self.state is not None and self.loaded != (self.state == "loaded"):
            raise BadRequest.invalid_field(
                "loaded", f"must be {str(not self.loaded).lower()} for state {self.state}")


@attrs.frozen
class Models:
    """Ask which models the daemon serves; answered by ``models_reply``."""

    OP: ClassVar[str] = "models"
    id: str = attrs.field(validator=check.request_id)


@attrs.frozen
class Load:
    """Load a model (or change how long a loaded one stays); answered by ``load_reply``
    once it is loaded."""

    OP: ClassVar[str] = "load"
    id: str = attrs.field(validator=check.request_id)
    model: str = attrs.field(validator=check.model_name)
    keep_alive: float | None = attrs.field(default=None, validator=check.keep_alive)
    """Seconds it stays loaded once idle (-1: until unloaded); ``None``: the daemon's
    default for it."""


@attrs.frozen
class Unload:
    """Unload a model, at once if idle, else once its running requests end; answered by
    ``unload_reply``."""

    OP: ClassVar[str] = "unload"
    id: str = attrs.field(validator=check.request_id)
    model: str = attrs.field(validator=check.model_name)


@attrs.frozen
class ModelsReply:
    """The models the daemon serves, loaded or not."""

    OP: ClassVar[str] = "models_reply"
    id: str = attrs.field(validator=check.request_id)
    models: tuple[ModelInfo, ...] = attrs.field(validator=check.rule(
        "an array of model infos", V.instance_of(ModelInfo), each="a ModelInfo", container="array"
    ))


@attrs.frozen
class LoadReply:
    """The answer to ``load``: the model as it is once loaded."""

    OP: ClassVar[str] = "load_reply"
    id: str = attrs.field(validator=check.request_id)
    model: ModelInfo = attrs.field(validator=check.instance(ModelInfo))


@attrs.frozen
class UnloadReply:
    """The answer to ``unload``: the model now, and whether it is unloaded already
    (``False``: it was busy and is still ``loaded``, serving its running requests, and is
    unloaded once they end)."""

    OP: ClassVar[str] = "unload_reply"
    id: str = attrs.field(validator=check.request_id)
    model: ModelInfo = attrs.field(validator=check.instance(ModelInfo))
    unloaded: bool = attrs.field(validator=check.boolean)
