"""Several models in one daemon: chosen by name, loaded on first use, unloaded when idle
or to make room, each answering exactly as it would alone."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import attrs
import httpx
import pytest

from meshd.clients import ctl
from meshd.daemon.models.model_set import ModelPlan, ModelSet, ModelState
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.native.default_model import default_model_path
from meshd.protocol import Client, Completion, ServerBusy, UnknownModel
from meshd.testing import testmodels
from tests.integration.helpers.daemon import reference, running_daemon, short_tempdir
from tests.integration.helpers.processes import (
    daemon_env,
    log_events,
    reaped,
    start,
    stop,
    wait_for_socket,
)

pytestmark = pytest.mark.anyio

PROMPT = "The three primary colours are"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def plans(**keep_alive: float) -> list[ModelPlan]:
    """SmolLM2 (the default) and a synthetic hybrid model with an MTP head."""
    mtp = str(testmodels.test_model_path("qwen35", acceptance=0.9))
    smol = str(default_model_path())
    common = dict(n_ctx_seq=512, n_seq_max=2, draft_max=3, calibrate=False, threads=2)
    return [
        ModelPlan("smol", RuntimeConfig(model_path=smol, **common),
                  keep_alive_s=keep_alive.get("smol"), size_bytes=os.path.getsize(smol)),
        ModelPlan("mtp", RuntimeConfig(model_path=mtp, **common),
                  keep_alive_s=keep_alive.get("mtp"), size_bytes=os.path.getsize(mtp)),
    ]


def model_set(**settings: object) -> ModelSet:
    keep = {k: v for k, v in settings.items() if k in ("smol", "mtp")}
    rest = {k: v for k, v in settings.items() if k not in keep}
    loads: list[str] = []

    def load(plan: ModelPlan) -> ModelRuntime:
        loads.append(plan.name)
        return ModelRuntime(plan.config)

    models = ModelSet(plans(**keep), load, **rest)
    models.loads = loads  # type: ignore[attr-defined]
    return models


@pytest.fixture
def closing() -> Iterator[list[ModelSet]]:
    made: list[ModelSet] = []
    yield made
    for models in made:
        models.close()


def state(models: ModelSet) -> dict[str, str]:
    return {m.name: m.state.value for m in models}


async def ask(client: Client, model: str | None, **kw: object) -> Completion:
    return await client.generate(PROMPT, max_tokens=12, temperature=0.0, model=model,
                                 **kw).collect()


async def test_two_models_interleaved_answer_as_each_alone(closing: list[ModelSet]) -> None:
    models = model_set()
    closing.append(models)
    answers: dict[str, list[Completion]] = {"smol": [], "mtp": []}
    models.describe()
    async with running_daemon(models) as (_server, path):
        assert state(models) == {"smol": "unloaded", "mtp": "unloaded"}
        async with Client.connect(path) as one, Client.connect(path) as two:
            before = {m.name: m for m in await one.models()}  # from the files alone
            assert before["mtp"].has_mtp and not before["mtp"].loaded
            assert before["smol"].has_chat_template and not before["smol"].has_mtp
            assert before["smol"].architecture == "llama"

            async def run(client: Client, name: str) -> None:
                answers[name].append(await ask(client, name))

            for _ in range(3):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run, one, "smol")
                    tg.start_soon(run, two, "mtp")
            default = await ask(one, None)
            listed = {m.name: m for m in await one.models()}
    assert models.loads == ["smol", "mtp"] or models.loads == ["mtp", "smol"]  # type: ignore[attr-defined]
    assert listed["smol"].default and not listed["mtp"].default
    assert listed["mtp"].has_mtp and not listed["smol"].has_mtp
    assert listed["mtp"].loaded and listed["mtp"].state == "loaded"
    assert "mtp" in listed["mtp"].proposers and "mtp" not in listed["smol"].proposers
    assert default.done.model == "smol"
    for name, completions in answers.items():
        rt = models.get(name).runtime
        assert rt is not None
        ids = list(rt.tokenize_prompt(PROMPT, chat=False))
        alone, _text, _finish = reference(rt, ids, max_tokens=12)
        for c in completions:
            assert c.done.model == name
            assert list(c.token_ids) == alone  # as plain decoding on that model alone
        proposers = {c.done.speculation.proposer for c in completions}
        # The MTP head's statistics appear on the MTP model's answers only.
        assert ("mtp" in proposers) == (name == "mtp")
    assert list(default.token_ids) == list(answers["smol"][0].token_ids)


@pytest.mark.parametrize("limit", ["max_loaded", "memory_limit"])
async def test_one_model_at_a_time_swaps_and_every_request_succeeds(
        closing: list[ModelSet], limit: str) -> None:
    smol, mtp = plans()
    room = {"max_loaded": 1, "memory_limit": smol.size_bytes + mtp.size_bytes - 1}
    models = model_set(**{limit: room[limit]})
    closing.append(models)
    async with running_daemon(models) as (_server, path), \
            Client.connect(path) as client:
        seen: dict[str, list[int]] = {}
        for name in ("smol", "mtp", "smol", "mtp"):
            got = await ask(client, name)
            assert got.done.finish_reason.value == "length"
            seen.setdefault(name, list(got.token_ids))
            assert list(got.token_ids) == seen[name]
            loaded = [m.name for m in await client.models() if m.loaded]
            assert loaded == [name]  # the other one went to make room
    assert models.loads == ["smol", "mtp", "smol", "mtp"]  # type: ignore[attr-defined]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_keep_alive_zero_unloads_after_the_request_and_gives_memory_back(
        closing: list[ModelSet]) -> None:
    models = model_set()
    closing.append(models)
    smol = models.get("smol")
    async with running_daemon(models) as (_server, path), \
            Client.connect(path) as client:
        await ask(client, "mtp")  # another model stays loaded all along
        first = await ask(client, "smol", keep_alive=60)
        loaded = rss_bytes()
        got = await ask(client, "smol", keep_alive=0)
        with anyio.fail_after(30):
            while smol.state is not ModelState.UNLOADED:
                await anyio.sleep(0.05)
        after = rss_bytes()
        listed = {m.name: m for m in await client.models()}
        again = await ask(client, "smol")  # loaded again on demand
    assert got.done.model == "smol" and list(got.token_ids) == list(first.token_ids)
    assert not listed["smol"].loaded and listed["smol"].state == "unloaded"
    assert listed["mtp"].loaded
    assert list(again.token_ids) == list(first.token_ids)
    assert smol.state is ModelState.LOADED  # and stays: keep-alive 0 was that request's
    # SmolLM2's weights are mapped from its file: once unmapped they leave the RSS.
    assert loaded - after >= 0.8 * smol.plan.size_bytes, (loaded, after)


async def test_unknown_names_are_refused_on_both_front_ends(closing: list[ModelSet]) -> None:
    models = model_set()
    closing.append(models)
    async with running_daemon(models) as (_server, path), \
            Client.connect(path) as client:
        with pytest.raises(UnknownModel, match=r"no model named 'nope'.*smol, mtp"):
            await ask(client, "nope")
        with pytest.raises(UnknownModel):
            await client.load("nope")
        assert (await ask(client, None)).done.model == "smol"
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://meshd") as http:
            r = await http.post("/v1/chat/completions", json={
                "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "model_not_found"
            assert r.json()["error"]["param"] == "model"
            r = await http.post("/v1/completions", json={
                "model": "mtp", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.json()["model"] == "mtp"
            listed = (await http.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed] == ["smol", "mtp"]
            assert [m["meta"]["loaded"] for m in listed] == [True, True]
            health = (await http.get("/health")).json()
            assert health["models"] == {"smol": "loaded", "mtp": "loaded"}
            metrics = (await http.get("/metrics")).text
            assert 'meshd_model_state{model="mtp",state="loaded"} 1.0' in metrics
            assert 'meshd_generation_tokens_total{model="mtp"} 4.0' in metrics
            # Ollama's keep_alive, per request: 0 unloads the model after it.
            r = await http.post("/v1/completions", json={
                "model": "mtp", "prompt": PROMPT, "max_tokens": 2, "keep_alive": "5x"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
            r = await http.post("/v1/completions", json={
                "model": "mtp", "prompt": PROMPT, "max_tokens": 2, "keep_alive": 0})
            assert r.status_code == 200
            with anyio.fail_after(30):
                while models.get("mtp").state is not ModelState.UNLOADED:
                    await anyio.sleep(0.02)


async def test_load_and_unload_on_request(closing: list[ModelSet]) -> None:
    models = model_set()
    closing.append(models)
    async with running_daemon(models) as (_server, path), \
            Client.connect(path) as client:
        info = await client.load("mtp", keep_alive=-1)
        assert info.loaded and info.has_mtp and info.keep_alive_s == -1
        assert state(models)["mtp"] == "loaded"
        reply = await client.unload("mtp")
        assert reply.unloaded and reply.model.state == "unloaded"
        again = await client.unload("mtp")  # nothing to do: no error
        assert again.unloaded
        # A keep-alive runs out on its own: loaded for 0.3 s, then gone.
        short = await client.load("mtp", keep_alive=0.3)
        assert short.loaded and short.keep_alive_s == 0.3
        with anyio.fail_after(30):
            while state(models)["mtp"] != "unloaded":
                await anyio.sleep(0.02)
        # A model with a request running goes once that request ends, never before.
        running = client.generate(PROMPT, max_tokens=60, temperature=0.0, model="mtp")
        async for _ in running:
            busy = await client.unload("mtp")
            assert not busy.unloaded and busy.model.state == "loaded"
            break
        finished = await running.collect()
        assert finished.done.finish_reason.value == "length"
        with anyio.fail_after(30):
            while state(models)["mtp"] != "unloaded":
                await anyio.sleep(0.02)


async def test_a_model_waiting_for_room_held_by_busy_ones_is_bounded(
        closing: list[ModelSet]) -> None:
    models = model_set(max_loaded=1, max_queue=0)
    closing.append(models)
    config = ServerConfig(max_queue=0)
    async with running_daemon(models, config) as (_server, path), \
            Client.connect(path) as a, Client.connect(path) as b, Client.connect(path) as c:
        long = a.generate(PROMPT, max_tokens=400, temperature=0.0, model="smol")
        results: dict[str, object] = {}

        async def first_token_then_wait() -> None:
            async for _ in long:
                if "started" not in results:
                    results["started"] = True
            results["long"] = long.done

        async def waiter() -> None:
            results["mtp"] = await ask(b, "mtp")

        async with anyio.create_task_group() as tg:
            tg.start_soon(first_token_then_wait)
            with anyio.fail_after(30):
                while "started" not in results:
                    await anyio.sleep(0.01)
            tg.start_soon(waiter)
            with anyio.fail_after(30):
                while not models.get("mtp").waiting_for_room:
                    await anyio.sleep(0.01)
            # A second request for it is over the queue's limit: a clear busy.
            with pytest.raises(ServerBusy, match="waits for memory held by busy models"):
                await ask(c, "mtp")
            await long.cancel()
        done = results["mtp"]
        assert isinstance(done, Completion) and done.done.model == "mtp"


async def test_a_new_configuration_adds_removes_and_changes_models_without_cutting_requests(
        closing: list[ModelSet]) -> None:
    models = model_set()
    closing.append(models)
    smol, _ = plans()
    async with running_daemon(models) as (_server, path), \
            Client.connect(path) as client:
        await ask(client, "smol")
        running = client.generate(PROMPT, max_tokens=60, temperature=0.0, model="mtp")
        async for _ in running:
            break
        bigger = ModelPlan("smol", attrs.evolve(smol.config, n_ctx_seq=768),
                           size_bytes=smol.size_bytes)
        extra = ModelPlan("small", smol.config, size_bytes=smol.size_bytes)
        changes = models.update([bigger, extra])
        assert changes == {"added": ["small"], "removed": ["mtp"], "changed": ["smol"]}
        finished = await running.collect()  # the removed model's request runs on
        assert finished.done.finish_reason.value == "length"
        assert finished.done.model == "mtp"
        with pytest.raises(UnknownModel):
            await ask(client, "mtp")
        with anyio.fail_after(30):
            while models.get("smol").state is not ModelState.UNLOADED \
                    or models._retiring:
                await anyio.sleep(0.02)
        assert (await ask(client, "small")).done.model == "small"
        assert (await ask(client, None)).done.model == "smol"
        listed = {m.name: m for m in await client.models()}
    assert list(listed) == ["smol", "small"]
    assert listed["smol"].n_ctx == 768  # reloaded with its new settings


def test_serve_takes_named_models_and_meshctl_lists_loads_and_unloads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``meshd serve -m NAME=PATH`` twice, as a user runs it: the first is the default and
    loads at start, the other on its first request; meshctl shows and moves them."""
    smol, mtp = plans()
    sock = os.path.join(short_tempdir(), "s")
    args = ["-m", f"smol={smol.config.model_path}", "-m", f"mtp={mtp.config.model_path}",
            "--socket", sock, "--threads", "1", "--slots", "1", "--ctx", "512", "--fixed-k",
            "--max-loaded", "1", "--keep-alive", "1h"]
    with reaped(start(args, daemon_env())) as proc:
        wait_for_socket(sock, proc)
        capsys.readouterr()
        assert ctl.main(["-s", sock, "models"]) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[1].split()[:3] == ["smol", "loaded", "yes"]
        assert table[2].split()[:3] == ["mtp", "unloaded", "no"]
        assert table[2].split()[5] == "yes"  # its MTP head, read from the file unloaded
        assert ctl.main(["-s", sock, "generate", "--model", "mtp", "--max-tokens", "4",
                         PROMPT]) == 0
        assert "model=mtp" in capsys.readouterr().err
        assert ctl.main(["-s", sock, "models", "--json"]) == 0
        listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
        assert listed["mtp"]["loaded"] and not listed["smol"]["loaded"]  # --max-loaded 1
        assert listed["mtp"]["keep_alive_s"] == 3600
        assert ctl.main(["-s", sock, "unload", "mtp"]) == 0
        assert ctl.main(["-s", sock, "load", "smol"]) == 0
        assert ctl.main(["-s", sock, "models", "--json"]) == 0
        listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
        assert listed["smol"]["loaded"] and listed["mtp"]["state"] == "unloaded"
        assert ctl.main(["-s", sock, "generate", "--model", "nope", "--max-tokens", "4",
                         PROMPT]) == 2
        assert "no model named 'nope'" in capsys.readouterr().err
        code, err = stop(proc)
    assert code == 0, err
    events = [e["event"] for e in log_events(err)]
    assert events.count("model_unloaded") == 2 and events.count("model_loaded") == 3


