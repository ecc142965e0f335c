"""Several models in one daemon, as configured: ``-m PATH`` and ``-m NAME=PATH`` on the
command line, ``[models.NAME]`` tables over ``[model]``, the default model, the errors
that name the table or flag at fault, and the durations and sizes of ``[serve]``'s
``keep_alive`` and ``memory_limit``. Nothing is loaded: empty ``*.gguf`` files do."""

from __future__ import annotations

import argparse
from pathlib import Path

import attrs
import pytest

from meshd.clients.argtypes import duration_seconds, size_bytes
from meshd.daemon.commands import cli
from meshd.daemon.config import settings as cfg
from meshd.daemon.config.model_specs import ModelSpec, model_name_from_path, model_specs
from meshd.daemon.config.values import split_model_arg

EMBEDDED_NAME = "SmolLM2-135M-Instruct.Q4_1"


def _serve_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = sub.choices["serve"]
    return serve


def _specs(argv: list[str], config: str | None = None,
           env: dict[str, str] | None = None) -> tuple[cfg.Loaded, list[ModelSpec]]:
    """What ``meshd serve ARGV`` would serve (``config``: the file's text)."""
    args = _serve_parser().parse_args(argv)
    loaded = cfg.load(config, environ=env or {}, flags=cfg.explicit_flags(args),
                      default_path=None)
    return loaded, model_specs(loaded)


@pytest.fixture
def models(tmp_path: Path) -> dict[str, str]:
    """Empty files a spec may name: chat.gguf, code.gguf, tiny.gguf."""
    paths = {}
    for name in ("chat", "code", "tiny"):
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"")
        paths[name] = str(path)
    return paths


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "meshd.toml"
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------- one model


def test_no_model_given_is_the_embedded_default_under_its_stem() -> None:
    loaded, specs = _specs([])
    assert [(s.name, s.model.path, s.source, s.keep_alive_s) for s in specs] == \
        [(EMBEDDED_NAME, None, "[model]", None)]
    assert specs[0].model == loaded.config.model
    assert specs[0].proposer == "auto"


def test_one_plain_model_path_is_today_s_single_model(models: dict[str, str]) -> None:
    """``-m PATH`` alone sets ``[model] path`` as before and serves it under its stem;
    its file is left to serve's own check (exit 3 there), so one that does not exist is
    no configuration error here."""
    args = _serve_parser().parse_args(["-m", models["chat"], "--ctx", "512"])
    flags = cfg.explicit_flags(args)
    assert flags == {"model": models["chat"], "models": [models["chat"]], "ctx": 512}
    loaded = cfg.load(None, environ={}, flags=flags, default_path=None)
    assert loaded.sources["model.path"] == "--model"
    (spec,) = model_specs(loaded)
    assert (spec.name, spec.model.path, spec.model.ctx, spec.source) == \
        ("chat", models["chat"], 512, "[model]")
    (missing,) = _specs(["-m", "/nonexistent/other.gguf"])[1]
    assert (missing.name, missing.model.path) == ("other", "/nonexistent/other.gguf")


@pytest.mark.parametrize(("path", "name"), [
    ("/srv/models/qwen2.5-1b.Q4_K_M.gguf", "qwen2.5-1b.Q4_K_M"),
    ("/srv/models/my model (v2).gguf", "my-model--v2-"),
    ("/srv/models/_hidden.gguf", "hidden"),
    ("/srv/models/modèle.gguf", "mod-le"),
    ("/srv/models/" + "x" * 80 + ".gguf", "x" * 64),
    ("/srv/models/---.gguf", "model"),
    (None, EMBEDDED_NAME),
])
def test_a_model_is_named_by_its_file_made_valid(path: str | None, name: str) -> None:
    assert model_name_from_path(path) == name


@pytest.mark.parametrize(("text", "expected"), [
    ("chat=/srv/chat.gguf", ("chat", "/srv/chat.gguf")),
    ("qwen2.5:1b=/srv/q.gguf", ("qwen2.5:1b", "/srv/q.gguf")),
    ("a=b=c.gguf", ("a", "b=c.gguf")),
    ("/srv/a=b.gguf", (None, "/srv/a=b.gguf")),  # "/srv/a" is no name: all of it a path
    ("models/x=1.gguf", (None, "models/x=1.gguf")),
    ("/srv/plain.gguf", (None, "/srv/plain.gguf")),
])
def test_name_equals_path_only_when_the_name_is_valid(text: str,
                                                      expected: tuple[str | None, str]) -> None:
    assert split_model_arg(text) == expected


