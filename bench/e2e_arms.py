"""The arms of ``meshd bench-e2e`` (:mod:`.e2e`): which servers run, their command
lines, and the requests their clients send.

Why apart from the runner: these are the decisions a reader checks first — that each
server gets only the flags its mode needs and its own defaults otherwise, and that every
arm is sent the same prompt — and they are plain data and functions, testable alone.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Final

import attrs
import gguf

from meshd.native.cpus import usable_cpus
from meshd.native.placement import block_counts

from .arms import ModelSpec
from .llama_server import ARM_PREFIX, DRAFT_MTP_MODES, spec_flags
from .workloads import BenchError, Workload

DEFAULT_WORKLOADS: Final = ("story", "json-reformat")
#: The arm every ratio is taken from.
MAIN_ARM: Final = "meshd"
GENERATE_ARM: Final = "meshd-generate"


@attrs.frozen
class E2eArm:
    """One way of serving the request: a server kind and the flags it adds."""

    name: str
    #: ``meshd`` (meshd serve), ``llama-server``, or ``generate`` (meshd generate).
    kind: str
    flags: tuple[str, ...] = ()
    #: Runs only on workloads whose answer copies the prompt (``"copies": true``), or
    #: repeats earlier answers (a family: ``"variants"``).
    copies_only: bool = False
    #: Runs only on families of requests (``"variants"``): the history arms and the
    #: peer's modes whose tables outlive a request.
    families_only: bool = False


MESHD_ARMS: Final = (
    E2eArm(MAIN_ARM, "meshd"),
    E2eArm("meshd-off", "meshd", ("--proposer", "off")),
    E2eArm(GENERATE_ARM, "generate"),
    # The default without history lookup (``auto`` is then prompt lookup alone): the
    # control says whether keeping answers ever costs.
    E2eArm("meshd-history-off", "meshd", ("--speculation-history-tokens", "0"),
           families_only=True),
)


def llama_server_arms(has_mtp: bool) -> list[E2eArm]:
    """Plain, ngram-simple (copying workloads and families), ngram-mod and ngram-map-k
    (families: their tables outlive a request) and, on an MTP model, draft-mtp-1..4."""
    arms = [E2eArm(ARM_PREFIX, "llama-server"),
            E2eArm(f"{ARM_PREFIX}-ngram-simple", "llama-server",
                   tuple(spec_flags("ngram-simple")), copies_only=True)]
    arms += [E2eArm(f"{ARM_PREFIX}-{m}", "llama-server", tuple(spec_flags(m)),
                    families_only=True) for m in ("ngram-mod", "ngram-map-k")]
    if has_mtp:
        arms += [E2eArm(f"{ARM_PREFIX}-{m}", "llama-server", tuple(spec_flags(m)))
                 for m in DRAFT_MTP_MODES]
    return arms


ARM_NAMES: Final = tuple(a.name for a in (*MESHD_ARMS, *llama_server_arms(True)))


@attrs.frozen
class E2eConfig:
    models: tuple[str, ...] = ("smollm2-q4_1",)
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    clients: tuple[int, ...] = (1, 4)
    tokens: int = 128
    reps: int = 3
    #: Context per session (meshd ``-c``); llama-server gets this times its slots.
    ctx: int = 2048
    threads: int = attrs.field(factory=usable_cpus)
    idle_seconds: float = 10.0
    #: Arms to run (``None``: every one that applies).
    arms: tuple[str, ...] | None = None
    llama_server: str | None = None
    timeout_s: float = 600.0
    #: Seconds a server may take from its start to ``/health`` answering 200.
    start_timeout_s: float = 180.0
    #: The ``long-prompt`` scene: the document's length in tokens, and how many
    #: streaming clients are already decoding when it is sent.
    prompt_tokens: int = 3000
    bystanders: int = 1
    #: The ``multi-turn`` scene: chats interleaved, turns each, system prompt tokens.
    chats: int = 2
    turns: int = 4
    system_tokens: int = 1000
    #: ``python -c "while True: pass"`` processes running beside the servers.
    busy: int = 0


@attrs.frozen
class ModelUnderTest:
    """A model file and what decides its arms and requests, read from its metadata."""

    spec: ModelSpec
    has_mtp: bool
    chat: bool

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


def model_under_test(spec: ModelSpec) -> ModelUnderTest:
    """Whether the GGUF has an MTP head and a chat template, without loading it."""
    reader = gguf.GGUFReader(str(spec.path), "r")
    _, nextn = block_counts(spec.path, reader)
    return ModelUnderTest(spec, nextn >= 1, "tokenizer.chat_template" in reader.fields)


# --------------------------------------------------------------------------- requests


def prompt_tag(rep: int | None, client: int, round_: int | None = None) -> str:
    """The tag that starts a request's first user turn: ``[rep.client]`` (1-based),
    ``[rep.client.round]`` in a family's rounds, or ``[warm-up]``."""
    if rep is None:
        return "[warm-up]"
    return f"[{rep + 1}.{client + 1}]" if round_ is None else \
        f"[{rep + 1}.{client + 1}.{round_ + 1}]"


