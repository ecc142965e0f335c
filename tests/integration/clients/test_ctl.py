"""meshctl against a daemon running in the test's event loop (meshctl blocks, so it runs
in a worker thread), and ``meshd demo`` end to end as a user would run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from meshd.clients import ctl
from meshd.clients.argtypes import duration_seconds
from meshd.clients.demo import run_demo
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.protocol import Client, FinishReason, Generate, ModelInfo, UnloadReply
from meshd.testing import testmodels
from tests.integration.helpers.daemon import (
    meshctl,
    reference,
    running_daemon,
    short_tempdir,
    wait_idle,
)
from tests.unit.protocol.fake_server import running_server

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(autouse=True)
def _quiet_daemon_logs() -> Iterator[None]:
    """The daemon's log events would otherwise land in the stdout meshctl writes to."""
    with capture_logs():
        yield


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


async def test_generate_streams_text_and_stats(runtime: ModelRuntime,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    prompt = runtime.tokenize_prompt("hello world", chat=False)
    ref_tokens, ref_text, _ = reference(runtime, prompt, max_tokens=20, proposer="ngram")
    async with running_daemon(runtime) as (_, path):
        assert await meshctl("--socket", path, "generate", "hello world", "--max-tokens",
                             "20", "--proposer", "ngram") == 0
        out, err = capsys.readouterr()
        assert out == ref_text + "\n"
        assert "finish=length" in err and "tokens=20" in err and "proposer=ngram" in err
        assert await meshctl("--socket", f"unix:{path}", "generate", "hello world",
                             "--max-tokens", "20", "--json") == 0
        result = json.loads(capsys.readouterr().out)
        assert result["text"] == ref_text and result["token_ids"] == ref_tokens
        assert result["done"]["finish_reason"] == "length"
        assert result["done"]["usage"]["completion_tokens"] == 20


async def test_other_commands(runtime: ModelRuntime, capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    async with running_daemon(runtime) as (_, path):
        monkeypatch.setenv("MESHD_SOCKET", path)  # no --socket: the environment decides
        assert await meshctl("health") == 0
        assert capsys.readouterr().out.startswith("ok uptime=")
        assert await meshctl("health", "--json") == 0
        assert json.loads(capsys.readouterr().out)["status"] == "ok"
        assert await meshctl("stats") == 0
        assert "requests_total" in capsys.readouterr().out
        assert await meshctl("stats", "--json") == 0
        assert "counters" in json.loads(capsys.readouterr().out)
        assert await meshctl("models") == 0
        header, row = capsys.readouterr().out.splitlines()
        assert header.split() == list(ctl.MODEL_COLUMNS)
        assert row.split()[1:3] == ["loaded", "yes"]  # the one model is the default
        assert await meshctl("models", "--json") == 0
        assert json.loads(capsys.readouterr().out)[0]["architecture"] == "llama"
        assert await meshctl("tokenize", "hello", "--no-special", "--json") == 0
        tokens = json.loads(capsys.readouterr().out)
        assert tokens == runtime.model.tokenizer.tokenize("hello", add_special=False)
        assert await meshctl("detokenize", *map(str, tokens)) == 0
        assert capsys.readouterr().out == "hello\n"


async def test_exit_codes(runtime: ModelRuntime, capsys: pytest.CaptureFixture[str]) -> None:
    directory = short_tempdir()
    missing = os.path.join(directory, "nothing-here")
    assert await meshctl("--socket", missing, "health") == ctl.EXIT_UNAVAILABLE
    assert "no daemon at" in capsys.readouterr().err
    async with running_daemon(runtime) as (_, path):
        assert await meshctl("--socket", path, "generate", "x", "--max-tokens",
                             "100000") == ctl.EXIT_USAGE
        err = capsys.readouterr().err
        assert "bad_request: generate.max_tokens: must be at most 512 (got 100000)" in err
        assert await meshctl("--socket", path, "cancel", "nosuch") == ctl.EXIT_FAILURE
        assert "no request 'nosuch' is running" in capsys.readouterr().err
        # (a model without a chat template is served with chatml, as by llama-server)
        assert await meshctl("--socket", path, "chat", "hi", "--max-tokens", "2") == 0
        capsys.readouterr()
        assert await meshctl("--socket", path, "generate", "word " * 600) == ctl.EXIT_MODEL
        err = capsys.readouterr().err
        assert "model_error: prompt of " in err
        assert "does not fit the context of 512 tokens per session (--ctx): at most 511 " \
            "prompt tokens" in err
    os.rmdir(directory)


async def test_cancel_from_another_process(runtime: ModelRuntime,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    async with running_daemon(runtime) as (server, path), Client.connect(path) as client:
        async with client.generate("hello", max_tokens=400, temperature=0.0,
                                   request_id="long-one") as stream:
            await stream.__anext__()
            assert await meshctl("--socket", path, "cancel", "long-one") == 0
            async for _ in stream:
                pass
        assert stream.done is not None
        assert stream.done.finish_reason is FinishReason.CANCELLED
        await wait_idle(server)
    assert "cancelled long-one" in capsys.readouterr().err


def test_demo_runs_the_daemon_end_to_end() -> None:
    """``meshd demo``: serve in a child process, one request through the socket, stop."""
    model = str(testmodels.test_model_path("llama"))
    result = subprocess.run(
        [sys.executable, "-m", "meshd.daemon.commands.cli", "demo", "--model", model, "--raw",
         "--prompt", "hello world", "--max-tokens", "16", "--proposer", "ngram",
         "--threads", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "finish=length" in result.stderr and "tokens=16" in result.stderr
    # while it waited, it said what the daemon was doing (its STATUS= lines), step by step
    assert "meshd demo: the daemon is loading llama" in result.stderr
    assert "meshd demo: the daemon is building the context\n" in result.stderr


def test_demo_says_why_it_gave_up_waiting() -> None:
    """A daemon that has not listened by ``--start-timeout``: the demo says so, with what
    the daemon was doing, and how to wait longer; it leaves no daemon behind."""
    model = str(testmodels.test_model_path("llama"))
    result = subprocess.run(
        [sys.executable, "-m", "meshd.daemon.commands.cli", "demo", "--model", model,
         "--start-timeout", "0.05", "--threads", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert ("meshd demo: the daemon did not start: no answer within 0.05 s: it had not "
            "said what it was doing yet") in result.stderr
    assert "give it longer with --start-timeout S" in result.stderr


# A daemon busy past the timeout, or dying while it loads, cannot be caused on demand:
# these stand-ins report over $NOTIFY_SOCKET as `meshd serve` does (sd_notify).
_REPORTING = ("import os, socket, sys, time\n"
              "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
              "for status in sys.argv[2:]:\n"
              "    s.sendto(b'STATUS=' + status.encode(), os.environ['NOTIFY_SOCKET'])\n"
              "    time.sleep(0.05)\n"
              "if sys.argv[1] == 'hang':\n"
              "    time.sleep(60)\n"
              "sys.exit(3)\n")


@pytest.mark.parametrize("ending", ["hang", "exit"])
def test_demo_reports_the_daemon_s_progress_and_last_status(
        ending: str, capsys: pytest.CaptureFixture[str]) -> None:
    directory = short_tempdir()
    try:
        statuses = ["loading m.gguf", "loading m.gguf: 50%", "measuring the verify cost: 30%"]
        status = run_demo([sys.executable, "-c", _REPORTING, ending, *statuses],
                          os.path.join(directory, "s"), ["health"], start_timeout=2)
    finally:
        assert sorted(os.listdir(directory)) == []  # its notify socket is gone
        os.rmdir(directory)
    assert status == 1
    err = capsys.readouterr().err
    assert "the daemon is loading m.gguf\n" in err  # each new step at once,
    assert "loading m.gguf: 50%" not in err  # its progress at most every 10 s
    assert "the daemon is measuring the verify cost: 30%" in err
    if ending == "hang":
        assert ("did not start: no answer within 2 s: it was still measuring the verify "
                "cost: 30%") in err
    else:
        assert ("did not start: it exited with status 3 before it listened (its error is "
                "above; it was measuring the verify cost: 30%)") in err


# ------------------------------------------------- several models: parsing and printing
# (The daemon's side of load/unload/--model is tested with the daemon; these need none.)


def test_load_unload_and_models_parse() -> None:
    parse = ctl.build_parser().parse_args
    load = parse(["load", "qwen2.5:1b", "--keep-alive", "5m", "--json"])
    assert (load.command, load.name, load.keep_alive, load.json) == \
        ("load", "qwen2.5:1b", 300.0, True)
    assert parse(["load", "m", "--keep-alive", "-1"]).keep_alive == -1.0
    assert parse(["load", "m"]).keep_alive is None
    unload = parse(["unload", "m", "--socket", "/tmp/s"])
    assert (unload.command, unload.name, unload.socket, unload.json) == \
        ("unload", "m", "/tmp/s", False)
    assert parse(["models", "--json"]).json


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_take_a_model_and_a_keep_alive(command: str) -> None:
    parse = ctl.build_parser().parse_args
    args = parse([command, "hi", "--model", "qwen2.5:1b", "--keep-alive", "0"])
    assert (args.model, args.keep_alive) == ("qwen2.5:1b", 0.0)
    args = parse([command, "hi", "--keep-alive", "1h"])
    assert (args.model, args.keep_alive) == (None, 3600.0)


def test_a_bad_duration_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["load", "m", "--keep-alive", "soon"]) == ctl.EXIT_USAGE
    assert "--keep-alive" in capsys.readouterr().err
    assert ctl.main(["load"]) == ctl.EXIT_USAGE  # the name is required
    assert "name" in capsys.readouterr().err


def test_the_models_table() -> None:
    models = [
        ModelInfo(name="qwen3-8b", n_ctx=8192, size_bytes=5_027_783_488, has_mtp=True,
                  state="loaded", default=True, proposers=("mtp", "ngram"), keep_alive_s=-1),
        ModelInfo(name="qwen2.5:1b", n_ctx=4096, size_bytes=986_046_272, loaded=False,
                  state="unloaded", keep_alive_s=300),
        ModelInfo(name="old-daemon"),  # a daemon that says no state: loaded, unknown rest
    ]
    header, *rows = ctl.models_table(models)
    assert header.split() == list(ctl.MODEL_COLUMNS)
    assert [row.split() for row in rows] == [
        ["qwen3-8b", "loaded", "yes", "5.0GB", "8192", "yes", "mtp,ngram", "forever"],
        ["qwen2.5:1b", "unloaded", "no", "986.0MB", "4096", "no", "-", "5m"],
        ["old-daemon", "loaded", "no", "-", "-", "no", "-", "-"],
    ]
    assert rows[1].index("unloaded") == header.index("STATE")  # aligned columns


@pytest.mark.parametrize(("seconds", "shown"), [
    (None, "-"), (-1, "forever"), (0, "0s"), (30, "30s"), (2.5, "2.5s"), (300, "5m"),
    (5400, "90m"), (7200, "2h"),
])
def test_keep_alive_is_shown_as_meshctl_takes_it(seconds: float | None, shown: str) -> None:
    assert ctl.format_keep_alive(seconds) == shown
    if seconds is not None and seconds >= 0:
        assert duration_seconds(shown) == seconds


class _ModelClient:
    """What ``meshctl load``/``unload`` call on a client, answering as a daemon would."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float | None]] = []

    def load(self, name: str, *, keep_alive: float | None = None) -> ModelInfo:
        self.calls.append(("load", name, keep_alive))
        return ModelInfo(name=name, state="loaded", keep_alive_s=keep_alive)

    def unload(self, name: str) -> UnloadReply:
        self.calls.append(("unload", name, None))
        busy = name == "busy"
        return UnloadReply(id="u", unloaded=not busy, model=ModelInfo(
            name=name, loaded=False, state="unloading" if busy else "unloaded"))


def test_load_and_unload_print(capsys: pytest.CaptureFixture[str]) -> None:
    client = _ModelClient()
    parse = ctl.build_parser().parse_args

    def run(*argv: str) -> tuple[str, str]:
        args = parse(list(argv))
        assert ctl.COMMANDS[args.command](client, args) == ctl.EXIT_OK  # type: ignore[arg-type]
        captured = capsys.readouterr()
        return captured.out, captured.err

    assert run("load", "m", "--keep-alive", "10m") == ("", "loaded m (keep-alive 10m)\n")
    out, _ = run("load", "m", "--json")
    assert json.loads(out)["name"] == "m" and json.loads(out)["keep_alive_s"] is None
    assert run("unload", "m") == ("", "unloaded m\n")
    assert "unloading busy: it is unloaded once its running requests end" in \
        run("unload", "busy")[1]
    out, _ = run("unload", "busy", "--json")
    assert json.loads(out)["unloaded"] is False
    assert json.loads(out)["model"]["state"] == "unloading"
    assert client.calls[:2] == [("load", "m", 600.0), ("load", "m", None)]


async def test_the_model_commands_end_to_end_against_a_stand_in(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Through the socket to the protocol tests' stand-in server (no model, no daemon)."""
    async with running_server() as (server, path):
        assert await meshctl("--socket", path, "load", "m", "--keep-alive", "5m") == 0
        assert capsys.readouterr().err == "loaded m (keep-alive 5m)\n"
        assert await meshctl("--socket", path, "load", "nosuch") == ctl.EXIT_USAGE
        assert "meshctl: unknown_model: load.model: no model 'nosuch'" in \
            capsys.readouterr().err
        assert await meshctl("--socket", path, "unload", "busy") == 0
        assert capsys.readouterr().err.startswith("unloading busy")
        assert await meshctl("--socket", path, "generate", "hi", "--model", "m2",
                             "--keep-alive", "-1", "--json") == 0
        assert json.loads(capsys.readouterr().out)["done"]["model"] == "m2"
        assert await meshctl("--socket", path, "chat", "hi", "--model", "m3") == 0
        assert "model=m3" in capsys.readouterr().err
        assert await meshctl("--socket", path, "generate", "hi", "--model", "a/b") == \
            ctl.EXIT_USAGE
        assert "bad_request: generate.model: must be a model name" in \
            capsys.readouterr().err
    sent = [(m.model, m.keep_alive) for m in server.received if isinstance(m, Generate)]
    assert sent == [("m2", -1.0), ("m3", None)]
