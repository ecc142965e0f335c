"""OpenAI's ``logprobs`` through the official client: chat's ``logprobs`` /
``top_logprobs`` and completions' ``logprobs: N``, streamed and not. Each value is the
log-softmax of the target's row that committed the token (under a constraint's mask),
and speculation on and off report the same values to 1e-4."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.protocol import Client
from tests.integration.helpers.daemon import assert_no_leaks, wait_idle
from tests.integration.helpers.http_api import http_daemon, openai_client

pytestmark = pytest.mark.anyio

COPY = [{"role": "user", "content": "Repeat exactly: alpha beta gamma delta, alpha beta "
                                    "gamma delta, alpha beta gamma delta."}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=6,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


async def test_chat_logprobs_agree_with_and_without_speculation(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        answers = []
        for enabled in (True, False):
            got = await api.chat.completions.create(
                model="m", messages=COPY, max_tokens=40, temperature=0, logprobs=True,
                top_logprobs=5, extra_body={"speculative": {"proposer": "ngram",
                                                            "enabled": enabled}})
            answers.append(got)
        on, off = answers
        assert (on.model_extra or {})["meshd"]["accepted"] > 0  # speculation did run
        assert on.choices[0].message.content == off.choices[0].message.content
        a, b = on.choices[0].logprobs.content, off.choices[0].logprobs.content
        assert len(a) == len(b) >= on.usage.completion_tokens - 1  # (the hidden end)
        assert "".join(t.token for t in a) == on.choices[0].message.content
        for x, y in zip(a, b, strict=True):
            assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-4
            assert len(x.top_logprobs) == 5
            # Greedy: the chosen token is the most likely one, and the values are
            # log-probabilities of one distribution.
            assert x.top_logprobs[0].token == x.token
            assert x.top_logprobs[0].logprob == pytest.approx(x.logprob)
            assert sum(math.exp(t.logprob) for t in x.top_logprobs) <= 1 + 1e-6
            assert bytes(x.bytes or []).decode("utf-8", "replace") == x.token
        # Streamed: the same values, chunk by chunk.
        stream = await api.chat.completions.create(
            model="m", messages=COPY, max_tokens=40, temperature=0, logprobs=True,
            top_logprobs=2, stream=True)
        streamed = [t async for c in stream if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.content or []]
        assert [t.token for t in streamed] == [t.token for t in a]
        assert all(abs(s.logprob - t.logprob) < 1e-4 for s, t in zip(streamed, a, strict=True))
        # Not asked: none.
        plain = await api.chat.completions.create(model="m", messages=COPY, max_tokens=4,
                                                  temperature=0)
        assert plain.choices[0].logprobs is None
        await wait_idle(server)
        assert_no_leaks(server)


async def test_completion_logprobs_and_constraint_mask(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        got = await api.completions.create(model="m", prompt="The colours are red, green",
                                           max_tokens=12, temperature=0, logprobs=3)
        lp = got.choices[0].logprobs
        assert lp is not None and len(lp.tokens or []) >= got.usage.completion_tokens - 1
        assert "".join(lp.tokens or []) == got.choices[0].text
        assert lp.text_offset == [sum(len(t) for t in (lp.tokens or [])[:i])
                                  for i in range(len(lp.tokens or []))]
        assert all(len(top) <= 3 for top in lp.top_logprobs or [])
        # Under a constraint the mask comes first: every alternative reported is a
        # token the grammar allows there (a prefix of "yes" or "no"), none other.
        r = await http.post("/v1/chat/completions", json={
            "messages": COPY, "max_tokens": 8, "temperature": 0, "logprobs": True,
            "top_logprobs": 20, "grammar": 'root ::= "yes" | "no"'})
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] in ("yes", "no")
        first = choice["logprobs"]["content"][0]
        assert first["top_logprobs"] and len(first["top_logprobs"]) < 20
        assert all(("yes".startswith(t["token"]) or "no".startswith(t["token"]))
                   and t["token"] for t in first["top_logprobs"])
        assert sum(math.exp(t["logprob"]) for t in first["top_logprobs"]) == \
            pytest.approx(1.0, abs=1e-6)
        for bad, param in (({"logprobs": 2}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs"),
                           ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")):
            r = await http.post("/v1/chat/completions", json={"messages": COPY, **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        await wait_idle(server)
        assert_no_leaks(server)


async def test_native_token_frames_carry_the_same_logprobs(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, path, http):
        r = await http.post("/v1/completions", json={
            "prompt": "The colours are red, green", "max_tokens": 10, "temperature": 0,
            "logprobs": 2})
        ref = r.json()["choices"][0]["logprobs"]
        async with Client.connect(path) as client:
            done = await client.generate("The colours are red, green", max_tokens=10,
                                         temperature=0.0, logprobs=2).collect()
            plain = await client.generate("The colours are red, green", max_tokens=10,
                                          temperature=0.0).collect()
        assert [lp.token for lp in done.logprobs] == list(done.token_ids)
        assert [lp.logprob for lp in done.logprobs][:len(ref["token_logprobs"])] == \
            pytest.approx(ref["token_logprobs"], abs=1e-4)
        assert all(len(lp.top) == 2 for lp in done.logprobs)
        assert plain.logprobs == () and plain.text == done.text
        await wait_idle(server)
        assert_no_leaks(server)
