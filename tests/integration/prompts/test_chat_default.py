"""Instruct models get their chat template the way users of chat front-ends expect, and
raw text is never sent to one silently."""

from __future__ import annotations

import io
import json
import sys

import pytest
from structlog.testing import capture_logs

from meshd.daemon.commands.cli import main
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from tests.integration.helpers.daemon import meshctl, running_daemon


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_generate_reads_the_prompt_from_stdin(capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    question = "Write a haiku about rivers."
    argv = ["generate", "--max-tokens", "6", "--fixed-k", "-t", "1", "--json"]
    assert main([*argv, "-p", question]) == 0
    direct = json.loads(capsys.readouterr().out)
    monkeypatch.setattr("sys.stdin", io.StringIO(question))
    assert main([*argv, "-p", "-"]) == 0
    piped = json.loads(capsys.readouterr().out)
    assert piped["tokens"] == direct["tokens"] and piped["chat"] is True
    # The default instruct model answers through its template instead of ending at once.
    assert len(direct["tokens"]) == 6 and direct["text"].strip()


@pytest.mark.anyio
async def test_meshctl_generate_says_it_skips_the_chat_template(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """To a person (stderr a terminal) only: a script calling ``generate`` in a loop on
    purpose would get the note on every call."""
    with capture_logs(), ModelRuntime(RuntimeConfig(n_ctx_seq=256, calibrate=False,
                                                    threads=1)) as rt:
        async with running_daemon(rt) as (_, path):
            for command, terminal, noted in (("generate", True, True),
                                             ("generate", False, False),
                                             ("chat", True, False)):
                monkeypatch.setattr(sys.stderr, "isatty", lambda t=terminal: t)
                status = await meshctl("--socket", path, command, "hi", "--max-tokens", "2")
                assert status == 0
                err = capsys.readouterr().err
                assert ("sent as raw text without the model's chat template" in err) is noted
