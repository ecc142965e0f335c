"""Command-line options shared by ``meshd serve``, ``generate``, ``demo`` and ``bench``.

Why one module: the same option (``--ctx``, ``--proposer``, ``--temperature``...) declared
once per subcommand lets types, checks and defaults drift apart. Each option is declared
here once, in a group a subcommand takes as an argparse *parent*, and
each default is a constant defined here (or, for sampling, the engine's own default), so
the help text, the parser and the code that runs agree.

Every option carries help; :class:`HelpFormatter` appends its default. Values are checked
while parsing (types, choices, proposer names), so a bad one is a usage error (exit 2)
before any model is loaded or daemon started.
"""

from __future__ import annotations

import argparse
from typing import Final

from meshd.clients.argtypes import (
    duration_seconds,
    gpu_layers,
    integer,
    non_negative,
    non_negative_float,
    positive,
    probability,
    size_bytes,
    weights,
)
from meshd.clients.options import (
    HelpFormatter,
    add_version,
    sampling_argv,
    sampling_extras,
    sampling_options,
    subparser,
    version_string,
)
from meshd.daemon.system.logs import DEFAULT_LLAMA_LOG_LEVEL, LEVELS, LLAMA_LEVELS
from meshd.native.cpus import THREAD_WAITS
from meshd.native.records import CACHE_TYPES_K, DEFAULT_DRAFT_MAX

#: ``--reasoning`` (llama-server's): auto and on let reasoning models think, off skips it.
REASONING_MODES: Final = ("auto", "on", "off")

__all__ = [
    "DEFAULT_CTX",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_PROPOSER",
    "HelpFormatter",
    "add_version",
    "daemon_options",
    "duration_text",
    "generation_options",
    "integer",
    "model_options",
    "non_negative",
    "non_negative_float",
    "placement_options",
    "positive",
    "probability",
    "proposer_name",
    "sampling_argv",
    "sampling_extras",
    "sampling_options",
    "size_text",
    "speculation_options",
    "subparser",
    "version_string",
]

DEFAULT_CTX: Final = 4096
"""Context length per session (capped at the model's training context)."""
DEFAULT_MAX_TOKENS: Final = 256
"""Tokens ``generate`` and ``demo`` generate when not told (``serve``'s requests that
set none go on until the model stops or the context ends, unless ``--max-tokens``)."""
DEFAULT_PROPOSER: Final = "auto"
DEFAULT_SLOTS: Final = 4
"""Generations ``serve`` decodes together (sessions in the shared context)."""
DEFAULT_MAX_QUEUE: Final = 64
"""Requests waiting for a slot before new ones are answered ``busy``."""
DEFAULT_STREAM_INTERVAL_MS: Final = 100
"""Tokens are streamed in batches at most this far apart (after the first token)."""
DEFAULT_KEEP_ALIVE: Final = "5m"
"""How long ``serve`` keeps an idle model loaded after its last request (Ollama's default)."""
DEFAULT_BACKEND: Final = "asyncio"
DEFAULT_LOG_LEVEL: Final = "info"


