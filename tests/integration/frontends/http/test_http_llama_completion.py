"""llama-server's own completion endpoint, ``POST /completion`` (and ``/completions``), on
SmolLM2, as its clients see it: the same text as the OpenAI endpoint, its prompt forms
(text, token ids, both mixed, several prompts), ``n_probs`` and ``post_sampling_probs``,
``logit_bias`` (a ban written ``false``, text), ``ignore_eos``, the stream (no
``[DONE]``), ``response_fields``, and its bounded inputs refused with a 400."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from meshd.daemon.commands.server import Server
from meshd.daemon.frontends.http.llama.completion_format import pick_fields
from meshd.daemon.frontends.http.llama.completion_request import MAX_N_PROBS, parse_llama_request
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.api_errors import ApiError
from tests.integration.helpers.daemon import assert_no_leaks, wait_idle
from tests.integration.helpers.http_api import http_daemon

pytestmark = pytest.mark.anyio

PROMPT = "I believe the meaning of life is"
CHAT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=2, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


@pytest.fixture
async def daemon(smol: ModelRuntime) -> AsyncIterator[tuple[Server, httpx.AsyncClient]]:
    async with http_daemon(smol) as (server, _path, http):
        yield server, http
        await wait_idle(server)
        assert_no_leaks(server)


async def _post(http: httpx.AsyncClient, body: dict[str, Any], path: str = "/completion"
                ) -> Any:
    r = await http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def _events(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = await http.post("/completion", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    records = [b for b in r.text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in records)
    assert records[-1] != "data: [DONE]"  # llama-server sends none on this endpoint
    return [json.loads(b.removeprefix("data: ")) for b in records]


# ------------------------------------------------------------------ without a model


def test_parse_defaults_and_bounds() -> None:
    req = parse_llama_request({"prompt": "x"})
    assert (req.sampling.temperature, req.sampling.top_k, req.sampling.top_p,
            req.sampling.min_p) == (0.8, 40, 0.95, 0.05)  # llama-server's defaults
    assert req.sampling.seed is not None  # one seed for all of its prompts
    assert req.n_predict is None and req.stream is False
    req = parse_llama_request({"prompt": ["a", [1, 2], [3, "b"], {"prompt_string": "c"}],
                               "temperature": 0, "top_p": 0, "top_k": -3, "seed": -1,
                               "logit_bias": {"15": False, " the": -1.5, "bad": "x"},
                               "unknown_field": {"any": 1}, "samplers": ["top_k"]})
    assert req.prompts == (("a",), (1, 2), (3, "b"), ("c",))
    assert req.sampling.seed is None and req.sampling.top_k == 0 and req.sampling.top_p > 0
    assert req.logit_bias == ((15, -math.inf), (" the", -1.5))
    for body, param in (({}, "prompt"), ({"prompt": []}, "prompt"),
                        ({"prompt": [["a", "b"]]}, "prompt[0]"),
                        ({"prompt": "x", "n_probs": MAX_N_PROBS + 1}, "n_probs"),
                        ({"prompt": ["x"] * 17}, "prompt"),
                        ({"prompt": ["x", "y"], "n_cmpl": 9}, "n_cmpl"),
                        ({"prompt": "x", "n_predict": -2}, "n_predict"),
                        ({"prompt": "x", "temperature": "hot"}, "temperature"),
                        ({"prompt": "x", "stop": ["a"] * 17}, "stop"),
                        ({"prompt": "x", "logit_bias": [[1, 2]] * 4097}, "logit_bias"),
                        ({"prompt": "x", "mirostat": 2}, "mirostat"),
                        ({"prompt": {"prompt_string": "x", "multimodal_data": ["AA=="]}},
                         "prompt")):
        with pytest.raises(ApiError) as err:
            parse_llama_request(body)
        assert err.value.status == 400 and err.value.param == param, body


def test_response_fields() -> None:
    body = {"content": "x", "generation_settings": {"n_predict": 3}, "timings": {}}
    assert pick_fields(body, ["content", "generation_settings/n_predict", "nope", "x/y"]) \
        == {"content": "x", "generation_settings/n_predict": 3}
    assert pick_fields(body, []) == body


# ------------------------------------------------------------------ on SmolLM2


async def test_greedy_answer_equals_openai_text(
        daemon: tuple[Server, httpx.AsyncClient], smol: ModelRuntime) -> None:
    _server, http = daemon
    body = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "return_tokens": True}
    got = await _post(http, body)
    ref = await _post(http, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0},
                      "/v1/completions")
    assert got["content"] == ref["choices"][0]["text"]
    assert got["tokens_predicted"] == len(got["tokens"]) == 12
    assert smol.model.tokenizer.detokenize(got["tokens"]) == got["content"]
    assert got["tokens_evaluated"] == ref["usage"]["prompt_tokens"]
    assert got["timings"]["predicted_n"] == 12
    assert (got["stop"], got["stop_type"], got["truncated"], got["stopping_word"]) \
        == (True, "limit", False, "")
    assert got["prompt"] == PROMPT and isinstance(got["has_new_line"], bool)
    settings = got["generation_settings"]
    assert (settings["n_predict"], settings["temperature"], settings["logit_bias"],
            settings["ignore_eos"]) == (12, 0.0, [], False)
    # The un-prefixed plural is llama-server's endpoint too (not OpenAI's).
    plural = await _post(http, body, "/completions")
    assert plural["content"] == got["content"] and "choices" not in plural
    # The prompt as token ids, as ids and text mixed, and several prompts.
    ids = smol.model.tokenizer.tokenize(PROMPT, add_special=True, parse_special=True)
    assert (await _post(http, {**body, "prompt": ids}))["content"] == got["content"]
    half = smol.model.tokenizer.tokenize(" meaning of life is", add_special=False)
    mixed = await _post(http, {**body, "prompt": [*ids[:-len(half)], " meaning of life is"]})
    assert mixed["content"] == got["content"]
    many = await _post(http, {**body, "prompt": [PROMPT, ids, {"prompt_string": PROMPT}]})
    assert [m["content"] for m in many] == [got["content"]] * 3
    assert [m["index"] for m in many] == [0, 1, 2]
    # A stop string ends the text before it; the answer names it.
    word = got["content"].split()[3]
    stopped = await _post(http, {**body, "stop": [word, "zzz"]})
    assert stopped["content"] == got["content"][:got["content"].index(word)]
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", word)
    # response_fields; an empty prompt; n_predict 0 (the prompt evaluated, nothing shown).
    picked = await _post(http, {**body, "response_fields": [
        "content", "generation_settings/n_predict", "prompt"]})
    assert picked == {"content": got["content"], "generation_settings/n_predict": 12,
                      "prompt": PROMPT}
    empty = await _post(http, {**body, "prompt": ""})
    assert (empty["content"], empty["tokens_predicted"]) == ("", 0)
    warm = await _post(http, {**body, "n_predict": 0})
    assert (warm["content"], warm["tokens"], warm["tokens_predicted"]) == ("", [], 0)


async def test_seeded_sampling_repeats_and_prompts_share_a_seed(
        daemon: tuple[Server, httpx.AsyncClient]) -> None:
    _server, http = daemon
    body = {"prompt": PROMPT, "n_predict": 10, "temperature": 1.0, "seed": 7}
    first = await _post(http, body)
    assert (await _post(http, body))["content"] == first["content"]
    assert first["generation_settings"]["seed"] == 7
    # Without a seed, one is chosen for the request: equal prompts give equal answers,
    # and n_cmpl's copies differ (the seed plus the copy's index).
    both = await _post(http, {**body, "seed": None, "prompt": [PROMPT, PROMPT]})
    assert both[0]["content"] == both[1]["content"]
    copies = await _post(http, {**body, "n_cmpl": 2})
    assert [c["generation_settings"]["seed"] for c in copies] == [7, 8]
    assert copies[0]["content"] == first["content"]


async def test_n_probs_shape_and_consistency(daemon: tuple[Server, httpx.AsyncClient]
                                             ) -> None:
    _server, http = daemon
    body = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "n_probs": 4,
            "return_tokens": True}
    got = await _post(http, body)
    probs = got["completion_probabilities"]
    assert [p["id"] for p in probs] == got["tokens"]
    for p in probs:
        assert len(p["top_logprobs"]) == 4
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the most likely one
        assert p["top_logprobs"][0]["logprob"] == pytest.approx(p["logprob"])
        assert [t["logprob"] for t in p["top_logprobs"]] == sorted(
            (t["logprob"] for t in p["top_logprobs"]), reverse=True)
        assert bytes(p["bytes"]).decode() == p["token"]
        assert p["logprob"] <= 0
    assert "".join(p["token"] for p in probs) == got["content"]
    ref = await _post(http, {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                             "logprobs": 4}, "/v1/completions")
    assert [p["logprob"] for p in probs] == pytest.approx(
        ref["choices"][0]["logprobs"]["token_logprobs"])
    # Streamed: one token's probabilities per event.
    events = await _events(http, body)
    assert [e["completion_probabilities"][0]["id"] for e in events[:-1]] == got["tokens"]
    assert "completion_probabilities" not in events[-1]
    # After the sampler chain: probabilities of the tokens it could draw.
    sampled = await _post(http, {**body, "temperature": 1.0, "seed": 3,
                                 "post_sampling_probs": True, "n_probs": 10})
    for p in sampled["completion_probabilities"]:
        assert 0 < p["prob"] <= 1 and "logprob" not in p
        tops = [t["prob"] for t in p["top_probs"]]
        assert tops == sorted(tops, reverse=True) and all(0 < t <= 1 for t in tops)
        assert sum(tops) <= 1 + 1e-6
        assert p["id"] in [t["id"] for t in p["top_probs"]] or len(tops) == 10
    greedy = await _post(http, {**body, "post_sampling_probs": True})
    assert all(p["prob"] == 1.0 for p in greedy["completion_probabilities"])


async def test_logit_bias_false_bans_a_token(daemon: tuple[Server, httpx.AsyncClient],
                                             smol: ModelRuntime) -> None:
    _server, http = daemon
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "return_tokens": True}
    plain = await _post(http, body)
    first = plain["tokens"][0]
    for bias in ([[first, False]], {str(first): False}):
        banned = await _post(http, {**body, "logit_bias": bias})
        assert first not in banned["tokens"]
        assert banned["generation_settings"]["logit_bias"] == [{"bias": None, "token": first}]
    # Text: each of its tokens gets the bias (here a ban by -100).
    word = smol.model.tokenizer.detokenize([first])
    banned = await _post(http, {**body, "logit_bias": [[word, -100]]})
    assert banned["tokens"][0] != first
    assert banned["generation_settings"]["logit_bias"] == [{"bias": -100.0, "token": first}]
    # A bias toward a token makes it the greedy choice.
    pushed = await _post(http, {**body, "logit_bias": [[plain["tokens"][1], 100]]})
    assert pushed["tokens"][0] == plain["tokens"][1]


async def test_ignore_eos_runs_to_n_predict(daemon: tuple[Server, httpx.AsyncClient],
                                            smol: ModelRuntime) -> None:
    _server, http = daemon
    body = {"prompt": CHAT, "n_predict": 48, "temperature": 0, "return_tokens": True}
    ends = await _post(http, body)
    assert ends["stop_type"] == "eos" and ends["tokens_predicted"] < 48
    assert ends["tokens"][-1] in smol.model.info.eog_tokens
    assert ends["generation_settings"]["logit_bias"] == []
    on = await _post(http, {**body, "ignore_eos": True})
    assert (on["stop_type"], on["tokens_predicted"]) == ("limit", 48)
    assert not set(on["tokens"]) & smol.model.info.eog_tokens
    bias = on["generation_settings"]["logit_bias"]
    assert bias == [{"bias": None, "token": t} for t in sorted(smol.model.info.eog_tokens)]
    assert on["generation_settings"]["ignore_eos"] is True
    # n_predict -1: on to the end of the context.
    n_ctx = smol.context.config.n_ctx_seq
    long = smol.model.tokenizer.tokenize(PROMPT * 80, add_special=False)[:n_ctx - 20]
    full = await _post(http, {**body, "prompt": long, "ignore_eos": True, "n_predict": -1})
    assert full["truncated"] is True and full["stop_type"] == "limit"
    assert full["tokens_evaluated"] + full["tokens_predicted"] == n_ctx + 1  # (the last
    # token is generated, not evaluated)


async def test_stream_equals_non_stream(daemon: tuple[Server, httpx.AsyncClient]) -> None:
    _server, http = daemon
    body = {"prompt": PROMPT, "n_predict": 10, "temperature": 0, "return_tokens": True}
    whole = await _post(http, body)
    events = await _events(http, body)
    *partials, last = events
    assert all(e["stop"] is False and len(e["tokens"]) == 1 for e in partials)
    assert "".join(e["content"] for e in partials) == whole["content"]
    assert [e["tokens"][0] for e in partials] == whole["tokens"]
    assert [e["tokens_predicted"] for e in partials] == list(range(1, 11))
    assert last["stop"] is True and last["content"] == "" and last["tokens"] == []
    assert (last["stop_type"], last["timings"]["predicted_n"]) == ("limit", 10)
    assert last["generation_settings"]["stream"] is True
    assert all("timings" not in e for e in partials)
    timed = await _events(http, {**body, "timings_per_token": True})
    assert all(e["timings"]["predicted_n"] == e["tokens_predicted"] for e in timed)
    # Several prompts: each one's events in turn, told apart by index.
    events = await _events(http, {**body, "prompt": [PROMPT, "Once upon a time"]})
    finals = [e for e in events if e["stop"]]
    assert [f["index"] for f in finals] == [0, 1]
    text0 = "".join(e["content"] for e in events if e["index"] == 0)
    assert text0 == whole["content"]


async def test_bounded_inputs_are_refused(daemon: tuple[Server, httpx.AsyncClient],
                                          smol: ModelRuntime) -> None:
    _server, http = daemon
    n_vocab = smol.model.info.n_vocab
    for body, param, code in (
            ({"prompt": "word " * 600}, "prompt", "context_length_exceeded"),
            ({"prompt": [1] * 600}, "prompt", "context_length_exceeded"),
            ({"prompt": [1, n_vocab]}, "prompt[1]", "bad_request"),
            ({"prompt": "x", "n_probs": MAX_N_PROBS + 1}, "n_probs", "bad_request"),
            ({"prompt": "x", "logit_bias": [["word " * 5000, False]]}, "logit_bias",
             "bad_request"),
            ({"prompt": "x", "grammar": "root ::= ("}, "grammar", "bad_request")):
        r = await http.post("/completion", json=body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (param, code), error
    r = await http.post("/completion", content=b"{not json")
    assert r.status_code == 400
    r = await http.get("/completion")
    assert r.status_code == 405
    # A constraint holds the text to its grammar.
    held = await _post(http, {"prompt": "Answer:", "n_predict": 8, "temperature": 0,
                              "grammar": 'root ::= "yes" | "no"'})
    assert held["content"] in ("yes", "no") and held["stop_type"] == "eos"
