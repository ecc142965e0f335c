"""Misbehaving out-of-process plugins (real processes) never change the output or hurt
the daemon: each fault is counted, the plugin quarantined and restarted."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import anyio
import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.plugins.config import parse_table
from meshd.protocol import Client
from tests.integration.helpers import UNIT_PLUGINS
from tests.integration.helpers.daemon import (
    assert_no_leaks,
    assert_serves,
    reference,
    running_daemon,
)

BAD = str(UNIT_PLUGINS / "bad_plugin.py")
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MAX_TOKENS = 20

#: mode -> the fault it must be counted as.
FAULTS = {
    "sleep": "late", "silent": "late", "oov": "out_of_vocab", "huge": "oversize",
    "raise": "plugin_error", "exit": "disconnected", "garbage": "garbage", "flood": "flood",
}

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def bad_runtime() -> Iterator[ModelRuntime]:
    plugins = {
        mode: parse_table(mode, {
            "command": [sys.executable, BAD, mode], "deadline_ms": 100, "max_faults": 2,
            "restart_backoff_s": 0.2, "restart_backoff_max_s": 0.4,
        })
        for mode in FAULTS
    }
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1, plugins=plugins))
    yield rt
    rt.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(FAULTS))
async def test_misbehaving_plugin_is_contained(bad_runtime: ModelRuntime, mode: str) -> None:
    rt = bad_runtime
    prompt = rt.tokenize_prompt(PROMPT, chat=False)
    expected, _, _ = reference(rt, prompt, max_tokens=MAX_TOKENS)
    key = f"plugin.{mode}."
    async with running_daemon(rt) as (server, path):
        async with Client.connect(path) as client:
            got = await client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                        proposer=mode).collect()
            assert list(got.token_ids) == expected  # identical to no plugin
            # Until quarantined (2 faults) and restarted after the backoff, requests go on.
            with anyio.fail_after(30):
                while True:
                    counters = (await client.stats()).counters
                    if counters.get(key + "restarts", 0) >= 1 and \
                            counters.get(key + "quarantines", 0) >= 1:
                        break
                    again = await client.generate(PROMPT, max_tokens=MAX_TOKENS,
                                                  temperature=0.0, proposer=mode).collect()
                    assert list(again.token_ids) == expected
                    await anyio.sleep(0.1)
        assert counters[key + "faults." + FAULTS[mode]] >= 2
        if mode == "sleep":  # the late answer turned up at the next step: discarded
            assert counters[key + "stale"] >= 1
        await assert_serves(path)
        assert_no_leaks(server)