def workers(text: str) -> tuple[str, ...]:
    """``HOST:PORT[,HOST:PORT...]``: remote workers (llama.cpp RPC servers)."""
    from meshd.native.rpc import parse_endpoints

    try:
        return tuple(str(ep) for ep in parse_endpoints(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def duration_text(text: str) -> str:
    """A duration (``5m``, ``300``, ``-1``), checked and kept as written."""
    duration_seconds(text)
    return text.strip()


def size_text(text: str) -> str:
    """A size (``8G``), checked and kept as written."""
    size_bytes(text)
    return text.strip()


def proposer_name(text: str) -> str:
    """``off``, ``auto``, an installed proposer, or ``NAME:PATH`` for one that declares a
    draft model (``draft:PATH``)."""
    from meshd.plugins.registry import default_registry
    from meshd.plugins.resources import Need

    registry = default_registry()
    name, _, arg = text.partition(":")
    wants_draft = name in registry and Need.DRAFT_MODEL in registry.needs(name)
    if text in ("off", "auto") or (name in registry and (arg == "" or wants_draft)):
        if wants_draft and not arg:
            raise argparse.ArgumentTypeError(
                f"the {name} proposer needs a model: {name}:PATH")
        return text
    available = ", ".join(["off", "auto", *registry.names()])
    broken = "".join(f"; {n} failed to load ({why})" for n, why in registry.errors.items())
    raise argparse.ArgumentTypeError(
        f"unknown proposer {text!r}; available: {available}{broken}")


# ---------------------------------------------------------------------- help


def _parent() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(add_help=False, formatter_class=HelpFormatter)


# ---------------------------------------------------------------------- option groups
# Each returns a fresh parent parser: argparse shares a parent's Action objects with the
# parsers built from it, so one parent per subcommand keeps their defaults independent.


def model_options(*, ctx: int = DEFAULT_CTX, model: bool = True,
                  several: bool = False) -> argparse.ArgumentParser:
    """``-m/--model`` (unless ``model=False``; repeatable, ``PATH`` or ``NAME=PATH``, with
    ``several=True``: ``serve``), ``-c/--ctx``, ``-t/--threads``, ``--cache-type-k``."""
    p = _parent()
    g = p.add_argument_group("model")
    if model and several:
        g.add_argument("-m", "--model", metavar="PATH", action="append",
                       help="GGUF model file (default: the embedded SmolLM2-135M-Instruct); "
                            "repeatable, each PATH or NAME=PATH (the file served as the "
                            "model NAME; a plain PATH is named by its file): the first -m is "
                            "the default model, a NAME=PATH replaces a [models.NAME] table")
    elif model:
        g.add_argument("-m", "--model", metavar="PATH",
                       help="GGUF model file (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("-c", "--ctx", type=positive, default=ctx, metavar="N",
                   help="context length per session in tokens; capped at the model's "
                        "training context (a note says so)")
    g.add_argument("-t", "--threads", type=positive, default=None, metavar="N",
                   help="CPU threads for llama.cpp (default: the CPUs this process may "
                        "use: its affinity mask, capped by its cgroup CPU quota)")
    g.add_argument("--thread-wait", choices=THREAD_WAITS, default=None,
                   help="how llama.cpp's threads wait between operations: spin (the "
                        "default: spin a short while, then sleep; fastest where meshd has "
                        "its cores) or sleep (at once: for machines whose cores other busy "
                        "processes share, where spinning collapses; about 3x slower on a "
                        "quiet one). OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment "
                        "win; meshd bench-threads measures both")
    g.add_argument("--cache-type-k", choices=CACHE_TYPES_K, default="auto",
                   help="the attention K cache's type (default auto: f16, with the CPU's "
                        "attention kernel pinned to one for every forward, so that "
                        "one-token decodes and verify windows compute the same bits at any "
                        "context length and speculation keeps plain decoding's text; bf16 "
                        "where the runtime "
                        "cannot pin it; 4.5x slower to prefill a long prompt). On an "
                        "accelerator llama.cpp's kernels choose, and past 256 tokens "
                        "speculation can leave plain decoding's text at a near-tie")
    g.add_argument("--chat-template-file", metavar="FILE", default=None,
                   help="a Jinja chat template used instead of the model's own")
    g.add_argument("--chat-template", metavar="NAME|JINJA", default=None,
                   help="a chat template used instead of the model's own: one of llama.cpp's "
                        "built-in formats by name (chatml, llama3, command-r ...: roles and "
                        "text only, no tools) or Jinja source")
    g.add_argument("--reasoning", choices=REASONING_MODES, default="auto",
                   help="whether reasoning models think: auto and on give the chat "
                        "template enable_thinking true, off gives false and closes an "
                        "open thinking block (a request's chat_template_kwargs win)")
    return p


def speculation_options(*, proposer: bool = True, fixed_k: bool = True,
                        ) -> argparse.ArgumentParser:
    """``--proposer``, ``--draft-max``, ``--fixed-k`` (each of the first and last optional)."""
    p = _parent()
    g = p.add_argument_group("speculation")
    if proposer:
        g.add_argument("--proposer", type=proposer_name, default=DEFAULT_PROPOSER,
                       metavar="NAME",
                       help="who drafts tokens: off | auto | mtp | ngram | composite | "
                            "draft:PATH | an installed plugin")
    g.add_argument("--draft-max", type=non_negative, default=DEFAULT_DRAFT_MAX, metavar="K",
                   help="longest draft per step; 0 turns speculation off")
    if fixed_k:
        g.add_argument("--fixed-k", action="store_true",
                       help="always draft --draft-max tokens (no cost model, no calibration)")
    return p


def generation_options() -> argparse.ArgumentParser:
    """``--max-tokens`` and ``--stop`` (what one request asks for)."""
    p = _parent()
    g = p.add_argument_group("generation")
    g.add_argument("--max-tokens", type=positive, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help="most tokens to generate")
    g.add_argument("--stop", action="append", default=[], metavar="S",
                   help="stop string (repeatable); not included in the output")
    return p


def placement_options() -> argparse.ArgumentParser:
    """``--gpu-layers``, ``--rpc`` and ``--tensor-split``: where the model's layers run."""
    p = _parent()
    g = p.add_argument_group("several machines")
    g.add_argument("--rpc", type=workers, default=None, metavar="HOST:PORT[,...]",
                   help="remote workers (meshd worker) to split the model's layers across "
                        "(default: none, everything runs here)")
    g.add_argument("--gpu-layers", type=gpu_layers, default=None, metavar="N|all",
                   help="layers to offload to the GPU (and workers); 0 keeps every layer on "
                        "this CPU (default: all, where the build has a GPU backend or --rpc "
                        "is given; a CPU-only build runs everything here)")
    g.add_argument("--tensor-split", type=weights, default=None, metavar="W[,W...]",
                   help="weigh the layer split: one weight per device (each worker's "
                        "devices, then local GPUs; default: by free memory)")
    return p


def daemon_options(*, log_level: str = DEFAULT_LOG_LEVEL) -> argparse.ArgumentParser:
    """``--backend``, ``--log-level`` and ``--llama-log-level`` (how the daemon runs)."""
    p = _parent()
    g = p.add_argument_group("daemon")
    g.add_argument("--backend", choices=["asyncio", "trio"], default=DEFAULT_BACKEND,
                   help="event loop (asyncio uses uvloop when installed)")
    g.add_argument("--log-level", choices=LEVELS, default=log_level,
                   help="least severe log events shown")
    g.add_argument("--llama-log-level", choices=LLAMA_LEVELS, default=DEFAULT_LLAMA_LOG_LEVEL,
                   help="least severe of llama.cpp's own messages shown, whatever "
                        "--log-level is (loading a model prints thousands at info)")
    return p
