"""The sampling fields clients of llama-server and OpenAI send: ``logit_bias``, the
repetition, presence and frequency penalties (over ``repeat_last_n`` tokens, prompt
included), ``min_p`` and ``typical_p``. They change the answer as llama.cpp's samplers
do, and speculation keeps the output identical with them (a verify row's penalties
count the drafts before it), greedy and seeded, on SmolLM2 and a hybrid qwen35."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest

from meshd.daemon.engine.sampling import Sampler, SamplingParams
from meshd.daemon.models.runtime import ModelRuntime
from tests.integration.helpers.daemon import KindRuntimes, assert_no_leaks, meshctl, wait_idle
from tests.integration.helpers.http_api import http_daemon

COPY = "Copy this list exactly: apple, banana, apple, cherry, banana, apple, cherry, apple."


def test_penalties_follow_llama_cpp() -> None:
    logits = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0,
                                     presence_penalty=0.25, frequency_penalty=0.5,
                                     repeat_last_n=3, logit_bias=((2, 10.0),)))
    # Token 0 is outside the last 3; token 1 (negative) twice; token 3 once.
    got = sampler.adjusted(logits, [0, 1, 3, 1])
    assert got.tolist() == pytest.approx([2.0, -2.0 - 1.0 - 0.25, 10.5, 1.5 - 0.5 - 0.25])
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0]  # the row itself is not changed
    assert sampler.match_rows(logits[None, :], (), [0, 1, 3, 1]) == [2]


def test_min_p_and_typical_p_keep_only_their_tokens() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float64)).astype(np.float32)
    seen_min_p = {Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5,
                                         seed=s)).sample(logits) for s in range(200)}
    assert seen_min_p == {0, 1}  # 0.15 and 0.05 are under half of 0.5
    seen_typical = {Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0,
                                           typical_p=0.2, seed=s)).sample(logits)
                    for s in range(200)}
    # Entropy 1.14 nats: token 1's surprise (1.20) is the closest, not token 0's (0.69).
    assert seen_typical == {1}


runtime = KindRuntimes(acceptance=0.9, n_ctx_seq=512, n_seq_max=2, draft_max=6,
                       calibrate=False, threads=1)


@pytest.fixture(scope="module", autouse=True)
def _close_runtimes() -> Iterator[None]:
    yield
    runtime.close()


def _prompt(rt: ModelRuntime) -> list[int]:
    try:
        return rt.tokenize_prompt(rt.render_chat([{"role": "user", "content": COPY}]),
                                  chat=True)
    except ValueError:
        return rt.tokenize_prompt(COPY, chat=False)


def _run(rt: ModelRuntime, proposer: str, params: SamplingParams) -> list[int]:
    gen = rt.generation(_prompt(rt), max_tokens=48, proposer=proposer, sampling=params)
    for _ in rt.run(gen):
        pass
    return list(gen.committed)


@pytest.mark.parametrize("kind, proposers", [("smol", ("ngram",)),
                                             ("qwen35", ("ngram", "mtp"))])
def test_speculation_keeps_output_identical_with_every_field(kind: str,
                                                             proposers: tuple[str, ...]
                                                             ) -> None:
    rt = runtime(kind)
    plain = _run(rt, "off", SamplingParams(temperature=0.0))
    banned = plain[len(plain) // 2]
    cases = [
        SamplingParams(temperature=0.0, repeat_penalty=1.3),
        SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, logit_bias=((banned, -100.0),)),
        SamplingParams(temperature=0.8, seed=3, min_p=0.1, typical_p=0.9,
                       repeat_penalty=1.1, repeat_last_n=16),
    ]
    changed = 0
    for params in cases:
        off = _run(rt, "off", params)
        changed += off != plain
        if params.logit_bias:
            assert banned not in off
        for proposer in proposers:
            assert _run(rt, proposer, params) == off, (kind, proposer, params)
    # The fields do change the answer (the synthetic model's logit margins are wide by
    # design: there only the ban is sure to).
    assert changed >= (3 if kind == "smol" else 1)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_http_fields_reach_the_sampler() -> None:
    rt = runtime("smol")
    body = {"messages": [{"role": "user", "content": COPY}], "max_tokens": 40,
            "temperature": 0}
    async with http_daemon(rt) as (server, _path, http):
        plain = (await http.post("/v1/chat/completions", json=body)).json()
        comma = (await http.post("/tokenize", json={"content": ","})).json()["tokens"][0]
        for extra in ({"logit_bias": {str(comma): -100}}, {"logit_bias": [[comma, False]]}):
            r = await http.post("/v1/chat/completions", json={**body, **extra})
            assert r.status_code == 200, r.text
            assert "," not in r.json()["choices"][0]["message"]["content"]
        r = await http.post("/v1/chat/completions", json={
            **body, "presence_penalty": 1.5, "frequency_penalty": 1.0, "repeat_last_n": -1})
        assert r.json()["choices"][0]["message"]["content"] != \
            plain["choices"][0]["message"]["content"]
        r = await http.post("/v1/chat/completions", json={**body, "logit_bias": {"99999999": 1}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
        await wait_idle(server)
        assert_no_leaks(server)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_meshctl_takes_the_fields(capsys: pytest.CaptureFixture[str]) -> None:
    rt = runtime("smol")
    comma = rt.model.tokenizer.tokenize(",", add_special=False)[0]
    async with http_daemon(rt) as (server, path, _http):
        code = await meshctl("--socket", path, "chat", COPY, "--max-tokens", "30", "--json",
                             "--logit-bias", f"{comma}=-100", "--repeat-penalty", "1.2",
                             "--min-p", "0.05")
        assert code == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("{"))
        assert "," not in json.loads(line)["text"]
        code = await meshctl("--socket", path, "generate", "x", "--presence-penalty", "9")
        assert code == 2 and "presence_penalty" in capsys.readouterr().err
        await wait_idle(server)
        assert_no_leaks(server)
