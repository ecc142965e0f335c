"""The default model split across two ``meshd worker`` processes on loopback.

What a user of ``meshd serve --rpc`` would see: the same tokens and the same speculation
as a local run, a clear error for a worker that is not there, and a daemon that survives
a worker killed mid-request (the request fails with a typed error, health says
``degraded`` until the worker is back, then everything works again).
"""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from meshd.daemon.commands.worker import free_port
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.native.errors import WorkerUnreachable
from meshd.protocol import Client, ModelError
from meshd.testing.loopback import LoopbackWorkers
from tests.integration.helpers.daemon import running_daemon

STORY = "Once upon a time, in a small village by the sea, there lived"
PROMPT = ("Copy this list exactly: apple, banana, cherry, date, elderberry, fig, grape. "
          "Copy: apple, banana, cherry, date, elderberry, fig, grape. Copy:")


@pytest.fixture(scope="module")
def workers() -> Iterator[LoopbackWorkers]:
    with LoopbackWorkers(2) as w:
        yield w


def _config(**kw: object) -> RuntimeConfig:
    # calibrate=False: fixed draft lengths, so speculation decides the same on both sides
    # (a calibrated cost curve would differ between local and network forwards). One K
    # cache type on both sides: "auto" keeps f16 where layers go to workers.
    return RuntimeConfig(n_ctx_seq=1024, threads=1, calibrate=False, draft_max=6,
                         cache_type_k="bf16", **kw)  # type: ignore[arg-type]


def _generate(rt: ModelRuntime, proposer: str, max_tokens: int = 48,
              ) -> tuple[list[int], tuple[int, int, int]]:
    gen = rt.generation(rt.tokenize_prompt(PROMPT, chat=False), max_tokens=max_tokens,
                        proposer=proposer, adaptive=False)
    list(rt.run(gen))
    st = gen.stats
    return list(gen.committed), (st.drafted, st.accepted, st.session.target_forwards)


@pytest.mark.slow
def test_split_over_two_workers_equals_local(workers: LoopbackWorkers) -> None:
    with ModelRuntime(_config()) as local:
        expected = {p: _generate(local, p) for p in ("off", "ngram")}
    with ModelRuntime(_config(rpc_workers=workers.addresses)) as split:
        assert split.remote is not None
        # Each worker offers its CPU; this CPU, listed last, holds the output head.
        assert [n[:3] for n in split.remote.device_names] == ["RPC", "RPC", "CPU"]
        for proposer, (tokens, stats) in expected.items():
            got_tokens, got_stats = _generate(split, proposer)
            assert got_tokens == tokens, f"{proposer}: split output differs from local"
            assert got_stats == stats, f"{proposer}: speculation differs (drafted, " \
                                       "accepted, forwards)"
        assert expected["ngram"][1][1] > 0, "the prompt should make n-gram drafts pay"
        traffic = split.remote.stats()
        assert traffic.round_trips > 0 and traffic.bytes_received > 0


def test_unreachable_worker_at_start_names_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(WorkerUnreachable, match=f"cannot reach worker {address}"):
        ModelRuntime(_config(rpc_workers=(address,)))


def test_generate_command_reports_an_unreachable_worker(
        capsys: pytest.CaptureFixture[str]) -> None:
    from meshd.daemon.commands.cli import main

    address = f"127.0.0.1:{free_port()}"
    assert main(["generate", "--prompt", "hi", "--rpc", address, "--fixed-k"]) == 3
    assert address in capsys.readouterr().err


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.slow
@pytest.mark.anyio
async def test_worker_killed_mid_request(workers: LoopbackWorkers) -> None:
    with ModelRuntime(_config()) as local:
        reference, _ = _generate(local, "off", max_tokens=8)
    victim = workers.addresses[1]
    rt = ModelRuntime(_config(rpc_workers=workers.addresses))
    try:
        config = ServerConfig(worker_probe_s=0.2, stream_interval_s=0.01)
        async with running_daemon(rt, config) as (_server, path), \
                Client.connect(path) as client:
            assert (await client.health()).status.value == "ok"
            stream = client.generate(STORY, max_tokens=900, temperature=0.0,
                                     proposer="off")
            async for _event in stream:
                if workers.procs[victim].poll() is None:
                    workers.kill(victim)  # after the first token: mid-request
            # Tokens were already streamed, so the failure is the request's ``done``
            # (finish_reason error, PROTOCOL.md), naming the worker.
            assert stream.done is not None
            assert stream.done.finish_reason.value == "error"
            assert f"worker {victim}" in (stream.done.error_message or "")
            # The daemon stays up and says why it cannot serve.
            assert (await client.health()).status.value == "degraded"
            with pytest.raises(ModelError, match=f"worker {victim}"):
                await client.generate(PROMPT, max_tokens=4, temperature=0.0).collect()
            # The worker comes back: the daemon reloads the model and serves again.
            await anyio.to_thread.run_sync(workers.start, victim)
            with anyio.fail_after(120):
                while (await client.health()).status.value != "ok":
                    await anyio.sleep(0.1)
            done = await client.generate(PROMPT, max_tokens=8, temperature=0.0,
                                         proposer="off").collect()
            assert list(done.token_ids) == reference
    finally:
        rt.close()


def test_workers_in_the_configuration(tmp_path: pytest.TempPathFactory) -> None:
    from meshd.daemon.config import settings as cfg

    path = f"{tmp_path}/meshd.toml"
    with open(path, "w") as f:
        f.write('[model]\nrpc = ["10.0.0.2:50052", "10.0.0.3:50052"]\n')
    loaded = cfg.load(path, environ={"MESHD_MODEL_TENSOR_SPLIT": "3,1"}, flags={})
    assert loaded.config.model.rpc == ("10.0.0.2:50052", "10.0.0.3:50052")
    assert loaded.config.model.tensor_split == (3.0, 1.0)
    flagged = cfg.load(path, environ={}, flags={"rpc": ("127.0.0.1:6000",)})
    assert flagged.config.model.rpc == ("127.0.0.1:6000",)
    with pytest.raises(cfg.ConfigError, match="HOST:PORT"):
        cfg.load(None, environ={"MESHD_MODEL_RPC": "nohost"}, flags={}, default_path=None)


@pytest.mark.slow
def test_bench_rpc_counts_one_round_trip_per_worker_and_forward(
        tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]) -> None:
    from meshd.daemon.commands.cli import main

    out = f"{tmp_path}/rpc.json"
    assert main(["bench-rpc", "--workers", "1,2", "--reps", "1", "--tokens", "8",
                 "--threads", "1", "--json", out]) == 0
    import json

    with open(out) as f:
        results = json.load(f)
    assert set(results) == {"local", "1 workers", "2 workers"}
    for n in (1, 2):
        for arm in ("off", "ngram"):
            assert results[f"{n} workers"][arm]["round_trips_per_forward"] == pytest.approx(n)
    assert results["local"]["off"]["round_trips_per_forward"] == 0
    assert "trips/fwd" in capsys.readouterr().out
