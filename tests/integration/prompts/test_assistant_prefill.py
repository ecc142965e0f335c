"""A conversation that ends with an assistant message is continued, not answered (a
prefill, as llama-server, vLLM's ``continue_final_message`` and Anthropic's API take
it): the prompt ends right after that message's text, in the templates users run and in
SmolLM2's own, over HTTP and the native protocol."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.prompts.chat_template import ChatTemplate, ChatTemplateError, continues_final
from meshd.protocol import BadRequest, Client
from tests.integration.helpers import DATA
from tests.integration.helpers.http_api import http_daemon

BOOK = [{"role": "system", "content": "Book"},
        {"role": "user", "content": "What is the best book"}]


@pytest.mark.parametrize(("template", "end"), [
    ("llama-3.1.jinja",
     "<|start_header_id|>user<|end_header_id|>\n\nWhat is the best book<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\nWhill"),
    ("qwen3.5.jinja", "<|im_start|>user\nWhat is the best book<|im_end|>\n"
                      "<|im_start|>assistant\n<think>\n\n</think>\n\nWhill"),
    ("gemma-3.jinja", "What is the best book<end_of_turn>\n<start_of_turn>model\nWhill"),
])
def test_the_prompt_ends_inside_the_final_assistant_message(template: str, end: str) -> None:
    chat = ChatTemplate((DATA / template).read_text(), bos_token="<s>")
    messages = [*BOOK, {"role": "assistant", "content": "Whill"}]
    prompt = chat.render(messages, continue_final=True)
    assert prompt.endswith(end), prompt[-120:]
    assert "\x00" not in prompt
    # What comes before the continued text is the conversation as the template shows it.
    answered = chat.render(messages, add_generation_prompt=False)
    assert answered.startswith(prompt)


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=1, draft_max=4,
                                    calibrate=False, threads=1))
    yield rt
    rt.close()


@pytest.mark.anyio
async def test_a_chat_ending_with_the_assistant_goes_on_with_its_text(
        smol: ModelRuntime) -> None:
    prefill = [{"role": "user", "content": "Name the capital of France."},
               {"role": "assistant", "content": "The capital of France is"}]
    prompt = smol.render_chat(prefill)
    assert prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    async with http_daemon(smol) as (_server, path, http):
        body = {"messages": prefill, "max_tokens": 8, "temperature": 0}
        answer = (await http.post("/v1/chat/completions", json=body)).json()
        assert answer["usage"]["prompt_tokens"] == len(smol.tokenize_prompt(prompt, chat=True))
        text = answer["choices"][0]["message"]["content"]
        # The continuation of that very prompt, greedy (not a new assistant turn).
        plain = (await http.post("/completion", json={
            "prompt": prompt, "n_predict": 8, "temperature": 0})).json()
        assert text == plain["content"] and "Paris" in text
        explicit = dict(body, continue_final_message=True, add_generation_prompt=False)
        assert (await http.post("/v1/chat/completions", json=explicit)).json()[
            "choices"][0]["message"]["content"] == text
        rendered = (await http.post("/apply-template", json={"messages": prefill})).json()
        assert rendered["prompt"] == prompt
        async with Client.connect(path) as native:
            got = await native.generate(messages=prefill, max_tokens=8,
                                        temperature=0).collect()
            assert got.text == text
            with pytest.raises(BadRequest, match="two assistant messages"):
                await native.generate(messages=[*prefill, prefill[-1]], max_tokens=4,
                                      temperature=0).collect()


@pytest.mark.anyio
async def test_a_prefill_in_text_parts_is_continued_as_llama_server_renders_it(
        smol: ModelRuntime) -> None:
    """A continued message's parts are joined by a blank line (llama.cpp renders them so);
    the parts of every other message by a newline."""
    parts = [{"type": "text", "text": "The capital"}, {"type": "text", "text": "of France"}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name"},
                                             {"type": "text", "text": "a capital."}]},
                {"role": "assistant", "content": parts}]
    async with http_daemon(smol) as (_server, _path, http):
        for path in ("/apply-template", "/v1/chat/completions"):
            body = {"messages": messages, "max_tokens": 4, "temperature": 0,
                    "verbose": True}
            answer = (await http.post(path, json=body)).json()
            prompt = answer["prompt"] if path == "/apply-template" \
                else answer["__verbose"]["prompt"]
            assert prompt.endswith("user\nName\na capital.<|im_end|>\n"
                                   "<|im_start|>assistant\nThe capital\n\nof France"), prompt


@pytest.mark.anyio
@pytest.mark.parametrize(("change", "param"), [
    ({"continue_final_message": True}, "continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": False,
      "messages": [{"role": "user", "content": "Hi"}]}, "continue_final_message"),
    ({"add_generation_prompt": False, "messages": [{"role": "user", "content": "Hi"}]},
     "add_generation_prompt"),
    ({"continue_final_message": "yes"}, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[1].tool_calls"),
])
async def test_what_cannot_be_continued_is_a_400_naming_the_field(
        smol: ModelRuntime, change: dict[str, object], param: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello"}],
            "max_tokens": 4, **change}
    async with http_daemon(smol) as (_server, _path, http):
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()
        twice = {"messages": [{"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "a"},
                              {"role": "assistant", "content": "b"}], "max_tokens": 4}
        r = await http.post("/v1/chat/completions", json=twice)
        assert r.status_code == 400 and "two assistant messages" in r.json()["error"]["message"]


def test_two_final_assistant_messages_cannot_both_go_on() -> None:
    chat = ChatTemplate((DATA / "llama-3.1.jinja").read_text())
    with pytest.raises(ChatTemplateError, match="two assistant messages"):
        continues_final([*BOOK, {"role": "assistant", "content": "a"},
                         {"role": "assistant", "content": "b"}])
    assert not continues_final(BOOK)
    assert chat.render(BOOK).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
