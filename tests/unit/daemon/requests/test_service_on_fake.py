"""The request lifecycle (``Service.prepare``'s checks, the run, its end) through the
NDJSON front end, against the fake runtime: what a client sees."""

from __future__ import annotations

import pytest

from meshd.protocol import BadRequest, Client, ModelError, UnknownModel
from meshd.testing.fake_runtime import STORY
from tests.unit.daemon.fake_daemon import N_CTX, fake_daemon, fake_model_runtime

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_generation_answers_as_the_model_says(monkeypatch: pytest.MonkeyPatch) -> None:
    async with fake_daemon(fake_model_runtime(monkeypatch)) as (_, path), \
            Client.connect(path, client_name="t") as client:
        plain = await client.generate("Once upon", max_tokens=20, temperature=0.0,
                                      proposer="off").collect()
        drafted = await client.generate("Once upon", max_tokens=20, temperature=0.0,
                                        proposer="ngram").collect()
    assert plain.text == STORY[len("Once upon"):][:20]
    assert plain.done.finish_reason.value == "length" and len(plain.token_ids) == 20
    assert drafted.token_ids == plain.token_ids


async def test_stop_strings_and_the_end_of_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    async with fake_daemon(fake_model_runtime(monkeypatch)) as (_, path), \
            Client.connect(path, client_name="t") as client:
        stopped = await client.generate("Once upon", stop=["fox"], temperature=0.0).collect()
        ended = await client.generate("Once upon", temperature=0.0).collect()
    answer = STORY[len("Once upon"):]
    assert (stopped.text, stopped.done.finish_reason.value) == (answer[:answer.index("fox")],
                                                                "stop")
    assert (ended.text, ended.done.finish_reason.value) == (answer, "eog")


async def test_prepare_refuses_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    async with fake_daemon(fake_model_runtime(monkeypatch)) as (_, path), \
            Client.connect(path, client_name="t") as client:
        with pytest.raises(BadRequest, match="proposer"):
            await client.generate("Once upon", max_tokens=4, proposer="no-such").collect()
        with pytest.raises(BadRequest, match="max_tokens"):
            await client.generate("Once upon", max_tokens=N_CTX + 1).collect()
        with pytest.raises(ModelError):
            await client.generate("x" * (N_CTX + 10), max_tokens=4).collect()
        with pytest.raises(UnknownModel):
            await client.generate("Once upon", max_tokens=4, model="other").collect()
        # The daemon goes on serving after each refusal.
        done = await client.generate("Once upon", max_tokens=3, temperature=0.0).collect()
    assert done.text == " a "


async def test_a_chat_request_is_rendered_with_the_model_template(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with fake_daemon(fake_model_runtime(monkeypatch)) as (_, path), \
            Client.connect(path, client_name="t") as client:
        chat = await client.generate(messages=[{"role": "user", "content": "hi"}],
                                     temperature=0.0).collect()
    # "user: hi\nassistant:" is not in the story, so the toy model tells it from the start.
    assert (chat.text, chat.done.finish_reason.value) == (STORY, "eog")
    # The rendered text is the prompt, tokenized without a BOS of its own.
    assert chat.done.usage.prompt_tokens == len("user: hi\nassistant:")
