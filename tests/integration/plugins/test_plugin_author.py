"""What a plugin author sees: ``python`` in a command is the daemon's interpreter (a
daemon in a venv runs the plugin in that venv), a plugin's stderr lands in the daemon's
log as events under the plugin's name, fault details read right, and the SDK declares
only the resources a plugin uses."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from structlog.testing import capture_logs

from meshd.daemon.commands.cli import main as meshd_main
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.plugins import sdk
from meshd.plugins.config import parse_table
from meshd.plugins.registry import Registry
from meshd.plugins.resources import Need, requires
from meshd.plugins.spawn import MAX_STDERR_LINE, spawn
from meshd.protocol import Client
from tests.integration.helpers import UNIT_PLUGINS
from tests.integration.helpers.daemon import assert_serves, reference, running_daemon

BAD = str(UNIT_PLUGINS / "bad_plugin.py")
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def foreign_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python``/``python3`` on PATH are another interpreter without meshd (as
    /usr/bin/python3 is for a daemon installed in a venv)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name in ("python", "python3"):
        fake = bindir / name
        fake.write_text("#!/bin/sh\necho \"$0: No module named 'meshd'\" >&2\nexit 1\n")
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")


def _runtime(tables: dict[str, dict[str, Any]]) -> ModelRuntime:
    return ModelRuntime(RuntimeConfig(
        n_ctx_seq=512, n_seq_max=2, draft_max=4, calibrate=False, threads=1,
        plugins={name: parse_table(name, table) for name, table in tables.items()}))


@pytest.mark.slow
async def test_python_in_a_command_is_the_daemons_interpreter(
        foreign_python: None, tmp_path: Path) -> None:
    snippets = tmp_path / "snippets.txt"
    snippets.write_text(PROMPT + " jumps over the lazy dog.\n")
    tables = {
        # The documented command, as written in a config file.
        "snippets": {"command": ["python", "-m", "meshd_snippets"], "files": [str(snippets)],
                     "deadline_ms": 2000},
        "raise": {"command": ["python3", BAD, "raise"]},  # the plugin calls itself "raise"
    }
    with _runtime(tables) as rt:
        async with running_daemon(rt) as (_server, path), Client.connect(path) as client:
            counters = (await client.stats()).counters
    for name in tables:
        assert counters[f"plugin.{name}.up"] == 1, counters
        assert counters[f"plugin.{name}.starts"] == 1
        assert f"plugin.{name}.faults.start_failed" not in counters


@pytest.mark.slow
async def test_a_plugins_stderr_is_logged_under_its_name(tmp_path: Path) -> None:
    missing = "meshd_test_no_such_plugin"
    table = {"command": ["python", "-m", missing]}
    with capture_logs() as logs, _runtime({"broken": table}) as rt:
        async with running_daemon(rt) as (_server, path):
            await assert_serves(path)
    lines = [e for e in logs if e["event"] == "plugin_stderr"]
    assert lines and all(e["plugin"] == "broken" for e in lines)
    assert any(f"No module named {missing}" in e["line"] for e in lines), lines
    failed = [e for e in logs if e["event"] == "plugin_start_failed"]
    assert len(failed) == 1 and failed[0]["plugin"] == "broken"
    assert f"No module named {missing}" in failed[0]["stderr"]  # the cause, with the failure


@pytest.mark.slow
async def test_fault_details_count_tokens_in_english() -> None:
    """An out-of-vocabulary answer of one token: the detail names the id and the
    vocabulary (it used to read ``1 tokens, at most 4``)."""
    table = {"command": [sys.executable, BAD, "oov"], "deadline_ms": 2000, "max_faults": 100}
    with capture_logs() as logs, _runtime({"oov": table}) as rt:
        n_vocab = rt.model.info.n_vocab
        async with running_daemon(rt) as (_server, path), Client.connect(path) as client:
            await client.generate(PROMPT, max_tokens=12, temperature=0.0,
                                  proposer="oov").collect()
    faults = [e for e in logs if e["event"] == "plugin_fault"]
    assert faults and all(e["kind"] == "out_of_vocab" for e in faults)
    for fault in faults:
        assert fault["detail"] == f"token id {n_vocab + 7}, the vocabulary has {n_vocab} ids"


# ------------------------------------------------------------------ SDK needs


def _propose(ctx: sdk.Context) -> list[int]:
    return []


@requires(Need.PROMPT_TEXT)
def _propose_reading_text(ctx: sdk.Context) -> list[int]:
    return [] if ctx.prompt_text is None else list(ctx.tokens[-1:])


@pytest.fixture
def listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           capsys: pytest.CaptureFixture[str]) -> Iterator[dict[str, list[str]]]:
    """``meshd plugins list --json``'s needs, by name, with three SDK plugins installed."""
    registry = Registry.load().copy()
    plugins = {
        "bare": sdk.Plugin("bare", _propose),
        "corpus": sdk.Plugin("corpus", _propose, corpus=lambda options: ["def f():"]),
        "reader": sdk.Plugin("reader", _propose_reading_text),
    }
    for name, plugin in plugins.items():
        registry.register(name, plugin.factory)
    monkeypatch.setattr("meshd.daemon.commands.plugins.default_registry", lambda: registry)
    config = tmp_path / "meshd.toml"
    config.write_text("")
    assert meshd_main(["plugins", "list", "-C", str(config), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    yield {row["name"]: row["needs"] for row in rows if row["name"] in plugins}


def test_the_sdk_declares_only_what_a_plugin_uses(listed: dict[str, list[str]]) -> None:
    assert listed == {"bare": [], "corpus": ["tokenizer"], "reader": ["prompt_text"]}


def test_the_sdk_refuses_needs_its_context_cannot_carry() -> None:
    @requires(Need.DRAFT_MODEL)
    def propose(ctx: sdk.Context) -> list[int]:
        return []

    with pytest.raises(ValueError, match="draft_model"):
        sdk.Plugin("drafty", propose)


def test_prompt_text_reaches_only_a_plugin_that_declares_it() -> None:
    """Both tables allow the text; the plugin whose propose does not declare it gets none."""
    seen: dict[str, set[str | None]] = {"bare": set(), "reader": set()}

    def bare(ctx: sdk.Context) -> list[int]:
        seen["bare"].add(ctx.prompt_text)
        return []

    @requires(Need.PROMPT_TEXT)
    def reader(ctx: sdk.Context) -> list[int]:
        seen["reader"].add(ctx.prompt_text)
        return []

    registry = Registry.load().copy()
    registry.register("bare", sdk.Plugin("bare", bare).factory)
    registry.register("reader", sdk.Plugin("reader", reader).factory)
    tables = {name: parse_table(name, {"allow_prompt_text": True}) for name in seen}
    with ModelRuntime(RuntimeConfig(n_ctx_seq=256, n_seq_max=1, calibrate=False, threads=1,
                                    plugins=tables), registry=registry) as rt:
        prompt = rt.tokenize_prompt(PROMPT, chat=False)
        for name in seen:
            reference(rt, prompt, max_tokens=4, proposer=name)
    assert seen["bare"] == {None}
    (text,) = seen["reader"]
    assert text is not None and PROMPT in text


async def test_stderr_lines_are_bounded(tmp_path: Path) -> None:
    """A plugin that writes one enormous stderr line does not make one enormous event."""
    script = tmp_path / "loud.py"
    script.write_text("import sys\nsys.stderr.write('x' * 100000 + '\\nbye\\n')\n")
    with capture_logs() as logs:
        proc, tail = spawn([sys.executable, str(script)], env=dict(os.environ), pass_fds=(),
                           log=structlog.get_logger("t").bind(plugin="loud"))
        await anyio.to_thread.run_sync(proc.wait)
        assert tail.wait(10) == "bye"
    lines = [e for e in logs if e["event"] == "plugin_stderr"]
    assert [len(e["line"]) for e in lines] == [MAX_STDERR_LINE, 3]
    assert lines[0].get("cut") is True and all(e["plugin"] == "loud" for e in lines)
