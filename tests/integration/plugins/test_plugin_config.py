"""Plugins are configured by name and get exactly the resources they declare, the same
way for built-ins and third parties; ``meshd plugins list`` shows what is installed."""

from __future__ import annotations

import grp
import json
import os
import pwd
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from meshd.daemon.commands.cli import main as meshd_main
from meshd.daemon.config.settings import load as load_config
from meshd.daemon.engine.request_errors import RequestError
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.native.default_model import default_model_path
from meshd.plugins.base import Capabilities, Outcome, Proposal, ProposalRequest, ProposerEnv
from meshd.plugins.config import PluginConfigError, parse_table
from meshd.plugins.registry import Registry
from meshd.plugins.resources import Need, requires

PROMPT = "Hello, plugin world"


class Recorder:
    """A do-nothing proposer that remembers the environment it was made with."""

    name = "recorder"
    capabilities = Capabilities()

    def __init__(self, env: ProposerEnv) -> None:
        self.env = env

    def propose(self, request: ProposalRequest) -> Proposal | None:
        return None

    def observe(self, outcome: Outcome) -> None:
        pass

    def close(self) -> None:
        pass


@requires(Need.DRAFT_MODEL, Need.TOKENIZER, Need.PROMPT_TEXT)
def greedy_factory(env: ProposerEnv) -> Recorder:
    return Recorder(env)


def plain_factory(env: ProposerEnv) -> Recorder:
    return Recorder(env)


def make_runtime(plugins: dict[str, dict[str, Any]]) -> ModelRuntime:
    registry = Registry.load().copy()
    registry.register("greedy", greedy_factory)
    registry.register("plain", plain_factory)
    return ModelRuntime(RuntimeConfig(
        n_ctx_seq=256, n_seq_max=1, calibrate=False, threads=1,
        allowed_drafts=(str(default_model_path()),),
        plugins={name: parse_table(name, table) for name, table in plugins.items()},
    ), registry=registry)


@pytest.fixture(scope="module")
def runtime() -> Iterator[ModelRuntime]:
    with make_runtime({"plain": {"depth": 3, "mode": "fast"}, "off-by-config": {
            "enabled": False}}) as rt:
        yield rt


def _env(rt: ModelRuntime, name: str, options: dict[str, Any] | None = None) -> ProposerEnv:
    prompt = rt.tokenize_prompt(PROMPT, chat=False)
    proposer, _ = rt.make_proposer(name, options, prompt)
    assert isinstance(proposer, Recorder)
    return proposer.env


def test_undeclared_resources_are_not_given_and_options_layer(runtime: ModelRuntime) -> None:
    env = _env(runtime, "plain", {"mode": "slow"})
    res = env.resources
    assert res.draft_model is None and res.tokenizer is None and res.prompt_text is None
    assert res.cost_curve is None and res.registry is None
    assert dict(env.options) == {"depth": 3, "mode": "slow"}  # table, then the request
    assert env.model.n_vocab == runtime.model.info.n_vocab and env.model.name.endswith(".gguf")


def test_a_third_party_gets_what_draft_gets(runtime: ModelRuntime) -> None:
    path = str(default_model_path())
    env = _env(runtime, f"greedy:{path}")
    assert env.resources.draft_model is runtime.draft_model(path)  # the shared one
    assert env.resources.tokenizer is runtime.model.tokenizer
    assert env.resources.prompt_text is None  # not allowed by its (absent) config
    with pytest.raises(RequestError, match="needs a draft model"):
        _env(runtime, "greedy")
    with pytest.raises(RequestError, match="not one this daemon serves"):
        _env(runtime, "greedy:/etc/passwd")
    draft, _ = runtime.make_proposer(f"draft:{path}")
    assert draft is not None and draft.name == "draft"
    draft.close()


def test_prompt_text_only_when_the_config_allows() -> None:
    path = str(default_model_path())
    with make_runtime({"greedy": {"allow_prompt_text": True}}) as rt:
        env = _env(rt, f"greedy:{path}")
        assert env.resources.prompt_text is not None and PROMPT in env.resources.prompt_text


def test_disabled_and_unknown(runtime: ModelRuntime) -> None:
    with pytest.raises(RequestError, match="unknown proposer 'nonexistent'"):
        runtime.make_proposer("nonexistent")
    runtime.registry.register("off-by-config", plain_factory)
    try:
        with pytest.raises(RequestError, match="disabled"):
            runtime.make_proposer("off-by-config")
    finally:
        runtime.registry.unregister("off-by-config")


@pytest.mark.parametrize("table", [
    {"command": "python x.py"}, {"command": []}, {"deadline_ms": 0}, {"max_faults": 0},
    {"enabled": "yes"}, {"deadline_ms": True}, {"restart_backoff_s": 5,
                                                "restart_backoff_max_s": 1},
])
def test_bad_tables_name_the_key(table: dict[str, Any]) -> None:
    with pytest.raises(PluginConfigError, match=r"speculation\.plugins\.p"):
        parse_table("p", table)


def test_a_connecting_plugin_is_pinned_by_uid_or_gid_names_or_ids() -> None:
    me = pwd.getpwuid(os.getuid())
    group = grp.getgrgid(os.getgid())
    by_name = parse_table("p", {"connect": True, "uid": me.pw_name, "gid": group.gr_name})
    by_id = parse_table("p", {"connect": True, "uid": os.getuid(), "gid": str(os.getgid())})
    for config in (by_name, by_id):
        assert (config.uid, config.gid, config.pinned) == (os.getuid(), os.getgid(), True)
        assert "uid" not in config.options and "gid" not in config.options
    assert not parse_table("p", {"connect": True}).pinned
    for table, why in [
        ({"connect": True, "uid": "no-such-user-meshd"}, "no such user"),
        ({"connect": True, "gid": "no-such-group-meshd"}, "no such group"),
        ({"connect": True, "uid": -1}, "uid"),
        ({"connect": True, "gid": True}, "gid"),
        ({"command": ["x"], "uid": os.getuid()}, "connect = true"),
    ]:
        with pytest.raises(PluginConfigError, match=why):
            parse_table("p", table)


def test_plugins_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "meshd.toml"
    config.write_text('[speculation.plugins.remote]\ncommand = ["my-plugin"]\n'
                      '[speculation.plugins.ngram]\nenabled = false\n')
    assert set(load_config(str(config), environ={}).plugins) == {"remote", "ngram"}
    assert meshd_main(["plugins", "list", "--json", "-C", str(config)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["snippets"]["loaded"] and "meshd-snippets" in rows["snippets"]["origin"]
    assert rows["snippets"]["capabilities"]["max_len"] == 16
    assert rows["draft"]["needs"] == ["draft_model"]
    assert rows["ngram"]["enabled"] is False
    assert "spawned: my-plugin" in rows["remote"]["origin"]
    assert meshd_main(["plugins", "list", "-C", str(config)]) == 0
    out = capsys.readouterr().out
    assert "snippets" in out and "from: meshd_snippets:factory" in out
    config.write_text("[speculation.plugins.bad]\nmax_faults = -1\n")
    assert meshd_main(["plugins", "list", "-C", str(config)]) == 2
