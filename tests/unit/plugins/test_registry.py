"""Registry: built-ins arrive through entry points; broken plugins are contained."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

from meshd.plugins.base import ProposerEnv, ProposerUnavailable
from meshd.plugins.composite import CompositeProposer
from meshd.plugins.mtp import MtpProposer
from meshd.plugins.ngram import NgramProposer, ngram_factory
from meshd.plugins.registry import (
    GROUP,
    ProposerFailed,
    Registry,
    UnknownProposer,
    bool_option,
    default_registry,
    float_option,
    int_option,
)
from meshd.plugins.resources import Resources

from ..policy.curves import Q8_0
from .fakes import FakeProposer

ENV = ProposerEnv(vocab_size=100, eog_tokens=frozenset({2}))


def test_builtins_come_from_entry_points() -> None:
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=GROUP)}
    assert eps["ngram"] == "meshd.plugins.ngram:ngram_factory"
    assert {"mtp", "ngram", "composite"} <= set(eps)
    reg = Registry.load()
    assert {"mtp", "ngram", "composite"} <= set(reg.names())
    assert reg.errors == {}
    assert isinstance(reg.create("ngram", ENV), NgramProposer)
    with pytest.raises(ProposerUnavailable):
        reg.create("mtp", ENV)  # no head on this model: a normal, typed answer

    class Head:
        def draft(self, k: int, *, probs: bool = False) -> tuple[list[int], list[float]]:
            return [1] * k, [0.9] * k if probs else []

    with_head = ProposerEnv(100, frozenset(), mtp=Head(), resources=Resources(cost_curve=Q8_0))
    assert isinstance(reg.create("mtp", with_head), MtpProposer)
    comp = reg.create("composite", with_head)
    assert isinstance(comp, CompositeProposer)
    assert [c.name for c in comp.children] == ["mtp", "ngram"]
    assert default_registry() is default_registry()


def test_unknown_name_lists_the_available_ones() -> None:
    reg = Registry()
    reg.register("ngram", ngram_factory)
    with pytest.raises(UnknownProposer, match=r"'nope'; available: ngram") as info:
        reg.create("nope", ENV)
    assert info.value.available == ["ngram"]
    assert isinstance(info.value, LookupError)


def test_broken_import_is_reported_and_the_rest_still_load(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = importlib.metadata.entry_points

    def fake(**kwargs: str) -> list[importlib.metadata.EntryPoint]:
        group = kwargs["group"]
        extra = [
            importlib.metadata.EntryPoint("broken", "meshd_no_such_module:factory", group),
            importlib.metadata.EntryPoint("notcallable", "meshd.plugins.registry:GROUP", group),
            importlib.metadata.EntryPoint("ngram", "meshd.plugins.mtp:mtp_factory", group),
        ]
        return [*real(group=group), *extra]

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    with caplog.at_level(logging.WARNING, logger="meshd.plugins.registry"):
        reg = Registry.load()
    assert {"mtp", "ngram", "composite"} <= set(reg.names())
    assert "broken" not in reg.names() and "notcallable" not in reg.names()
    assert "ModuleNotFoundError" in reg.errors["broken"]
    assert "not callable" in reg.errors["notcallable"]
    assert "duplicate" in reg.errors["ngram"]  # first claim kept, the second reported
    assert isinstance(reg.create("ngram", ENV), NgramProposer)
    assert "broken" in caplog.text
    with pytest.raises(UnknownProposer, match="failed to load"):
        reg.create("broken", ENV)


def test_failing_factory_is_contained() -> None:
    reg = Registry()

    def boom(env: ProposerEnv) -> FakeProposer:
        raise RuntimeError("kaput")

    def wrong(env: ProposerEnv) -> object:
        return object()

    reg.register("boom", boom)
    reg.register("wrong", wrong)  # type: ignore[arg-type]
    reg.register("ok", lambda env: FakeProposer("ok", [1]))
    with pytest.raises(ProposerFailed, match="kaput"):
        reg.create("boom", ENV)
    with pytest.raises(ProposerFailed, match="without name, capabilities"):
        reg.create("wrong", ENV)
    assert reg.create("ok", ENV).name == "ok"


def test_register_rules() -> None:
    reg = Registry()
    reg.register("x", ngram_factory)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("x", ngram_factory)
    reg.register("x", lambda env: FakeProposer("x", []), replace=True)
    assert reg.create("x", ENV).name == "x" and "x" in reg
    with pytest.raises(ValueError):
        reg.register("", ngram_factory)
    with pytest.raises(TypeError):
        reg.register("y", 3)  # type: ignore[arg-type]


def test_option_helpers() -> None:
    opts = {"i": 3, "f": 0.5, "b": True, "s": "x"}
    assert int_option(opts, "i", 1) == 3 and int_option(opts, "missing", 7) == 7
    assert float_option(opts, "f", 1.0) == 0.5 and float_option(opts, "i", 1.0) == 3.0
    assert bool_option(opts, "b", False) is True
    for call in [
        lambda: int_option(opts, "b", 1),
        lambda: int_option(opts, "s", 1),
        lambda: int_option(opts, "i", 1, minimum=4),
        lambda: float_option(opts, "s", 1.0),
        lambda: float_option(opts, "f", 1.0, maximum=0.1),
        lambda: bool_option(opts, "i", False),
    ]:
        with pytest.raises(ValueError):
            call()
