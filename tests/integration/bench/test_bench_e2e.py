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
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import pytest
from jsonschema import Draft202012Validator

from meshd.bench.arms import resolve_model
from meshd.bench.e2e import Run, _same_text, _summary, client_counts
from meshd.bench.e2e_arms import (
    ModelUnderTest,
    generate_prompt,
    model_under_test,
    prompt_tag,
    request_body,
)
from meshd.bench.e2e_report import format_e2e
from meshd.bench.e2e_scenes import document_text, scene_ratios, token_counter
from meshd.bench.processes import busy_loops, clean_env, proc_cpu_s
from meshd.bench.stream_client import (
    GrammarStats,
    RequestRecord,
    StreamResult,
    aggregate_decode_rate,
    answer_tokens_and_span,
    decode_rate,
    gaps_within,
    parse_sse,
)
from meshd.bench.workloads import BenchError, Workload, load_workloads
from meshd.daemon.commands.cli import main

TOKENS = 8
SCHEMA_WORKLOADS = ("schema-extract", "schema-classify", "schema-list", "schema-config")


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


def test_answered_rate_counts_the_wait_from_sending_including_later_prefills() -> None:
    """Two servers, the same two answers: one gives a first text at once and prefills
    the other prompt between its decode steps; the other prefills both first. The decode
    span flatters the second (its clock starts late); the answered rate is the clients'
    wait, and there the first one, done sooner, is ahead."""
    def served(first_a: float, first_b: float, last: float) -> list[RequestRecord]:
        return [RequestRecord(0, "[1.1]", 0.0, StreamResult(t_first=first_a, t_last=last,
                                                            completion_tokens=21)),
                RequestRecord(1, "[1.2]", 0.0, StreamResult(t_first=first_b, t_last=last,
                                                            completion_tokens=21))]
    early = served(0.5, 1.5, 3.0)   # interleaved: one answer starts early
    late = served(2.0, 2.0, 3.5)    # both prompts first, then both answers
    assert aggregate_decode_rate(early) == 40 / 2.5 < aggregate_decode_rate(late) == 40 / 1.5
    assert answer_tokens_and_span(early) == (42, 3.0)
    assert answer_tokens_and_span(late) == (42, 3.5)
    run = Run("meshd", 0, tuple(early + late), rounds=2)
    assert run.answered_tok_s == 84 / 6.5 and run.as_dict()["answered_tok_s"] == 84 / 6.5
    assert answer_tokens_and_span([*early, RequestRecord(2, "[1.3]", 0.0, StreamResult(
        error="HTTP 503"))]) is None


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


# --------------------------------------------------------------------------- constraints

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}
CITY_FORMAT = {"type": "json_schema",
               "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}


def _workload_file(tmp_path: Path, response_format: object) -> Path:
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"name": "mine", "messages": [
        {"role": "user", "content": "Where is the Eiffel tower? Answer as JSON."}],
        "response_format": response_format}))
    return path


@pytest.fixture(scope="module")
def chat_model() -> ModelUnderTest:
    return model_under_test(resolve_model("smollm2-q4_1"))


def test_a_workload_files_response_format_reaches_every_request(
        tmp_path: Path, chat_model: ModelUnderTest) -> None:
    """Chat requests carry it verbatim (both servers read it there); plain completions
    carry its schema as ``json_schema``, the field llama-server's /v1/completions reads."""
    (w,) = load_workloads([str(_workload_file(tmp_path, CITY_FORMAT))])
    assert (w.response_format, w.schema, w.constrained) == (CITY_FORMAT, CITY_SCHEMA, True)
    body = request_body(chat_model, w, prompt_tag(0, 0), TOKENS)
    assert body["response_format"] == CITY_FORMAT and "json_schema" not in body
    plain = request_body(attrs.evolve(chat_model, chat=False), w, prompt_tag(0, 0), TOKENS)
    assert plain["json_schema"] == CITY_SCHEMA and "response_format" not in plain
    (any_object,) = load_workloads([str(_workload_file(tmp_path, {"type": "json_object"}))])
    assert request_body(attrs.evolve(chat_model, chat=False), any_object, "[1.1]",
                        TOKENS)["json_schema"] == {"type": "object"}
    (text,) = load_workloads([str(_workload_file(tmp_path, {"type": "text"}))])
    assert not text.constrained
    assert request_body(chat_model, text, "[1.1]", TOKENS)["response_format"] == \
        {"type": "text"}
    unconstrained = Workload("w", "", (("user", "Say hi."),))
    assert not {"response_format", "json_schema"} & \
        set(request_body(chat_model, unconstrained, "[1.1]", TOKENS))


