"""``meshd bench-e2e``: servers as users run them, timed from a streaming client.

The end-to-end test runs the mode for real on the default SmolLM2 (tiny settings) and
checks what a user reads: the table's rows, per-request records whose token counts are
the tokens generated, positive rates, the idle CPU, and no server left running. The
llama-server arms run when ``llama-server`` is on PATH; otherwise the output must say
they are unavailable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import pytest

from meshd.bench.arms import resolve_model
from meshd.bench.e2e import client_counts
from meshd.bench.e2e_arms import (
    generate_prompt,
    model_under_test,
    prompt_tag,
    request_body,
)
from meshd.bench.processes import clean_env, proc_cpu_s
from meshd.bench.stream_client import (
    RequestRecord,
    StreamResult,
    aggregate_decode_rate,
    decode_rate,
    parse_sse,
)
from meshd.bench.workloads import Workload
from meshd.daemon.cli import main

TOKENS = 8


# --------------------------------------------------------------------------- units


def test_clean_env_drops_what_would_change_a_servers_threads_or_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"PATH": "/bin", "HOME": "/root", "OMP_WAIT_POLICY": "active",
           "OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "0", "KMP_BLOCKTIME": "0",
           "MESHD_SOCKET": "/tmp/x.sock", "MESHD_MODEL_CTX": "64", "MY_OMP_NOTE": "kept"}
    assert clean_env(env) == {"PATH": "/bin", "HOME": "/root", "MY_OMP_NOTE": "kept"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    monkeypatch.setenv("MESHD_SOCKET", "/tmp/x.sock")
    got = clean_env()  # this process's environment, untouched
    assert "OMP_WAIT_POLICY" not in got and "MESHD_SOCKET" not in got
    assert got["PATH"] == os.environ["PATH"] and os.environ["OMP_WAIT_POLICY"] == "active"


def test_cpu_time_is_read_from_proc() -> None:
    """What the idle-CPU figure is made of: a live process's CPU seconds; none for a
    process that is gone."""
    spent = proc_cpu_s(os.getpid())
    assert spent is not None and spent > 0
    assert proc_cpu_s(2**22 + 1) is None  # above Linux's pid_max: never a process


def _sse(*records: object, t0: float = 10.0) -> Iterable[tuple[float, bytes]]:
    """Lines as a server writes them, one second apart: ``data: JSON``, blank line."""
    for i, record in enumerate(records):
        data = record if isinstance(record, str) else json.dumps(record)
        yield t0 + i, f"data: {data}\n".encode()
        yield t0 + i, b"\n"


def _chat(content: str | None = None, finish: str | None = None, **extra: object) -> object:
    delta = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def test_sse_tokens_come_from_usage_not_from_chunks() -> None:
    """meshd packs several tokens into one chunk: the usage chunk's count is used."""
    r = parse_sse(_sse(
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        _chat("Once"), _chat(" upon a time,"), _chat(" there"),  # t = 11, 12, 13
        _chat(finish="length", timings={"predicted_n": 7}),
        {"choices": [], "usage": {"prompt_tokens": 31, "completion_tokens": 7,
                                  "total_tokens": 38}},
        "[DONE]", _chat("after the end")))
    assert r.text == "Once upon a time, there" and r.content_chunks == 3
    assert (r.completion_tokens, r.tokens_from, r.prompt_tokens) == (7, "usage", 31)
    assert (r.t_first, r.t_last, r.finish_reason, r.error) == (11.0, 13.0, "length", None)


def test_sse_without_usage_falls_back_to_timings_then_chunks() -> None:
    timed = parse_sse(_sse(_chat("a"), _chat("b"), _chat(finish="stop",
                                                         timings={"predicted_n": 5}), "[DONE]"))
    assert (timed.completion_tokens, timed.tokens_from) == (5, "timings")
    completion = parse_sse(_sse({"choices": [{"text": "x"}]}, {"choices": [{"text": "y"}]},
                                "[DONE]"))
    assert (completion.text, completion.completion_tokens, completion.tokens_from) == \
        ("xy", 2, "chunks")


def test_sse_error_record_is_kept() -> None:
    r = parse_sse(_sse(_chat("a"), {"error": {"message": "boom", "code": 500}}))
    assert r.error is not None and "boom" in r.error and r.text == "a"


def test_rates_count_tokens_after_the_first() -> None:
    assert decode_rate(11, 1.0, 3.0) == 5.0
    assert decode_rate(1, 1.0, 3.0) is None and decode_rate(5, 2.0, 2.0) is None
    a = RequestRecord(0, "[1.1]", 0.0, StreamResult(t_first=1.0, t_last=3.0,
                                                    completion_tokens=9))
    b = RequestRecord(1, "[1.2]", 0.0, StreamResult(t_first=2.0, t_last=5.0,
                                                    completion_tokens=5))
    assert aggregate_decode_rate([a, b]) == (8 + 4) / (5.0 - 1.0)
    failed = RequestRecord(2, "[1.3]", 0.0, StreamResult(error="HTTP 503"))
    assert aggregate_decode_rate([a, failed]) is None


