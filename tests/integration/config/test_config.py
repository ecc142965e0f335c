"""The daemon's configuration: precedence (flag > env > file > default), environment
parsing, every key reachable three ways, errors that name the key and its source, and
``meshd config check``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from meshd.daemon.commands import cli
from meshd.daemon.config import settings as cfg
from meshd.daemon.requests.service import ServerConfig
from meshd.testing import testmodels


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "meshd.toml"
    path.write_text(text)
    return str(path)


def _serve_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve: argparse.ArgumentParser = sub.choices["serve"]
    return serve


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = _write(tmp_path, "[serve]\nmax_queue = 8\nslots = 2\nmax_tokens = 100\n"
                            "[model]\nctx = 1024\n")
    env = {"MESHD_SERVE_MAX_QUEUE": "16", "MESHD_SERVE_SLOTS": "3"}
    loaded = cfg.load(path, environ=env, flags={"slots": 5})
    c = loaded.config
    assert (c.serve.slots, c.serve.max_queue, c.serve.max_tokens, c.model.ctx) == (5, 16, 100,
                                                                                   1024)
    assert c.serve.stream_interval_ms == cfg.Config().serve.stream_interval_ms  # default
    assert loaded.sources["serve.slots"] == "--slots"
    assert loaded.sources["serve.max_queue"] == "$MESHD_SERVE_MAX_QUEUE"
    assert loaded.sources["serve.max_tokens"] == path
    assert loaded.sources["serve.stream_interval_ms"] == "default"


def test_flags_given_on_the_command_line_win_and_defaults_yield(tmp_path: Path) -> None:
    path = _write(tmp_path, "[serve]\nmax_queue = 8\n[model]\nctx = 1024\n")
    args = _serve_parser().parse_args(["--config", path, "--ctx", "512"])
    flags = cfg.explicit_flags(args)
    assert flags == {"ctx": 512}  # --max-queue's default does not hide the file's 8
    c = cfg.load(args.config, environ={}, flags=flags).config
    assert (c.model.ctx, c.serve.max_queue) == (512, 8)
    # The help still shows the real defaults.
    assert "(default: 64)" in " ".join(_serve_parser().format_help().split())


def test_environment_values_are_parsed_by_type() -> None:
    env = {
        "MESHD_SPECULATION_FIXED_K": "yes",
        "MESHD_SERVE_SHUTDOWN_GRACE": "2.5",
        "MESHD_SERVE_ALLOW_GROUPS": "meshd, 1000",
        "MESHD_MODEL_THREADS": "",  # empty: unset (the default)
        "MESHD_GPU": "cpu",
    }
    c = cfg.load(None, environ=env, default_path=None).config
    assert c.speculation.fixed_k is True
    assert c.serve.shutdown_grace == 2.5
    assert c.serve.allow_groups == ("meshd", "1000")
    assert c.model.threads is None


def test_every_key_is_a_file_key_an_environment_variable_and_a_flag() -> None:
    parser = _serve_parser()
    dests = {a.dest for a in parser._actions}
    for section, cls in cfg.SECTIONS.items():
        for field in attrs.fields(cls):
            dest = field.metadata.get("flag") or f"{section}_{field.name}"
            assert dest in dests, f"{section}.{field.name} has no flag"
            value = getattr(getattr(cfg.Config(), section), field.name)
            text = ",".join(value) if isinstance(value, tuple) else \
                ("" if value is None else str(value).lower())
            env = {f"MESHD_{section.upper()}_{field.name.upper()}": text}
            loaded = cfg.load(None, environ=env, default_path=None)
            assert loaded.sources[f"{section}.{field.name}"].startswith("$MESHD_")


def test_serve_defaults_are_defined_once() -> None:
    """The server's own defaults and the configuration's agree (no second copy)."""
    assert cfg.server_config(cfg.Config()) == ServerConfig()


@pytest.mark.parametrize(("text", "expected"), [
    ("[serve]\nmax_qeue = 3\n", "unknown key serve.max_qeue"),
    ("[srve]\nslots = 3\n", "unknown section [srve]"),
    ("[serve]\nmax_queue = \"64\"\n", "serve.max_queue: expected an integer, got '64'"),
    ("[serve]\nslots = 1.5\n", "serve.slots: expected an integer, got 1.5"),
    ("[serve]\nslots = 0\n", "serve.slots: must be >= 1 (got 0)"),
    ("[log]\nlevel = \"loud\"\n", "log.level: must be in"),
    ("[speculation]\nfixed_k = 1\n", "speculation.fixed_k: expected true or false, got 1"),
    ("[speculation]\nrollback_snapshots = \"sometimes\"\n",
     "speculation.rollback_snapshots: must be in"),
    ("[serve]\nallow_users = [\"a\", 5]\n", "serve.allow_users: expected a string, got 5"),
    ("[serve]\nallow_users = \"root\"\n", "serve.allow_users: expected a list, got 'root'"),
    ("[serve]\nkeep_alive = \"soon\"\n", "serve.keep_alive: must be a duration"),
    ("[serve]\nkeep_alive = [5]\n", "serve.keep_alive: expected a duration"),
    ("[serve]\nmemory_limit = \"8X\"\n", "serve.memory_limit: must be a size"),
    ("[serve]\nmax_loaded = 0\n", "serve.max_loaded: must be >= 1 (got 0)"),
    ("[model]\ncache_type_k = \"q4_0\"\n", "model.cache_type_k: must be in"),
    ("[serve\n", "not valid TOML"),
    ("serve = 3\n", "serve must be a table"),
])
def test_file_errors_name_the_file_and_the_key(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(cfg.ConfigError) as info:
        cfg.load(path, environ={})
    assert str(info.value).startswith(f"{path}: ")
    assert expected in str(info.value)


@pytest.mark.parametrize(("env", "expected"), [
    ({"MESHD_SERVE_MAX_QUEUE": "many"}, "$MESHD_SERVE_MAX_QUEUE: serve.max_queue: expected "
                                        "an integer, got 'many'"),
    ({"MESHD_SERVE_SLOTZ": "2"}, "$MESHD_SERVE_SLOTZ: unknown key serve.slotz"),
    ({"MESHD_SPECULATION_FIXED_K": "maybe"}, "speculation.fixed_k: expected true or false"),
    ({"MESHD_SERVE_SHUTDOWN_GRACE": "-1"}, "serve.shutdown_grace: must be >= 0.0 (got -1.0)"),
])
def test_environment_errors_name_the_variable_and_the_key(env: dict[str, str],
                                                          expected: str) -> None:
    with pytest.raises(cfg.ConfigError) as info:
        cfg.load(None, environ=env, default_path=None)
    assert expected in str(info.value)


def test_a_missing_file_given_explicitly_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(cfg.ConfigError, match="no such configuration file"):
        cfg.load(str(tmp_path / "nope.toml"), environ={})


def test_config_check_prints_the_effective_config(tmp_path: Path) -> None:
    path = _write(tmp_path, "[serve]\nmax_queue = 8\n")
    command = [sys.executable, "-m", "meshd", "config", "check", "--config", path]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60,
                          env={"MESHD_SERVE_SLOTS": "2", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert any(line.startswith("max_queue = 8") and path in line for line in lines)
    assert any(line.startswith("slots = 2") and "$MESHD_SERVE_SLOTS" in line for line in lines)
    assert any(line.startswith("ctx = 4096") and line.endswith("# default") for line in lines)
    assert any(line.startswith("backend = ") and "default, restart to change" in line
               for line in lines)
    # What it prints is itself a valid configuration file.
    (tmp_path / "printed.toml").write_text(done.stdout)
    again = cfg.load(str(tmp_path / "printed.toml"), environ={}).config
    assert again.serve.max_queue == 8 and again.serve.slots == 2
    bad = subprocess.run(command, capture_output=True, text=True, timeout=60,
                         env={"MESHD_SERVE_SLOTS": "none", "PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2
    assert "$MESHD_SERVE_SLOTS: serve.slots: expected an integer, got 'none'" in bad.stderr


def test_every_name_of_a_key_has_one_precedence(tmp_path: Path) -> None:
    """``$MESHD_SOCKET`` is another name for ``serve.socket``: environment, so it wins
    over the file; the key's own variable wins over it, and a flag over both."""
    path = _write(tmp_path, '[serve]\nsocket = "/from/file.sock"\n')
    env = {"MESHD_SOCKET": "/from/alias.sock"}
    loaded = cfg.load(path, environ=env)
    assert loaded.config.serve.socket == "/from/alias.sock"
    assert loaded.sources["serve.socket"] == "$MESHD_SOCKET"
    env["MESHD_SERVE_SOCKET"] = "/from/env.sock"
    loaded = cfg.load(path, environ=env)
    assert (loaded.config.serve.socket, loaded.sources["serve.socket"]) == \
        ("/from/env.sock", "$MESHD_SERVE_SOCKET")
    flagged = cfg.load(path, environ=env, flags={"socket": "/from/flag.sock"})
    assert flagged.config.serve.socket == "/from/flag.sock"
    assert cfg.load(path, environ={}).config.serve.socket == "/from/file.sock"


