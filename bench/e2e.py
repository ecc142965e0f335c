"""``meshd bench-e2e``: meshd and llama-server as their users run them, measured from the
client's side of a streamed OpenAI request.

Why: ``meshd bench`` compares decoding loops on the same tokens with the same settings;
a user sees something else — a server started with its own defaults, a streamed HTTP
answer, other clients at the same time. This starts each server the way its users do and
times what a client receives: TTFT, and the decode rate ``(tokens - 1) / (t_last -
t_first)`` of the text's arrival (N clients: ``sum(tokens_i - 1) / (max t_last - min
t_first)``), tokens counted by the final ``usage`` chunk, never by chunks. meshd
streams in batches (``--stream-interval-ms``, its default), llama-server token by token:
either way the times are when the text reached the client.

The servers, per model and client count N (started once, kept up for every workload and
repetition, arms interleaved A B C A B C..., then stopped; each gets the environment
without ``OMP_*``/``GOMP_*``/``KMP_*``/``MESHD_*`` variables, and dies with this process):

* ``meshd``: ``meshd serve`` with its defaults (proposer ``auto``) except the model,
  ``-t``, ``-c``, ``--slots max(4, N)``, a private socket and ``--http`` on loopback;
  ``meshd-off``: the same with ``--proposer off`` (what speculation is worth).
* ``llama-server``: ``-m -t -c --host --port -np N`` and its own defaults for the rest;
  ``llama-server-ngram-simple`` (``--spec-type ngram-simple``) on workloads that copy
  their prompt; on a model with an MTP head ``llama-server-draft-mtp-K`` (``--spec-type
  draft-mtp --spec-draft-n-max K``, K = 1..4). Without a binary they are reported
  unavailable and the meshd arms still run.
* Context: meshd's ``-c`` is per session, llama-server's is shared by its slots, so meshd
  gets ``-c CTX`` and llama-server ``-c CTX*N``: every slot has room for the prompt and
  ``--tokens``.

``meshd-generate`` (1 client) is the same request in-process: ``meshd generate --json``
in a fresh process with the same model, threads and proposer default; its decode rate is
``(emitted - 1) / (wall - prefill)`` from its own stats, so "serve over HTTP /
in-process" is what the daemon and HTTP cost on top of the engine. It takes one user
turn, so it runs on workloads of one user message.

Requests: ``/v1/chat/completions`` with the workload's messages when the model has a
chat template, else ``/v1/completions`` with the workload's plain text (and ``meshd
generate --raw``), so both servers get the same prompt either way. A workload's
``response_format`` goes into every request (a plain completion sends its schema as
``json_schema``, which both servers read there), so both servers are held to the same
schema; ``meshd generate`` takes none, so it does not run on such a workload, and the
table adds, per meshd arm, the share of tokens the grammar forced and meshd accepted and
the grammar's time per token (medians over runs of meshd's own counters).

Each request's first user turn starts with a tag naming its repetition and client
(``[2.3] ...``): every request is a new prompt that shares only the template's head with
earlier ones, so a prefix cache cannot make it trivial (a suffix would leave the whole
workload cached); arms of one repetition get the same prompts. One warm-up request per
server precedes the measurements. After the runs each server is left idle for 2 s, then
its CPU time (``/proc/PID/stat``) is read over ``--idle-seconds``: a daemon that spins
while idle slows everything else on the machine. Every server's time to ready (process
start to ``/health`` 200) is reported too. ``--workload long-prompt`` / ``multi-turn``
are scenes (:mod:`.e2e_scenes`), on servers of their own. ``--busy N`` runs N Python busy
loops beside the servers throughout (started first, killed by pid on every exit path).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
from prometheus_client.parser import text_string_to_metric_families

from meshd.clients.argtypes import non_negative_float, positive, positive_seconds
from meshd.native.cpus import usable_cpus
from meshd.native.errors import NativeError

from .arms import resolve_model
from .e2e_arms import (
    ARM_NAMES,
    DEFAULT_WORKLOADS,
    GENERATE_ARM,
    MAIN_ARM,
    MESHD_ARMS,
    E2eArm,
    E2eConfig,
    ModelUnderTest,
    find_llama_server,
    generate_prompt,
    llama_server_arms,
    llama_server_command,
    meshd_command,
    meshd_executable,
    model_under_test,
    prompt_tag,
    request_body,
)
from .e2e_report import format_e2e
from .e2e_scenes import (
    SCENE_NAMES,
    Scene,
    add_scene_arguments,
    make_scene,
    ready_ratios,
    run_scene,
    scene_options,
)
from .llama_server import ARM_PREFIX, server_version
from .processes import (
    ServerProcess,
    busy_loops,
    check_alive,
    clean_env,
    die_with_parent,
    free_port,
)
from .stream_client import (
    RequestRecord,
    StreamResult,
    answer_tokens_and_span,
    decode_tokens_and_span,
    grammar_per_token,
    run_clients,
)
from .stream_client import median_or_none as _median
from .workloads import ArmUnavailable, BenchError, Workload, load_workloads

__all__ = ["E2eConfig", "add_arguments", "cmd_bench_e2e", "run_e2e"]

#: Seconds a server is left alone after the last request before its idle CPU is read.
IDLE_SETTLE_S: Final = 2.0
#: Rounds of requests in one repetition of a family (agent loops, SQL...): each client
#: asks this many of the family's questions, one after another.
FAMILY_ROUNDS: Final = 4

Log = Callable[[str], None]


def _start_server(stack: contextlib.ExitStack, arm: E2eArm, mut: ModelUnderTest,
                  cfg: E2eConfig, clients: int, binary: str | None) -> ServerProcess:
    """Start ``arm``'s server; ``stack`` stops it (and removes its socket's directory)."""
    port = free_port()
    if arm.kind == "meshd":
        sock_dir = Path(tempfile.mkdtemp(prefix="meshd-e2e-"))
        stack.callback(shutil.rmtree, sock_dir, ignore_errors=True)
        cmd = meshd_command(arm, mut.spec.path, cfg, clients, sock_dir / "meshd.sock", port)
    else:
        assert binary is not None
        cmd = llama_server_command(arm, binary, mut.spec.path, cfg, clients, port)
    server = ServerProcess(cmd, port, name=arm.name, env=clean_env(),
                           start_timeout_s=cfg.start_timeout_s)
    stack.callback(server.close)
    return server


def _warm_up(server: ServerProcess, mut: ModelUnderTest, workload: Workload,
             cfg: E2eConfig) -> str | None:
    """One request before the measured ones; why the server cannot be used, if so."""
    tag = prompt_tag(None, 0)
    (record,) = run_clients(server.port, mut.path,
                            [request_body(mut, workload, tag, cfg.tokens)], tags=[tag],
                            timeout=cfg.timeout_s)
    r = record.result
    if r.error is None and r.completion_tokens:
        return None
    return f"its warm-up request failed: {r.error or 'no tokens'}; its last lines:\n" \
           f"{server.log_tail()}"


def _warm_family(server: ServerProcess, mut: ModelUnderTest, workload: Workload,
                 cfg: E2eConfig) -> None:
    """A family's warm-up requests, one at a time (not measured)."""
    for tag in workload.warm_up_tags():
        run_clients(server.port, mut.path, [request_body(mut, workload, tag, cfg.tokens)],
                    tags=[tag], timeout=cfg.timeout_s)


