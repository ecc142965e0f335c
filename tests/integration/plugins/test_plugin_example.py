"""The example plugin (plugins/examples/snippets, installed in the test environment) in
all three ways of running it: in-process through its entry point, spawned by the daemon
over a socketpair, and connecting to the daemon's socket. Same output as no plugin,
acceptance on a workload it is made for (the snippet file holds what the model writes).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.plugins.config import parse_table
from meshd.plugins.registry import default_registry
from meshd.protocol import Client
from tests.integration.helpers.daemon import (
    assert_no_leaks,
    assert_serves,
    reference,
    running_daemon,
)

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
MAX_TOKENS = 48

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def _runtime(table: dict[str, Any]) -> ModelRuntime:
    return ModelRuntime(RuntimeConfig(
        n_ctx_seq=512, n_seq_max=2, draft_max=8, calibrate=False, threads=1,
        plugins={"snippets": parse_table("snippets", table)},
    ))


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[int], Path]]:
    """The plain greedy continuation, and a snippet file that contains it."""
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=1, calibrate=False, threads=1))
    try:
        prompt = rt.tokenize_prompt(PROMPT, chat=False)
        tokens, text, _ = reference(rt, prompt, max_tokens=MAX_TOKENS)
    finally:
        rt.close()
    path = tmp_path_factory.mktemp("snippets") / "fib.py"
    path.write_text("# unrelated\nimport os\n\n" + PROMPT + text + "\n")
    yield tokens, path


async def _generate_and_check(path: str, expected: list[int]) -> dict[str, float]:
    async with Client.connect(path) as client:
        got = await client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                    proposer="snippets").collect()
        assert list(got.token_ids) == expected
        stats = await client.stats()
    per = stats.proposers["snippets"]
    assert per.requests == 1 and per.drafted > 0 and per.accepted > 0
    return stats.counters


def test_example_is_discovered_through_its_entry_point() -> None:
    entry = {e.name: e for e in default_registry().entries()}["snippets"]
    assert entry.loaded and "meshd-snippets" in entry.origin
    assert entry.capabilities is not None and entry.capabilities.max_len == 16


@pytest.mark.slow
async def test_in_process_entry_point(workload: tuple[list[int], Path]) -> None:
    expected, snippets = workload
    with _runtime({"files": [str(snippets)]}) as rt:
        async with running_daemon(rt) as (server, path):
            await _generate_and_check(path, expected)
            assert_no_leaks(server)


@pytest.mark.slow
async def test_spawned_over_a_socketpair(workload: tuple[list[int], Path]) -> None:
    expected, snippets = workload
    table = {"command": [sys.executable, "-m", "meshd_snippets"], "files": [str(snippets)],
             "deadline_ms": 2000}
    with _runtime(table) as rt:
        async with running_daemon(rt) as (server, path):
            counters = await _generate_and_check(path, expected)
            assert counters["plugin.snippets.proposals"] > 0
            assert counters["plugin.snippets.up"] == 1
            assert not any(k.startswith("plugin.snippets.faults") for k in counters)
            assert_no_leaks(server)


@pytest.mark.slow
async def test_connecting_to_the_socket(workload: tuple[list[int], Path]) -> None:
    expected, snippets = workload
    table = {"connect": True, "files": [str(snippets)], "deadline_ms": 2000}
    with _runtime(table) as rt:
        async with running_daemon(rt) as (server, path):
            proc = subprocess.Popen([sys.executable, "-m", "meshd_snippets", "--socket", path])
            try:
                async with Client.connect(path) as client:
                    with anyio.fail_after(30):
                        while not (await client.stats()).counters.get("plugin.snippets.up"):
                            await anyio.sleep(0.05)
                counters = await _generate_and_check(path, expected)
                assert counters["plugin.snippets.proposals"] > 0
                await assert_serves(path)
            finally:
                proc.kill()
                proc.wait()
            assert_no_leaks(server)


@pytest.mark.slow
async def test_unknown_connecting_plugin_is_refused(workload: tuple[list[int], Path]) -> None:
    _, snippets = workload
    with _runtime({"files": [str(snippets)]}) as rt:  # in-process only: no connect
        async with running_daemon(rt) as (_server, path):
            proc = await anyio.run_process(
                [sys.executable, "-m", "meshd_snippets", "--socket", path], check=False)
            assert proc.returncode == 1 and b"refused" in proc.stderr
            await assert_serves(path)
