"""OpenAI request validation: each bad field is a 400 naming it; good requests become
the request a native ``generate`` would (a token-id prompt as its ids, no text)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from meshd.daemon.frontends.http.openai.api import (
    MAX_PROMPTS,
    parse_request,
)
from meshd.daemon.requests.api_errors import ApiError
from meshd.protocol import MAX_MESSAGES, MAX_STOP_LENGTH, MAX_STOP_STRINGS, BadRequest


def _parse(body: dict[str, Any], chat: bool = False) -> Any:
    return parse_request(json.dumps(body).encode(), chat=chat)


def test_fields_map_onto_generate() -> None:
    req = _parse({"model": "m", "prompt": ["hi"], "max_completion_tokens": 7,
                  "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": "\n", "stream": True,
                  "stream_options": {"include_usage": True}, "user": "ignored",
                  "speculative": {"proposer": "ngram", "draft_max": 4}})
    g = req.spec
    assert (g.prompt, g.max_tokens, g.stop) == ("hi", 7, ("\n",))
    assert (g.sampling.temperature, g.sampling.top_p, g.sampling.seed, g.sampling.top_k) == \
        (0.5, 0.9, 3, 0)
    assert (g.speculative.proposer, g.speculative.draft_max) == ("ngram", 4)
    assert req.stream and req.include_usage and not req.chat
    chat = _parse({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "speculative": {"enabled": False}}, chat=True)
    assert chat.spec.messages[0].content == "a\nb"  # as llama.cpp and vLLM join them
    assert chat.spec.speculative.proposer == "off"
    assert chat.spec.id.startswith("chatcmpl-")


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"prompt": "x", "stop": ["ok", "a" * (MAX_STOP_LENGTH + 1)]}, "stop[1]"),
    ({"prompt": "x", "stop": [""]}, "stop[0]"),
    ({"prompt": "x", "n": 9}, "n"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "speculative": {"draft_max": 0}}, "speculative.draft_max"),
    ({"prompt": "x", "speculative": {"colour": 1}}, "speculative"),
    ({"prompt": "x", "model": 5}, "model"),
])
def test_bad_fields_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        _parse(body)
    assert caught.value.status == 400 and caught.value.param == param


def test_bad_messages_and_bodies() -> None:
    for body, param in (({"messages": []}, "messages"),
                        ({"messages": [{"content": "x"}]}, "messages[0].role"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                         "messages[0].content[0]")):
        with pytest.raises(ApiError) as caught:
            _parse(body, chat=True)
        assert caught.value.param == param
    for raw in (b"[1, 2]", b"\xff", b"{"):
        with pytest.raises(ApiError):
            parse_request(raw, chat=False)


def test_limits_are_the_protocols_and_name_their_value() -> None:
    """The native socket's limits, with the limit and the value sent in the message."""
    assert _parse({"prompt": "x", "stop": ["s"] * MAX_STOP_STRINGS}).spec.stop \
        == ("s",) * MAX_STOP_STRINGS
    cases = [
        ({"prompt": "x", "stop": ["a" * 1_000_000]}, False,
         (f"at most {MAX_STOP_LENGTH} chars", "1000000 chars")),
        ({"prompt": "x", "stop": ["s"] * 20}, False, (f"at most {MAX_STOP_STRINGS}", "20")),
        ({"messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}, True,
         (f"at most {MAX_MESSAGES} messages", str(MAX_MESSAGES + 1))),
        ({"messages": [{"role": "r" * 100, "content": "hi"}]}, True,
         ("messages[0].role", "must be one of", "r" * 64)),
    ]
    for body, chat, wanted in cases:
        with pytest.raises(ApiError) as caught:
            _parse(body, chat=chat)
        assert caught.value.status == 400
        for part in wanted:
            assert part in caught.value.message, (part, caught.value.message)


def test_prompt_arrays_of_text_or_token_ids() -> None:
    """OpenAI's prompt forms: one string in an array, token ids, or one array of them;
    several prompts are a batch (bounded)."""
    assert _parse({"prompt": ["hi"]}).spec.prompt == "hi"
    assert _parse({"prompt": ["hi"]}).spec.prompt_ids is None
    ids = _parse({"prompt": [1, 2, 3]}).spec
    assert (ids.prompt_ids, ids.prompt, ids.messages) == ((1, 2, 3), None, None)  # no text
    assert _parse({"prompt": [[4, 5]]}).spec.prompt_ids == (4, 5)
    assert _parse({"prompt": [[4, 5]]}).batch == ()
    batch = _parse({"prompt": ["a", [1, 2]]})
    assert batch.batch == ("a", (1, 2))
    assert (batch.spec.prompt, batch.spec.prompt_ids) == ("a", None)
    for bad, words in (({"prompt": ["a"] * (MAX_PROMPTS + 1)}, f"at most {MAX_PROMPTS}"),
                       ({"prompt": [[1], [-2]]}, "prompt[1]: must be a non-empty array"),
                       ({"prompt": ["a", ""]}, "prompt[1]: must be a non-empty string"),
                       ({"prompt": [1, -2]}, "token ids"),
                       ({"prompt": []}, "non-empty")):
        with pytest.raises(ApiError) as caught:
            _parse(bad)
        assert caught.value.param == "prompt" and words in caught.value.message


def test_response_format_and_llama_server_fields_become_one_constraint() -> None:
    assert _parse({"prompt": "x", "response_format": {"type": "text"}}).spec.constraint \
        is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "json_object"}}, ("json_object", None, None),
         "response_format"),
        ({"response_format": {"type": "json_object", "schema": schema}},
         ("json_schema", schema, None), "response_format"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "n", "schema": schema}}},
         ("json_schema", schema, None), "response_format"),
        ({"json_schema": schema}, ("json_schema", schema, None), "json_schema"),
        ({"grammar": 'root ::= "a"'}, ("gbnf", None, 'root ::= "a"'), "grammar"),
        ({"json_schema": {}, "grammar": ""}, None, "response_format"),
    ]
    for extra, want, param in cases:
        req = _parse({"prompt": "x", **extra})
        c = req.spec.constraint
        assert (None if c is None else (c.kind, c.schema, c.grammar)) == want, extra
        assert req.constraint_param == param
    for extra, param in (({"response_format": {"type": "yaml"}}, "response_format"),
                         ({"response_format": {"type": "json_schema", "json_schema": 3}},
                          "response_format.json_schema"),
                         ({"grammar": 7}, "grammar"),
                         ({"json_schema": [1]}, "json_schema"),
                         ({"grammar": 'root ::= "a"', "json_schema": schema}, "grammar")):
        with pytest.raises(ApiError) as caught:
            _parse({"prompt": "x", **extra})
        assert caught.value.status == 400 and caught.value.param == param, extra


