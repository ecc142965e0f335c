"""A chat template of one's own and reasoning on or off, as llama-server users set them:
``--chat-template-file`` replaces the GGUF's template for chat requests and
``/apply-template``; ``--reasoning off`` gives templates ``enable_thinking`` false and
closes the thinking block that reasoning templates open (DeepSeek-R1, QwQ) or expect the
model to open (Command R7B)."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.prompts.chat_template import ChatTemplate
from meshd.native.errors import ModelLoadError
from tests.integration.helpers import DATA
from tests.integration.helpers.http_api import http_daemon, openai_client

ASK = [{"role": "user", "content": "What is today?"}]

#: The shapes of three reasoning families' generation prompts.
OPENS_THINKING = ("{% for m in messages %}<|User|>{{ m.content }}{% endfor %}"
                  "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}")
THINKS_ON_ITS_OWN = ("{% for m in messages %}<|USER|>{{ m.content }}"
                     "{% if m.thinking %}<|START_THINKING|>{{ m.thinking }}<|END_THINKING|>"
                     "{% endif %}{% endfor %}{% if add_generation_prompt %}<|CHATBOT|>"
                     "{% endif %}")


@pytest.mark.parametrize(("source", "on_end", "off_end"), [
    ((DATA / "qwen3.5.jinja").read_text(), "assistant\n<think>\n",
     "assistant\n<think>\n\n</think>\n\n"),
    (OPENS_THINKING, "<|Assistant|><think>\n", "<|Assistant|><think>\n</think>"),
    (THINKS_ON_ITS_OWN, "<|CHATBOT|>", "<|CHATBOT|><|START_THINKING|><|END_THINKING|>"),
])
def test_reasoning_off_closes_the_thinking_block(source: str, on_end: str,
                                                 off_end: str) -> None:
    template = ChatTemplate(source, eos_token="<|im_end|>")
    assert template.render(ASK, thinking=True).endswith(on_end)
    off = template.render(ASK, thinking=False)
    assert off.endswith(off_end), off
    # without a generation prompt nothing is added
    assert template.render(ASK, add_generation_prompt=False, thinking=False) == \
        template.render(ASK, add_generation_prompt=False, thinking=True)


def test_reasoning_off_leaves_other_templates_alone() -> None:
    template = ChatTemplate((DATA / "llama-3.1.jinja").read_text())
    assert template.render(ASK, thinking=False) == template.render(ASK, thinking=True)


def test_templates_get_the_date_as_llama_cpp_passes_it() -> None:
    """FireFunction v2's template appends ``functions`` and ``datetime`` (llama.cpp's
    "%b %d %Y") to its system prompt; Llama 3.x prints ``date_string``."""
    template = ChatTemplate("{%- set suffix = 'Functions:' + '\n' + functions -%}"
                            "{{ suffix }}\nToday is {{ datetime }}; {{ date_string }}")
    today = datetime.date.today()
    assert template.render(ASK) == (f"Functions:\n\nToday is {today.strftime('%b %d %Y')}; "
                                    f"{today.strftime('%d %b %Y')}")


def test_request_variables_never_replace_the_template_s_own() -> None:
    template = ChatTemplate("{{ messages[0].content }}|{{ flavour }}|{{ add_generation_prompt }}")
    assert template.render(ASK, variables={"flavour": "tart", "messages": [],
                                           "add_generation_prompt": "no"}) == \
        "What is today?|tart|True"


def test_map_filters_serialize_as_lists() -> None:
    template = ChatTemplate("{{ messages | map(attribute='role') | tojson }}")
    assert template.render(ASK) == '["user"]'


@pytest.fixture(scope="module")
def llama_templated() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=2, draft_max=4, calibrate=False,
                                    threads=1, chat_template_file=str(DATA / "llama-3.1.jinja"),
                                    reasoning="off"))
    yield rt
    rt.close()


@pytest.mark.anyio
async def test_a_template_file_replaces_the_model_s_own(llama_templated: ModelRuntime) -> None:
    source = (DATA / "llama-3.1.jinja").read_text()
    async with http_daemon(llama_templated) as (_server, _path, http):
        r = await http.post("/apply-template", json={"messages": ASK})
        assert r.status_code == 200
        prompt = r.json()["prompt"]
        assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        assert datetime.date.today().strftime("%d %b %Y") in prompt  # llama.cpp's date_string
        assert "<|im_start|>" not in prompt.removeprefix("<|im_start|>")  # not SmolLM2's own
        r = await http.post("/apply-template", json={"messages": ASK,
                                                     "add_generation_prompt": False})
        assert "assistant<|end_header_id|>" not in r.json()["prompt"]
        props = (await http.get("/props")).json()
        assert props["chat_template"] == source
        # a chat request is rendered by it: its prompt is that text's tokens
        got = await openai_client(http).chat.completions.create(
            model="m", messages=ASK, max_tokens=2)  # type: ignore[arg-type]
        assert got.usage is not None
        assert got.usage.prompt_tokens == len(llama_templated.tokenize_prompt(prompt, chat=True))


def test_a_template_file_that_cannot_work_stops_the_load(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jinja"
    with pytest.raises(ModelLoadError, match=r"missing\.jinja"):
        ModelRuntime(RuntimeConfig(n_ctx_seq=256, calibrate=False, threads=1,
                                   chat_template_file=str(missing)))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    with pytest.raises(ModelLoadError, match=r"broken\.jinja.*does not compile"):
        ModelRuntime(RuntimeConfig(n_ctx_seq=256, calibrate=False, threads=1,
                                   chat_template_file=str(broken)))
    with pytest.raises(ModelLoadError, match=r"--chat-template.*does not compile"):
        ModelRuntime(RuntimeConfig(n_ctx_seq=256, calibrate=False, threads=1,
                                   chat_template="{% if %}"))
    with pytest.raises(ModelLoadError, match="not both"):
        ModelRuntime(RuntimeConfig(n_ctx_seq=256, calibrate=False, threads=1,
                                   chat_template="chatml",
                                   chat_template_file=str(DATA / "llama-3.1.jinja")))


COMMAND_R = ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
             "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
             "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_built_in_format_or_inline_jinja_replaces_the_model_s_own() -> None:
    """``--chat-template command-r`` renders llama.cpp's built-in Command R format (as
    llama-server's does): /apply-template shows it, chat requests are prompted with it,
    a prefill continues inside its last turn, and tools are offered in the generic
    format (it has no place for them); inline Jinja works as a file's would."""
    messages = [{"role": "system", "content": "You are a test."},
                {"role": "user", "content": "Hi there"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {}}}}]
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=512, n_seq_max=1, calibrate=False, threads=1,
                                    chat_template="command-r"))
    try:
        async with http_daemon(rt) as (_server, _path, http):
            r = await http.post("/apply-template", json={"messages": messages})
            assert r.status_code == 200 and r.json()["prompt"] == COMMAND_R
            got = await openai_client(http).chat.completions.create(
                model="m", messages=messages, max_tokens=2)  # type: ignore[arg-type]
            assert got.usage is not None
            assert got.usage.prompt_tokens == len(rt.tokenize_prompt(COMMAND_R, chat=True))
            prefill = [*messages, {"role": "assistant", "content": "Hel"}]
            verbose = (await http.post("/v1/chat/completions", json={
                "messages": prefill, "max_tokens": 1, "verbose": True})).json()
            assert verbose["__verbose"]["prompt"].endswith(
                "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hel")
            # tools: the format has no place for them, so the generic one offers them
            r = await http.post("/apply-template", json={"messages": messages,
                                                         "tools": tools})
            assert r.status_code == 200
            offered = r.json()["prompt"]
            assert offered.startswith("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>")
            assert '"name": "f"' in offered and offered.endswith("<|CHATBOT_TOKEN|>")
    finally:
        rt.close()
    inline = ModelRuntime(RuntimeConfig(n_ctx_seq=256, n_seq_max=1, calibrate=False,
                                        threads=1, chat_template="{% for m in messages %}"
                                        "[{{ m.role }}] {{ m.content }}\n{% endfor %}"))
    try:
        assert inline.render_chat(messages) == "[system] You are a test.\n[user] Hi there\n"
    finally:
        inline.close()


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_template_that_knows_tools_offers_them_itself(
        llama_templated: ModelRuntime) -> None:
    """``tool_choice: auto`` with a template that takes ``tools`` (Llama 3.1's here): the
    template offers them in its own words, earlier calls and their results read as it
    renders them, and a chat request, /apply-template and input_tokens agree on the
    prompt; a forced call is offered the same way (and held to the template's syntax)."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function", "function": {
                       "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    async with http_daemon(llama_templated) as (_server, _path, http):
        r = await http.post("/apply-template", json={"messages": history, "tools": WEATHER})
        assert r.status_code == 200
        prompt = r.json()["prompt"]
        assert "Given the following functions" in prompt  # Llama 3.1's own offer
        assert '"name": "get_weather"' in prompt and "<tools>" not in prompt
        assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in prompt
        assert "<|start_header_id|>ipython<|end_header_id|>\n\n\"sunny, 21C\"" in prompt \
            or "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 21C" in prompt
        n_prompt = len(llama_templated.tokenize_prompt(prompt, chat=True))
        body = {"messages": history, "tools": WEATHER, "max_tokens": 2, "temperature": 0}
        got = (await http.post("/v1/chat/completions", json=body)).json()
        assert got["usage"]["prompt_tokens"] == n_prompt
        counted = await http.post("/v1/chat/completions/input_tokens", json=body)
        assert counted.json()["input_tokens"] == n_prompt
        forced = (await http.post("/v1/chat/completions", json={
            **body, "tool_choice": "required", "max_tokens": 64})).json()
        assert forced["usage"]["prompt_tokens"] == n_prompt  # the template's own offer
        (call,) = forced["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
