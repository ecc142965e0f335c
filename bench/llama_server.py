"""``meshd bench --llama-server PATH``: llama.cpp's own server as extra arms.

Why: users compare meshd with ``llama-server`` on the same model, so the benchmark runs
it side by side with the other arms — same GGUF, same prompt token ids, greedy, same
threads, context, batch size and flash-attention setting — and reports its plain
decoding and each of its n-gram speculation modes (and ``draft-mtp`` on a model with an
MTP head). Its speculation type is a command-line setting (the per-request override is
compiled out in this llama.cpp), so every mode is one server process on loopback,
started when the arm opens and stopped when it closes; only one generation runs at a
time, so an idle server costs the other arms nothing but memory.

Speeds come from the server's own ``timings`` (``predicted_ms`` covers the tokens after
the prompt, whose first one the prompt's logits give, exactly what meshd's decode rate
measures); the HTTP round trip counts as host time. CPU use is read from the server's
``/proc/PID/stat`` so the contention check sees the process that did the work.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from .arms import ArmRunner, ArmSpec, BenchModel, RunResult
from .processes import START_TIMEOUT_S, ServerProcess, clean_env, free_port, proc_cpu_s
from .workloads import ArmUnavailable, BenchError

#: llama-server's n-gram speculation types (``--spec-type``), each one arm.
NGRAM_MODES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")

#: Modes whose n-gram table outlives a request (``ngram-mod`` hashes every prompt and
#: output into one table, ``ngram-cache`` keeps a dynamic cache): restarted per run.
#: ``--spec-type draft-mtp`` with ``--spec-draft-n-max N`` (N = 1..4): the peer's MTP
#: drafting at each fixed draft length (it has no adaptive one), the best one reported.
DRAFT_MTP_MODES = tuple(f"draft-mtp-{n}" for n in range(1, 5))
STATEFUL_MODES = frozenset({"ngram-mod", "ngram-cache"})

#: Prefix of every llama-server arm's name.
ARM_PREFIX = "llama-server"


class LlamaServerError(Exception):
    """The llama-server process failed (did not start, died, or answered an error)."""


def spec_flags(spec_type: str | None) -> list[str]:
    """The flags of one speculation mode: ``--spec-type TYPE``, and for ``draft-mtp-N``
    ``--spec-type draft-mtp --spec-draft-n-max N`` (none for plain decoding)."""
    if spec_type is None:
        return []
    if spec_type.startswith("draft-mtp-"):
        return ["--spec-type", "draft-mtp", "--spec-draft-n-max", spec_type.rpartition("-")[2]]
    return ["--spec-type", spec_type]


def server_command(binary: str, bm: BenchModel, spec_type: str | None, port: int,
                   ) -> list[str]:
    """The command line: every setting the other arms share, and one speculation type."""
    return [
        binary, "--model", str(bm.spec.path), "--host", "127.0.0.1", "--port", str(port),
        "--ctx-size", str(bm.n_ctx), "--batch-size", str(bm.n_batch),
        "--ubatch-size", str(bm.n_batch), "--threads", str(bm.threads),
        "--threads-batch", str(bm.threads), "--parallel", "1",
        "--flash-attn", "on" if bm.llama_flash_attn else "off", "--no-webui",
        "--cache-type-k", bm.cache_type_k, *spec_flags(spec_type),
    ]


class LlamaServerRunner:
    """One llama-server process (one speculation type) and greedy completions on it.

    Modes in :data:`STATEFUL_MODES` keep an n-gram table across requests, so a repeated
    prompt (every repetition of a benchmark) would be drafted from the earlier runs'
    outputs; for them the server is restarted before each run (outside the timing), so
    every run sees only its own prompt, as meshd's per-request prompt lookup does.
    """

    def __init__(self, binary: str, bm: BenchModel, spec_type: str | None, *,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        self.spec_type = spec_type
        self.fresh_each_run = spec_type in STATEFUL_MODES
        self._runs = 0
        self._start_timeout_s = start_timeout_s
        self._bm = bm
        self._binary = binary
        self._start()

    def _start(self) -> None:
        port = free_port()
        self.server = ServerProcess(
            server_command(self._binary, self._bm, self.spec_type, port), port,
            name="llama-server", start_timeout_s=self._start_timeout_s,
            env=clean_env())  # its own defaults, not a setting of this process

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self.server.proc

    def run(self, prompt: Sequence[int], max_tokens: int) -> RunResult:
        body = {
            "prompt": [int(t) for t in prompt], "n_predict": max_tokens,
            "temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0,
            "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "seed": 0, "stream": False, "cache_prompt": False, "return_tokens": True,
        }
        if self.fresh_each_run and self._runs:
            self.server.close()
            self._start()
        self._runs += 1
        cpu0 = proc_cpu_s(self.proc.pid)
        t0 = time.perf_counter()
        try:
            status, data = self.server.request("POST", "/completion", body)
        except OSError as exc:
            raise LlamaServerError(f"llama-server request failed: {exc}; its last lines:\n"
                                   f"{self.server.log_tail()}") from exc
        wall = time.perf_counter() - t0
        cpu1 = proc_cpu_s(self.proc.pid)
        if status != 200 or not isinstance(data, dict):
            raise LlamaServerError(f"llama-server answered HTTP {status}: {data!r}")
        tokens = tuple(int(t) for t in data.get("tokens") or ())
        timings = data.get("timings") or {}
        prompt_s = float(timings.get("prompt_ms", 0.0)) / 1e3
        predicted_s = float(timings.get("predicted_ms", 0.0)) / 1e3
        drafted = int(timings.get("draft_n", 0) or 0)
        accepted = int(timings.get("draft_n_accepted", 0) or 0)
        # Every forward after the prompt commits its accepted drafts plus one token.
        forwards = max(0, len(tokens) - 1 - accepted)
        return RunResult(
            tokens=tokens, wall_s=wall, ttft_s=max(0.0, wall - predicted_s),
            prefill_s=prompt_s, forward_s=predicted_s, decode_forwards=forwards,
            cpu_s=None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
            drafts=(drafted, accepted) if self.spec_type is not None else None,
        )

    def close(self) -> None:
        self.server.close()


def llama_server_arms(binary: str, modes: Sequence[str] = NGRAM_MODES) -> list[ArmSpec]:
    """``llama-server`` (plain) and ``llama-server-<mode>`` for each speculation mode,
    plus ``llama-server-draft-mtp`` (opened only on a model with an MTP head)."""
    path = Path(binary)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise BenchError(f"--llama-server {binary}: not an executable file")
    known = (*NGRAM_MODES, "draft-mtp", *DRAFT_MTP_MODES)
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise BenchError(f"unknown llama-server mode(s) {', '.join(unknown)}; known: "
                         f"{', '.join(known)}")
    # once each; draft-mtp (its default n-max) always unless an n-max is named
    mtp = [] if any(m.startswith("draft-mtp") for m in modes) else ["draft-mtp"]
    wanted = list(dict.fromkeys([*modes, *mtp]))

    def arm(spec_type: str | None) -> ArmSpec:
        def open_(bm: BenchModel) -> ArmRunner:
            if (spec_type or "").startswith("draft-mtp") and not bm.rt.model.info.has_mtp:
                raise ArmUnavailable("the model has no MTP head")
            return LlamaServerRunner(str(path), bm, spec_type)

        name = ARM_PREFIX if spec_type is None else f"{ARM_PREFIX}-{spec_type}"
        what = "plain decoding" if spec_type is None else f"--spec-type {spec_type}"
        return ArmSpec(name, f"llama.cpp's llama-server on loopback, {what}", open_)

    return [arm(None), *(arm(m) for m in wanted)]


def server_version(binary: str) -> str:
    """``llama-server --version``'s first line (the build it reports), for the report."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BenchError(f"cannot run llama-server {binary!r}: {exc}") from exc
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines()
             if ln.strip().startswith("version")]
    return lines[0] if lines else "version unknown"
