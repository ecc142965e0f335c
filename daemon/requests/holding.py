"""Holding a model for a request: loaded on first use, kept until released.

Why one place: every request that needs a model (a generation, tokenize, a load, a
plugin's connection) holds it the same way and is refused with the same errors: an
unknown name, no room to load it, a load that failed.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from meshd.daemon.models.model_set import LoadFailed, ModelSet, NoRoom, NoSuchModel, ServedModel
from meshd.daemon.models.runtime import ModelRuntime
from meshd.protocol import ModelError, ServerBusy, UnknownModel

__all__ = ["hold", "holding"]


async def hold(models: ModelSet, name: str | None, request_id: str | None) -> ServedModel:
    """Hold the model ``name`` (None: the default), loading it first if need be, until
    :meth:`ModelSet.release`. Raises UnknownModel, ServerBusy or ModelError."""
    try:
        return await models.acquire(name)
    except NoSuchModel:
        known = ", ".join(models.models)
        raise UnknownModel(f"no model named {name!r}; this daemon serves: {known}",
                           request_id=request_id) from None
    except NoRoom as exc:
        raise ServerBusy(str(exc), request_id=request_id) from None
    except LoadFailed as exc:
        raise ModelError(f"model {name or models.default.name!r} did not load: "
                         f"{exc}", request_id=request_id) from None


@contextlib.asynccontextmanager
async def holding(models: ModelSet, name: str | None, request_id: str | None
                  ) -> AsyncIterator[ModelRuntime]:
    """The runtime of model ``name`` (None: the default), held for the block."""
    served = await hold(models, name, request_id)
    try:
        assert served.runtime is not None
        yield served.runtime
    finally:
        models.release(served)