# ---------------------------------------------------------------------- command line


def test_repeated_models_are_served_by_name_the_first_the_default(
        models: dict[str, str]) -> None:
    loaded, specs = _specs(["-m", f"chat={models['chat']}", "-m", f"coder={models['code']}",
                            "-m", models["tiny"], "-t", "3"])
    assert loaded.command_line_models == (f"chat={models['chat']}", f"coder={models['code']}",
                                          models["tiny"])
    assert loaded.config.model.path is None  # [model] is only what they inherit
    assert [(s.name, s.model.path, s.model.threads, s.source) for s in specs] == [
        ("chat", models["chat"], 3, f"-m chat={models['chat']}"),
        ("coder", models["code"], 3, f"-m coder={models['code']}"),
        ("tiny", models["tiny"], 3, f"-m {models['tiny']}"),
    ]
    _, reordered = _specs(["-m", f"chat={models['chat']}", "-m", f"coder={models['code']}",
                           "--default-model", "coder"])
    assert [s.name for s in reordered] == ["coder", "chat"]


def test_one_named_model_is_several_models_of_one(models: dict[str, str]) -> None:
    loaded, specs = _specs(["-m", f"chat={models['code']}"])
    assert "model" not in loaded.flags and loaded.config.model.path is None
    assert [(s.name, s.model.path) for s in specs] == [("chat", models["code"])]


@pytest.mark.parametrize(("argv", "expected"), [
    (["-m", "a={chat}", "-m", "a={code}"],
     "-m a={code}: the model name a is given twice (also by -m a={chat})"),
    (["-m", "{chat}", "-m", "chat={code}"],
     "-m chat={code}: the model name chat is given twice (also by -m {chat})"),
    (["-m", "a={chat}", "-m", "b=/nonexistent/b.gguf"],
     "-m b=/nonexistent/b.gguf: model file not found: /nonexistent/b.gguf"),
    (["-m", "a={chat}", "-m", "b={dir}"], "-m b={dir}: {dir} is not a file"),
    (["-m", "a={chat}", "--default-model", "z"],
     "serve.default_model (from --default-model): no model is named z (the models: a)"),
])
def test_command_line_errors_name_the_flag(models: dict[str, str], tmp_path: Path,
                                           argv: list[str], expected: str) -> None:
    values = {**models, "dir": str(tmp_path)}
    with pytest.raises(cfg.ConfigError) as info:
        _specs([a.format(**values) for a in argv])
    assert str(info.value) == expected.format(**values)


# ---------------------------------------------------------------------- config file


def test_tables_inherit_model_and_override_their_keys(tmp_path: Path,
                                                      models: dict[str, str]) -> None:
    """A key a table leaves out is ``[model]``'s after the environment and flags; its
    own ctx, threads, proposer and keep_alive win; file order, the first the default."""
    path = _file(tmp_path, f"""
[model]
ctx = 2048
threads = 2
cache_type_k = "f16"
[speculation]
proposer = "off"
[models.code]
path = "{models['code']}"
ctx = 8192
threads = 4
proposer = "ngram"
keep_alive = "30m"
[models.chat]
path = "{models['chat']}"
keep_alive = -1
""")
    loaded, specs = _specs(["--thread-wait", "sleep"], path,
                           env={"MESHD_MODEL_CACHE_TYPE_K": "bf16"})
    assert list(loaded.models) == ["code", "chat"]
    code, chat = specs
    assert (code.name, code.model.path, code.model.ctx, code.model.threads, code.proposer,
            code.keep_alive_s, code.source) == \
        ("code", models["code"], 8192, 4, "ngram", 1800.0, f"[models.code] in {path}")
    assert (chat.name, chat.model.ctx, chat.model.threads, chat.proposer,
            chat.keep_alive_s) == ("chat", 2048, 2, "off", -1.0)
    for spec in specs:  # the flag and the variable reach every table
        assert (spec.model.thread_wait, spec.model.cache_type_k) == ("sleep", "bf16")


