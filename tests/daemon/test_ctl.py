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
from meshd.daemon.runtime import ModelRuntime, RuntimeConfig
from meshd.native import testmodels
from meshd.protocol import Client, FinishReason

from .daemon_helpers import meshctl, reference, running_daemon, short_tempdir, wait_idle

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
        assert "arch=llama" in capsys.readouterr().out
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
        assert await meshctl("--socket", path, "chat", "hi") == ctl.EXIT_USAGE
        assert "chat template" in capsys.readouterr().err
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
        [sys.executable, "-m", "meshd.daemon.cli", "demo", "--model", model, "--raw",
         "--prompt", "hello world", "--max-tokens", "16", "--proposer", "ngram",
         "--threads", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "finish=length" in result.stderr and "tokens=16" in result.stderr