# --------------------------------------------------------------------------- runs


@attrs.frozen
class Run:
    """One repetition of one arm: its requests, served together (a family's: in
    ``rounds`` of one request per client, one round after another)."""

    arm: str
    rep: int
    requests: tuple[RequestRecord, ...]
    #: meshd serve's host gap per decode step in this run (its compute thread's time
    #: outside forwards, from ``/metrics``), in ms; None for other servers.
    host_ms_per_step: float | None = None
    rounds: int = 1
    #: The same host time per generated token (wider windows make fewer, dearer steps:
    #: per token is what a user pays).
    host_ms_per_token: float | None = None

    @property
    def decode_tok_s(self) -> float | None:
        """The rounds' tokens over their decode spans (each round's as
        :func:`decode_tokens_and_span`)."""
        return self._over_rounds(decode_tokens_and_span)

    @property
    def answered_tok_s(self) -> float | None:
        """The rounds' tokens over the time their clients waited, from sending to the
        last text (each round's as :func:`answer_tokens_and_span`): what an agent that
        waits for whole answers gets, prefills included."""
        return self._over_rounds(answer_tokens_and_span)

    def _over_rounds(self, measure: Callable[[Sequence[RequestRecord]],
                                             tuple[int, float] | None]) -> float | None:
        """Tokens over seconds summed over the rounds, each round's by ``measure``."""
        size = len(self.requests) // self.rounds
        parts = [measure(self.requests[r * size:(r + 1) * size]) for r in range(self.rounds)]
        if any(p is None for p in parts):
            return None
        return sum(p[0] for p in parts if p) / sum(p[1] for p in parts if p)

    @property
    def forced_accepted_share(self) -> float | None:
        """Of the tokens meshd emitted under a constraint, the share it had drafted
        because the grammar forced them and then accepted (None: no counters)."""
        per_token = grammar_per_token(self.requests)
        return None if per_token is None else per_token[0]

    @property
    def copy_accepted_share(self) -> float | None:
        """Of those tokens, the share meshd drafted as a copy of the prompt into a JSON
        string value and then accepted (None: no counters)."""
        per_token = grammar_per_token(self.requests)
        return None if per_token is None else per_token[2]

    @property
    def grammar_ms_per_token(self) -> float | None:
        """meshd's time choosing tokens under the constraint, per emitted token."""
        per_token = grammar_per_token(self.requests)
        return None if per_token is None else per_token[1]

    def as_dict(self) -> dict[str, Any]:
        return {"arm": self.arm, "rep": self.rep, "decode_tok_s": self.decode_tok_s,
                "answered_tok_s": self.answered_tok_s,
                "host_ms_per_step": self.host_ms_per_step,
                "host_ms_per_token": self.host_ms_per_token,
                "forced_accepted_share": self.forced_accepted_share,
                "copy_accepted_share": self.copy_accepted_share,
                "grammar_ms_per_token": self.grammar_ms_per_token,
                "requests": [r.as_dict() for r in self.requests]}