async def test_a_load_never_holds_up_another_models_decoding(
        closing: list[ModelSet]) -> None:
    loading = anyio.Event()

    def slow_load(plan: ModelPlan) -> ModelRuntime:
        if plan.name == "mtp":  # a large model: its load takes a while
            loading.set()
            time.sleep(1.5)
        return ModelRuntime(plan.config)

    models = ModelSet(plans(), slow_load)
    closing.append(models)
    arrivals: list[float] = []
    async with running_daemon(models) as (_server, path), \
            Client.connect(path) as a, Client.connect(path) as b:
        await ask(a, "smol")  # loaded and warm
        long = a.generate(PROMPT, max_tokens=300, temperature=0.0, model="smol")

        async def stream() -> None:
            async for _ in long:
                arrivals.append(time.monotonic())

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream)
            with anyio.fail_after(30):
                while len(arrivals) < 2:
                    await anyio.sleep(0.01)
            t0 = time.monotonic()
            other = await ask(b, "mtp")
            t1 = time.monotonic()
            await long.cancel()
    assert other.done.model == "mtp" and t1 - t0 >= 1.5
    during = [t for t in arrivals if t0 <= t <= t1]
    # smol kept streaming through the whole load (tokens are posted every 50 ms or so)
    assert len(during) >= 10, (len(during), t1 - t0)
    assert max(b - a for a, b in zip([t0, *during], [*during, t1], strict=True)) < 0.75


