"""A loaded GGUF model and what it can do (its capabilities), loaded once per process.

Why capabilities are read, never assumed: speculation's repair path depends on them (an
attention-only model trims its KV suffix, a recurrent one needs in-place rollback or a
checkpoint), and llama.cpp silently clamps options it does not support.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from .errors import ModelLoadError
from .gguf_file import check_model_file
from .llama import ensure_backend, last_error, lc
from .placement import LayerPlan, Placement, plan_for
from .records import ModelInfo as ModelInfo
from .rpc import local_gpus
from .tokenizer import Tokenizer

ProgressCallback = Callable[[float], None]


class Model:
    """One GGUF model loaded through llama.cpp; shared read-only by every context."""

    def __init__(self, handle: Any, info: ModelInfo, chat_template: str | None,
                 placement: Placement | None = None, gpu_layers: int = 0,
                 plan: LayerPlan | None = None) -> None:
        self._handle = handle
        #: Layers llama.cpp offloads to accelerators or workers (0: all on this CPU).
        self.gpu_layers = gpu_layers
        #: Where the layers are when they are not all local (remote workers).
        self.placement = placement
        #: How many layers each device of ``placement`` holds.
        self.plan = plan
        self.info = info
        self.chat_template = chat_template
        if chat_template is not None and not info.has_chat_template:
            self.info = attrs.evolve(info, has_chat_template=True)
        vocab = lc.llama_model_get_vocab(handle)
        self.tokenizer = Tokenizer(vocab, info.n_vocab, bool(lc.llama_vocab_get_add_bos(vocab)))
        self._closed = False
        self._lock = threading.Lock()

    @property
    def handle(self) -> Any:
        if self._closed:
            raise ModelLoadError("the model has been closed")
        return self._handle

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        n_gpu_layers: int = -1,
        load_mtp: bool = True,
        on_progress: ProgressCallback | None = None,
        placement: Placement | None = None,
        chat_template: str | None = None,
    ) -> Model:
        """Load ``path``. ``load_mtp`` loads the MTP (nextn) blocks when the file has them;
        ``n_gpu_layers``: how many of the last layers go to accelerators (-1: all; a
        build without one keeps them here); ``placement`` splits those layers over
        devices (remote workers), keeping the MTP blocks and the output head here;
        ``chat_template`` replaces the file's own."""
        p = check_model_file(path)
        ensure_backend()
        last_error()  # forget errors of earlier calls
        params = lc.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.load_mtp = load_mtp
        keep: list[Any] = []
        plan = None
        if placement is not None:
            plan = plan_for(placement, p, n_gpu_layers)
            placement.apply(params, keep, plan)
        if on_progress is not None:
            def _progress(progress: float, _user: Any) -> bool:
                on_progress(float(progress))
                return True

            cb = lc.llama_progress_callback(_progress)
            keep.append(cb)
            params.progress_callback = cb
        handle = _open(p, params, "load")
        try:
            info, template = _read_info(handle, p)
        except Exception:
            lc.llama_model_free(handle)
            raise
        if plan is not None and placement is not None:  # what is not on this CPU
            offloaded = sum(plan.counts) - (plan.counts[-1] if placement.cpu_tail else 0)
        elif local_gpus():
            n_all = info.n_layer + 1  # llama.cpp counts the output layer as one more
            offloaded = n_all if n_gpu_layers < 0 else min(n_gpu_layers, n_all)
        else:
            offloaded = 0
        return cls(handle, info, template if chat_template is None else chat_template,
                   placement, offloaded, plan)

    def check_devices(self) -> None:
        """Raise (WorkerLost) if a device holding some of the layers is gone."""
        if self.placement is not None and self.placement.check is not None:
            self.placement.check()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.tokenizer.close()
                lc.llama_model_free(self._handle)

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def meta(self, key: str) -> str | None:
        return meta_value(self.handle, key)


def meta_value(handle: Any, key: str) -> str | None:
    """A GGUF metadata value of a loaded model (a vocabulary-only load too), as text."""
    size = 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lc.llama_model_meta_val_str(handle, key.encode(), buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.value.decode("utf-8", "replace")
        size = n + 1


def describe_model(path: str | os.PathLike[str]) -> tuple[ModelInfo, str | None]:
    """What a GGUF file holds (architecture, vocabulary, chat template, MTP layers)
    without loading its weights: llama.cpp's vocabulary-only load, a fraction of a
    second. Its ``n_params`` and ``size_bytes`` may be 0 (no tensors are read)."""
    p = check_model_file(path)
    ensure_backend()
    last_error()
    params = lc.llama_model_default_params()
    params.vocab_only = True
    handle = _open(p, params, "read")
    try:
        info, template = _read_info(handle, p)
        # The MTP layers are counted as their tensors load; the metadata says it too.
        arch = meta_value(handle, "general.architecture") or ""
        nextn = meta_value(handle, f"{arch}.nextn_predict_layers")
        if nextn is not None and nextn.isdigit():
            info = attrs.evolve(info, n_layer_nextn=int(nextn))
        return info, template
    finally:
        lc.llama_model_free(handle)


def _open(path: Path, params: Any, verb: str) -> Any:
    """``llama_model_load_from_file``; ModelLoadError with llama.cpp's reason on failure."""
    handle = lc.llama_model_load_from_file(str(path).encode(), params)
    if not handle:
        why = last_error()
        raise ModelLoadError(f"llama.cpp could not {verb} {path}" + (f": {why}" if why else ""))
    return handle


def _read_info(handle: Any, path: Path) -> tuple[ModelInfo, str | None]:
    vocab = lc.llama_model_get_vocab(handle)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    eog = frozenset(t for t in range(n_vocab) if lc.llama_vocab_is_eog(vocab, t))
    desc = ctypes.create_string_buffer(256)
    lc.llama_model_desc(handle, desc, 256)
    tmpl_ptr = lc.llama_model_chat_template(handle, None)
    template = tmpl_ptr.decode("utf-8", "replace") if tmpl_ptr else None
    bos = lc.llama_vocab_bos(vocab)
    eos = lc.llama_vocab_eos(vocab)
    info = ModelInfo(
        path=str(path),
        architecture=meta_value(handle, "general.architecture") or "unknown",
        description=desc.value.decode("utf-8", "replace"),
        n_vocab=n_vocab,
        n_ctx_train=lc.llama_model_n_ctx_train(handle),
        n_embd=lc.llama_model_n_embd(handle),
        n_layer=lc.llama_model_n_layer(handle),
        n_layer_nextn=lc.llama_model_n_layer_nextn(handle),
        n_params=lc.llama_model_n_params(handle),
        size_bytes=lc.llama_model_size(handle),
        is_recurrent=bool(lc.llama_model_is_recurrent(handle)),
        is_hybrid=bool(lc.llama_model_is_hybrid(handle)),
        eog_tokens=eog,
        bos_token=bos if bos >= 0 else None,
        eos_token=eos if eos >= 0 else None,
        has_chat_template=template is not None,
    )
    return info, template