def _serve_run(arm: E2eArm, server: ServerProcess, mut: ModelUnderTest,
               workload: Workload, rep: int, clients: int, cfg: E2eConfig) -> Run:
    """One repetition: every client's request at once; a family's in
    :data:`FAMILY_ROUNDS` rounds, each round's questions the next of the family's
    (a family's answers are short: one round is too few tokens to time)."""
    rounds = FAMILY_ROUNDS if workload.variants else 1
    meshd = arm.name.startswith("meshd")
    before = _step_host_seconds(server) if meshd else None
    records: list[RequestRecord] = []
    for r in range(rounds):
        tags = [prompt_tag(rep, c, r if workload.variants else None) for c in range(clients)]
        bodies = [request_body(mut, workload, t, cfg.tokens,
                               (rep * rounds + r) * clients + c if workload.variants else None)
                  for c, t in enumerate(tags)]
        records += run_clients(server.port, mut.path, bodies, tags=tags,
                               timeout=cfg.timeout_s)
    after = _step_host_seconds(server) if meshd else None
    gap = per_token = None
    if before is not None and after is not None and after[1] > before[1]:
        gap = 1e3 * (after[0] - before[0]) / (after[1] - before[1])
        if after[2] > before[2]:
            per_token = 1e3 * (after[0] - before[0]) / (after[2] - before[2])
    return Run(arm.name, rep, tuple(records), gap, rounds, per_token)


def _step_host_seconds(server: ServerProcess) -> tuple[float, int, float] | None:
    """``meshd_step_host_seconds``' sum and count, and ``meshd_generation_tokens``,
    from meshd's ``/metrics``."""
    try:
        status, text = server.request("GET", "/metrics", timeout=10)
    except (OSError, http.client.HTTPException):
        return None
    if status != 200 or not isinstance(text, str):
        return None
    host: tuple[float, int] | None = None
    tokens = 0.0
    for family in text_string_to_metric_families(text):
        values = {s.name: s.value for s in family.samples}
        if family.name == "meshd_step_host_seconds":
            host = (values["meshd_step_host_seconds_sum"],
                    int(values["meshd_step_host_seconds_count"]))
        elif family.name == "meshd_generation_tokens":
            tokens = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return None if host is None else (*host, tokens)


def _generate_run(arm: E2eArm, mut: ModelUnderTest, prompt: str, rep: int,
                  cfg: E2eConfig) -> Run:
    """The same request through ``meshd generate --json`` in a fresh process."""
    cmd = [str(meshd_executable()), "generate", "-m", str(mut.spec.path),
           "-t", str(cfg.threads), "-c", str(cfg.ctx), "--max-tokens", str(cfg.tokens),
           "--temperature", "0", "--json", "--chat" if mut.chat else "--raw",
           "--prompt", prompt]
    try:
        done = subprocess.run(cmd, env=clean_env(), capture_output=True, text=True,
                              timeout=cfg.timeout_s, check=False,
                              preexec_fn=die_with_parent)
        result = _generate_result(done)
    except subprocess.TimeoutExpired:
        result = StreamResult(error=f"meshd generate took over {cfg.timeout_s:g} s")
    return Run(arm.name, rep, (RequestRecord(0, prompt_tag(rep, 0), 0.0, result),))


