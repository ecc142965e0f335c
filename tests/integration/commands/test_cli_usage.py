"""The command lines as a new user meets them: help, version, shared options, usage
errors reported before anything starts, the environment."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshd.clients import ctl
from meshd.daemon.commands import cli
from meshd.testing import testmodels
from tests.integration.helpers.daemon import short_tempdir

VERSION = importlib.metadata.version("meshd")


def run(*argv: str, env: dict[str, str] | None = None,
        stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, input=stdin,
                          env={**os.environ, "OMP_WAIT_POLICY": "passive", **(env or {})})


def meshd(*argv: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return run(sys.executable, "-m", "meshd", *argv, **kw)  # type: ignore[arg-type]


def subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


@pytest.mark.parametrize("build", [cli.build_parser, ctl.build_parser], ids=["meshd", "meshctl"])
def test_every_option_has_help_and_shows_its_default(build: object) -> None:
    parser = build()  # type: ignore[operator]
    for name, sub in [("", parser), *subcommands(parser)]:
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            where = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help.strip(), f"{where} has no help"
            default = action.default
            if action.option_strings and isinstance(default, int | float | str) \
                    and not isinstance(default, bool) and default is not argparse.SUPPRESS:
                assert "default" in sub._get_formatter()._expand_help(action) \
                    or "default" in (action.help or ""), f"{where}: default not shown"
        assert "``" not in text, f"{name}: reStructuredText in the help"


def test_help_lists_the_commands_without_markup() -> None:
    done = meshd("--help")
    assert done.returncode == 0
    for command in ("serve", "demo", "generate", "bench", "make-test-model"):
        assert command in done.stdout
    assert "``" not in done.stdout
    serve = " ".join(meshd("serve", "--help").stdout.split())  # unwrapped
    assert "--ctx N" in serve and "(default: 4096)" in serve and "-m PATH, --model PATH" in serve


def test_version_and_python_dash_m() -> None:
    assert meshd("--version").stdout.strip() == f"meshd {VERSION}"
    done = run(os.path.join(os.path.dirname(sys.executable), "meshctl"), "--version")
    assert done.returncode == 0 and done.stdout.strip() == f"meshctl {VERSION}"


def test_shared_options_are_one_definition() -> None:
    """serve, generate, demo and bench take the same model/speculation/sampling options
    with the same types and defaults, and the usual short forms."""
    parser = cli.build_parser()
    subs = dict(subcommands(parser))

    def option(command: str, flag: str) -> argparse.Action:
        return subs[command]._option_string_actions[flag]

    for flag in ("--ctx", "--threads", "--draft-max"):
        types = {option(c, flag).type for c in ("serve", "generate", "demo", "bench")}
        assert len(types) == 1, flag
    for flag in ("--model", "--proposer", "--fixed-k"):
        assert len({(option(c, flag).type, option(c, flag).default)
                    for c in ("serve", "generate", "demo")}) == 1, flag
    for flag in ("--temperature", "--seed", "--top-k", "--top-p", "--max-tokens"):
        assert len({(option(c, flag).type, option(c, flag).default)
                    for c in ("generate", "demo")}) == 1, flag
    # generate and demo stop at one default; serve's requests that set no max_tokens go on
    # until the model stops or the context ends (unless the operator sets --max-tokens).
    assert option("generate", "--max-tokens").default == option("demo", "--max-tokens").default
    assert option("serve", "--max-tokens").default is None
    for short, long in (("-m", "--model"), ("-c", "--ctx"), ("-t", "--threads")):
        for command in ("serve", "generate", "demo"):
            assert option(command, short) is option(command, long)
    args = parser.parse_args(["generate", "-m", "x.gguf", "-c", "512", "-t", "1", "-p", "hi"])
    assert (args.model, args.ctx, args.threads, args.prompt) == ("x.gguf", 512, 1, "hi")


def test_demo_checks_its_options_before_starting_the_daemon() -> None:
    done = meshd("demo", "--max-tokens", "-1")
    assert done.returncode == 2
    assert "usage: meshd demo" in done.stderr and "meshctl" not in done.stderr
    assert "--max-tokens: expected a positive integer, got -1" in done.stderr
    done = meshd("demo", "--log-level", "verbose")
    assert done.returncode == 2 and "invalid choice: 'verbose'" in done.stderr
    assert "meshctl" not in done.stderr
    done = meshd("demo", "--model", "/nonexistent/model.gguf")
    assert done.returncode == 3 and "model file not found: /nonexistent/model.gguf" in done.stderr


def test_serve_refuses_an_unknown_proposer_before_loading() -> None:
    """The proposer is checked while parsing: even a model path that does not exist is
    never looked at, and no socket is created."""
    directory = short_tempdir()
    sock = os.path.join(directory, "s")
    done = meshd("serve", "--socket", sock, "--proposer", "bogus", "--model", "/nope.gguf")
    assert done.returncode == 2
    assert "unknown proposer 'bogus'; available: off, auto," in done.stderr
    assert "/nope.gguf" not in done.stderr and not os.path.exists(sock)
    os.rmdir(directory)


def test_model_paths_that_are_not_gguf_files(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("just some text, certainly not a model\n")
    for argv in (["generate", "-p", "hi", "-m", str(tmp_path)],
                 ["serve", "--socket", str(tmp_path / "s"), "-m", str(tmp_path)]):
        done = meshd(*argv)
        assert done.returncode == 3
        assert f"{tmp_path} is a directory, not a GGUF file" in done.stderr
    done = meshd("generate", "-p", "hi", "-m", str(text))
    assert done.returncode == 3
    assert f"{text} is not a GGUF file" in done.stderr
    assert "gguf_init_from_reader" not in done.stderr and "meshd.llama" not in done.stderr
    done = meshd("generate", "-p", "hi", "--proposer", f"draft:{text}")
    assert done.returncode == 3 and f"draft model {text} is not a GGUF file" in done.stderr


def test_meshctl_usage_errors_say_what_was_expected(capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["generate", "hi", "--max-tokens", "abc"]) == ctl.EXIT_USAGE
    err = capsys.readouterr().err
    assert "argument --max-tokens: expected a positive integer, got 'abc'" in err
    assert "_positive" not in err


def test_meshctl_global_options_after_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    directory = short_tempdir()
    missing = os.path.join(directory, "nothing-here")
    for argv in (["health", "--socket", missing], ["--socket", "/elsewhere", "health",
                                                   "--socket", missing, "--timeout", "2"]):
        assert ctl.main(argv) == ctl.EXIT_UNAVAILABLE
        assert f"no daemon at {missing}" in capsys.readouterr().err
    os.rmdir(directory)


@pytest.mark.slow
def test_serve_listens_on_meshd_socket(tmp_path: Path) -> None:
    """``$MESHD_SOCKET`` is where ``meshd serve`` listens when --socket is not given, so
    meshctl (which reads it too) finds the daemon with no options at all."""
    directory = short_tempdir()
    env = {**os.environ, "MESHD_SOCKET": os.path.join(directory, "env.sock"),
           "OMP_WAIT_POLICY": "passive"}
    model = str(testmodels.test_model_path("llama"))
    daemon = subprocess.Popen(
        [sys.executable, "-m", "meshd", "serve", "-m", model, "-t", "1", "--fixed-k",
         "--log-level", "warning"], env=env, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(env["MESHD_SOCKET"]) and time.monotonic() < deadline:
            assert daemon.poll() is None, "the daemon exited"
            time.sleep(0.05)
        meshctl = os.path.join(os.path.dirname(sys.executable), "meshctl")
        done = subprocess.run([meshctl, "health"], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("ok ")
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=30) == 0
        os.rmdir(directory)