def test_fields_that_change_nothing_pass_others_are_named() -> None:
    """No-op fields and defaults pass; fields that would change the answer, and fields
    nobody defines, are a 400 naming them (as OpenAI refuses unknown arguments)."""
    _parse({"prompt": "x", "user": "u", "metadata": {"a": "b"}, "store": False,
            "service_tier": "auto", "cache_prompt": True, "presence_penalty": 0,
            "frequency_penalty": 0.0, "logprobs": False, "logit_bias": {}, "echo": False,
            "best_of": 1, "tool_choice": "none"})
    for body, param in (({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
                        ({"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
                        ({"prompt": "x", "logit_bias": {"x": 1}}, "logit_bias"),
                        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias['5']"),
                        ({"prompt": "x", "logit_bias": [[5]]}, "logit_bias[0]"),
                        ({"prompt": "x", "min_p": 1.5}, "min_p"),
                        ({"prompt": "x", "typical_p": 0}, "typical_p"),
                        ({"prompt": "x", "repeat_penalty": 0}, "repeat_penalty"),
                        ({"prompt": "x", "repeat_last_n": -2}, "repeat_last_n"),
                        ({"prompt": "x", "mirostat": 2}, "mirostat"),
                        ({"prompt": "x", "max_token": 5}, "max_token"),
                        ({"prompt": "x", "messages": []}, "messages"),
                        ({"prompt": "x", "echo": True}, "echo")):
        with pytest.raises(ApiError) as caught:
            _parse(body)
        assert caught.value.status == 400 and caught.value.param == param, body
    with pytest.raises(ApiError) as caught:
        _parse({"messages": [{"role": "user", "content": "x"}], "toolz": []}, chat=True)
    assert caught.value.param == "toolz" and "unrecognized" in caught.value.message


def test_roles_and_contents_are_checked() -> None:
    """A role outside OpenAI's set is refused (a template would print it as text);
    ``developer`` is rendered as ``system``; a user turn needs content."""
    for msg, param in (({"role": "wizard", "content": "x"}, "messages[0].role"),
                       ({"role": "user"}, "messages[0].content")):
        with pytest.raises(ApiError) as caught:
            _parse({"messages": [msg]}, chat=True)
        assert caught.value.param == param
    req = _parse({"messages": [{"role": "developer", "content": "be brief"},
                               {"role": "user", "content": "hi"},
                               {"role": "assistant", "content": None}]}, chat=True)
    assert [m.role for m in req.spec.messages] == ["system", "user", "assistant"]


def test_native_field_names_become_openai_ones() -> None:
    """``generate.max_tokens`` is reported under the field the request used."""
    err = BadRequest.invalid_field("generate.max_tokens", "must be at most 1024 (got 5000)")
    api = ApiError.from_protocol(err)
    assert (api.param, api.message) == ("max_tokens", "max_tokens: must be at most 1024 "
                                                      "(got 5000)")
    api = ApiError.from_protocol(err, max_tokens_param="max_completion_tokens")
    assert api.param == "max_completion_tokens"
    assert api.message.startswith("max_completion_tokens: ")
    api = ApiError.from_protocol(BadRequest("generate.prompt: tokenizes to no tokens"))
    assert (api.param, api.message) == ("prompt", "prompt: tokenizes to no tokens")
    api = ApiError.from_protocol(BadRequest.invalid_field(
        "generate.speculative.proposer", "unknown proposer 'x'"))
    assert api.param == "speculative.proposer"