def _generate_result(done: subprocess.CompletedProcess[str]) -> StreamResult:
    """``meshd generate --json``'s answer as a stream would have shown it: the first
    token when the prefill ended, the last when the generation did."""
    try:
        out = json.loads(done.stdout.strip().splitlines()[-1])
        stats = out["stats"]
        return StreamResult(
            text=out["text"], t_first=stats["prefill_ms"] / 1e3,
            t_last=stats["wall_ms"] / 1e3, completion_tokens=len(out["tokens"]),
            prompt_tokens=stats["prompt_tokens"], tokens_from="generate",
            finish_reason=out["finish_reason"])
    except (ValueError, KeyError, IndexError, TypeError):
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        return StreamResult(error=f"meshd generate exited {done.returncode}: {tail}")


def _not_applicable(arm: E2eArm, mut: ModelUnderTest, workload: Workload, clients: int,
                    ) -> str | None:
    if arm.kind == "generate" and clients > 1:
        return "one request in-process: 1 client only"
    if arm.kind == "generate" and (workload.constrained or workload.prediction is not None):
        return "meshd generate takes no response_format or prediction"
    if arm.copies_only and not (workload.copies or workload.constrained or workload.variants):
        return "runs only on workloads that copy their prompt or constrain the answer"
    if arm.families_only and not workload.variants:
        return "runs only on families of requests (workloads with variants)"
    if arm.kind == "generate" and generate_prompt(mut, workload, "") is None:
        return "meshd generate sends one user turn; this workload has " \
               f"{len(workload.messages)} messages"
    return None


def _run_workload(workload: Workload, arms: Sequence[E2eArm],
                  servers: dict[str, ServerProcess], unavailable: dict[str, str],
                  mut: ModelUnderTest, clients: int, cfg: E2eConfig, log: Log,
                  ) -> dict[str, Any]:
    """Every repetition of every arm on ``workload``, interleaved (A B C A B C ...)."""
    names = {a.name for a in arms}
    not_run = {n: why for n, why in unavailable.items() if n not in names}
    active: list[E2eArm] = []
    for arm in arms:
        why = unavailable.get(arm.name) or _not_applicable(arm, mut, workload, clients)
        if why is None:
            active.append(arm)
        else:
            not_run[arm.name] = why
    runs: dict[str, list[Run]] = {a.name: [] for a in active}
    for arm in active:  # a family's warm-up: what the servers may learn from
        if arm.kind != "generate" and workload.warm_up and arm.name not in unavailable:
            _warm_family(servers[arm.name], mut, workload, cfg)
            check_alive(arm.name, servers, unavailable)
    for rep in range(cfg.reps):
        for arm in active:
            if arm.name in unavailable:
                continue  # its server died in an earlier run
            if arm.kind == "generate":
                prompt = generate_prompt(mut, workload, prompt_tag(rep, 0))
                assert prompt is not None
                run = _generate_run(arm, mut, prompt, rep, cfg)
            else:
                run = _serve_run(arm, servers[arm.name], mut, workload, rep, clients, cfg)
                check_alive(arm.name, servers, unavailable)
            runs[arm.name].append(run)
            log(f"  {mut.spec.name} {workload.name} {clients} client(s) {arm.name} rep "
                f"{rep + 1}: {_rate_text(run)}")
    summaries = {name: _summary(rs) for name, rs in runs.items()}
    for name, same in _same_text(runs).items():
        summaries[name]["same_text_as_meshd"] = same
    for name in summaries:
        if name in unavailable:
            summaries[name]["error"] = unavailable[name]
    return {"workload": workload.name, "description": workload.description,
            "copies": workload.copies, "response_format": workload.response_format,
            "arms": summaries, "not_run": not_run, **_ratios(summaries)}


def _rate_text(run: Run) -> str:
    rate = run.decode_tok_s
    if rate is not None:
        return f"{rate:.1f} tok/s"
    errors = [r.result.error for r in run.requests if r.result.error]
    return f"failed ({errors[0]})" if errors else "no decode rate (one chunk)"