@pytest.mark.parametrize("bad", [
    "json", ["json_object"], {"type": "xml"}, {"json_schema": {"schema": {}}},
    {"type": "json_schema", "json_schema": {"name": "no schema"}},
    {"type": "json_schema", "json_schema": {"schema": "{}"}},
    {"type": "json_object", "schema": []},
])
def test_a_bad_response_format_is_refused_before_any_server_starts(
        tmp_path: Path, bad: object) -> None:
    with pytest.raises(BenchError, match="'response_format'"):
        load_workloads([str(_workload_file(tmp_path, bad))])


def test_the_shipped_schema_workloads_ask_for_bounded_json(chat_model: ModelUnderTest,
                                                           ) -> None:
    """Each is a valid JSON schema whose objects are closed and fully required, so the
    answer ends; constrained workloads stay out of the in-process benches' default set."""
    workloads = load_workloads(list(SCHEMA_WORKLOADS))
    for w in workloads:
        assert w.response_format is not None and w.response_format["type"] == "json_schema"
        assert w.schema is not None and "JSON" in w.messages[-1][1], w.name
        Draft202012Validator.check_schema(w.schema)
        for obj in _objects(w.schema):
            assert obj["additionalProperties"] is False, w.name
            assert set(obj["required"]) == set(obj["properties"]), w.name
        assert request_body(chat_model, w, "[1.1]", TOKENS)["response_format"] == \
            w.response_format
        assert generate_prompt(chat_model, w, "[1.1]") is not None  # one user turn
    assert {w.name: w.copies for w in workloads} == {
        "schema-extract": True, "schema-classify": False, "schema-list": True,
        "schema-config": False}
    assert not set(SCHEMA_WORKLOADS) & {w.name for w in load_workloads()}


def _objects(schema: dict[str, Any]) -> Iterable[dict[str, Any]]:
    """Every object schema within ``schema`` (properties and array items)."""
    if schema.get("type") == "object":
        yield schema
    children = [*schema.get("properties", {}).values()]
    if isinstance(schema.get("items"), dict):
        children.append(schema["items"])
    for child in children:
        yield from _objects(child)


def _meshd_finish(extra: dict[str, object]) -> object:
    """meshd's streamed finish chunk: ``timings`` and the ``meshd`` block."""
    return _chat(finish="stop", timings={"predicted_n": 4},
                 meshd={"proposer": "auto", "drafted": 6, "accepted": 5, "extra": extra,
                        "seed": None})


def test_sse_keeps_meshds_constraint_counters() -> None:
    extra = {"trims": 0, "forced_drafted": 6, "forced_accepted": 5, "grammar_cut": 1,
             "grammar_ms": 0.8, "grammar_masks": 2, "copy_drafted": 4, "copy_accepted": 3}
    r = parse_sse(_sse(_chat('{"city": '), _chat('"Paris"}'), _meshd_finish(extra),
                       {"choices": [], "usage": {"completion_tokens": 10}}, "[DONE]"))
    assert r.text == '{"city": "Paris"}' and r.completion_tokens == 10
    assert r.grammar == GrammarStats(forced_drafted=6, forced_accepted=5, grammar_cut=1,
                                     grammar_ms=0.8, grammar_masks=2, copy_drafted=4,
                                     copy_accepted=3)
    # unconstrained meshd (no grammar counters), llama-server (no meshd block)
    assert parse_sse(_sse(_chat("x"), _meshd_finish({"trims": 0}), "[DONE]")).grammar is None
    assert parse_sse(_sse(_chat("x"), _chat(finish="stop"), "[DONE]")).grammar is None


def _record(client: int, text: str, tokens: int, grammar: GrammarStats | None,
            ) -> RequestRecord:
    return RequestRecord(client, f"[1.{client + 1}]", 0.0, StreamResult(
        text=text, t_first=1.0, t_last=2.0, completion_tokens=tokens, grammar=grammar))