def test_serve_refuses_a_missing_model_file_naming_its_flag(tmp_path: Path) -> None:
    sock = os.path.join(short_tempdir(), "s")
    missing = tmp_path / "nothing-here.gguf"
    proc = start(["-m", f"smol={default_model_path()}", "-m", f"gone={missing}",
                  "--socket", sock, "--log-format", "json"], daemon_env())
    with reaped(proc):
        code, err = stop(proc, sig=None)
    assert code == 2
    bad = next(e for e in log_events(err) if e["event"] == "bad_config")
    assert bad["error"] == f"-m gone={missing}: model file not found: {missing}"
    assert not os.path.exists(sock)


async def test_health_says_each_models_state(closing: list[ModelSet]) -> None:
    models = model_set()
    closing.append(models)
    async with running_daemon(models) as (_server, path), Client.connect(path) as client:
        assert (await client.health()).models == {"smol": "unloaded", "mtp": "unloaded"}
        await ask(client, "mtp")
        assert (await client.health()).models == {"smol": "unloaded", "mtp": "loaded"}


async def test_two_models_waiting_for_room_both_get_it(closing: list[ModelSet]) -> None:
    smol, mtp = plans()
    small = ModelPlan("small", smol.config, size_bytes=smol.size_bytes)
    models = ModelSet([smol, mtp, small], lambda plan: ModelRuntime(plan.config),
                      max_loaded=1)
    closing.append(models)
    async with running_daemon(models) as (_server, path), \
            Client.connect(path) as a, Client.connect(path) as b, Client.connect(path) as c:
        long = a.generate(PROMPT, max_tokens=400, temperature=0.0, model="smol")
        done: dict[str, Completion] = {}

        async def wanting(client: Client, name: str) -> None:
            done[name] = await ask(client, name)

        async with anyio.create_task_group() as tg:
            async for _ in long:
                break
            tg.start_soon(wanting, b, "mtp")
            tg.start_soon(wanting, c, "small")
            with anyio.fail_after(30):
                while not (models.get("mtp").waiting_for_room
                           and models.get("small").waiting_for_room):
                    await anyio.sleep(0.01)
            await long.cancel()
            with anyio.fail_after(60):  # neither waiter is forgotten when room frees
                while len(done) < 2:
                    await anyio.sleep(0.05)
    assert done["mtp"].done.model == "mtp" and done["small"].done.model == "small"


