"""What clients of OpenAI, vLLM and llama-server send, on SmolLM2: values that change
nothing (``reasoning_effort: none``, ``verbosity``, ``prompt_cache_retention``, an empty
``web_search_options``, ``reasoning_format``) are accepted and listed in
``meshd.ignored_fields``; ``chat_template_kwargs`` and ``reasoning_effort: none`` reach
the chat template; vLLM's ``repetition_penalty``, ``min_tokens`` and ``guided_*`` are
served; what would change the answer and is not served stays a 400 naming it; and
Predicted Outputs are counted as OpenAI counts them. The Agents SDK's default setup
runs against the daemon where the package is installed."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from tests.integration.helpers import DATA
from tests.integration.helpers.daemon import assert_no_leaks, wait_idle
from tests.integration.helpers.http_api import http_daemon, openai_client

pytestmark = pytest.mark.anyio

ASK = [{"role": "user", "content": "Name three colours."}]
SHORT = [{"role": "user", "content": "Reply with one word: hello."}]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=8,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


@pytest.fixture(scope="module")
def thinking() -> Iterator[ModelRuntime]:
    """SmolLM2 rendered by Qwen 3.5's template (it reads ``enable_thinking``)."""
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=4, calibrate=False,
                                    threads=1, chat_template_file=str(DATA / "qwen3.5.jinja")))
    yield rt
    rt.close()


