"""What a request does when it does not say: one set of sampling defaults for the
protocol and both command lines, and ``done`` naming only a proposer that ran."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anyio
import pytest

from meshd.clients import ctl
from meshd.daemon.commands.cli import main
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.native.default_model import default_model_path
from meshd.protocol import Client, SamplingParams, Stats
from meshd.testing import testmodels
from tests.integration.helpers.daemon import running_daemon

pytestmark = pytest.mark.anyio

PROMPT = "Write a list of fruits:"
HOT = 1.5  # a temperature at which top_k/top_p change the tokens of a small model


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(model_path=None, n_ctx_seq=512, n_seq_max=1,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


def _cli_tokens(capsys: pytest.CaptureFixture[str], *extra: str) -> list[int]:
    argv = ["generate", "--model", str(default_model_path()), "--prompt", PROMPT,
            "--max-tokens", "16", "--proposer", "off", "--threads", "1", "--raw", "--json", *extra]
    assert main(argv) == 0
    return list(json.loads(capsys.readouterr().out)["tokens"])


async def test_cli_meshctl_and_protocol_sample_alike(
    smol: ModelRuntime, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same seed and temperature, nothing else said: the same tokens from
    ``meshd generate``, ``meshctl generate`` and a protocol request."""
    cli = await anyio.to_thread.run_sync(
        lambda: _cli_tokens(capsys, "--temperature", str(HOT), "--seed", "7"))
    unfiltered = await anyio.to_thread.run_sync(
        lambda: _cli_tokens(capsys, "--temperature", str(HOT), "--seed", "7",
                            "--top-k", "0", "--top-p", "1"))
    assert cli != unfiltered  # the defaults matter here, so agreeing below means something
    async with running_daemon(smol) as (_, path):
        async with Client.connect(path) as client:
            wire = await client.generate(
                PROMPT, max_tokens=16, proposer="off",
                sampling=SamplingParams(temperature=HOT, seed=7)).collect()
        assert list(wire.token_ids) == cli
        code = await anyio.to_thread.run_sync(lambda: ctl.main(
            ["--socket", path, "generate", PROMPT, "--max-tokens", "16", "--proposer", "off",
             "--temperature", str(HOT), "--seed", "7", "--json"]))
        assert code == 0
        out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        assert json.loads(out[-1])["token_ids"] == cli


async def test_unsaid_sampling_is_greedy_everywhere(smol: ModelRuntime) -> None:
    async with running_daemon(smol) as (_, path), Client.connect(path) as client:
        default = await client.generate(PROMPT, max_tokens=8, proposer="off").collect()
        greedy = await client.generate(PROMPT, max_tokens=8, proposer="off",
                                       temperature=0.0).collect()
    assert default.token_ids == greedy.token_ids


@pytest.fixture(scope="module")
def llama() -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path("llama"))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=256, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


async def test_done_names_the_proposer_only_when_it_ran(llama: ModelRuntime) -> None:
    async with running_daemon(llama) as (server, path), Client.connect(path) as client:
        # Two tokens: the prefill gives the first, the one step left has no room to draft.
        refused = await client.generate("hello", max_tokens=2, proposer="ngram",
                                        temperature=0.0).collect()
        spec = refused.done.speculation
        assert spec.proposer is None and spec.drafted == 0
        assert spec.refusals["budget"] > 0
        ran = await client.generate("hello hello hello", max_tokens=8, proposer="ngram",
                                    temperature=0.0).collect()
        assert ran.done.speculation.proposer == "ngram"
        assert ran.done.speculation.extra["proposals"] > 0
        stats = server.service.stats(Stats(id="s"))
        assert stats.proposers["ngram"].requests == 1