def _check(path: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
           **env: str) -> tuple[int, str, str]:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = cli.main(["config", "check", "--config", path])
    out, err = capsys.readouterr()
    return code, out, err


def test_config_check_passes_what_serve_would_start_with(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    model = str(testmodels.test_model_path("llama"))
    path = _write(tmp_path, f'[model]\npath = "{model}"\n[serve]\n'
                            f'socket = "{tmp_path}/run/meshd.sock"\n')
    code, out, err = _check(path, monkeypatch, capsys)
    assert code == 0, err
    assert f'path = "{model}"' in out


@pytest.mark.parametrize(("file", "env", "key", "source", "expected"), [
    ("", {"MESHD_MODEL_PATH": "/nonexistent.gguf"}, "model.path", "$MESHD_MODEL_PATH",
     "model file not found: /nonexistent.gguf"),
    ('[model]\npath = "{tmp}/notes.txt"\n', {}, "model.path", "{file}",
     "is not a GGUF file"),
    ('[model]\npath = "{tmp}"\n', {}, "model.path", "{file}", "is a directory"),
    ('[model]\ndraft_models = ["/gone.gguf"]\n', {}, "model.draft_models", "{file}",
     "draft model file not found: /gone.gguf"),
    ('[serve]\nsocket = "{tmp}/notes.txt/meshd.sock"\n', {}, "serve.socket", "{file}",
     "notes.txt is not a directory"),
    ("", {"MESHD_SERVE_ALLOW_GROUPS": "no-such-group-here"}, "serve.allow_groups",
     "$MESHD_SERVE_ALLOW_GROUPS", "no such group"),
    ('[speculation]\nproposer = "nonesuch"\n', {}, "speculation.proposer", "{file}",
     "unknown proposer 'nonesuch'"),
])
def test_config_check_fails_where_serve_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        file: str, env: dict[str, str], key: str, source: str, expected: str) -> None:
    """Exit 2 before anything loads, naming the key, where its value came from, and
    what is wrong with it."""
    (tmp_path / "notes.txt").write_text("not a model\n")
    path = _write(tmp_path, file.format(tmp=tmp_path))
    code, out, err = _check(path, monkeypatch, capsys, **env)
    assert code == 2, (out, err)
    assert err.startswith(f"meshd config check: {key} (from {source.format(file=path)}): "), err
    assert expected in err, err
    assert out == ""