async def _chat(http: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await http.post("/v1/chat/completions",
                           json={"messages": ASK, "max_tokens": 4, **body})


async def test_neutral_values_are_accepted_and_reported_as_ignored(smol: ModelRuntime) -> None:
    neutral = {"reasoning_effort": "none", "verbosity": "low", "prompt_cache_retention": "24h",
               "web_search_options": {}, "reasoning_format": "none", "user": "u1"}
    async with http_daemon(smol) as (server, _path, http):
        r = await _chat(http, temperature=0, **neutral)
        assert r.status_code == 200, r.text
        # (reasoning_effort none acts: it turns a reasoning template's thinking off)
        assert r.json()["meshd"]["ignored_fields"] == [
            "verbosity", "prompt_cache_retention", "web_search_options", "reasoning_format",
            "user"]
        plain = await _chat(http, temperature=0)
        assert "ignored_fields" not in plain.json()["meshd"]
        assert r.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
        r = await http.post("/v1/completions", json={
            "prompt": "Colours:", "max_tokens": 2, "reasoning_effort": "none",
            "verbosity": "medium"})
        assert r.status_code == 200, r.text
        assert r.json()["meshd"]["ignored_fields"] == ["verbosity", "reasoning_effort"]
        # streamed: the finish chunk's meshd block says it too
        r = await _chat(http, stream=True, verbosity="high")
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        assert [c["meshd"]["ignored_fields"] for c in chunks if "meshd" in c] == [["verbosity"]]
        # what would change the answer is still refused, by name
        for extra, param, needle in (
                ({"web_search_options": {"search_context_size": "low"}}, "web_search_options",
                 "not supported"),
                ({"reasoning_effort": "high"}, "reasoning_effort", "takes no reasoning effort"),
                ({"verbosity": "terse"}, "verbosity", "low, medium, high"),
                ({"reasoning_format": "yaml"}, "reasoning_format", "deepseek"),
                ({"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs",
                 "true or false"),
                ({"chat_template_kwargs": {"x": "y" * 20_000}}, "chat_template_kwargs",
                 "16384 bytes"),
                ({"repetition_penalty": 1.2, "repeat_penalty": 1.1}, "repetition_penalty",
                 "differs"),
                ({"min_tokens": 9}, "min_tokens", "max_tokens"),
                ({"guided_choice": []}, "guided_choice", "non-empty"),
                ({"guided_regex": "a", "guided_json": {}}, "guided_regex", "only one"),
                ({"guided_grammar": "root ::= x"}, "guided_grammar", "unrecognized")):
            r = await _chat(http, **extra)
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param and needle in error["message"], (extra, error)
        r = await http.post("/v1/completions", json={"prompt": "x", "reasoning_effort": "low"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
        await wait_idle(server)
        assert_no_leaks(server)


async def test_responses_take_the_agents_sdk_defaults(smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        r = await http.post("/v1/responses", json={
            "input": "Say hi.", "max_output_tokens": 4, "reasoning": {"effort": "none"},
            "text": {"verbosity": "low"}, "include": [], "prompt_cache_retention": "24h"})
        assert r.status_code == 200, r.text
        for extra, param in (({"reasoning": {"effort": "high"}}, "reasoning.effort"),
                             ({"reasoning": {"effort": "none", "depth": 3}}, "reasoning"),
                             ({"text": {"verbosity": "loud"}}, "text.verbosity")):
            r = await http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2,
                                                       **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.json())
        await wait_idle(server)
        assert_no_leaks(server)


def _prompt_of(answer: dict[str, Any]) -> str:
    return str(answer["__verbose"]["prompt"])


async def test_chat_template_kwargs_reach_the_template(thinking: ModelRuntime) -> None:
    async with http_daemon(thinking) as (server, _path, http):
        thinks = await _chat(http, verbose=True)
        assert _prompt_of(thinks.json()).endswith("assistant\n<think>\n"), thinks.text
        off = "assistant\n<think>\n\n</think>\n\n"
        for extra in ({"chat_template_kwargs": {"enable_thinking": False}},
                      {"reasoning_effort": "none"},
                      # (reasoning_effort none wins, as on llama-server)
                      {"reasoning_effort": "none",
                       "chat_template_kwargs": {"enable_thinking": True}}):
            r = await _chat(http, verbose=True, **extra)
            assert r.status_code == 200, r.text
            assert _prompt_of(r.json()).endswith(off), (extra, _prompt_of(r.json()))
            # the count of input tokens renders the prompt as the request does
            count = await http.post("/v1/chat/completions/input_tokens",
                                    json={"messages": ASK, **extra})
            assert count.json()["input_tokens"] == r.json()["usage"]["prompt_tokens"]
        assert r.json()["usage"]["prompt_tokens"] > thinks.json()["usage"]["prompt_tokens"]
        # any variable reaches it; the template's own are never replaced
        r = await _chat(http, verbose=True, chat_template_kwargs={
            "enable_thinking": False, "add_generation_prompt": False})
        assert _prompt_of(r.json()).endswith(off)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_repetition_penalty_is_llama_s_repeat_penalty_over_everything(
        smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        body = {"messages": ASK, "max_tokens": 24, "temperature": 0}
        vllm = await http.post("/v1/chat/completions", json={**body, "repetition_penalty": 1.8})
        llama = await http.post("/v1/chat/completions", json={
            **body, "repeat_penalty": 1.8, "repeat_last_n": -1})
        plain = await http.post("/v1/chat/completions", json=body)
        text = vllm.json()["choices"][0]["message"]["content"]
        assert text == llama.json()["choices"][0]["message"]["content"]
        assert text != plain.json()["choices"][0]["message"]["content"]
        await wait_idle(server)
        assert_no_leaks(server)


async def test_min_tokens_holds_the_end_back_with_and_without_speculation(
        smol: ModelRuntime) -> None:
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        short = await api.chat.completions.create(model="m", messages=SHORT,  # type: ignore[arg-type]
                                                  max_tokens=64, temperature=0)
        assert short.choices[0].finish_reason == "stop"
        assert short.usage is not None
        n = short.usage.completion_tokens
        answers = []
        for speculative in ({"enabled": False}, {"proposer": "ngram"}, None):
            extra: dict[str, Any] = {"min_tokens": n + 6, "seed": 11}
            if speculative is not None:
                extra["speculative"] = speculative
            got = await api.chat.completions.create(
                model="m", messages=SHORT, max_tokens=n + 40,  # type: ignore[arg-type]
                temperature=0.7, extra_body=extra)
            assert got.usage is not None and got.usage.completion_tokens >= n + 6, got
            answers.append(got.choices[0].message.content)
        assert answers[0] == answers[1] == answers[2]
        # the answer is the one its own prediction drafts (sample-and-match agrees)
        predicted = await api.chat.completions.create(
            model="m", messages=SHORT, max_tokens=n + 40,  # type: ignore[arg-type]
            temperature=0.7, prediction={"type": "content", "content": answers[0] or ""},
            extra_body={"min_tokens": n + 6, "seed": 11})
        assert predicted.choices[0].message.content == answers[0]
        assert (predicted.model_extra or {})["meshd"]["accepted"] > 0
        await wait_idle(server)
        assert_no_leaks(server)


async def test_guided_fields_constrain_as_response_format_does(smol: ModelRuntime) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 12}},
              "required": ["colour"], "additionalProperties": False}
    async with http_daemon(smol) as (server, _path, http):
        r = await _chat(http, max_tokens=8, guided_choice=["crimson", "teal", "ochre"])
        assert r.json()["choices"][0]["message"]["content"] in ("crimson", "teal", "ochre")
        # min_tokens holds the end back only where the constraint allows more
        r = await _chat(http, max_tokens=8, guided_choice=["teal", "ochre"], min_tokens=6)
        answer = r.json()["choices"][0]
        assert (answer["message"]["content"], answer["finish_reason"]) in (
            ("teal", "stop"), ("ochre", "stop")), r.text
        r = await _chat(http, max_tokens=8, guided_regex="[0-9]{3}-[a-z]{2}")
        assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.json()["choices"][0]["message"]["content"])
        for guided in (schema, json.dumps(schema)):
            r = await _chat(http, max_tokens=24, guided_json=guided)
            answer = r.json()["choices"][0]
            assert answer["finish_reason"] == "stop", r.text
            assert set(json.loads(answer["message"]["content"])) == {"colour"}
        r = await http.post("/v1/completions", json={"prompt": "Pick:", "max_tokens": 8,
                                                     "guided_choice": ["yes", "no"]})
        assert r.json()["choices"][0]["text"] in ("yes", "no")
        await wait_idle(server)
        assert_no_leaks(server)


CODE = "\n".join(f"def handler_{i}(request):\n    return respond(request, code={200 + i})\n"
                 for i in range(4))
EDIT = [{"role": "user", "content": "Output this code exactly as it is:\n\n" + CODE}]


async def test_prediction_counters_are_openai_s(smol: ModelRuntime) -> None:
    """Prediction tokens the answer holds are accepted, the rest rejected, whether the
    prediction was drafted from or not; the counters are there whenever a prediction
    was sent."""
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        plain = await api.chat.completions.create(
            model="m", messages=EDIT, max_tokens=100, temperature=0,  # type: ignore[arg-type]
            extra_body={"speculative": {"enabled": False}})
        answer = plain.choices[0].message.content or ""
        assert plain.usage is not None and plain.usage.completion_tokens_details is None
        total = len(smol.model.tokenizer.tokenize(answer, add_special=False))
        for speculative in ({"enabled": False}, {"proposer": "prediction"}, {"proposer": "ngram"},
                            None):
            extra = {} if speculative is None else {"speculative": speculative}
            got = await api.chat.completions.create(
                model="m", messages=EDIT, max_tokens=100, temperature=0,  # type: ignore[arg-type]
                prediction={"type": "content", "content": answer}, extra_body=extra)
            assert got.choices[0].message.content == answer
            assert got.usage is not None
            details = got.usage.completion_tokens_details
            assert details is not None, speculative
            assert (details.accepted_prediction_tokens,
                    details.rejected_prediction_tokens) == (total, 0), speculative
        # an edit in the middle: the replaced tokens are rejected, the rest accepted
        edited = answer.replace("code=201", "status=The quick brown fox jumps", 1)
        assert edited != answer
        got = await api.chat.completions.create(
            model="m", messages=EDIT, max_tokens=100, temperature=0,  # type: ignore[arg-type]
            prediction={"type": "content", "content": edited})
        details = got.usage.completion_tokens_details  # type: ignore[union-attr]
        n_edited = len(smol.model.tokenizer.tokenize(edited, add_special=False))
        assert details is not None and details.rejected_prediction_tokens is not None
        assert 0 < details.rejected_prediction_tokens < 12
        assert details.accepted_prediction_tokens == n_edited - details.rejected_prediction_tokens
        # n choices: each choice's counters, summed
        r = await http.post("/v1/chat/completions", json={
            "messages": EDIT, "max_tokens": 100, "temperature": 0, "n": 2,
            "prediction": {"type": "content", "content": answer}})
        assert r.json()["usage"]["completion_tokens_details"] == {
            "accepted_prediction_tokens": 2 * total, "rejected_prediction_tokens": 0}
        # streamed, with usage: the same counters
        stream = await api.chat.completions.create(
            model="m", messages=EDIT, max_tokens=100, temperature=0,  # type: ignore[arg-type]
            prediction={"type": "content", "content": answer}, stream=True,
            stream_options={"include_usage": True})
        last = [c async for c in stream][-1]
        assert last.usage is not None and last.usage.completion_tokens_details is not None
        assert last.usage.completion_tokens_details.accepted_prediction_tokens == total
        await wait_idle(server)
        assert_no_leaks(server)


async def test_the_agents_sdk_default_setup_runs(smol: ModelRuntime) -> None:
    """openai-agents as its docs set it up for another provider: its default model
    settings (``reasoning.effort: none``, ``verbosity: low``), on the Responses API and
    on chat completions."""
    agents = pytest.importorskip("agents")
    async with http_daemon(smol) as (server, _path, http):
        client = openai_client(http)
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_tracing_disabled(True)
        agent = agents.Agent(name="greeter", instructions="Answer in one short sentence.")
        assert agent.model_settings.reasoning is not None  # (the defaults it sends)
        result = await agents.Runner.run(agent, "Say hello.", max_turns=1)
        assert isinstance(result.final_output, str) and result.final_output
        agents.set_default_openai_api("chat_completions")
        try:
            result = await agents.Runner.run(agent, "Say hello.", max_turns=1)
        finally:
            agents.set_default_openai_api("responses")
        assert isinstance(result.final_output, str) and result.final_output
        await wait_idle(server)
        assert_no_leaks(server)
