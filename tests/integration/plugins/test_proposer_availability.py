"""Every proposer the daemon lists can serve a request, and one that cannot is named
with its reason: a plugin that failed to start is unavailable (a request naming it gets
a typed error that says why), and ``composite`` drafts under ``--fixed-k`` (no measured
cost curve) instead of failing every request."""

from __future__ import annotations

import sys

import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.plugins.config import parse_table
from meshd.protocol import BadRequest, Client
from tests.integration.helpers.daemon import assert_serves, reference, running_daemon

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"

#: A plugin program that calls itself "other" (its table calls it "mine").
MISNAMED = ("from meshd.plugins import sdk\n"
            "raise SystemExit(sdk.Plugin('other', lambda ctx: [], version='1').main())\n")

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.slow
async def test_a_plugin_that_failed_to_start_is_unavailable() -> None:
    table = parse_table("mine", {"command": [sys.executable, "-c", MISNAMED],
                                 "restart_backoff_s": 60, "restart_backoff_max_s": 60})
    with ModelRuntime(RuntimeConfig(n_ctx_seq=256, calibrate=False, threads=1,
                                    plugins={"mine": table})) as rt:
        why = rt.unavailable_proposers()["mine"]
        assert "failed to start" in why and "'other'" in why
        async with running_daemon(rt) as (_, path), Client.connect(path) as client:
            assert "mine" not in client.welcome.proposers
            with pytest.raises(BadRequest) as info:
                await client.generate(PROMPT, max_tokens=4, proposer="mine").collect()
            assert info.value.message.startswith(
                "generate.speculative.proposer: proposer 'mine' cannot serve this model: "
                "the plugin failed to start")
            assert "it is 'other'" in info.value.message
            await assert_serves(path)


@pytest.mark.slow
async def test_composite_drafts_under_fixed_k() -> None:
    with ModelRuntime(RuntimeConfig(n_ctx_seq=512, calibrate=False, threads=1,
                                    draft_max=4)) as rt:  # calibrate=False: --fixed-k
        assert rt.curve is None
        prompt = rt.tokenize_prompt(PROMPT, chat=False)
        expected, _, _ = reference(rt, prompt, max_tokens=32)
        async with running_daemon(rt) as (_, path), Client.connect(path) as client:
            assert "composite" in client.welcome.proposers
            got = await client.generate(PROMPT, max_tokens=32, temperature=0.0,
                                        proposer="composite").collect()
            assert list(got.token_ids) == expected
            per = (await client.stats()).proposers["composite"]
            assert per.drafted > 0 and per.accepted > 0