def test_every_request_is_a_new_prompt_with_the_same_template_head() -> None:
    mut = model_under_test(resolve_model("smollm2-q4_1"))
    assert (mut.chat, mut.has_mtp, mut.path) == (True, False, "/v1/chat/completions")
    w = Workload("w", "", (("system", "Be brief."), ("user", "Say hi.")))
    bodies = [request_body(mut, w, prompt_tag(0, c), TOKENS) for c in range(3)]
    assert [b["messages"][1]["content"] for b in bodies] == \
        ["[1.1] Say hi.", "[1.2] Say hi.", "[1.3] Say hi."]
    assert all(b["messages"][0] == {"role": "system", "content": "Be brief."} for b in bodies)
    assert bodies[0]["stream"] and bodies[0]["stream_options"] == {"include_usage": True}
    assert (bodies[0]["temperature"], bodies[0]["max_tokens"]) == (0, TOKENS)
    assert generate_prompt(mut, w, "[1.1]") is None  # two messages: not one user turn
    one = Workload("one", "", (("user", "Say hi."),))
    assert generate_prompt(mut, one, "[2.1]") == "[2.1] Say hi."
    assert client_counts("4,1,4") == (1, 4)


# --------------------------------------------------------------------------- for real


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_bench_e2e_reports_what_a_user_sees(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "e2e.json"
    peer = shutil.which("llama-server")
    assert main(["bench-e2e", "--tokens", str(TOKENS), "--reps", "1", "--clients", "1,2",
                 "--idle-seconds", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    report = json.loads(out.read_text())

    # The table: a block per workload and client count, a row per arm.
    for workload in ("story", "json-reformat"):
        for who in ("1 client", "2 clients (aggregate)"):
            assert f"-- {workload}, {who}\n" in text
    row = rf"\d+\.\d +\d+ +{TOKENS} +\d+"  # decode tok/s, TTFT ms, tokens, prompt
    assert len(re.findall(rf"^  meshd +{row} +- +-$", text, re.M)) == 4
    assert len(re.findall(rf"^  meshd-off +{row} +[12]/[12] +\d+\.\d\dx$", text, re.M)) == 4
    assert len(re.findall(rf"^  meshd-generate +{row} +1/1 +\d+\.\d\dx$", text, re.M)) == 2
    assert text.count("serve over HTTP / in-process (meshd / meshd-generate): ") == 2
    # meshd's own measure of its host gap, read from its /metrics around each run
    assert len(re.findall(r"^  host gap per decode step \(compute thread outside forwards\): "
                          r"meshd \d+\.\d{3} ms, meshd-off \d+\.\d{3} ms$", text, re.M)) == 4
    assert len(re.findall(r"^-- idle CPU, [12] client\(s\): .*meshd \d+\.\d%, meshd-off "
                          r"\d+\.\d%", text, re.M)) == 2
    if peer is None:
        assert report["llama_server"]["unavailable"].startswith("no llama-server on PATH")
        assert len(re.findall(r"^  llama-server +not run: no llama-server on PATH", text,
                              re.M)) == 4
        assert "llama-server: unavailable: no llama-server on PATH" in text

    # The JSON: every request of every run, its tokens those it was asked for.
    (model,) = report["models"]
    assert [b["clients"] for b in model["blocks"]] == [1, 2]
    for block in model["blocks"]:
        for table in block["workloads"]:
            for arm, summary in table["arms"].items():
                assert summary["decode_tok_s"] > 0 and summary["failed_runs"] == 0, arm
                gap = summary["host_ms_per_step"]
                if arm in ("meshd", "meshd-off"):  # well under one forward of SmolLM2
                    assert gap is not None and 0 < gap < 5, (arm, gap)
                else:
                    assert gap is None, arm
                (run,) = summary["runs"]
                assert len(run["requests"]) == (block["clients"] if arm != "meshd-generate"
                                                else 1)
                for req in run["requests"]:
                    assert req["completion_tokens"] == TOKENS, (arm, req)
                    assert req["finish_reason"] == "length" and req["text"]
                    assert req["decode_tok_s"] > 0 and req["ttft_s"] > 0
                    assert req["tokens_from"] == ("generate" if arm == "meshd-generate"
                                                  else "usage")
            if block["clients"] == 1:
                assert table["serve_over_generate"] > 0
                # the same request, the same engine: the same text
                assert table["arms"]["meshd-generate"]["same_text_as_meshd"] == [True]
            if peer is not None:
                assert table["arms"]["llama-server"]["decode_tok_s"] > 0
                assert table["meshd_over_best_peer"] > 0
        servers = block["servers"]
        assert {"meshd", "meshd-off"} <= set(servers)
        for name, info in servers.items():
            assert info["idle_cpu_pct"] is not None and info["idle_cpu_pct"] >= 0, name
            # Nothing is left running, and meshd's private socket directory is gone.
            assert _pid_gone(info["pid"]), name
            for arg in info["command"]:
                if arg.startswith("unix:"):
                    assert not Path(arg[5:]).parent.exists()
