"""OpenAI's Predicted Outputs: ``prediction`` is drafted from by the ``prediction``
proposer (what ``auto`` becomes for such a request), the answer is the one the request
gets without it, and ``usage.completion_tokens_details`` says how much of the prediction
the answer took."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.plugins.base import ProposalRequest
from meshd.plugins.prediction import PredictionProposer
from tests.integration.helpers.daemon import assert_no_leaks, wait_idle
from tests.integration.helpers.http_api import http_daemon, openai_client

CODE = "\n".join(f"def handler_{i}(request):\n    return respond(request, code={200 + i})\n"
                 for i in range(12))
ASK = [{"role": "user", "content": "Rename respond to reply in this code and output the "
                                   "whole file:\n\n" + CODE}]


def test_drafts_what_follows_the_latest_longest_match() -> None:
    prop = PredictionProposer([1, 2, 3, 4, 5, 1, 2, 9, 9], max_len=3)

    def ask(tokens: list[int], k: int = 8) -> tuple[int, ...] | None:
        got = prop.propose(ProposalRequest(tokens=tokens, n_prompt=0, max_len=k,
                                           deadline=1e18))
        return None if got is None else got.tokens

    assert ask([7, 1, 2]) == (9, 9)        # the latest place of (1, 2)
    assert ask([2, 3, 0]) is None          # (3, 0) is not in the prediction
    assert ask([9, 1, 2, 3]) == (4, 5, 1)  # (2, 3) once: what follows it, max_len 3
    assert ask([4, 5, 1, 2]) == (9, 9)     # longest suffix 4 5 1 2 ends at the latest
    assert ask([3, 4], k=1) == (5,)


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=2048, n_seq_max=2, draft_max=8,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_prediction_is_drafted_and_changes_nothing(smol: ModelRuntime) -> None:
    predicted = CODE.replace("respond", "reply")
    async with http_daemon(smol) as (server, _path, http):
        api = openai_client(http)
        plain = await api.chat.completions.create(
            model="m", messages=ASK, max_tokens=120, temperature=0,
            extra_body={"speculative": {"enabled": False}})
        got = await api.chat.completions.create(
            model="m", messages=ASK, max_tokens=120, temperature=0,
            prediction={"type": "content", "content": predicted})
        assert got.choices[0].message.content == plain.choices[0].message.content
        extra = got.model_extra or {}
        assert extra["meshd"]["proposer"] == "prediction"
        details = got.usage.completion_tokens_details
        assert details is not None
        # (OpenAI's counters: the prediction's tokens the answer holds, and the rest)
        n_predicted = len(smol.model.tokenizer.tokenize(predicted, add_special=False))
        assert details.accepted_prediction_tokens is not None
        assert details.rejected_prediction_tokens is not None
        assert details.accepted_prediction_tokens > 0 and extra["meshd"]["accepted"] > 0
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens \
            == n_predicted
        assert plain.usage.completion_tokens_details is None
        r = await http.post("/v1/chat/completions", json={
            "messages": ASK, "prediction": {"type": "text", "content": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prediction"
        await wait_idle(server)
        assert_no_leaks(server)
