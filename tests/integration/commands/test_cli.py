"""`meshd generate` and `meshd make-test-model` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshd.daemon.commands.cli import main
from meshd.native.model import Model
from meshd.testing import testmodels


def test_generate_json_reports_text_tokens_and_stats(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    argv = ["generate", "--model", path, "--prompt", "hello there", "--max-tokens", "30",
            "--json", "--fixed-k", "--draft-max", "3"]
    assert main([*argv, "--proposer", "off"]) == 0
    off = json.loads(capsys.readouterr().out)
    assert main([*argv, "--proposer", "mtp"]) == 0
    mtp = json.loads(capsys.readouterr().out)
    assert off["tokens"] == mtp["tokens"] and len(off["tokens"]) == 30
    assert off["text"] == mtp["text"] and off["finish_reason"] == "length"
    st = mtp["stats"]
    assert mtp["proposer"] == "mtp" and st["verify_calls"] > 0 and st["accepted"] > 0
    assert st["state_bytes"] > 0  # KV + recurrent state held by the session
    for key in ("emitted", "target_forwards", "drafted", "accepted_per_position",
                "rollbacks_in_place", "checkpoints", "checkpoint_bytes", "restores", "wall_ms",
                "prefill_ms", "decode_ms", "verify_ms", "refusals"):
        assert key in st


def test_generate_stop_string(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(testmodels.test_model_path("llama"))
    base = ["generate", "--model", path, "--prompt", "abc", "--max-tokens", "60", "--json"]
    assert main(base) == 0
    full = json.loads(capsys.readouterr().out)["text"]
    stop = full[10:13]
    assert main([*base, "--stop", stop, "--proposer", "ngram", "--fixed-k"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop" and out["text"] == full[: full.index(stop)]


def test_generate_chat_on_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    """The prompt is rendered with the GGUF's own template by default (SmolLM2's adds a
    system turn); --raw sends it as it is."""
    question = "What is the capital of France?"
    argv = ["generate", "--prompt", question, "--max-tokens", "8", "--json", "--fixed-k"]
    assert main([*argv, "--raw"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(argv) == 0  # a model with a chat template gets it by default
    chat = json.loads(capsys.readouterr().out)
    assert main([*argv, "--chat"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == chat["tokens"]
    assert chat["chat"] and not plain["chat"]
    with Model.load(chat["model"]) as model:
        tok = model.tokenizer
        rendered = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                    "by Hugging Face<|im_end|>\n<|im_start|>user\n" + question +
                    "<|im_end|>\n<|im_start|>assistant\n")
        assert chat["stats"]["prompt_tokens"] == len(tok.tokenize(rendered, parse_special=True))
        assert plain["stats"]["prompt_tokens"] == len(tok.tokenize(question))
    with pytest.raises(ValueError, match="closed"):
        tok.tokenize(question)  # a freed model's tokenizer refuses instead of crashing
    assert chat["text"] and chat["tokens"] != plain["tokens"]


def test_generate_errors_are_clear(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(testmodels.test_model_path("llama"))
    assert main(["generate", "--model", path, "--prompt", "x", "--proposer", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown proposer 'nope'; available: off, auto, " in err and "ngram" in err
    assert main(["generate", "--model", "/nonexistent.gguf", "--prompt", "x"]) == 3
    assert "not found" in capsys.readouterr().err
    assert main(["generate", "--model", path, "--prompt", "x", "--temperature", "-1"]) == 2
    assert "--temperature: expected a number >= 0, got -1" in capsys.readouterr().err
    # A model without a chat template chats all the same (llama-server's chatml).
    assert main(["generate", "--model", path, "--prompt", "x", "--chat",
                 "--max-tokens", "2"]) == 0


def test_make_test_model_writes_a_loadable_model(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    done = subprocess.run(
        [sys.executable, "-m", "meshd.daemon.commands.cli", "make-test-model", "mimo2", str(out),
         "--acceptance", "0.5"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    with Model.load(out) as model:
        assert model.info.architecture == "mimo2" and model.info.has_mtp