def _summary(runs: Sequence[Run]) -> dict[str, Any]:
    """An arm's medians: decode rate and constraint counters over runs, TTFT and token
    counts over requests."""
    reqs = [q for r in runs for q in r.requests]
    rates = [r.decode_tok_s for r in runs]
    return {
        "decode_tok_s": _median(rates),
        "answered_tok_s": _median([r.answered_tok_s for r in runs]),
        "host_ms_per_step": _median([r.host_ms_per_step for r in runs]),
        "host_ms_per_token": _median([r.host_ms_per_token for r in runs]),
        "forced_accepted_share": _median([r.forced_accepted_share for r in runs]),
        "copy_accepted_share": _median([r.copy_accepted_share for r in runs]),
        "grammar_ms_per_token": _median([r.grammar_ms_per_token for r in runs]),
        "ttft_s": _median([q.ttft_s for q in reqs]),
        "completion_tokens": _median([q.result.completion_tokens for q in reqs]),
        "prompt_tokens": _median([q.result.prompt_tokens for q in reqs]),
        "failed_runs": sum(r is None for r in rates),
        "runs": [r.as_dict() for r in runs],
    }


def _ratios(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """meshd's rate over each other arm's, over the best llama-server arm's, and over
    the same request in-process (``meshd-generate``)."""
    over = _over_arms(summaries, "decode_tok_s")
    best = _best_peer(summaries, "decode_tok_s")
    answered = _over_arms(summaries, "answered_tok_s")
    best_answered = _best_peer(summaries, "answered_tok_s")
    return {"meshd_over": over, "best_peer": best,
            "meshd_over_best_peer": over.get(best) if best else None,
            "serve_over_generate": over.get(GENERATE_ARM),
            "best_peer_answered": best_answered,
            "meshd_over_best_peer_answered": answered.get(best_answered)
            if best_answered else None}


def _over_arms(summaries: Mapping[str, Mapping[str, Any]], key: str) -> dict[str, float]:
    """meshd's ``key`` rate over each other arm's that has one."""
    main = summaries.get(MAIN_ARM, {}).get(key)
    return {n: main / s[key] for n, s in summaries.items()
            if main and s.get(key) and n != MAIN_ARM}


def _best_peer(summaries: Mapping[str, Mapping[str, Any]], key: str) -> str | None:
    """The llama-server arm with the highest ``key`` rate (None: none has one)."""
    peers = {n: s[key] for n, s in summaries.items()
             if s.get(key) and n.startswith(ARM_PREFIX)}
    return max(peers, key=lambda n: peers[n]) if peers else None


def _same_text(runs: Mapping[str, Sequence[Run]]) -> dict[str, list[bool]]:
    """Per arm, per request: whether its text is meshd's for the same prompt (same
    repetition and client). Rates compare like with like only where texts agree; two
    servers' numerics (cache types, kernels) can part at a near-tie."""
    ref = {q.prompt_tag: q.result.text for r in runs.get(MAIN_ARM, ())
           for q in r.requests if q.result.error is None}
    return {arm: [q.result.text == ref[q.prompt_tag] for r in rs for q in r.requests
                  if q.prompt_tag in ref and q.result.error is None]
            for arm, rs in runs.items() if arm != MAIN_ARM and ref}


def _idle_cpu(servers: Mapping[str, ServerProcess], seconds: float,
              ) -> dict[str, float | None]:
    """Each server's CPU use while nobody asks it anything, in % of one core."""
    time.sleep(IDLE_SETTLE_S)
    before = {name: s.cpu_s() for name, s in servers.items()}
    time.sleep(seconds)
    out: dict[str, float | None] = {}
    for name, s in servers.items():
        b, e = before[name], s.cpu_s()
        out[name] = None if b is None or e is None else 100.0 * (e - b) / seconds
    return out


# --------------------------------------------------------------------------- blocks


def _start_servers(stack: contextlib.ExitStack, arms: Sequence[E2eArm],
                   mut: ModelUnderTest, clients: int, workloads: Sequence[Workload],
                   cfg: E2eConfig, binary: str | None, binary_why: str | None,
                   unavailable: dict[str, str], log: Log,
                   ) -> tuple[dict[str, ServerProcess], dict[str, dict[str, Any]]]:
    """Start and warm up every server arm; the ones that cannot run go to
    ``unavailable`` with the reason."""
    servers: dict[str, ServerProcess] = {}
    started: dict[str, dict[str, Any]] = {}
    for arm in arms:
        if arm.kind == "generate" or arm.name in unavailable:
            continue
        if arm.copies_only and not any(w.copies or w.constrained or w.variants
                                       for w in workloads):
            continue  # each workload's table says why it did not run
        if arm.families_only and not any(w.variants for w in workloads):
            continue
        if arm.kind == "llama-server" and binary is None:
            unavailable[arm.name] = binary_why or "no llama-server binary"
            continue
        log(f"  starting {arm.name} for {clients} client(s)")
        try:
            server = _start_server(stack, arm, mut, cfg, clients, binary)
        except (ArmUnavailable, BenchError) as exc:
            unavailable[arm.name] = str(exc)
            continue
        started[arm.name] = {"command": server.command, "pid": server.pid,
                             "ready_s": server.ready_s}
        why = _warm_up(server, mut, workloads[0], cfg)
        if why is not None:
            unavailable[arm.name] = why
            server.close()
            continue
        servers[arm.name] = server
    return servers, started


def _run_block(mut: ModelUnderTest, arms: Sequence[E2eArm], clients: int,
               workloads: Sequence[Workload], cfg: E2eConfig, binary: str | None,
               binary_why: str | None, unavailable: Mapping[str, str], log: Log,
               scene: Scene | None = None) -> dict[str, Any]:
    """One model at one client count: its servers started, every workload run (or the
    scene, its servers warmed up by ``workloads[0]``), the idle CPU read, the servers
    stopped (on every exit path)."""
    missing = dict(unavailable)
    idle: dict[str, float | None] = {}
    with contextlib.ExitStack() as stack:
        servers, started = _start_servers(stack, arms, mut, clients, workloads, cfg,
                                          binary, binary_why, missing, log)
        tables = [] if scene else [_run_workload(w, arms, servers, missing, mut, clients,
                                                 cfg, log) for w in workloads]
        scene_table = None if scene is None else run_scene(scene, arms, servers, missing, log)
        if cfg.idle_seconds > 0 and servers:
            log(f"  idle CPU: {IDLE_SETTLE_S:g} s, then {cfg.idle_seconds:g} s of reading")
            idle = _idle_cpu(servers, cfg.idle_seconds)
    for name, info in started.items():
        info["idle_cpu_pct"] = idle.get(name)
    return {"clients": clients, "ctx": cfg.ctx, "servers": started, "unavailable": missing,
            "idle_seconds": cfg.idle_seconds, "workloads": tables,
            "ready_over_llama_server": ready_ratios(started), "scene": scene_table}


def _arms_for(mut: ModelUnderTest, wanted: Sequence[str] | None,
              ) -> tuple[list[E2eArm], dict[str, str]]:
    """The arms that apply to the model (those ``wanted``, if named), and the wanted
    ones that do not apply, with why."""
    arms = [*MESHD_ARMS, *llama_server_arms(mut.has_mtp)]
    if not wanted:
        return arms, {}
    names = {a.name for a in arms}
    return ([a for a in arms if a.name in wanted],
            {n: "the model has no MTP head" for n in wanted if n not in names})


def run_e2e(cfg: E2eConfig, log: Log | None = None) -> dict[str, Any]:
    """Run every model, client count, workload and arm; the report (JSON-ready)."""
    say = log or _stderr
    unknown = [a for a in cfg.arms or () if a not in ARM_NAMES]
    if unknown:
        raise BenchError(f"unknown arm(s) {', '.join(unknown)}; known: {', '.join(ARM_NAMES)}")
    if not meshd_executable().is_file():
        raise BenchError(f"no meshd executable at {meshd_executable()}")
    scenes = [w for w in cfg.workloads if w in SCENE_NAMES]
    names = [w for w in cfg.workloads if w not in SCENE_NAMES]
    workloads = load_workloads(names) if names else []
    binary, binary_why = find_llama_server(cfg.llama_server)
    models = []
    with busy_loops(cfg.busy) as busy:
        if busy:
            say(f"busy machine: {len(busy)} busy loop(s) beside the servers, pids "
                f"{', '.join(map(str, busy))}")
        for name in cfg.models:
            mut = model_under_test(resolve_model(name, threads=cfg.threads))
            arms, unavailable = _arms_for(mut, cfg.arms)
            say(f"{mut.spec.name}: {mut.spec.path}")
            blocks = [_run_block(mut, arms, n, workloads, cfg, binary, binary_why,
                                 unavailable, say) for n in cfg.clients if workloads]
            for scene_name in scenes:
                scene = make_scene(scene_name, mut, cfg)
                say(f"  {scene_name}: {scene.describe()}")
                blocks.append(_run_block(
                    mut, arms, scene.clients, [scene.warm_up],
                    attrs.evolve(cfg, ctx=scene.ctx), binary, binary_why, unavailable, say,
                    scene=scene))
            models.append({"name": mut.spec.name, "path": str(mut.spec.path),
                           "note": mut.spec.note, "has_mtp": mut.has_mtp, "chat": mut.chat,
                           "endpoint": mut.path, "blocks": blocks})
    return {
        "command": "meshd bench-e2e", "config": attrs.asdict(cfg),
        "meshd": str(meshd_executable()),
        "llama_server": {"binary": binary, "unavailable": binary_why,
                         "version": server_version(binary) if binary else None},
        "busy_pids": busy, "models": models,
    }


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- command


def client_counts(text: str) -> tuple[int, ...]:
    """``N[,N...]``: client counts, each positive (sorted, once each)."""
    try:
        counts = sorted({positive(part) for part in text.split(",")})
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, got {text!r}") from None
    return tuple(counts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", action="append", default=[], metavar="NAME|PATH",
                   help="smollm2-q4_1, smollm2-q8_0, qwen35-0.74, qwen35-1b-0.74, ... or a "
                        "GGUF path, as for meshd bench (repeatable; default: smollm2-q4_1)")
    p.add_argument("--workload", action="append", default=[], metavar="NAME",
                   help="shipped workload, FILE.json, or a scene: long-prompt, multi-turn "
                        f"(repeatable; default: {', '.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--clients", type=client_counts, default="1,4", metavar="N[,N...]",
                   help="clients sending at once; each count gets its own servers")
    p.add_argument("--tokens", type=positive, default=128, metavar="N",
                   help="max_tokens of every request")
    p.add_argument("--reps", type=positive, default=3, metavar="N",
                   help="repetitions of every arm (interleaved)")
    p.add_argument("-c", "--ctx", type=positive, default=2048, metavar="N",
                   help="context per session: meshd serve -c N, llama-server -c N x clients")
    p.add_argument("-t", "--threads", type=positive, default=None, metavar="N",
                   help="threads of every server (default: the CPUs this process may use)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME",
                   help=f"arm (repeatable; default: all that apply of {', '.join(ARM_NAMES)})")
    p.add_argument("--llama-server", metavar="PATH",
                   help="llama.cpp's llama-server (default: llama-server on PATH; without "
                        "one its arms are reported unavailable)")
    p.add_argument("--idle-seconds", type=non_negative_float, default=10.0, metavar="S",
                   help="read each server's CPU use over this long while idle (0 skips)")
    p.add_argument("--timeout", type=positive_seconds, default=600.0, metavar="S",
                   help="give up on one request after this long")
    p.add_argument("--json", metavar="FILE", help="also write everything, every request, "
                                                  "as JSON")
    add_scene_arguments(p)


def _unwind(signum: int, _frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so every server is stopped and its socket's
    directory removed (a SIGKILL leaves the directory; the servers die with us)."""
    raise SystemExit(128 + signum)


def cmd_bench_e2e(args: argparse.Namespace) -> int:
    """Run ``meshd bench-e2e``: 0, 2 on bad usage, 3 on a model error."""
    previous = signal.signal(signal.SIGTERM, _unwind)
    try:
        cfg = E2eConfig(
            models=tuple(args.model) or E2eConfig().models,
            workloads=tuple(args.workload) or DEFAULT_WORKLOADS, clients=args.clients,
            tokens=args.tokens, reps=args.reps, ctx=args.ctx,
            threads=args.threads or usable_cpus(), idle_seconds=args.idle_seconds,
            arms=tuple(args.arm) or None, llama_server=args.llama_server,
            timeout_s=args.timeout, **scene_options(args))
        report = run_e2e(cfg)
    except BenchError as exc:
        print(f"meshd bench-e2e: {exc}", file=sys.stderr)
        return 2
    except NativeError as exc:
        print(f"meshd bench-e2e: {exc}", file=sys.stderr)
        return 3
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_e2e(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="meshd bench-e2e", description=__doc__)
    add_arguments(p)
    return cmd_bench_e2e(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