def test_default_model_and_the_command_line_first(tmp_path: Path,
                                                  models: dict[str, str]) -> None:
    path = _file(tmp_path, f"""
[serve]
default_model = "chat"
[models.code]
path = "{models['code']}"
ctx = 1024
[models.chat]
path = "{models['chat']}"
""")
    assert [s.name for s in _specs([], path)[1]] == ["chat", "code"]
    # -m models come first; one named like a table replaces it (the command line wins).
    _, specs = _specs(["-m", f"code={models['tiny']}", "-m", f"extra={models['tiny']}",
                       "--default-model", "extra"], path)
    assert [(s.name, s.model.path, s.model.ctx, s.source) for s in specs] == [
        ("extra", models["tiny"], 4096, f"-m extra={models['tiny']}"),
        ("code", models["tiny"], 4096, f"-m code={models['tiny']}"),
        ("chat", models["chat"], 4096, f"[models.chat] in {path}"),
    ]
    # A single plain -m with tables is one of the models, the first.
    _, specs = _specs(["-m", models["tiny"]], path)
    assert [s.name for s in specs] == ["chat", "tiny", "code"]  # default_model still first


@pytest.mark.parametrize(("text", "expected"), [
    ('[models.chat]\nctx = 4096\n', "{file}: [models.chat] has no path (every model table"),
    ('[models.chat]\npath = "/nonexistent/c.gguf"\n',
     "[models.chat] in {file}: model file not found: /nonexistent/c.gguf"),
    ('[models.chat]\npath = "{tmp}"\n', "[models.chat] in {file}: {tmp} is not a file"),
    ('[models."my model"]\npath = "{chat}"\n',
     "{file}: [models.my model]: 'my model' is not a model name"),
    ('[models.chat]\npath = "{chat}"\nctxx = 1\n',
     "{file}: unknown key models.chat.ctxx (known: path, ctx,"),
    ('[models.chat]\npath = "{chat}"\nctx = "big"\n',
     "{file}: models.chat.ctx: expected an integer, got 'big'"),
    ('[models.chat]\npath = "{chat}"\nctx = 0\n', "{file}: models.chat.ctx: must be >= 1"),
    ('[models.chat]\npath = "{chat}"\ncache_type_k = "q4_0"\n',
     "{file}: models.chat.cache_type_k: must be in"),
    ('[models.chat]\npath = "{chat}"\ndraft_models = "d.gguf"\n',
     "{file}: models.chat.draft_models: expected a list, got 'd.gguf'"),
    ('[models.chat]\npath = "{chat}"\nproposer = 3\n',
     "{file}: models.chat.proposer: expected a string, got 3"),
    ('[models.chat]\npath = "{chat}"\nkeep_alive = "soon"\n',
     "{file}: models.chat.keep_alive: expected a duration"),
    ('[models.chat]\npath = "{chat}"\nkeep_alive = true\n',
     "{file}: models.chat.keep_alive: expected a duration (a string like \"5m\" or a number"),
    ('[serve]\ndefault_model = "code"\n[models.chat]\npath = "{chat}"\n',
     "serve.default_model (from {file}): no model is named code (the models: chat)"),
    ('[serve]\ndefault_model = "a b"\n', "{file}: serve.default_model: must be a model name"),
    ('[models]\npath = "{chat}"\n', "{file}: models.path must be a table"),
    ('models = 3\n', "{file}: models must be tables ([models.NAME])"),
])
def test_file_errors_name_the_table_and_the_file(tmp_path: Path, models: dict[str, str],
                                                 text: str, expected: str) -> None:
    path = _file(tmp_path, text.format(tmp=tmp_path, chat=models["chat"]))
    with pytest.raises(cfg.ConfigError) as info:
        _specs([], path)
    assert str(info.value).startswith(expected.format(file=path, tmp=tmp_path)), \
        str(info.value)


