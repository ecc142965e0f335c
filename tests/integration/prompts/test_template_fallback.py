"""Models users bring: a GGUF without a chat template is served with the template
llama-server falls back to (the file's ``tool_use`` one, llama.cpp's built-in format of the
architecture where every model of it speaks one, else chatml), and the log says which,
once, at info."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshd.daemon.commands.cli import main
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.prompts import chat_template
from meshd.native.chat_builtin import builtin_names
from meshd.native.default_model import default_model_path
from tests.integration.helpers.daemon import short_tempdir
from tests.integration.helpers.http_api import http_daemon
from tests.integration.helpers.processes import (
    daemon_env,
    log_events,
    reaped,
    start,
    stop,
    wait_for_socket,
)

ASK = {"messages": [{"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": "Name three colours."}],
       "max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def templateless(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 (whose own template is chatml) copied without ``tokenizer.chat_template``,
    with gguf's own metadata tool."""
    out = tmp_path_factory.mktemp("models") / "smol-no-template.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(default_model_path()),
         str(out), "--remove-metadata", "tokenizer.chat_template", "--force"],
        capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return out


def test_every_architecture_format_is_one_of_llama_cpps() -> None:
    assert set(chat_template._ARCHITECTURE_FORMATS.values()) <= builtin_names()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_model_without_a_template_chats_with_chatml_and_the_log_says_so(
        templateless: Path) -> None:
    """Served by ``meshd serve`` over HTTP on its socket: chat answers as SmolLM2 with
    its own (chatml) template answers the same conversation, and one info event names
    the fallback."""
    with ModelRuntime(RuntimeConfig(n_ctx_seq=512, calibrate=False, threads=1)) as own:
        async with http_daemon(own) as (_server, _path, http):
            reference = (await http.post("/v1/chat/completions", json=ASK)).json()
    directory = short_tempdir()
    sock = os.path.join(directory, "s")
    try:
        with reaped(start(["--socket", sock, "-m", str(templateless), "--threads", "1",
                           "--slots", "1", "--ctx", "512", "--log-format", "json"],
                          daemon_env())) as proc:
            wait_for_socket(sock, proc)
            transport = httpx.HTTPTransport(uds=sock)
            with httpx.Client(transport=transport, base_url="http://meshd",
                              timeout=120) as client:
                got = client.post("/v1/chat/completions", json=ASK)
                assert got.status_code == 200, got.text
                assert got.json()["choices"][0]["message"]["content"] == \
                    reference["choices"][0]["message"]["content"]
                rendered = client.post("/apply-template", json={"messages": ASK["messages"]})
                assert rendered.json()["prompt"] == (
                    "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n"
                    "<|im_start|>user\nName three colours.<|im_end|>\n"
                    "<|im_start|>assistant\n")
            code, err = stop(proc)
            assert code == 0, err
        fallbacks = [e for e in log_events(err) if e["event"] == "chat_template_fallback"]
        assert len(fallbacks) == 1, err
        assert fallbacks[0]["level"] == "info"
        assert fallbacks[0]["template"] == "chatml"
        assert fallbacks[0]["architecture"] == "llama"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def tool_use_only(tmp_path_factory: pytest.TempPathFactory, templateless: Path
                  ) -> Iterator[Path]:
    """The same file with only a ``tokenizer.chat_template.tool_use`` template (a
    distinct one, so it shows which was taken)."""
    out = tmp_path_factory.mktemp("models") / "smol-tool-use.gguf"
    source = ("{% for m in messages %}<|im_start|>{{ m.role }} (tool_use)\n{{ m.content }}"
              "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% endif %}")
    done = subprocess.run(
        [sys.executable, "-c",
         "import sys, gguf\n"
         "from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata\n"
         "r = gguf.GGUFReader(sys.argv[1])\n"
         "w = gguf.GGUFWriter(sys.argv[2], arch='llama', endianess=r.endianess)\n"
         "copy_with_new_metadata(r, w, {'tokenizer.chat_template.tool_use': MetadataDetails("
         "gguf.GGUFValueType.STRING, sys.argv[3])}, [])\n",
         str(templateless), str(out), source],
        capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    yield out


def test_the_files_tool_use_template_comes_first(tool_use_only: Path) -> None:
    events: list[tuple[str, dict[str, object]]] = []
    with ModelRuntime(RuntimeConfig(model_path=str(tool_use_only), n_ctx_seq=256,
                                    calibrate=False, threads=1),
                      events=lambda event, **fields: events.append((event, fields))) as rt:
        assert rt.render_chat([{"role": "user", "content": "hi"}]) == \
            "<|im_start|>user (tool_use)\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert [f["template"] for e, f in events if e == "chat_template_fallback"] == ["tool_use"]


def test_meshd_generate_keeps_a_plain_prompt_raw_on_such_a_model(
        templateless: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file without a template is often a base model: ``meshd generate`` sends its
    prompt as it is unless ``--chat`` asks for the fallback."""
    argv = ["generate", "-m", str(templateless), "-p", "Once upon a time", "--max-tokens",
            "2", "-t", "1", "--fixed-k", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["chat"] is False
    assert main([*argv, "--chat"]) == 0
    assert json.loads(capsys.readouterr().out)["chat"] is True
