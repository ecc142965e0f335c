"""Connecting plugins (``connect = true``) are not up for grabs: a second process that
connects under a name that is up is refused and the first keeps serving; a table pinned
to a uid/gid refuses other users (SO_PEERCRED); the prompt's text goes only to a pinned
connecting plugin. Real plugin processes, a real daemon, a real model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.plugins.config import parse_table
from meshd.protocol import Client
from tests.integration.helpers import UNIT_PLUGINS
from tests.integration.helpers.daemon import assert_serves, running_daemon

PROBE = str(UNIT_PLUGINS / "probe_plugin.py")
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MAX_TOKENS = 16

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def _other_gid() -> int:
    """A group this process is not in."""
    mine = {os.getgid(), *os.getgroups()}
    return next(g for g in range(max(mine) + 1, max(mine) + 1000) if g not in mine)


TABLES: dict[str, dict[str, Any]] = {
    "open": {"connect": True, "allow_prompt_text": True, "deadline_ms": 2000},
    "pinned": {"connect": True, "allow_prompt_text": True, "deadline_ms": 2000,
               "uid": os.getuid(), "gid": os.getgid()},
    "other_user": {"connect": True, "uid": os.getuid() + 1},
    "other_group": {"connect": True, "gid": _other_gid()},
}


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(
        n_ctx_seq=512, n_seq_max=2, draft_max=4, calibrate=False, threads=1,
        plugins={name: parse_table(name, table) for name, table in TABLES.items()}))
    yield rt
    rt.close()


def _plugin(name: str, record: Path, path: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, PROBE, name, str(record), "--socket", path],
                            stderr=subprocess.PIPE)


@asynccontextmanager
async def _connected(name: str, record: Path, path: str,
                     ) -> AsyncIterator[subprocess.Popen[bytes]]:
    """A probe plugin connected as ``name`` (its start counted by the daemon)."""
    async with Client.connect(path) as client:
        starts = (await client.stats()).counters[f"plugin.{name}.starts"]
        proc = _plugin(name, record, path)
        try:
            with anyio.fail_after(30):
                while (await client.stats()).counters[f"plugin.{name}.starts"] == starts:
                    assert proc.poll() is None, proc.communicate()[1]
                    await anyio.sleep(0.05)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


async def _refused(name: str, record: Path, path: str) -> str:
    """Run a probe plugin that the daemon must refuse (then it exits 1); its stderr."""
    proc = _plugin(name, record, path)
    try:
        _, stderr = await anyio.to_thread.run_sync(lambda: proc.communicate(timeout=30))
    finally:
        proc.kill()  # still running after 30 s: it was accepted
        proc.wait()
    assert proc.returncode == 1, stderr
    return stderr.decode()


async def _generate(path: str, proposer: str) -> dict[str, float]:
    async with Client.connect(path) as client:
        await client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                              proposer=proposer).collect()
        stats = await client.stats()
    assert stats.proposers[proposer].drafted > 0  # the plugin's drafts were used
    return stats.counters


def _records(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in record.read_text().splitlines()]


async def test_a_second_connection_under_a_name_that_is_up_is_refused(
        runtime: ModelRuntime, tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    with capture_logs() as logs:
        async with running_daemon(runtime) as (_server, path):
            async with _connected("open", first, path) as proc:
                stderr = await _refused("open", second, path)
                assert "name_in_use" in stderr
                counters = await _generate(path, "open")
                assert proc.poll() is None  # the first plugin is still up ...
                assert counters["plugin.open.starts"] == 1 and counters["plugin.open.up"] == 1
                assert counters["plugins_refused"] >= 1
            await assert_serves(path)
    # ... and it, not the newcomer, was asked for the request's drafts.
    assert [r["pid"] for r in _records(first)] == [proc.pid]
    assert not second.exists()
    refused = [e for e in logs if e["event"] == "plugin_refused"]
    assert [(e["plugin"], e["code"]) for e in refused] == [("open", "name_in_use")]
    assert refused[0]["uid"] == os.getuid()
    ready = [e for e in logs if e["event"] == "plugin_ready" and e["plugin"] == "open"]
    assert [e["pid"] for e in ready] == [proc.pid]  # SO_PEERCRED's pid, not None


async def test_a_plugin_that_went_away_can_connect_again(
        runtime: ModelRuntime, tmp_path: Path) -> None:
    with capture_logs() as logs:
        async with running_daemon(runtime) as (_server, path):
            async with _connected("open", tmp_path / "a", path) as gone:
                pass  # killed on leaving; nothing asked it since, so nothing noticed
            async with _connected("open", tmp_path / "b", path) as proc:
                await _generate(path, "open")
    assert [r["pid"] for r in _records(tmp_path / "b")] == [proc.pid]
    # Each connection's plugin_ready names the connected process (SO_PEERCRED).
    ready = [e for e in logs if e["event"] == "plugin_ready" and e["plugin"] == "open"]
    assert [e["pid"] for e in ready] == [gone.pid, proc.pid]


@pytest.mark.parametrize("name", ["other_user", "other_group"])
async def test_a_pinned_plugin_from_another_uid_or_gid_is_refused(
        runtime: ModelRuntime, tmp_path: Path, name: str) -> None:
    with capture_logs() as logs:
        async with running_daemon(runtime) as (_server, path):
            stderr = await _refused(name, tmp_path / "r", path)
            assert "peer_not_allowed" in stderr
            async with Client.connect(path) as client:
                counters = (await client.stats()).counters
            assert counters[f"plugin.{name}.up"] == 0 and counters["plugins_refused"] == 1
            await assert_serves(path)
    refused = [e for e in logs if e["event"] == "plugin_refused"]
    assert [(e["plugin"], e["code"]) for e in refused] == [(name, "peer_not_allowed")]
    assert refused[0]["uid"] == os.getuid() and refused[0]["gid"] == os.getgid()


async def test_prompt_text_goes_only_to_a_pinned_connecting_plugin(
        runtime: ModelRuntime, tmp_path: Path) -> None:
    async with running_daemon(runtime) as (_server, path), \
            _connected("open", tmp_path / "open", path), \
            _connected("pinned", tmp_path / "pinned", path):
        await _generate(path, "open")
        await _generate(path, "pinned")
    (unpinned,) = _records(tmp_path / "open")
    (pinned,) = _records(tmp_path / "pinned")
    assert unpinned["prompt_text"] is None  # both tables allow it; only one is pinned
    assert pinned["prompt_text"] is not None and PROMPT in pinned["prompt_text"]