def test_constraint_counters_per_token_medians_and_identity() -> None:
    """Per run: forced-and-accepted tokens and grammar ms over the run's tokens; the arm's
    figure is the median over runs. The counters do not enter the text comparison."""
    text = '{"city": "Paris"}'
    runs = {
        "meshd": [Run("meshd", rep, (_record(0, text, 10, GrammarStats(
                                         forced_accepted=f, grammar_ms=ms, copy_accepted=f)),
                                     _record(1, text, 10, GrammarStats(
                                         forced_accepted=f, grammar_ms=ms))))
                  for rep, (f, ms) in enumerate([(2, 0.2), (5, 0.6), (3, 0.4)])],
        "llama-server": [Run("llama-server", rep, (_record(0, text, 10, None),
                                                   _record(1, '{"city":"Paris"}', 10, None)))
                         for rep in range(3)],
    }
    assert runs["meshd"][1].forced_accepted_share == 0.5
    assert runs["meshd"][1].copy_accepted_share == 0.25  # one request of the two copied
    assert runs["meshd"][1].grammar_ms_per_token == pytest.approx(0.06)
    meshd, peer = _summary(runs["meshd"]), _summary(runs["llama-server"])
    assert meshd["forced_accepted_share"] == 0.3
    assert meshd["copy_accepted_share"] == 0.15
    assert meshd["grammar_ms_per_token"] == pytest.approx(0.04)
    assert meshd["runs"][0]["requests"][0]["grammar"]["forced_accepted"] == 2
    assert (peer["forced_accepted_share"], peer["grammar_ms_per_token"]) == (None, None)
    assert _same_text(runs) == {"llama-server": [True, False] * 3}


def _report(tables: list[dict[str, object]]) -> dict[str, object]:
    return {"config": {"reps": 1, "tokens": TOKENS, "threads": 2, "ctx": 512},
            "llama_server": {"binary": None, "unavailable": "none here", "version": None},
            "meshd": "meshd",
            "models": [{"name": "m", "note": "", "path": "m.gguf", "chat": True,
                        "endpoint": "/v1/chat/completions", "has_mtp": False,
                        "blocks": [{"clients": 1, "servers": {}, "idle_seconds": 0,
                                    "workloads": tables}]}]}


def _table(name: str, response_format: object) -> dict[str, object]:
    arm = {"decode_tok_s": 50.0, "ttft_s": 0.1, "completion_tokens": 8, "prompt_tokens": 30,
           "failed_runs": 0}
    return {"workload": name, "response_format": response_format, "meshd_over": {"p": 1.0},
            "not_run": {}, "best_peer": None, "meshd_over_best_peer": None, "arms": {
                "meshd": {**arm, "forced_accepted_share": 0.25, "copy_accepted_share": 0.125,
                          "grammar_ms_per_token": 0.04},
                "p": {**arm, "forced_accepted_share": None, "copy_accepted_share": None,
                      "grammar_ms_per_token": None,
                      "same_text_as_meshd": [True]}}}