def tagged_messages(workload: Workload, tag: str) -> list[dict[str, str]]:
    """The workload's chat messages, the first user turn starting with ``tag``."""
    out: list[dict[str, str]] = []
    tagged = False
    for role, content in workload.messages:
        if role == "user" and not tagged:
            content, tagged = f"{tag} {content}", True
        out.append({"role": role, "content": content})
    return out


def request_body(mut: ModelUnderTest, workload: Workload, tag: str, tokens: int,
                 index: int | None = None) -> dict[str, Any]:
    """The streamed, greedy OpenAI request a client sends (chat or plain completion),
    with the workload's output constraint, the same for every server (``index``: see
    :meth:`Workload.for_tag`)."""
    workload = workload.for_tag(tag, index)
    body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True},
                            "temperature": 0, "max_tokens": tokens}
    if mut.chat:
        body["messages"] = tagged_messages(workload, tag)
    else:
        body["prompt"] = f"{tag} {workload.plain_text}"
    body.update(constraint_fields(mut, workload))
    if workload.prediction is not None:  # llama-server ignores it; meshd drafts from it
        body["prediction"] = {"type": "content", "content": workload.prediction}
    return body


def constraint_fields(mut: ModelUnderTest, workload: Workload) -> dict[str, Any]:
    """The request fields that hold the answer to the workload's ``response_format``.

    Chat requests carry it verbatim. A plain completion carries the schema as
    ``json_schema`` instead: llama-server's ``/v1/completions`` passes
    ``response_format`` through unread (only its chat endpoint converts it), so it would
    answer unconstrained; both servers read ``json_schema`` on either endpoint."""
    if workload.response_format is None:
        return {}
    if mut.chat:
        return {"response_format": workload.response_format}
    schema = workload.schema
    return {} if schema is None else {"json_schema": schema}


def generate_prompt(mut: ModelUnderTest, workload: Workload, tag: str) -> str | None:
    """The ``meshd generate --prompt`` text for the same request (``None``: a chat
    workload that is not one user turn, which ``generate`` cannot send)."""
    workload = workload.for_tag(tag)
    if not mut.chat:
        return f"{tag} {workload.plain_text}"
    if len(workload.messages) != 1 or workload.messages[0][0] != "user":
        return None
    return tagged_messages(workload, tag)[0]["content"]


# --------------------------------------------------------------------------- servers


def meshd_executable() -> Path:
    """The ``meshd`` of this environment (next to its Python)."""
    return Path(sys.executable).parent / "meshd"


def meshd_command(arm: E2eArm, model: Path, cfg: E2eConfig, clients: int, sock: Path,
                  port: int) -> list[str]:
    return [str(meshd_executable()), "serve", "-m", str(model), "-t", str(cfg.threads),
            "-c", str(cfg.ctx), "--slots", str(max(4, clients)), "-s", f"unix:{sock}",
            "--http", f"tcp:127.0.0.1:{port}", *arm.flags]


def llama_server_command(arm: E2eArm, binary: str, model: Path, cfg: E2eConfig,
                         clients: int, port: int) -> list[str]:
    return [binary, "-m", str(model), "-t", str(cfg.threads), "--port", str(port),
            "--host", "127.0.0.1", "-np", str(clients), "-c", str(cfg.ctx * clients),
            *arm.flags]


def find_llama_server(explicit: str | None) -> tuple[str | None, str | None]:
    """The binary (``--llama-server``, else ``llama-server`` on PATH), or why none."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise BenchError(f"--llama-server {explicit}: not an executable file")
        return str(path), None
    found = shutil.which("llama-server")
    if found is None:
        return None, "no llama-server on PATH (give --llama-server PATH)"
    return found, None
