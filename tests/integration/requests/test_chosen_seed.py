"""Speculation for sampled requests: an unseeded sampled request gets a seed.

A request that asks for a temperature but no seed gets a seed chosen by the daemon,
reported in ``done``; drafts are verified by sample-and-match, so such a request
speculates, and sending the reported seed back replays the same tokens, with
speculation on or off, for every installed proposer (and auto). A request that gives
only a prompt (the wire's defaults throughout) drafts on a copy workload.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshd.daemon.engine.sampling import GREEDY, SamplingParams, with_chosen_seed
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.plugins.config import parse_table
from meshd.plugins.registry import default_registry
from meshd.policy.costs import CostCurve
from meshd.protocol import Client
from meshd.testing import testmodels
from tests.integration.helpers.daemon import running_daemon, wait_idle

#: What each proposer needs besides the model: a draft model (the synthetic llama drafts
#: for every synthetic model, itself included) or an MTP head (qwen35, mimo2).
NEEDS_MTP = {"mtp"}
#: Synthetic models rarely repeat a bigram: single-token matches make n-gram drafts.
OPTIONS: dict[str, dict[str, object]] = {"ngram": {"min_n": 1},
                                         "composite": {"ngram": {"min_n": 1}},
                                         "snippets": {"min_match": 1}}

#: A prompt whose continuation copies it: six identical blocks, the model writes more.
COPY_PROMPT = "".join(
    f"item {i}: the {c} box holds {n} bolts and {n + 3} nuts\n"
    for _ in range(6)
    for i, (c, n) in enumerate([("red", 12), ("blue", 40), ("green", 7), ("grey", 19)])
)


def _proposers(kind: str) -> list[str]:
    """Every installed proposer that can run on ``kind``, and ``auto``."""
    names = sorted(e.name for e in default_registry().entries() if e.loaded)
    return ["auto", *(n for n in names if n not in NEEDS_MTP or kind != "llama")]


def _synthetic(kind: str, corpus: str | None = None) -> ModelRuntime:
    path = str(testmodels.test_model_path(kind, acceptance=0.9))
    plugins = {} if corpus is None else {
        "snippets": parse_table("snippets", {"files": [corpus], "allow_prompt_text": True})}
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=2,
                                    draft_max=6, calibrate=False, threads=1,
                                    plugins=plugins),
                      registry=default_registry())
    # A cheap-verify cost curve (like F32/F16 models) so the composite speculates.
    rt.curve = CostCurve.sanitized([1.0 + 0.15 * k for k in range(7)])
    return rt


def _run(rt: ModelRuntime, prompt: list[int], sampling: SamplingParams,
         proposer: str, options: dict[str, object] | None = None
         ) -> tuple[list[int], int, dict[str, int]]:
    name = proposer
    if proposer == "draft":
        name = f"draft:{testmodels.test_model_path('llama')}"
    gen = rt.generation(prompt, max_tokens=60, sampling=sampling, proposer=name,
                        adaptive=False, proposer_options=options or OPTIONS.get(proposer))
    for _ in rt.run(gen):
        pass
    return list(gen.committed), gen.stats.verify_calls, dict(gen.stats.refusals)


def test_greedy_and_seeded_parameters_are_kept() -> None:
    assert with_chosen_seed(GREEDY) is GREEDY
    seeded = SamplingParams(temperature=0.7, seed=42)
    assert with_chosen_seed(seeded) is seeded


@pytest.mark.parametrize("kind", ["llama", "mimo2", "qwen35"])
def test_a_chosen_seed_replays_with_and_without_speculation(kind: str,
                                                             tmp_path: Path) -> None:
    text = "sampled by a chosen seed"
    # The snippets plugin drafts from files: give it one that holds the prompt.
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text * 4)
    rt = _synthetic(kind, str(corpus))
    try:
        prompt = rt.tokenize_prompt(text, chat=False)
        sampling = with_chosen_seed(SamplingParams(temperature=0.8, top_k=40, top_p=0.95))
        assert sampling.seed is not None and sampling.exact_verifiable
        ref, _, _ = _run(rt, prompt, sampling, "off")
        assert len(ref) == 60
        proposers = _proposers(kind)
        assert {"auto", "ngram", "composite", "draft"} <= set(proposers)
        assert ("mtp" in proposers) == (kind != "llama")
        for proposer in proposers:
            # A predicted output (the prediction proposer) is the answer the client expects.
            options = {"tokens": ref} if proposer == "prediction" else None
            got, verifies, refusals = _run(rt, prompt, sampling, proposer, options)
            assert got == ref, proposer
            assert verifies > 0 and "unseeded_sampling" not in refusals, proposer
    finally:
        rt.close()


@pytest.fixture(scope="module")
def smollm2_runtime() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=8,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


@pytest.mark.anyio
@pytest.mark.slow
# Speculation's choice, made on the compute thread: one event-loop backend is enough (the
# others in this file run on every backend).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_unseeded_sampled_request_drafts(smollm2_runtime: ModelRuntime) -> None:
    """Sampling without a seed (temperature 0.8) on a copy workload speculates."""
    rt = smollm2_runtime
    async with running_daemon(rt) as (server, path), Client.connect(path) as client:
        # Sampled text may still wander off or end early: judge a few requests together.
        runs = [await client.generate(COPY_PROMPT, max_tokens=48, temperature=0.8).collect()
                for _ in range(3)]
        await wait_idle(server)
    seeds = {run.done.seed for run in runs}
    assert None not in seeds and len(seeds) == 3  # chosen per request: samples still vary
    stats = [run.done.speculation for run in runs]
    assert all("unseeded_sampling" not in sp.refusals for sp in stats)
    assert sum(sp.drafted for sp in stats) > 0 and sum(sp.accepted for sp in stats) > 0


@pytest.mark.anyio
@pytest.mark.slow
# Speculation's choice, made on the compute thread: one event-loop backend is enough (the
# others in this file run on every backend).
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_request_that_gives_only_a_prompt_drafts(smollm2_runtime: ModelRuntime,
                                                        ) -> None:
    """A plain API request (a prompt and nothing else: the wire's sampling defaults, the
    daemon's default proposer and length) on a copy workload speculates."""
    rt = smollm2_runtime
    config = ServerConfig(max_tokens_default=48)
    async with running_daemon(rt, config) as (server, path), Client.connect(path) as client:
        runs = [await client.generate(COPY_PROMPT).collect() for _ in range(2)]
        await wait_idle(server)
    assert all(0 < len(run.token_ids) <= 48 for run in runs)
    stats = [run.done.speculation for run in runs]
    assert all(not sp.refusals.get("unseeded_sampling") for sp in stats)
    assert sum(sp.drafted for sp in stats) > 0 and sum(sp.accepted for sp in stats) > 0


@pytest.mark.anyio
async def test_done_reports_the_seed_that_replays_the_request() -> None:
    rt = _synthetic("llama")
    try:
        async with running_daemon(rt) as (server, path), Client.connect(path) as client:
            chosen = await client.generate("replay me", max_tokens=30, temperature=0.8,
                                           proposer="ngram").collect()
            seed = chosen.done.seed
            assert seed is not None
            again = await client.generate("replay me", max_tokens=30, seed=seed,
                                          temperature=0.8, proposer="off").collect()
            greedy = await client.generate("replay me", max_tokens=5,
                                           temperature=0.0).collect()
            await wait_idle(server)
        assert again.done.seed == seed
        assert list(again.token_ids) == list(chosen.token_ids)
        assert greedy.done.seed is None
    finally:
        rt.close()


@pytest.mark.anyio
async def test_the_daemons_seed_serves_every_unseeded_request(
        smollm2_runtime: ModelRuntime) -> None:
    """``--seed N`` (llama-server's): a sampled request that sends no seed is sampled
    with N, natively and over HTTP, so equal requests give equal answers; one that sends
    its own seed keeps it."""
    config = ServerConfig(seed=42)
    async with running_daemon(smollm2_runtime, config) as (server, path), \
            Client.connect(path) as client:
        runs = [await client.generate("the same request", max_tokens=30,
                                      temperature=0.9).collect() for _ in range(2)]
        own = await client.generate("the same request", max_tokens=30, temperature=0.9,
                                    seed=7).collect()
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://meshd",
                                     timeout=60) as http:
            body = {"prompt": "the same request", "max_tokens": 30, "temperature": 0.9}
            oai = [(await http.post("/v1/completions", json=body)).json() for _ in range(2)]
            llama = [(await http.post("/completion", json={
                "prompt": "the same request", "n_predict": 30, "temperature": 0.9,
            })).json() for _ in range(2)]
            props = (await http.get("/props")).json()
            assert props["default_generation_settings"]["params"]["seed"] == 42
        await wait_idle(server)
    assert [r.done.seed for r in runs] == [42, 42] and own.done.seed == 7
    assert list(runs[0].token_ids) == list(runs[1].token_ids) != list(own.token_ids)
    assert [r["meshd"]["seed"] for r in oai] == [42, 42]
    # (each API has its own sampling defaults, so only its own answers compare)
    assert oai[0]["choices"][0]["text"] == oai[1]["choices"][0]["text"]
    assert llama[0]["content"] == llama[1]["content"]