async def test_aliases_name_a_model_on_both_front_ends(closing: list[ModelSet]) -> None:
    """Clients that send a fixed model name (``gpt-4o-mini``) reach the model that name
    is an alias of; listings show every name and the tags; new aliases on a reload
    apply without reloading the model."""
    smol, mtp = plans()
    mtp = attrs.evolve(mtp, aliases=("qwen", "gpt-4o-mini"), tags=("mtp", "small"))
    models = ModelSet([smol, mtp], lambda plan: ModelRuntime(plan.config))
    closing.append(models)
    async with running_daemon(models) as (_server, path), \
            Client.connect(path) as client:
        assert (await ask(client, "qwen")).done.model == "mtp"
        transport = httpx.AsyncHTTPTransport(uds=path)
        async with httpx.AsyncClient(transport=transport, base_url="http://meshd") as http:
            r = await http.post("/v1/completions", json={
                "model": "gpt-4o-mini", "max_tokens": 2, "prompt": PROMPT})
            assert r.status_code == 200 and r.json()["model"] == "mtp"
            listed = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
            assert listed["mtp"]["aliases"] == ["mtp", "qwen", "gpt-4o-mini"]
            assert listed["mtp"]["tags"] == ["mtp", "small"]
            assert listed["smol"]["aliases"] == ["smol"] and listed["smol"]["tags"] == []
            one = await http.get("/v1/models/qwen")
            assert one.status_code == 200 and one.json()["id"] == "mtp"
            assert (await http.get("/v1/models/gpt-4o")).status_code == 404
        changed = models.update([smol, attrs.evolve(mtp, aliases=("qwen2",))])
        assert changed["changed"] == [] and models.get("mtp").state is ModelState.LOADED
        assert (await ask(client, "qwen2")).done.model == "mtp"
        with pytest.raises(UnknownModel):
            await ask(client, "qwen")
