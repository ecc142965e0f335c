"""One request type at the engine's door: the same request sent over the NDJSON protocol
and over HTTP reaches the scheduler as one equal engine request (prompt tokens, limits,
sampling, stop strings, compiled constraint, proposer), because both front ends hand the
service one ``RequestSpec`` and ``Service.prepare`` makes the engine request once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from meshd.daemon.commands.server import Server
from meshd.daemon.engine.cancellation import Cancellation
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.models.scheduler import GenerationHandle, GenerationRequest
from meshd.protocol import Client, Constraint, ToolFunction
from tests.integration.helpers.daemon import assert_no_leaks, wait_idle
from tests.integration.helpers.http_api import http_daemon

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["asyncio"])]

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
ANSWER = {"type": "object", "properties": {"colour": {"type": "string"}},
          "required": ["colour"], "additionalProperties": False}
MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Name a primary colour."}]


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, calibrate=False, threads=1))
    yield rt
    rt.close()


def _spy(server: Server, monkeypatch: pytest.MonkeyPatch) -> list[GenerationRequest]:
    """The engine requests the default model's scheduler is handed, in order."""
    scheduler = server.scheduler
    seen: list[GenerationRequest] = []
    submit: Callable[[GenerationRequest, Cancellation | None], GenerationHandle] = \
        scheduler.submit

    def spy(request: GenerationRequest, cancellation: Cancellation | None = None
            ) -> GenerationHandle:
        seen.append(request)
        return submit(request, cancellation)

    monkeypatch.setattr(scheduler, "submit", spy)
    return seen


CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "text, greedy": (
        {"path": "/v1/completions", "prompt": "The three primary colours are",
         "max_tokens": 12, "temperature": 0},
        {"prompt": "The three primary colours are", "max_tokens": 12, "temperature": 0.0,
         "top_k": 0, "top_p": 1.0}),
    "chat, seeded, stop strings": (
        {"path": "/v1/chat/completions", "messages": MESSAGES, "max_tokens": 16,
         "temperature": 0.8, "top_p": 0.9, "seed": 7, "stop": ["\n\n", "."]},
        {"messages": MESSAGES, "max_tokens": 16, "temperature": 0.8, "top_p": 0.9,
         "top_k": 0, "seed": 7, "stop": ["\n\n", "."]}),
    "chat, JSON schema": (
        {"path": "/v1/chat/completions", "messages": MESSAGES, "max_tokens": 24,
         "temperature": 0, "response_format": {
             "type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}}},
        {"messages": MESSAGES, "max_tokens": 24, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
         "constraint": Constraint(kind="json_schema", schema=ANSWER)}),
    "chat, tools": (
        {"path": "/v1/chat/completions", "messages": MESSAGES, "max_tokens": 24,
         "temperature": 0, "tools": [{"type": "function", "function": {
             "name": "weather", "description": "The weather in a city.",
             "parameters": WEATHER}}]},
        {"messages": MESSAGES, "max_tokens": 24, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
         "tools": [ToolFunction(name="weather", description="The weather in a city.",
                                parameters=WEATHER)]}),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_the_same_request_reaches_the_engine_equal_from_either_front_end(
        smol: ModelRuntime, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    over_http, over_native = CASES[case]
    async with http_daemon(smol) as (server, path, http):
        seen = _spy(server, monkeypatch)
        body = {k: v for k, v in over_http.items() if k != "path"}
        answer = await http.post(over_http["path"], json=body)
        assert answer.status_code == 200, answer.text
        async with Client.connect(path) as native:
            await native.generate(**over_native).collect()
        assert len(seen) == 2
        from_http, from_native = seen
        assert from_http == from_native
        assert from_http.prompt  # (a real request: rendered and tokenized)
        if "constraint" in over_native or "tools" in over_native:
            assert from_http.grammar is not None
        await wait_idle(server)
        assert_no_leaks(server)


async def test_a_prompt_of_token_ids_reaches_the_engine_as_those_ids(
        smol: ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt sent as token ids is the request's prompt (no text stands in for it): the
    ids of a text prompt reach the engine as the same request the text does."""
    async with http_daemon(smol) as (server, path, http):
        seen = _spy(server, monkeypatch)
        async with Client.connect(path) as native:
            await native.generate(prompt="The three primary colours are", max_tokens=6,
                                  temperature=0.0, top_k=0, top_p=1.0).collect()
        ids = list(seen[0].prompt)
        answer = await http.post("/v1/completions", json={
            "prompt": ids, "max_tokens": 6, "temperature": 0})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] == len(ids)
        assert len(seen) == 2 and seen[1] == seen[0]
        await wait_idle(server)
        assert_no_leaks(server)
