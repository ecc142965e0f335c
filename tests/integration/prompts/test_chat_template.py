"""Chat templates render as llama-cpp-python renders them (given the variables llama.cpp
passes): the real templates of Qwen3.5,
Llama 3, Gemma 3 and Mistral (as stored in their GGUF metadata), with the Jinja extras
vendors use (``{% break %}``, ``strftime_now``, ``raise_exception``)."""

from __future__ import annotations

import datetime

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from meshd.daemon.prompts.chat_template import ChatTemplate, ChatTemplateError
from tests.integration.helpers import DATA

TEMPLATES = {
    # file: (bos, eos) as the models' GGUFs name them
    "qwen3.5.jinja": ("", "<|im_end|>"),
    "llama-3.1.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama-3.2.jinja": ("<|begin_of_text|>", "<|eot_id|>"),
    "gemma-3.jinja": ("<bos>", "<eos>"),
    "mistral-small-3.2.jinja": ("<s>", "</s>"),
}

CONVERSATION = [
    {"role": "system", "content": "You are terse. Réponds en français."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Another one, please."},
]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_real_templates_render_like_llama_cpp_python(name: str) -> None:
    source = (DATA / name).read_text()
    bos, eos = TEMPLATES[name]
    ours = ChatTemplate(source, bos_token=bos, eos_token=eos).render(CONVERSATION)
    # given the variables llama.cpp passes too (llama-cpp-python passes neither)
    theirs = Jinja2ChatFormatter(source, eos_token=eos, bos_token=bos)(
        messages=CONVERSATION, enable_thinking=True,
        date_string=datetime.date.today().strftime("%d %b %Y")).prompt
    assert ours == theirs
    assert "Another one, please." in ours
    assert "Réponds en français." in ours  # non-ASCII text passes through as is


def test_dated_templates_get_todays_date() -> None:
    source = (DATA / "llama-3.2.jinja").read_text()
    text = ChatTemplate(source, bos_token="<|begin_of_text|>").render(CONVERSATION[1:])
    assert datetime.date.today().strftime("%d %b %Y") in text


def test_loop_controls_work() -> None:
    source = ("{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
              "{% if m.role == 'skip' %}{% continue %}{% endif %}[{{ m.content }}]"
              "{% endfor %}")
    messages = [{"role": "user", "content": "a"}, {"role": "skip", "content": "b"},
                {"role": "user", "content": "c"}, {"role": "stop", "content": "d"},
                {"role": "user", "content": "e"}]
    assert ChatTemplate(source).render(messages) == "[a][c]"


def test_template_refusal_is_a_clear_error() -> None:
    source = (DATA / "gemma-3.jinja").read_text()
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        ChatTemplate(source, bos_token="<bos>").render(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_broken_template_is_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        ChatTemplate("{{ messages[5].content }}").render([{"role": "user", "content": "x"}])