def test_report_adds_the_constraint_columns_only_to_constrained_workloads() -> None:
    text = format_e2e(_report([_table("free", None), _table("json", CITY_FORMAT)]))
    free, json_table = text.split("-- free, 1 client\n")[1].split("-- json, 1 client\n")
    assert "forced acc" not in free
    assert re.search(r"^  meshd +50\.0 +100 +8 +30 +- +-$", free, re.M)
    assert re.search(r"^  p +50\.0 +100 +8 +30 +1/1 +1\.00x$", free, re.M)
    assert re.search(r"^  arm .* meshd / arm +forced acc +copy acc +grammar ms/tok$",
                     json_table, re.M)
    assert re.search(r"^  meshd +50\.0 .* - +25\.0% +12\.5% +0\.040$", json_table, re.M)
    assert re.search(r"^  p +50\.0 .* 1\.00x +- +- +-$", json_table, re.M)


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
                 "--idle-seconds", "0.5", "--json", str(out)]) == 0
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
    # N clients: also the answers' tokens over the time their clients waited
    assert len(re.findall(r"^  answered tok/s \(the answers' tokens over the time their "
                          r"clients waited, prompts included\): meshd \d+\.\d, meshd-off "
                          r"\d+\.\d", text, re.M)) == 2
    # meshd's own measure of its host gap, read from its /metrics around each run
    assert len(re.findall(r"^  host gap per decode step \(compute thread outside verify "
                          r"forwards; MTP drafting counts; per generated token\): meshd "
                          r"\d+\.\d{3} ms \(\d+\.\d{3} ms/token\), "
                          r"meshd-off \d+\.\d{3} ms \(\d+\.\d{3} ms/token\)$", text,
                          re.M)) == 4
    assert len(re.findall(r"^-- idle CPU, [12] client\(s\): .*meshd \d+\.\d%, meshd-off "
                          r"\d+\.\d%", text, re.M)) == 2
    assert len(re.findall(r"^-- time to ready \(process start to /health 200\), [12] "
                          r"client\(s\): meshd \d+\.\d\d s, meshd-off \d+\.\d\d s", text,
                          re.M)) == 2
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
                if arm != "meshd-generate":  # a wait from sending: below the decode rate
                    assert 0 < summary["answered_tok_s"] < summary["decode_tok_s"], arm
                gap, per_token = summary["host_ms_per_step"], summary["host_ms_per_token"]
                if arm in ("meshd", "meshd-off"):  # well under one forward of SmolLM2
                    assert gap is not None and 0 < gap < 5, (arm, gap)
                    assert per_token is not None and 0 < per_token <= gap, (arm, per_token)
                else:
                    assert gap is None and per_token is None, arm
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
            assert 0 < info["ready_s"] < 180, name
            # Nothing is left running, and meshd's private socket directory is gone.
            assert _pid_gone(info["pid"]), name
            for arg in info["command"]:
                if arg.startswith("unix:"):
                    assert not Path(arg[5:]).parent.exists()


# --------------------------------------------------------------------------- scenes


def test_sse_keeps_when_each_piece_arrived_and_reports_it_as_it_comes() -> None:
    seen: list[float] = []
    r = parse_sse(_sse(_chat("a"), _chat(""), _chat("b"), _chat("c"), "[DONE]"),
                  on_piece=seen.append)
    assert r.piece_times == (10.0, 12.0, 13.0) and seen == [10.0, 12.0, 13.0]
    assert (r.t_first, r.t_last) == (10.0, 13.0)


def test_a_bystanders_waits_are_those_overlapping_the_prefill() -> None:
    """A wait that straddles either end of the window counts whole: a bystander stalled
    from before the long prompt was sent to after its first text waited all of it."""
    times = [0.0, 0.1, 0.2, 3.0, 3.1, 3.2]
    assert gaps_within(times, 0.15, 3.05) == pytest.approx([0.1, 2.8, 0.1])
    assert gaps_within(times, 5.0, 6.0) == []
    assert gaps_within([1.0], 0.0, 2.0) == []


def test_busy_loops_spin_and_are_killed_by_pid_on_every_exit() -> None:
    with busy_loops(2) as pids:
        assert len(pids) == 2 and not any(_pid_gone(p) for p in pids)
        deadline = time.monotonic() + 10
        while (proc_cpu_s(pids[0]) or 0) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (proc_cpu_s(pids[0]) or 0) >= 0.05  # it burns CPU
    assert all(_pid_gone(p) for p in pids)
    with pytest.raises(RuntimeError), busy_loops(1) as failed:
        raise RuntimeError("the benchmark failed")
    assert _pid_gone(failed[0])
    with busy_loops(0) as none:
        assert none == []