def test_a_replaced_table_needs_no_path_but_is_still_checked(tmp_path: Path,
                                                             models: dict[str, str]) -> None:
    path = _file(tmp_path, "[models.chat]\nctx = 512\n")
    _, specs = _specs(["-m", f"chat={models['chat']}"], path)
    assert [(s.name, s.model.ctx) for s in specs] == [("chat", 4096)]
    bad = _file(tmp_path, "[models.chat]\nctx = -1\n")
    with pytest.raises(cfg.ConfigError, match=r"models\.chat\.ctx: must be >= 1"):
        _specs(["-m", f"chat={models['chat']}"], bad)


def test_config_check_lists_the_models(tmp_path: Path, models: dict[str, str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = _file(tmp_path, f"""
[serve]
default_model = "code"
[models.chat]
path = "{models['chat']}"
keep_alive = 60
[models.code]
path = "{models['code']}"
""")
    assert cli.main(["config", "check", "--config", path]) == 0
    out = capsys.readouterr().out
    assert f"#   code = {models['code']}  ([models.code] in {path})\n" \
           f"#   chat = {models['chat']}  ([models.chat] in {path})" in out
    # What it prints is still a configuration file, with the same models.
    (tmp_path / "printed.toml").write_text(out)
    again = model_specs(cfg.load(str(tmp_path / "printed.toml"), environ={}))
    assert [(s.name, s.keep_alive_s) for s in again] == [("code", None), ("chat", 60.0)]
    broken = _file(tmp_path, '[models.chat]\npath = "/nonexistent/c.gguf"\n')
    assert cli.main(["config", "check", "--config", broken]) == 2
    err = capsys.readouterr().err
    assert err == f"meshd config check: [models.chat] in {broken}: model file not " \
                  "found: /nonexistent/c.gguf\n"


# ---------------------------------------------------------------------- [serve] keys


@pytest.mark.parametrize(("text", "seconds"), [
    ("300", 300.0), ("2.5", 2.5), ("30s", 30.0), ("5m", 300.0), ("1h", 3600.0),
    ("1h30m", 5400.0), ("500ms", 0.5), ("0", 0.0), ("-1", -1.0), ("-5m", -1.0),
    ("-0.5", -1.0), (" 10s ", 10.0),
])
def test_durations(text: str, seconds: float) -> None:
    assert duration_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "5x", "m", "5 m", "1e3", "inf", "nan", "--1",
                                  "1.2.3", "-"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="expected a duration"):
        duration_seconds(text)
    with pytest.raises(argparse.ArgumentTypeError, match="expected a duration"):
        duration_seconds(text)


@pytest.mark.parametrize(("text", "size"), [
    ("123", 123), ("64K", 64 << 10), ("512M", 512 << 20), ("8G", 8 << 30),
    ("1.5G", 3 << 29), ("2T", 2 << 40), ("8GiB", 8 << 30), ("512mib", 512 << 20),
    ("8GB", 8_000_000_000), ("512MB", 512_000_000), ("1B", 1), ("8 G", 8 << 30),
])
def test_sizes(text: str, size: int) -> None:
    assert size_bytes(text) == size


@pytest.mark.parametrize("text", ["0", "0.5", "-1", "lots", "8X", "8GiBB", "1e3", "G", ""])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        size_bytes(text)


def test_serve_keys_from_flags_environment_and_file(tmp_path: Path) -> None:
    serve = cfg.Config().serve
    assert (serve.keep_alive, serve.max_loaded, serve.memory_limit, serve.default_model) == \
        ("5m", None, None, None)
    args = _serve_parser().parse_args(["--keep-alive", "-1", "--max-loaded", "2",
                                       "--memory-limit", "8G", "--default-model", "chat"])
    assert cfg.explicit_flags(args) == {"keep_alive": "-1", "max_loaded": 2,
                                        "memory_limit": "8G", "default_model": "chat"}
    env = cfg.load(None, environ={"MESHD_SERVE_KEEP_ALIVE": "10m",
                                  "MESHD_SERVE_MEMORY_LIMIT": "512M",
                                  "MESHD_SERVE_MAX_LOADED": "3"}, default_path=None)
    assert (env.config.serve.keep_alive, env.config.serve.memory_limit,
            env.config.serve.max_loaded) == ("10m", "512M", 3)
    assert env.sources["serve.keep_alive"] == "$MESHD_SERVE_KEEP_ALIVE"
    for value, expected in (("300", "300"), ("-1", "-1"), ("2.5", "2.5"), ('"1h"', "1h")):
        path = _file(tmp_path, f"[serve]\nkeep_alive = {value}\n")
        assert cfg.load(path, environ={}).config.serve.keep_alive == expected


@pytest.mark.parametrize(("argv", "expected"), [
    (["--keep-alive", "soon"], "argument --keep-alive: expected a duration"),
    (["--memory-limit", "0"], "argument --memory-limit: expected a size of at least 1 byte"),
    (["--memory-limit", "lots"], "argument --memory-limit: expected a size"),
    (["--max-loaded", "0"], "argument --max-loaded: expected a positive integer"),
])
def test_serve_flags_are_checked_while_parsing(argv: list[str], expected: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(argv)
    assert expected in capsys.readouterr().err


@pytest.mark.parametrize(("env", "expected"), [
    ({"MESHD_SERVE_KEEP_ALIVE": "soon"},
     "$MESHD_SERVE_KEEP_ALIVE: serve.keep_alive: must be a duration"),
    ({"MESHD_SERVE_MEMORY_LIMIT": "8X"},
     "$MESHD_SERVE_MEMORY_LIMIT: serve.memory_limit: must be a size"),
    ({"MESHD_SERVE_MAX_LOADED": "0"},
     "$MESHD_SERVE_MAX_LOADED: serve.max_loaded: must be >= 1 (got 0)"),
])
def test_serve_key_errors_name_the_variable_and_the_key(env: dict[str, str],
                                                        expected: str) -> None:
    with pytest.raises(cfg.ConfigError) as info:
        cfg.load(None, environ=env, default_path=None)
    assert str(info.value).startswith(expected), str(info.value)


def test_keep_alive_and_the_limits_are_live() -> None:
    old = cfg.Config()
    new = attrs.evolve(old, serve=attrs.evolve(
        old.serve, keep_alive="1h", max_loaded=2, memory_limit="8G", default_model="x"))
    assert cfg.live_changes(old, new) == ["serve.keep_alive", "serve.max_loaded",
                                          "serve.memory_limit", "serve.default_model"]
    assert cfg.restart_needed(old, new) == []
    # A model's own keys reload it (once idle); how its threads wait needs a restart.
    moved = attrs.evolve(old, model=attrs.evolve(old.model, ctx=512, thread_wait="sleep"))
    assert cfg.live_changes(old, moved) == ["model.ctx"]
    assert cfg.restart_needed(old, moved) == ["model.thread_wait"]


def test_aliases_and_tags_belong_to_one_model(tmp_path: Path, models: dict[str, str]) -> None:
    """``--alias``/``--tags`` (``[model]`` aliases and tags) name the single model, or the
    first ``-m`` model of several; a table has only its own; a name two models would
    answer to, or an alias that is not a model name, is an error naming where."""
    (one,) = _specs(["-m", models["chat"], "--alias", "gpt-4o, fim", "--tags", "chat"])[1]
    assert (one.model.aliases, one.model.tags) == (("gpt-4o", "fim"), ("chat",))
    path = _file(tmp_path, f'[models.tiny]\npath = "{models["tiny"]}"\naliases = ["t"]\n')
    specs = _specs(["-m", f"chat={models['chat']}", "-m", f"code={models['code']}",
                    "--alias", "gpt-4o"], path)[1]
    assert [(s.name, s.model.aliases) for s in specs] == \
        [("chat", ("gpt-4o",)), ("code", ()), ("tiny", ("t",))]
    clash = _file(tmp_path, f'[models.tiny]\npath = "{models["tiny"]}"\naliases = ["chat"]\n')
    with pytest.raises(cfg.ConfigError, match=r"\[models\.tiny\] in .*: the alias chat also "
                                              r"names the model of -m chat="):
        _specs(["-m", f"chat={models['chat']}"], clash)
    with pytest.raises(cfg.ConfigError,
                       match=r"model\.aliases: must be a model name.*\(got 'a b'\)"):
        _specs([], _file(tmp_path, '[model]\naliases = ["a b"]\n'))
