"""llama-server's command line mapped onto ``meshd serve``, for running llama.cpp's own
server test suite against meshd (``meshd bench-peer-suite``).

The suite starts ``llama-server`` with the flags of its presets; both arms of the
comparison are given one fixed model file in place of the suite's downloads, so a test
compares the servers, not the models. Flags meshd has no counterpart for are listed in
:attr:`MeshdServe.ignored`, so a launcher can say what it left out.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import attrs

#: Flags that name the model; both arms get the fixed model file instead.
MODEL_FLAGS = ("--model", "-m", "--model-url", "--hf-repo", "-hf", "--hf-file", "-hff",
               "--models-dir", "--models-preset")
#: Model flags without a value.
MODEL_SWITCHES = ("--offline",)

#: ``--spec-type`` values and the meshd proposer that does the same job.
SPEC_TYPES = {"none": "off", "draft": "draft", "draft-mtp": "mtp"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama-server", add_help=False, allow_abbrev=False)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-c", "--ctx-size", type=int, default=0)
    p.add_argument("-np", "--parallel", type=int, default=-1)
    p.add_argument("--kv-unified", "-kvu", action="store_true")
    p.add_argument("-t", "--threads", type=int)
    p.add_argument("-s", "--seed", type=int, default=-1)
    p.add_argument("-n", "--n-predict", type=int)
    p.add_argument("-a", "--alias")
    p.add_argument("--tags")
    p.add_argument("--api-key")
    p.add_argument("--cors-origins")
    p.add_argument("--slots", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--spec-type")
    p.add_argument("--spec-draft-n-max", type=int)
    p.add_argument("-md", "--model-draft")
    p.add_argument("--chat-template-file")
    p.add_argument("--chat-template")
    p.add_argument("--reasoning", choices=("on", "off", "auto"))
    p.add_argument("-v", "--verbose", action="store_true")
    return p


@attrs.frozen
class MeshdServe:
    """The ``meshd serve`` arguments for one llama-server command line."""

    argv: tuple[str, ...]
    #: llama-server arguments with no meshd counterpart (left out).
    ignored: tuple[str, ...]


def without_model(argv: Sequence[str]) -> list[str]:
    """``argv`` without the flags (and values) that name a model."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in MODEL_FLAGS:
            skip = "=" not in arg
            continue
        if arg in MODEL_SWITCHES:
            continue
        out.append(arg)
    return out


def llama_server_argv(binary: str, argv: Sequence[str], model: Path) -> list[str]:
    """The llama-server command line of ``argv`` with ``model`` as its model."""
    return [binary, *without_model(argv), "--model", str(model)]


def meshd_serve_argv(meshd: str, argv: Sequence[str], model: Path,
                     socket: Path) -> MeshdServe:
    """``meshd serve`` doing what llama-server with ``argv`` does, on ``model``.

    llama-server's ``--ctx-size`` is the whole context, split across ``--parallel``
    slots unless the cache is unified (auto, its default, is 4 unified slots); meshd's
    ``-c`` is one session's context.
    """
    flags, rest = _parser().parse_known_args(without_model(argv))
    # llama-server names the model by its first alias in sorted order (a std::set)
    aliases = sorted({a.strip() for a in (flags.alias or "").split(",") if a.strip()})
    name = f"{aliases[0]}={model}" if aliases else str(model)
    hosts = [h.strip() for h in flags.host.split(",") if h.strip()]
    http = ",".join(f"tcp:[{h}]:{flags.port}" if ":" in h else f"tcp:{h}:{flags.port}"
                    for h in hosts)
    out = [meshd, "serve", "-m", name, "-s", str(socket), "--http", http]
    slots = flags.parallel if flags.parallel > 0 else 4
    unified = flags.kv_unified or flags.parallel < 0
    if flags.ctx_size > 0:
        out += ["-c", str(max(16, flags.ctx_size // (1 if unified else slots)))]
    out += ["--slots", str(slots)]
    if flags.threads:
        out += ["-t", str(flags.threads)]
    if flags.n_predict is not None and flags.n_predict > 0:
        out += ["--max-tokens", str(flags.n_predict)]
    if flags.seed >= 0:  # -1: llama-server's random one per request, as meshd's default
        out += ["--seed", str(flags.seed)]
    if aliases[1:]:
        out += ["--alias", ",".join(aliases[1:])]
    if flags.tags:
        out += ["--tags", flags.tags]
    if flags.api_key:
        out += ["--api-key", flags.api_key]
    if flags.cors_origins:
        out += ["--cors-origins", flags.cors_origins]
    if flags.slots is False:
        out += ["--no-slots-endpoint"]
    if flags.model_draft:
        out += ["--draft-model", flags.model_draft]
    if flags.spec_type:
        kind = flags.spec_type.split(",")[0]
        proposer = "ngram" if kind.startswith("ngram") else SPEC_TYPES.get(kind)
        if proposer == "draft" and flags.model_draft:
            proposer = f"draft:{flags.model_draft}"
        if proposer is not None and proposer != "draft":
            out += ["--proposer", proposer]
    if flags.chat_template_file:
        out += ["--chat-template-file", str(Path(flags.chat_template_file).resolve())]
    if flags.chat_template:
        out += ["--chat-template", flags.chat_template]
    if flags.reasoning:
        out += ["--reasoning", flags.reasoning]
    if flags.verbose:  # its answers' __verbose block (its logging is its own)
        out += ["--verbose-responses"]
    if flags.spec_draft_n_max:
        out += ["--draft-max", str(flags.spec_draft_n_max)]
    return MeshdServe(argv=tuple(out), ignored=tuple(rest))
