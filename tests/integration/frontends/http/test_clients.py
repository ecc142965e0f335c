"""Third-party clients as their own docs show them, against the daemon on SmolLM2:
LangChain's ``OpenAI(...).batch()`` (one ``/v1/completions`` request with a list of
prompts), its chat model's ``bind_tools`` and ``with_structured_output``, pydantic-ai's
structured output and streaming, instructor's tool mode and the ``llm`` CLI with a
model configured in ``extra-openai-models.yaml``. Each is skipped where its package is
not installed. (The Agents SDK's default setup is in ``test_client_fields.py``; the
``ollama`` client in ``test_ollama_api.py``.) The matrix in docs/http-api.md ("Clients")
records what these and the other clients were measured to do."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest
from pydantic import BaseModel

from meshd.daemon.commands.server import serving
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from tests.integration.helpers.daemon import (
    assert_no_leaks,
    running_daemon,
    short_tempdir,
    wait_idle,
)

pytestmark = pytest.mark.anyio

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):"]


class City(BaseModel):
    name: str
    country: str



@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=4, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


def _uds_client(path: str, bodies: list[dict[str, Any]]) -> httpx.Client:
    """A blocking client on the daemon's socket that records each request's body."""
    def record(request: httpx.Request) -> None:
        bodies.append(json.loads(request.read() or b"{}"))

    return httpx.Client(transport=httpx.HTTPTransport(uds=path), timeout=60,
                        event_hooks={"request": [record]})


async def test_langchain_batch_is_one_completions_request_with_every_prompt(
        smol: ModelRuntime) -> None:
    """``OpenAI(...).batch()`` sends its prompts as one list; each answer is the one the
    prompt gets alone."""
    langchain_openai = pytest.importorskip("langchain_openai")
    async with running_daemon(smol) as (server, path):
        bodies: list[dict[str, Any]] = []
        with _uds_client(path, bodies) as http:
            llm = langchain_openai.OpenAI(base_url="http://meshd/v1", api_key="unused",
                                          model="smollm2", max_tokens=8, temperature=0,
                                          max_retries=0, http_client=http)
            batch = await anyio.to_thread.run_sync(llm.batch, PROMPTS)
            alone = [await anyio.to_thread.run_sync(llm.invoke, p) for p in PROMPTS]
        assert bodies[0]["prompt"] == PROMPTS, "batch() sent its prompts one by one"
        assert len(bodies) == 1 + len(PROMPTS)
        assert batch == alone and all(batch)
        await wait_idle(server)
        assert_no_leaks(server)


async def test_langchain_chat_tools_and_structured_output(smol: ModelRuntime) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    tools = pytest.importorskip("langchain_core.tools")

    @tools.tool
    def get_weather(city: str) -> str:
        """Get the weather in a city."""
        return "sunny"

    async with running_daemon(smol) as (server, path):
        bodies: list[dict[str, Any]] = []
        with _uds_client(path, bodies) as http:
            chat = langchain_openai.ChatOpenAI(
                base_url="http://meshd/v1", api_key="unused", model="smollm2",
                max_tokens=100, temperature=0, max_retries=0, http_client=http)
            called = await anyio.to_thread.run_sync(
                chat.bind_tools([get_weather], tool_choice="get_weather").invoke,
                "What is the weather in Paris?")
            assert [c["name"] for c in called.tool_calls] == ["get_weather"]
            assert set(called.tool_calls[0]["args"]) == {"city"}
            for method in ("json_schema", "function_calling"):
                city = await anyio.to_thread.run_sync(
                    chat.with_structured_output(City, method=method).invoke, "Describe Paris.")
                assert isinstance(city, City)
        assert bodies[1]["response_format"]["type"] == "json_schema"
        assert bodies[2]["tool_choice"]["function"]["name"] == "City"
        await wait_idle(server)


async def test_pydantic_ai_structured_output_and_streaming(smol: ModelRuntime) -> None:
    pytest.importorskip("pydantic_ai.models.openai")
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    async with running_daemon(smol) as (server, path), httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=path), timeout=60) as http:
        client = openai.AsyncOpenAI(base_url="http://meshd/v1", api_key="unused",
                                    http_client=http, max_retries=0)
        model = OpenAIChatModel("smollm2", provider=OpenAIProvider(openai_client=client))
        settings = ModelSettings(max_tokens=100, temperature=0)
        for output in (City, NativeOutput(City)):  # a tool call; response_format
            result = await Agent(model, output_type=output, model_settings=settings
                                 ).run("Describe Paris.")
            assert isinstance(result.output, City)
        async with Agent(model, model_settings=ModelSettings(max_tokens=16, temperature=0)
                         ).run_stream("Say hello.") as streamed:
            pieces = [t async for t in streamed.stream_text(delta=True)]
        assert len(pieces) > 1 and "".join(pieces).strip()
        await wait_idle(server)


async def test_instructor_tools_mode(smol: ModelRuntime) -> None:
    instructor = pytest.importorskip("instructor")
    async with running_daemon(smol) as (server, path), httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=path), timeout=60) as http:
        client = instructor.from_openai(openai.AsyncOpenAI(
            base_url="http://meshd/v1", api_key="unused", http_client=http, max_retries=0))
        city = await client.chat.completions.create(
            model="smollm2", response_model=City, max_tokens=100, temperature=0,
            max_retries=0, messages=[{"role": "user", "content": "Describe Paris."}])
        assert isinstance(city, City)
        await wait_idle(server)


async def test_llm_cli_with_an_extra_openai_model(smol: ModelRuntime) -> None:
    """``llm`` with meshd's ``--http`` listener in ``extra-openai-models.yaml``: a chat
    model (streamed, and with ``--schema``) and a completion model."""
    llm = shutil.which("llm", path=os.path.dirname(sys.executable))
    if llm is None:
        pytest.skip("the llm CLI is not installed")
    home = short_tempdir()
    try:
        async with serving(smol, f"{home}/s", http="tcp:127.0.0.1:0") as server:
            assert server.http_listener is not None
            port = server.http_listener.address.rpartition(":")[2]
            base = f"http://127.0.0.1:{port}/v1"
            with open(f"{home}/extra-openai-models.yaml", "w") as f:
                f.write(f"- model_id: meshd\n  model_name: smollm2\n  api_base: {base}\n"
                        f"  supports_schema: true\n"
                        f"- model_id: meshd-text\n  model_name: smollm2\n  api_base: {base}\n"
                        f"  completion: true\n")
            env = {**os.environ, "LLM_USER_PATH": home}

            async def run(*argv: str) -> str:
                done = await anyio.run_process([llm, *argv, "-o", "temperature", "0"],
                                               env=env, check=False)
                assert done.returncode == 0, done.stderr.decode()
                return done.stdout.decode()

            assert (await run("-m", "meshd", "Say hello.", "-o", "max_tokens", "8")).strip()
            answer = await run("-m", "meshd", "--schema", "name, country", "Describe Paris.",
                               "-o", "max_tokens", "60")
            assert set(json.loads(answer)) == {"name", "country"}
            assert (await run("-m", "meshd-text", "Once upon a time",
                              "-o", "max_tokens", "8")).strip()
            await wait_idle(server)
    finally:
        shutil.rmtree(home, ignore_errors=True)