@pytest.mark.parametrize("n", [200, 3000])
def test_the_long_document_is_cut_to_the_asked_tokens(n: int) -> None:
    with token_counter(resolve_model("smollm2-q4_1").path) as count:
        text, got = document_text(n, count)
        assert count(text) == got and abs(got - n) <= max(4, n // 100)
    assert text == text.strip() and "meshd" in text


@pytest.mark.parametrize("scene", [["--workload", "long-prompt", "--prompt-tokens", "2500"],
                                   ["--workload", "multi-turn", "--system-tokens", "1900"]])
def test_a_scene_longer_than_the_models_context_is_refused_before_any_server_starts(
        scene: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The synthetic llama was trained for 2,048 tokens: rather than servers that refuse
    every long request, the bench says which option to lower."""
    assert main(["bench-e2e", "-m", "llama", "--arm", "meshd", "--reps", "1", *scene]) == 2
    captured = capsys.readouterr()
    assert "trained for a 2048-token context" in captured.err
    assert scene[2] in captured.err and "starting meshd" not in captured.out


def test_scene_ratios_are_meshds_time_over_each_arms() -> None:
    summaries = {"meshd": {"ttft_s": 1.0, "turns": [{"ttft_s": 0.5}, {"ttft_s": None}]},
                 "llama-server": {"ttft_s": 2.0, "turns": [{"ttft_s": 0.25}, {"ttft_s": 1.0}]},
                 "other": {"ttft_s": 0.0, "turns": []}}
    assert scene_ratios(summaries, ["ttft_s", "turns.0.ttft_s", "turns.1.ttft_s"]) == {
        "llama-server": {"ttft_s": 0.5, "turns.0.ttft_s": 2.0, "turns.1.ttft_s": None},
        "other": {"ttft_s": None, "turns.0.ttft_s": None, "turns.1.ttft_s": None}}
    assert scene_ratios({"llama-server": {"ttft_s": 1.0}}, ["ttft_s"]) == {}


def _scene_block(scene: dict[str, object]) -> dict[str, object]:
    return {"clients": 2, "ctx": 4096, "idle_seconds": 0, "workloads": [],
            "servers": {"meshd": {"ready_s": 1.5, "idle_cpu_pct": None},
                        "llama-server": {"ready_s": 0.5, "idle_cpu_pct": None}},
            "ready_over_llama_server": {"meshd": 3.0}, "scene": scene}


def test_report_prints_the_scenes_waits_turns_and_time_to_ready() -> None:
    def gaps(most: float, median: float) -> list[dict[str, object]]:
        return [{"max_gap_s": most, "median_gap_s": median, "covered": True, "errors": []}]
    long_prompt = {
        "scene": "long-prompt", "document_tokens": 3000, "bystanders": 1, "reps": 3,
        "tokens": 8, "not_run": {}, "arms": {
            "meshd": {"prompt_tokens": 3040, "ttft_alone_s": 12.0, "ttft_beside_s": 13.0,
                      "bystanders": gaps(0.5, 0.05), "failed_runs": 0, "quiet_after": True},
            "llama-server": {"prompt_tokens": 3040, "ttft_alone_s": 12.0,
                             "ttft_beside_s": 26.0, "bystanders": gaps(14.0, 0.01),
                             "failed_runs": 0, "quiet_after": True}},
        "meshd_over": {"llama-server": {"ttft_alone_s": 1.0, "ttft_beside_s": 0.5,
                                        "bystanders.0.max_gap_s": 0.5 / 14,
                                        "bystanders.0.median_gap_s": 5.0}}}
    turns = [{"ttft_s": t, "prompt_tokens": p, "failed": 0}
             for t, p in [(1.0, 1040), (0.1, 1100), (0.12, 1160), (0.15, 1220)]]
    multi_turn = {
        "scene": "multi-turn", "chats": 2, "turns": 4, "system_tokens": 1000, "reps": 3,
        "tokens": 8, "not_run": {"llama-server-ngram-simple": "copies only"},
        "arms": {"meshd": {"turns": turns}, "llama-server": {"turns": turns}},
        "meshd_over": {"llama-server": {f"turns.{t}.ttft_s": 1.0 for t in range(4)}}}
    report = _report([])
    blocks = report["models"][0]["blocks"]  # type: ignore[index]
    blocks[:] = [_scene_block(long_prompt), _scene_block(multi_turn)]
    text = format_e2e(report)
    assert re.search(r"^-- long-prompt: a 3000-token document, alone and beside 1 streaming",
                     text, re.M)
    assert re.search(r"^  meshd +3040 +12000 +13000 +1 +500 +50$", text, re.M)
    assert re.search(r"^  llama-server +3040 +12000 +26000 +1 +14000 +10$", text, re.M)
    assert re.search(r"^  meshd / llama-server \(times: below 1\.00x meshd's is shorter\): "
                     r"TTFT alone 1\.00x; TTFT beside 0\.50x; bystander 1 longest wait "
                     r"0\.04x, median wait 5\.00x$", text, re.M)
    assert re.search(r"^  arm +turn 1 +turn 2 +turn 3 +turn 4 +prompt$", text, re.M)
    assert re.search(r"^  meshd +1000 +100 +120 +150 +1040/1100/1160/1220$", text, re.M)
    assert re.search(r"^  meshd / llama-server +(1\.00x +){3}1\.00x", text, re.M)
    assert re.search(r"^  llama-server-ngram-simple +not run: copies only$", text, re.M)
    assert len(re.findall(r"^-- time to ready \(process start to /health 200\), "
                          r"(long-prompt|multi-turn) servers \(2 slot\(s\), context 4096\): "
                          r"meshd 1\.50 s, llama-server 0\.50 s; meshd / llama-server 3\.00x$",
                          text, re.M)) == 2


def _run_scene_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], *args: str,
                   ) -> tuple[str, dict[str, Any]]:
    """``meshd bench-e2e`` on the meshd arm (and llama-server, if on PATH): its text and
    JSON report; no server is left running."""
    out = tmp_path / "e2e.json"
    assert main(["bench-e2e", "--tokens", str(TOKENS), "--reps", "1", "--idle-seconds", "0",
                 "--arm", "meshd", "--arm", "llama-server", "--json", str(out), *args]) == 0
    report = json.loads(out.read_text())
    for model in report["models"]:
        for block in model["blocks"]:
            assert 0 < block["servers"]["meshd"]["ready_s"] < 180
            for name, info in block["servers"].items():
                assert _pid_gone(info["pid"]), name
    return capsys.readouterr().out, report


def _peer_unavailable(text: str, scene: dict[str, Any]) -> bool:
    """Without llama-server on PATH its arm is reported not run, in the JSON and text."""
    if shutil.which("llama-server") is not None:
        return False
    assert scene["not_run"]["llama-server"].startswith("no llama-server on PATH")
    assert re.search(r"^  llama-server +not run: no llama-server on PATH", text, re.M)
    return True


@pytest.mark.slow
def test_long_prompt_scene_reports_the_bystanders_waits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, report = _run_scene_cli(tmp_path, capsys, "--workload", "long-prompt",
                                  "--prompt-tokens", "300", "--bystanders", "1")
    (block,) = report["models"][0]["blocks"]
    scene = block["scene"]
    assert block["clients"] == 2 and scene["scene"] == "long-prompt"
    assert abs(scene["document_tokens"] - 300) <= 4
    assert re.search(rf"^-- long-prompt: a {scene['document_tokens']}-token document, alone "
                     r"and beside 1 streaming bystander", text, re.M)
    # prompt, TTFT alone, TTFT beside, bystander, longest and median wait: nothing else
    assert re.search(r"^  meshd +\d+ +\d+ +\d+ +1 +\d+ +\d+$", text, re.M)
    assert re.search(r"^-- time to ready \(process start to /health 200\), long-prompt "
                     r"servers \(2 slot\(s\), context 2048\): meshd \d+\.\d\d s", text, re.M)
    meshd = scene["arms"]["meshd"]
    assert meshd["failed_runs"] == 0 and meshd["quiet_after"]
    assert meshd["prompt_tokens"] > scene["document_tokens"]
    assert meshd["ttft_alone_s"] > 0 and meshd["ttft_beside_s"] > 0
    (bystander,) = meshd["bystanders"]
    assert bystander["covered"] and not bystander["errors"]
    assert 0 < bystander["median_gap_s"] <= bystander["max_gap_s"]
    (run,) = meshd["runs"]
    assert run["beside"]["completion_tokens"] == TOKENS and run["beside"]["error"] is None
    (by_request,) = run["bystander_requests"]  # it hung up once the prefill was over
    assert by_request["error"] is None and by_request["t_first"] < run["beside"]["t_sent"]
    assert by_request["t_last"] > run["beside"]["t_first"]
    if not _peer_unavailable(text, scene):
        assert scene["meshd_over"]["llama-server"]["bystanders.0.max_gap_s"] > 0


@pytest.mark.slow
def test_multi_turn_scene_reports_ttft_per_turn(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, report = _run_scene_cli(tmp_path, capsys, "--workload", "multi-turn",
                                  "--chats", "2", "--turns", "4", "--system-tokens", "200")
    (block,) = report["models"][0]["blocks"]
    scene = block["scene"]
    assert (scene["chats"], scene["turns"], block["clients"]) == (2, 4, 2)
    assert re.search(r"^  meshd +(\d+ +){4}\d+/\d+/\d+/\d+$", text, re.M)
    turns = scene["arms"]["meshd"]["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3, 4]
    assert all(t["ttft_s"] > 0 and t["failed"] == 0 for t in turns)
    prompts = [t["prompt_tokens"] for t in turns]  # each turn resends the history
    assert prompts == sorted(prompts) and prompts[0] > scene["system_tokens"]
    assert prompts[3] - prompts[0] >= 3 * TOKENS
    (run,) = scene["arms"]["meshd"]["runs"]
    assert [[q["chat"] for q in row] for row in run["turns"]] == [[0, 1]] * 4
    assert [q["prompt_tag"] for q in run["turns"][3]] == ["[1.1]", "[1.2]"]
    if not _peer_unavailable(text, scene):
        assert all(scene["meshd_over"]["llama-server"][f"turns.{t}.ttft_s"] > 0
                   for t in range(1, 4))


@pytest.mark.slow
def test_busy_machine_mode_reports_time_to_ready_and_kills_its_loops(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, report = _run_scene_cli(tmp_path, capsys, "--busy", "1", "--workload", "story",
                                  "--clients", "1")
    (pid,) = report["busy_pids"]
    assert _pid_gone(pid) and report["config"]["busy"] == 1
    assert "busy machine: 1 'python -c \"while True: pass\"' process(es) ran beside" in text
    assert re.search(r"^-- time to ready \(process start to /health 200\), 1 client\(s\): "
                     r"meshd \d+\.\d\d s", text, re.M)
    (block,) = report["models"][0]["blocks"]
    (table,) = block["workloads"]
    assert table["arms"]["meshd"]["decode_tok_s"] > 0


# --------------------------------------------------------------------------- families

FAMILIES = ("agent-loop", "text-to-sql", "repeated-edit", "story-control")


def test_a_familys_requests_vary_alike_for_every_arm_and_warm_up_first(
        chat_model: ModelUnderTest) -> None:
    from meshd.bench.e2e import _not_applicable
    from meshd.bench.e2e_arms import MESHD_ARMS, llama_server_arms

    families = load_workloads(list(FAMILIES))
    assert all(w.variants and w.warm_up == 8 for w in families)
    assert not set(FAMILIES) & {w.name for w in load_workloads()}  # not meshd bench's set
    for w in families:
        tags = [prompt_tag(r, c) for r in range(3) for c in range(4)]
        def text(tag: str, w: Workload = w) -> str:
            return json.dumps(request_body(chat_model, w, tag, TOKENS)["messages"])

        texts = [text(t) for t in tags]
        assert "{variant}" not in "".join(texts) and len(set(texts)) > 3, w.name
        assert texts == [text(t) for t in tags]  # the same per tag: for every arm
        warm = [text(t) for t in w.warm_up_tags()]
        assert len(warm) == 8 and len(set(warm)) > 3
    arms = {a.name: a for a in (*MESHD_ARMS, *llama_server_arms(False))}
    for name in ("meshd-history-off", "llama-server-ngram-mod",
                 "llama-server-ngram-map-k", "llama-server-ngram-simple"):
        assert _not_applicable(arms[name], chat_model, families[0], 1) is None, name
    story = load_workloads(["story"])[0]
    assert _not_applicable(arms["meshd-history-off"], chat_model, story, 1) is not None
    assert _not_applicable(arms["llama-server-ngram-mod"], chat_model, story, 1) is not None
    assert "--speculation-history-tokens" in arms["meshd-history-off"].flags


@pytest.mark.slow
def test_the_sql_family_is_drafted_from_history_after_its_warm_up() -> None:
    """A smoke run of the family in-process (no servers): after the warm-up, history
    drafts the measured requests, and their text is plain decoding's."""
    from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig

    (w,) = load_workloads(["text-to-sql"])
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=1, draft_max=16,
                                    calibrate=False, threads=1))
    try:
        def run(tag: str, proposer: str) -> Any:
            messages = [{"role": r, "content": c} for r, c in w.for_tag(tag).messages]
            prompt = rt.tokenize_prompt(rt.render_chat(messages), chat=True)
            gen = rt.generation(prompt, max_tokens=48, proposer=proposer)
            for _ in rt.run(gen):
                pass
            return gen

        for tag in w.warm_up_tags():
            run(tag, "off")
        accepted = 0
        for c in range(2):
            tag = prompt_tag(0, c)
            gen = run(tag, "composite")
            assert gen.committed == run(tag, "off").committed
            accepted += gen.stats.source_accepted.get("history", 0)
        assert accepted > 0
    finally:
        rt.close()
