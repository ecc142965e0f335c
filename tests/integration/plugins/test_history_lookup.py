"""History lookup on the real small model: a repeated task drafts from the answers the
daemon already wrote for the same owner, never from another owner's, and the output is
plain decoding's whatever the history holds (greedy, seeded, under a JSON schema).

The machine's economics are pinned to a measured CPU cost curve (as in
``test_prompt_lookup``), so which drafts are verified does not depend on this machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from meshd.daemon.commands.server import serving
from meshd.daemon.config.http import HttpConfig
from meshd.daemon.config.server import ServerConfig
from meshd.daemon.engine.generation import Generation
from meshd.daemon.engine.sampling import GREEDY, SamplingParams
from meshd.daemon.frontends.http.metrics import render_metrics
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.plugins import history as history_plugin
from meshd.plugins.history import ANCHOR
from meshd.plugins.registry import default_registry
from meshd.policy.costs import CostCurve, CostModel
from meshd.protocol import Client, Constraint
from tests.integration.helpers.daemon import running_daemon, short_tempdir

#: Relative cost of verifying k drafts (k + 1 rows), SmolLM2 Q4_1 on a 2-core CPU.
CPU = CostCurve.from_row_costs({2: 1.74, 9: 4.9, 17: 8.5, 33: 16.0})
SEEDED = SamplingParams(temperature=0.8, seed=7)
TASK = ("List the steps to make a cup of tea, as a numbered list of five short steps.")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 40},
                  "minItems": 2, "maxItems": 4},
    },
    "required": ["name", "steps"],
    "additionalProperties": False,
}


class PinnedCosts(CostModel):
    """Curve :data:`CPU`, unmoved by measured forwards."""

    def record(self, rows: int, seconds: float, *, sequences: int = 1) -> None:
        pass


def _runtime(history_tokens: int) -> ModelRuntime:
    runtime = ModelRuntime(
        RuntimeConfig(n_ctx_seq=2048, n_seq_max=1, draft_max=CPU.max_k, calibrate=False,
                      prefix_cache_tokens=0, history_tokens=history_tokens),
        registry=default_registry(),
    )
    runtime.costs = PinnedCosts(CPU.costs)
    return runtime


@pytest.fixture
def rt() -> Iterator[ModelRuntime]:
    runtime = _runtime(50_000)
    yield runtime
    runtime.close()


def generate(rt: ModelRuntime, text: str, proposer: str, *, owner: str | None = "uid:1",
             max_tokens: int = 80, sampling: SamplingParams = GREEDY,
             grammar: str | None = None) -> Generation:
    prompt = rt.tokenize_prompt(rt.render_chat([{"role": "user", "content": text}]),
                                chat=True)
    gen = rt.generation(prompt, max_tokens=max_tokens, proposer=proposer, owner=owner,
                        sampling=sampling, grammar=grammar)
    for _ in rt.run(gen):
        pass
    return gen


def history(gen: Generation) -> tuple[int, int]:
    """(drafted, accepted) of the history source in this request."""
    st = gen.stats
    return st.source_drafted.get("history", 0), st.source_accepted.get("history", 0)


@pytest.mark.slow
def test_a_repeated_task_is_drafted_from_history_after_a_warm_up(rt: ModelRuntime) -> None:
    plain = generate(rt, TASK, "off")
    # "off" answers are kept too, after their prompt's end
    assert rt.ledger.history.kept == ANCHOR + len(plain.committed)
    again = generate(rt, TASK, "composite")
    assert again.committed == plain.committed
    drafted, accepted = history(again)
    assert accepted > len(plain.committed) // 2, again.stats.as_dict()
    assert drafted >= accepted


@pytest.mark.slow
def test_another_owners_answers_are_never_drafted_from(rt: ModelRuntime) -> None:
    plain = generate(rt, TASK, "off", owner="uid:1")
    other = generate(rt, TASK, "composite", owner="uid:2")
    assert other.committed == plain.committed
    assert history(other) == (0, 0), other.stats.as_dict()
    unknown = generate(rt, TASK, "composite", owner=None)  # neither drafts nor is kept
    assert history(unknown) == (0, 0)
    kept = rt.ledger.history.kept
    same = generate(rt, TASK, "composite", owner="uid:1")
    assert history(same)[1] > 0
    assert rt.ledger.history.kept == kept + ANCHOR + len(same.committed)


@pytest.mark.slow
def test_a_shared_history_drafts_across_owners() -> None:
    runtime = ModelRuntime(
        RuntimeConfig(n_ctx_seq=2048, n_seq_max=1, draft_max=CPU.max_k, calibrate=False,
                      prefix_cache_tokens=0, history_tokens=50_000, history_shared=True),
        registry=default_registry())
    runtime.costs = PinnedCosts(CPU.costs)
    try:
        generate(runtime, TASK, "off", owner="uid:1")
        assert history(generate(runtime, TASK, "composite", owner="uid:2"))[1] > 0
    finally:
        runtime.close()


def _poison(rt: ModelRuntime, gen: Generation, owner: str) -> None:
    """Keep a wrong version of ``gen``'s answer as ``owner``'s: every seventh token
    changed, so history drafts long runs that the target must reject part of."""
    wrong = [t if i % 7 != 6 else (t + 1) % rt.model.info.n_vocab
             for i, t in enumerate(gen.committed)]
    for _ in range(3):  # the most frequent continuation is the wrong one
        rt.history_view(owner).remember(gen.prompt, wrong)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_wrong_history_drafts_are_never_committed(rt: ModelRuntime,
                                                  sampling: SamplingParams) -> None:
    plain = generate(rt, TASK, "off", owner=None, sampling=sampling)
    _poison(rt, plain, "uid:1")
    spec = generate(rt, TASK, "composite", sampling=sampling)
    assert spec.committed == plain.committed
    drafted, accepted = history(spec)
    assert drafted > accepted > 0, spec.stats.as_dict()  # it drafted, some were wrong
    alone = generate(rt, TASK, "history", sampling=sampling)  # the source on its own
    assert alone.committed == plain.committed
    assert history(alone)[0] > 0


@pytest.mark.slow
def test_under_a_json_schema_history_drafts_are_cut_and_verified(
        rt: ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    # history trusted as much as prompt lookup: it drafts the poisoned answer far enough
    # for the grammar to have something to cut
    monkeypatch.setattr(history_plugin, "PRIOR_FACTOR", 1.0)
    grammar = rt.compile_constraint("json_schema", SCHEMA)
    text = "Describe making tea as JSON: a name and a few steps."
    plain = generate(rt, text, "off", owner=None, grammar=grammar)
    _poison(rt, plain, "uid:1")
    spec = generate(rt, text, "composite", grammar=grammar)
    assert spec.committed == plain.committed
    assert history(spec)[0] > 0, spec.stats.as_dict()
    assert spec.stats.grammar_cut > 0  # the wrong tokens the grammar forbids never ran


@pytest.mark.slow
def test_history_off_keeps_nothing() -> None:
    runtime = _runtime(0)
    try:
        generate(runtime, TASK, "off", max_tokens=24)
        gen = generate(runtime, TASK, "composite", max_tokens=24)
        assert runtime.ledger.history.kept == 0
        assert history(gen) == (0, 0)
        assert "history" not in gen.stats.source_drafted
    finally:
        runtime.close()


# ---------------------------------------------------------------- over the socket

SOCKET_TASKS = ("List the steps to make a cup of tea, as a numbered list of five short steps.",
                "Write a haiku about the sea.")


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.mark.slow
def test_over_the_socket_concurrent_requests_match_plain_decoding_and_say_who_drafted(
) -> None:
    anyio.run(_over_the_socket)


async def _over_the_socket() -> None:
    smol = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=3, draft_max=8,
                                      calibrate=False, threads=1))
    schema = Constraint(kind="json_schema", schema=SCHEMA)
    kinds: list[dict[str, Any]] = [
        {"temperature": 0.0}, {"temperature": 0.8, "seed": 5},
        {"temperature": 0.0, "constraint": schema}]
    try:
        async with running_daemon(smol) as (server, path):
            async with Client.connect(path) as client:

                async def ask(text: str, proposer: str, kind: dict[str, Any]) -> Any:
                    return await client.generate(messages=_messages(text), max_tokens=40,
                                                 proposer=proposer, **kind).collect()

                plain = [await ask(t, "off", k) for t in SOCKET_TASKS for k in kinds]
                results: list[Any] = [None] * len(plain)

                async def run(i: int) -> None:
                    results[i] = await ask(SOCKET_TASKS[i // len(kinds)], "composite",
                                           kinds[i % len(kinds)])

                async with anyio.create_task_group() as tg:  # all at once, 3 slots
                    for i in range(len(plain)):
                        tg.start_soon(run, i)
                stats = await client.stats()
            metrics = render_metrics(server.service).decode()
    finally:
        smol.close()
    for p, r in zip(plain, results, strict=True):
        assert r.token_ids == p.token_ids
    extras = [r.done.speculation.extra for r in results]
    assert sum(e.get("accepted_by_history", 0) for e in extras) > 0, extras
    assert all(e.get("drafted_by_history", 0) >= e.get("accepted_by_history", 0)
               for e in extras)
    by_source = stats.proposers["composite/history"]
    assert by_source.accepted > 0 and by_source.drafted >= by_source.accepted
    assert 'proposer="composite/history"' in metrics


@pytest.mark.slow
def test_over_http_each_api_key_and_the_socket_draft_only_from_their_own_answers() -> None:
    anyio.run(_over_http)


async def _over_http() -> None:
    smol = ModelRuntime(RuntimeConfig(n_ctx_seq=1024, n_seq_max=1, draft_max=8,
                                      calibrate=False, threads=1))
    path = f"{short_tempdir()}/s"
    body = {"messages": _messages(SOCKET_TASKS[0]), "max_tokens": 40, "temperature": 0.0,
            "speculative": {"proposer": "composite"}}

    async def ask(client: httpx.AsyncClient) -> tuple[str, dict[str, Any]]:
        got = await client.post("/v1/chat/completions", json=body)
        assert got.status_code == 200, got.text
        answer = got.json()
        return answer["choices"][0]["message"]["content"], answer["meshd"]["extra"]

    try:
        config = ServerConfig(http=HttpConfig(api_key="key-one"))
        async with serving(smol, path, config, http="tcp:127.0.0.1:0") as server:
            assert server.http_listener is not None
            base = f"http://127.0.0.1:{server.http_listener.address.rpartition(':')[2]}"
            unix = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=path),
                                     base_url="http://meshd", timeout=120)
            one = httpx.AsyncClient(base_url=base, timeout=120,
                                    headers={"Authorization": "Bearer key-one"})
            async with unix, one:
                first, _ = await ask(unix)  # the socket's answer: kept as its uid's
                text, extra = await ask(one)  # another owner: nothing to draft from
                assert text == first
                assert extra.get("drafted_by_history", 0) == 0, extra
                text, extra = await ask(unix)  # the socket's own answer drafts
                assert text == first
                assert extra.get("accepted_by_history", 0) > 0, extra
                text, extra = await ask(one)  # the key's own first answer now does
                assert text == first
                assert extra.get("accepted_by_history", 0) > 0, extra
    finally:
        smol.close()
