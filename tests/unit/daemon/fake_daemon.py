"""A daemon over the fake runtime (``meshd.testing.fake_runtime``), in the test's event
loop on a fresh Unix socket: the real ModelRuntime, scheduler, service and front ends,
with the toy model where llama.cpp's would be."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from meshd.daemon.commands.server import Server, serving
from meshd.daemon.models import runtime as runtime_module
from meshd.daemon.models.model_loading import LoadedModel
from meshd.daemon.models.runtime import ModelRuntime
from meshd.daemon.models.runtime_config import RuntimeConfig
from meshd.daemon.prompts import chat_template
from meshd.daemon.requests.service import ServerConfig
from meshd.native.records import ContextConfig
from meshd.testing.fake_runtime import ToyModel

N_CTX = 256


def fake_model_runtime(monkeypatch: pytest.MonkeyPatch, model: ToyModel | None = None,
                       *, n_ctx_seq: int = N_CTX, n_seq_max: int = 2) -> ModelRuntime:
    """A ModelRuntime whose load gives the toy model and a fake context. The seams
    patched: the runtime's ``load_model``, and the names of llama.cpp's built-in chat
    formats (the toy runtime has none: its template is Jinja)."""
    toy = model or ToyModel()
    context = toy.context(ContextConfig(n_ctx_seq=n_ctx_seq, n_seq_max=n_seq_max,
                                        draft_max=8))
    monkeypatch.setattr(chat_template, "builtin_names", frozenset)
    monkeypatch.setattr(runtime_module, "load_model",
                        lambda *args, **kwargs: LoadedModel(toy, context, None))  # type: ignore[arg-type]
    return ModelRuntime(RuntimeConfig(model_path="fake.gguf", n_ctx_seq=n_ctx_seq,
                                      n_seq_max=n_seq_max, draft_max=8, calibrate=False,
                                      threads=1), calibrate_now=False)


@asynccontextmanager
async def fake_daemon(runtime: ModelRuntime, config: ServerConfig | None = None,
                      ) -> AsyncIterator[tuple[Server, str]]:
    """The daemon serving ``runtime`` on a fresh socket; yields (server, socket path)."""
    directory = tempfile.mkdtemp(dir="/tmp", prefix="mdf")
    path = os.path.join(directory, "s")
    try:
        async with serving(runtime, path, config) as server:
            yield server, path
    finally:
        shutil.rmtree(directory, ignore_errors=True)