def test_every_serve_option_is_a_configuration_key() -> None:
    """A serve flag without a key would be settable only on the command line (and not
    from /etc/meshd/meshd.toml or the environment): declare it in meshd.daemon.config.settings."""
    keys = {field.metadata.get("flag") or f"{section}_{field.name}"
            for section, cls in cfg.SECTIONS.items() for field in attrs.fields(cls)}
    options = {a.dest for a in _serve_parser()._actions
               if a.option_strings and a.dest not in ("help", "config")}
    assert options - keys == set(), "serve options without a configuration key"


def test_the_prefix_cache_can_be_bounded_or_turned_off(tmp_path: Path) -> None:
    """``--prefix-cache-tokens 0`` (or ``prefix_cache_tokens = 0`` in the file) turns the
    prefix cache off (with an f16 K cache a hit can move a greedy text); the default
    leaves the bound to the runtime (every slot's context)."""
    assert cfg.Config().serve.prefix_cache_tokens is None
    args = _serve_parser().parse_args(["--prefix-cache-tokens", "0"])
    c = cfg.load(None, environ={}, flags=cfg.explicit_flags(args)).config
    assert c.serve.prefix_cache_tokens == 0
    path = _write(tmp_path, "[serve]\nprefix_cache_tokens = 4096\n")
    assert cfg.load(path, environ={}, flags={}).config.serve.prefix_cache_tokens == 4096
    with pytest.raises(cfg.ConfigError):
        cfg.load(_write(tmp_path, "[serve]\nprefix_cache_tokens = -1\n"), environ={}, flags={})


def test_the_k_cache_type_reaches_the_runtime_from_flag_and_file(tmp_path: Path) -> None:
    """``--cache-type-k`` / ``[model] cache_type_k``: auto by default (f16 with the
    attention kernel pinned on the CPU, for identity at any length), bf16 on request."""
    assert cfg.Config().model.cache_type_k == "auto"
    args = _serve_parser().parse_args(["--cache-type-k", "f16"])
    assert cfg.load(None, environ={}, flags=cfg.explicit_flags(args)).config.model \
        .cache_type_k == "f16"
    path = _write(tmp_path, "[model]\ncache_type_k = \"bf16\"\n")
    assert cfg.load(path, environ={}, flags={}).config.model.cache_type_k == "bf16"
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["--cache-type-k", "q8_0"])


def test_an_on_by_default_key_is_turned_off_by_its_flag_over_the_file(tmp_path: Path) -> None:
    """``--no-slots-endpoint`` (a key whose default is on): its False is a given flag,
    where a left-out store_true flag's False is not."""
    path = tmp_path / "meshd.toml"
    path.write_text("[http]\nslots_endpoint = true\n")
    off = _serve_parser().parse_args(["--config", str(path), "--no-slots-endpoint"])
    loaded = cfg.load(str(path), environ={}, flags=cfg.explicit_flags(off)).config
    assert cfg.server_config(loaded).http.slots_endpoint is False
    left_out = _serve_parser().parse_args(["--config", str(path)])
    loaded = cfg.load(str(path), environ={}, flags=cfg.explicit_flags(left_out)).config
    assert cfg.server_config(loaded).http.slots_endpoint is True
