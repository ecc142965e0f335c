"""meshd's MTP drafts, step by step, against llama.cpp's own ``--spec-type draft-mtp``.

Both sides draft greedily from the same head with the same hidden-row pairing, so with
a fixed draft length (no cost model) every step must propose the same tokens and accept
the same number of them. The comparison with llama-server needs its binary (not part
of CI): ``MESHD_LLAMA_SERVER=PATH``, else ``llama-server`` on ``PATH``. Without it the
hybrid qwen35 model is compared with the attention-only mimo2 model, which drafts like
llama-server on every step: the two synthetic kinds share the designed rule and the MTP
head's seeded mistakes, so their steps must be equal too (the recurrent state's
rollback may not cost a draft anywhere, the first step after the prompt included).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.plugins.base import Outcome, Proposal, ProposalRequest, Proposer
from meshd.plugins.registry import default_registry
from meshd.testing import testmodels

ACCEPTANCE = 0.74
TOKENS = 200
PROMPTS = ("The quick brown fox jumps over the lazy dog.", "abc def ghi")


@attrs.frozen
class Step:
    """One drafted window: the proposal and how many of its tokens were accepted."""

    draft: tuple[int, ...]
    accepted: int


class Recorder:
    """Wraps the request's proposer and records every proposal and its outcome."""

    def __init__(self, inner: Proposer) -> None:
        self.inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities
        self.steps: list[Step] = []
        self._draft: tuple[int, ...] = ()

    def propose(self, request: ProposalRequest) -> Proposal | None:
        proposal = self.inner.propose(request)
        self._draft = proposal.tokens if proposal is not None else ()
        return proposal

    def observe(self, outcome: Outcome) -> None:
        self.steps.append(Step(self._draft[:outcome.proposed], outcome.accepted))
        self.inner.observe(outcome)

    def close(self) -> None:
        self.inner.close()


_runtimes: dict[str, ModelRuntime] = {}


def runtime(kind: str) -> ModelRuntime:
    if kind not in _runtimes:
        _runtimes[kind] = ModelRuntime(
            RuntimeConfig(model_path=str(model_path(kind)), n_ctx_seq=1024, n_seq_max=1,
                          draft_max=8, calibrate=False, threads=1),
            registry=default_registry(),
        )
    return _runtimes[kind]


@pytest.fixture(scope="module", autouse=True)
def _close_runtimes() -> Iterator[None]:
    yield
    for rt in _runtimes.values():
        rt.close()
    _runtimes.clear()


def model_path(kind: str) -> Path:
    return testmodels.test_model_path(kind, acceptance=ACCEPTANCE)


def prompt_ids(text: str) -> list[int]:
    return runtime("mimo2").model.tokenizer.tokenize(text, add_special=True)


def meshd_steps(kind: str, prompt: list[int], n_max: int) -> tuple[list[int], list[Step]]:
    """meshd's committed tokens and drafted windows at a fixed draft length."""
    rt = runtime(kind)
    gen = rt.generation(prompt, max_tokens=TOKENS, proposer="mtp", draft_max=n_max,
                        adaptive=False)
    assert gen.proposer is not None
    recorder = Recorder(gen.proposer)
    gen.proposer = recorder
    for _ in rt.run(gen):
        pass
    assert len(gen.committed) == TOKENS
    assert sum(s.accepted for s in recorder.steps) == gen.stats.accepted
    return list(gen.committed), recorder.steps


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("n_max", [1, 3])
def test_hybrid_model_drafts_every_step_like_attention_only(prompt: str, n_max: int) -> None:
    ids = prompt_ids(prompt)
    tokens, steps = meshd_steps("qwen35", ids, n_max)
    ref_tokens, ref_steps = meshd_steps("mimo2", ids, n_max)
    assert tokens == ref_tokens  # the same rule: the comparison below is meaningful
    assert steps == ref_steps
    # A fixed draft length drafts on every step but the last when one token of budget
    # remains (the first token comes from the prompt's logits).
    plain_steps = TOKENS - 1 - sum(s.accepted + 1 for s in steps)
    assert plain_steps <= 1


def _llama_server() -> str | None:
    found = os.environ.get("MESHD_LLAMA_SERVER") or shutil.which("llama-server")
    return found if found and os.access(found, os.X_OK) else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_steps(binary: str, kind: str, prompt: list[int], n_max: int,
                       log_path: Path) -> tuple[list[int], list[Step]]:
    """llama-server's tokens and drafted windows (from its trace and debug log)."""
    port = _free_port()
    cmd = [binary, "--model", str(model_path(kind)), "--host", "127.0.0.1", "--port",
           str(port), "--ctx-size", "1024", "--threads", "1", "--threads-batch", "1",
           "--parallel", "1", "--no-webui", "--spec-type", "draft-mtp",
           "--spec-draft-n-max", str(n_max), "--verbose"]
    env = dict(os.environ, LLAMA_TRACE="1", OMP_WAIT_POLICY="passive")
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, log_path.read_text()[-2000:]
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "llama-server did not start"
                time.sleep(0.2)
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            body = {"prompt": prompt, "n_predict": TOKENS, "temperature": 0,
                    "cache_prompt": False, "return_tokens": True}
            conn.request("POST", "/completion", json.dumps(body),
                         {"Content-Type": "application/json"})
            answer = json.loads(conn.getresponse().read())
        finally:
            proc.terminate()
            proc.wait(30)
    return answer["tokens"], parse_steps(log_path.read_text())


def parse_steps(log: str) -> list[Step]:
    """Drafted windows from llama-server's log: the head's top candidate at each draft
    position (``--verbose``), cut to the draft length the trace line verified."""
    drafts: list[list[int]] = []
    steps: list[Step] = []
    for line in log.splitlines():
        cand = re.search(r"draft candidate +0, pos +(\d+): +(\d+)", line)
        if cand:
            if int(cand[1]) == 0:
                drafts.append([])
            drafts[-1].append(int(cand[2]))
            continue
        verified = re.search(r"\bI slot .*accepted +(\d+)/ *(\d+) draft tokens", line)
        if verified:
            n = int(verified[2])
            steps.append(Step(tuple(drafts[len(steps)][:n]), int(verified[1])))
    return steps


@pytest.mark.slow
@pytest.mark.skipif(_llama_server() is None, reason="no llama-server binary (set "
                    "MESHD_LLAMA_SERVER=PATH or put llama-server on PATH)")
@pytest.mark.parametrize("kind", ["qwen35", "mimo2"])
@pytest.mark.parametrize("n_max", [1, 3])
def test_drafts_equal_llama_server_draft_mtp(kind: str, n_max: int, tmp_path: Path) -> None:
    binary = _llama_server()
    assert binary is not None
    ids = prompt_ids(PROMPTS[0])
    tokens, steps = meshd_steps(kind, ids, n_max)
    ref_tokens, ref_steps = llama_server_steps(binary, kind, ids, n_max,
                                               tmp_path / "llama-server.log")
    assert ref_tokens == tokens
    assert len(ref_steps) > TOKENS // (n_max + 1), "llama-server's log had no draft steps"
    assert [s.draft for s in steps] == [s.draft for s in ref_steps]
    assert [s.accepted for s in steps] == [s.accepted for s in ref_steps]
