"""Ollama's model endpoints: ``/api/tags``, ``/api/ps``, ``/api/show``, and how its model
names (``name:tag``) find meshd's models.

Why answered from what the daemon already knows: the configured models, their files and
:class:`~meshd.protocol.ModelInfo`. Nothing here loads a model (``/api/show`` gives the
chat template of a loaded one).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Final

from meshd.daemon.frontends.http.json_body import json_object
from meshd.daemon.frontends.http.ollama import answers
from meshd.daemon.frontends.http.responder import Responder, RouteContext
from meshd.daemon.models.model_set import ModelState, NoSuchModel, ServedModel
from meshd.daemon.requests.api_errors import JSON, ApiError, bad_field, json_bytes
from meshd.daemon.requests.service import Service

__all__ = ["ps", "resolve", "show", "tags"]

_FILE_TYPES: Final = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE",
}
"""llama.cpp's ``general.file_type`` values (``llama_ftype``) as Ollama names them."""
_QUANT_IN_NAME: Final = re.compile(r"(?i)(?<![A-Z0-9])(I?Q\d_[A-Z0-9_]+?|Q\d_\d|BF16|F16|F32)"
                                   r"(?=\.gguf$|[-.]|$)")


def resolve(service: Service, asked: str | None) -> str | None:
    """The served model an Ollama name means (None: the default): its name or an
    alias, with or without the ``:latest`` tag. A daemon serving one model answers any
    name with it (as its OpenAI endpoints do); with several, another name is a 404."""
    models = service.models
    if not asked or len(models.models) == 1:
        return None
    for name in (asked, asked.removesuffix(":latest")):
        try:
            return models.get(name).name
        except NoSuchModel:
            continue
    raise ApiError(404, f"model '{asked}' not found; this daemon serves "
                        f"{', '.join(answers.ollama_name(n) for n in models.models)} "
                        "(meshd does not pull models)", param="model",
                   code="model_not_found")


def _path(served: ServedModel) -> str:
    """The model's file ("" for the embedded default model while it is not loaded)."""
    if served.plan.config.model_path:
        return served.plan.config.model_path
    rt = served.runtime
    return rt.model.info.path if rt is not None else ""


def _quantization(served: ServedModel, path: str) -> str:
    """The weights' type: the loaded file's ``general.file_type``, else its file name's."""
    rt = served.runtime
    if rt is not None and served.state is ModelState.LOADED:
        value = rt.model.meta("general.file_type")
        if value is not None and value.isdigit() and int(value) in _FILE_TYPES:
            return _FILE_TYPES[int(value)]
    found = _QUANT_IN_NAME.search(os.path.basename(path))
    return found.group(1).upper() if found else ""


def _entry(service: Service, served: ServedModel) -> dict[str, Any]:
    info = service.info(served)
    path = _path(served)
    try:
        stat = os.stat(path)
        size, mtime_ns = stat.st_size, stat.st_mtime_ns
    except OSError:
        size, mtime_ns = info.size_bytes or 0, 0
    return answers.model_entry(info, path=path, size=info.size_bytes or size,
                               mtime_ns=mtime_ns, quantization=_quantization(served, path))


async def tags(routes: RouteContext, _body: bytes, out: Responder) -> None:
    """``GET /api/tags``: every model the daemon serves, loaded or not."""
    service = routes.service
    await out.send(200, json_bytes({"models": [_entry(service, m) for m in service.models]}),
                   JSON)


def _expires_at(service: Service, served: ServedModel) -> str:
    """When an idle model unloads: its expiry; a busy one's keep-alive from now."""
    models = service.models
    if served.users > 0:
        keep = models.keep_alive_of(served)
        return answers.forever() if keep < 0 else answers.iso(time.time() + keep)
    if served.expires is None:
        return answers.forever()
    return answers.iso(time.time() + max(0.0, served.expires - time.monotonic()))


async def ps(routes: RouteContext, _body: bytes, out: Responder) -> None:
    """``GET /api/ps``: the models loaded now."""
    service = routes.service
    running = []
    for served in service.models.loaded():
        entry = _entry(service, served)
        info = service.info(served)
        del entry["modified_at"]
        entry.update(expires_at=_expires_at(service, served),
                     size_vram=entry["size"] if info.gpu_layers else 0,
                     context_length=info.n_ctx)
        running.append(entry)
    await out.send(200, json_bytes({"models": running}), JSON)




async def show(routes: RouteContext, raw: bytes, out: Responder) -> None:
    """``POST /api/show``: a model's details, chat template, and what it can do."""
    body = json_object(raw)
    asked = body.get("model", body.get("name"))
    if asked is not None and not isinstance(asked, str):
        raise bad_field("model", "must be a string")
    service = routes.service
    served = service.models.get(resolve(service, asked))
    info = service.info(served)
    entry = _entry(service, served)
    path = _path(served)
    rt = served.runtime  # (the template of a model not loaded is said once it loads)
    template = (rt.model.chat_template or "") if rt is not None else ""
    arch = info.architecture or "general"
    model_info: dict[str, Any] = {"general.architecture": info.architecture or "",
                                  f"{arch}.context_length": info.n_ctx}
    if info.n_params:
        model_info["general.parameter_count"] = info.n_params
    capabilities = ["completion", *(["tools"] if info.has_chat_template else [])]
    await out.send(200, json_bytes({
        "modelfile": f"# served by meshd from its GGUF file\nFROM {path}\n"
                     f"PARAMETER num_ctx {info.n_ctx}\n",
        "parameters": f"num_ctx {info.n_ctx}",
        "template": template,
        "details": entry["details"],
        "model_info": model_info,
        "capabilities": capabilities,
        "modified_at": entry["modified_at"],
    }), JSON)
