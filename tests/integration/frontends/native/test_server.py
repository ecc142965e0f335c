"""The daemon over a real socket: streamed output equals in-process generation, many
clients with cancels and disconnects leave no session behind, health stays responsive
while the engine works, and shutdown ends every request with ``done``."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator

import anyio
import pytest
from structlog.testing import capture_logs

from meshd.daemon.engine.sampling import SamplingParams
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.requests.service import ServerConfig
from meshd.protocol import (
    Client,
    Done,
    FinishReason,
    Generate,
    SpeculativeOverrides,
    Token,
)
from meshd.protocol import (
    SamplingParams as WireSampling,
)
from meshd.testing import testmodels
from tests.integration.helpers.daemon import (
    RawConnection,
    assert_no_leaks,
    assert_serves,
    reference,
    running_daemon,
    wait_idle,
)

pytestmark = pytest.mark.anyio

SLOTS = 4


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _runtime(kind: str) -> ModelRuntime:
    path = str(testmodels.test_model_path(kind, acceptance=0.8))
    # One thread: OpenMP workers spin-waiting on an oversubscribed machine make a tiny
    # model's forward take 100x longer; the tests are about behaviour, not speed.
    return ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=512, n_seq_max=SLOTS,
                                      draft_max=4, calibrate=False, threads=1))


@pytest.fixture(scope="module", params=["llama", "qwen35"])
def runtime(request: pytest.FixtureRequest) -> Iterator[ModelRuntime]:
    rt = _runtime(request.param)
    yield rt
    assert rt.idle_slots == SLOTS
    rt.close()


@pytest.fixture(scope="module")
def qwen35() -> Iterator[ModelRuntime]:
    """Hybrid model with an MTP head: auto means mtp, repairs need checkpoints."""
    rt = _runtime("qwen35")
    yield rt
    assert rt.idle_slots == SLOTS
    rt.close()


def _prompt(i: int) -> str:
    return f"request number {i} " + "ab" * (i % 5)


@pytest.mark.parametrize("proposer", ["off", "ngram", "auto"])
async def test_stream_equals_in_process(runtime: ModelRuntime, proposer: str) -> None:
    prompt = runtime.tokenize_prompt(_prompt(3), chat=False)
    ref_tokens, ref_text, ref_finish = reference(runtime, prompt, max_tokens=60,
                                                 proposer=proposer)
    async with running_daemon(runtime) as (server, path), Client.connect(path) as client:
        async with client.generate(_prompt(3), max_tokens=60, temperature=0.0,
                                   proposer=proposer) as stream:
            tokens = [t async for t in stream]
        done = stream.done
        assert done is not None
        assert list(stream.token_ids) == ref_tokens
        assert stream.text == ref_text == "".join(t.text for t in tokens)
        assert done.finish_reason.value == ref_finish
        assert done.usage.prompt_tokens == len(prompt)
        assert done.usage.completion_tokens == len(ref_tokens)
        sp = done.speculation
        assert sp.emitted == len(ref_tokens)
        assert sp.proposer == runtime.resolve_proposer(proposer)
        if proposer == "off":
            assert sp.drafted == 0
        await wait_idle(server)
        assert_no_leaks(server)


async def test_seeded_sampling_and_stop_equal_in_process(qwen35: ModelRuntime) -> None:
    prompt = qwen35.tokenize_prompt(_prompt(1), chat=False)
    sampling = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=1234)
    ref_tokens, ref_text, _ = reference(qwen35, prompt, max_tokens=50, proposer="auto",
                                        sampling=sampling)
    stop = ref_text[20:23] if len(ref_text) > 23 else "zzz"
    ref_stopped = reference(qwen35, prompt, max_tokens=50, proposer="auto",
                            sampling=sampling, stop=[stop])
    async with running_daemon(qwen35) as (_, path), Client.connect(path) as client:
        kw = dict(temperature=0.9, top_k=20, top_p=0.9, seed=1234, max_tokens=50)
        full = await client.generate(_prompt(1), **kw).collect()  # type: ignore[arg-type]
        cut = await client.generate(_prompt(1), stop=[stop], **kw).collect()  # type: ignore[arg-type]
    assert (list(full.token_ids), full.text) == (ref_tokens, ref_text)
    assert (list(cut.token_ids), cut.text, cut.done.finish_reason.value) == ref_stopped
    assert full.done.speculation.proposer == "mtp"


async def test_concurrent_clients_cancels_and_disconnects(qwen35: ModelRuntime) -> None:
    """8 clients on 4 slots, mixed proposers; some cancel, some leave, some hang up."""
    rng = random.Random(5)
    proposers = ["off", "ngram", "auto", "mtp"]
    plans = []
    for i in range(8):
        prompt = _prompt(i)
        max_tokens = rng.randint(30, 90)
        proposer = proposers[i % len(proposers)]
        ids = qwen35.tokenize_prompt(prompt, chat=False)
        ref = reference(qwen35, ids, max_tokens=max_tokens, proposer=proposer)
        behaviour = ["complete", "cancel", "aclose", "disconnect"][i % 4]
        plans.append((prompt, max_tokens, proposer, ref, behaviour, rng.randint(1, 10)))
    results: dict[int, tuple[str, list[int], Done | None]] = {}

    async def client_task(i: int, path: str) -> None:
        prompt, max_tokens, proposer, _, behaviour, after = plans[i]
        if behaviour == "disconnect":
            async with RawConnection.open(path) as raw:
                await raw.send(Generate(id="g", prompt=prompt, max_tokens=max_tokens,
                                        sampling=WireSampling(temperature=0.0),
                                        speculative=SpeculativeOverrides(proposer=proposer)))
                got: list[int] = []
                while len(got) < after:
                    frame = await raw.recv()
                    if not isinstance(frame, Token):
                        break
                    got.extend(frame.token_ids)
            results[i] = (behaviour, got, None)  # closed with the generation running
            return
        async with Client.connect(path) as client:
            stream = client.generate(prompt, max_tokens=max_tokens, temperature=0.0,
                                     proposer=proposer)
            async with stream:
                n = 0
                async for token in stream:
                    n += len(token.token_ids)
                    if n >= after and behaviour == "cancel":
                        await stream.cancel()  # keep reading: ends with done cancelled
                        behaviour = "cancelled"
                    elif n >= after and behaviour == "aclose":
                        break  # leaving the block sends cancel
            results[i] = (plans[i][4], list(stream.token_ids), stream.done)

    async with running_daemon(qwen35) as (server, path):
        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(client_task, i, path)
        await wait_idle(server)
        assert_no_leaks(server)
        await assert_serves(path)
        await wait_idle(server)
        assert_no_leaks(server)
    for i, (behaviour, tokens, done) in results.items():
        ref_tokens = plans[i][3][0]
        assert tokens == ref_tokens[: len(tokens)], f"client {i} ({behaviour}) diverged"
        if behaviour == "complete":
            assert done is not None and tokens == ref_tokens
            assert done.finish_reason.value == plans[i][3][2]
        elif behaviour == "cancel":
            assert done is not None
            # A cancel may race the end of a short generation; otherwise it wins.
            assert done.finish_reason is FinishReason.CANCELLED or tokens == ref_tokens
    assert len(results) == 8


async def test_a_late_cancel_never_stops_another_clients_request(qwen35: ModelRuntime) -> None:
    """Two clients of one process: the first cancels its own request after it ended (the
    race every client has); the daemon looks the id up on other connections, so the
    second client's running request must not carry the same id."""
    prompt = _prompt(3)
    async with (running_daemon(qwen35) as (_, path), Client.connect(path) as first,
                Client.connect(path) as second):
        ended = first.generate(prompt, max_tokens=2, temperature=0.0)
        await ended.collect()
        running = second.generate(prompt, max_tokens=40, temperature=0.0)
        async with running:
            assert running.id != ended.id
            async for _ in running:
                assert not await first.cancel_confirmed(ended.id)
                break
            done = (await running.collect()).done
    assert done is not None and done.finish_reason is not FinishReason.CANCELLED


@pytest.fixture(scope="module")
def smollm2_runtime() -> Iterator[ModelRuntime]:
    """The embedded default model (real tokenizer and chat template); used sparingly."""
    # One thread: the tests must not depend on how busy the machine's other cores are.
    rt = ModelRuntime(RuntimeConfig(model_path=None, n_ctx_seq=1024, n_seq_max=1,
                                    calibrate=False, threads=1))
    yield rt
    assert rt.idle_slots == 1
    rt.close()


async def test_health_answers_while_generating(smollm2_runtime: ModelRuntime) -> None:
    """Liveness, not speed: health is answered from counters while the engine runs
    llama.cpp on its worker thread (the 50 ms target is measured by
    meshd.bench.socket_cost)."""
    rt = smollm2_runtime
    async with running_daemon(rt) as (server, path), Client.connect(path) as client:
        story = [{"role": "user", "content": "Write a long story about a lighthouse."}]
        async with client.generate(messages=story, max_tokens=400, temperature=0.0,
                                   proposer="off") as stream:
            await stream.__anext__()
            latencies = []
            actives = []
            for _ in range(5):
                t0 = time.perf_counter()
                health = await client.health()
                latencies.append(time.perf_counter() - t0)
                actives.append(health.active_requests)
                await anyio.sleep(0.02)
            await stream.cancel()
            async for _ in stream:
                pass
        assert stream.done is not None
        assert stream.done.finish_reason in (FinishReason.CANCELLED, FinishReason.EOG)
        assert max(actives) == 1
        assert sorted(latencies)[2] < 0.5, latencies
        await wait_idle(server)
        assert_no_leaks(server)


async def test_chat_on_smollm2_equals_in_process(smollm2_runtime: ModelRuntime) -> None:
    rt = smollm2_runtime
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt = rt.tokenize_prompt(rt.render_chat(messages), chat=True)
    ref_tokens, ref_text, _ = reference(rt, prompt, max_tokens=24, proposer="auto")
    async with running_daemon(rt) as (_, path), Client.connect(path) as client:
        assert "chat" in client.welcome.capabilities
        assert client.welcome.model.has_chat_template
        done = await client.generate(messages=messages, max_tokens=24,
                                     temperature=0.0).collect()
    assert list(done.token_ids) == ref_tokens and done.text == ref_text


async def test_graceful_shutdown_ends_requests_with_done(runtime: ModelRuntime) -> None:
    # Small stream batches: the generations must still be running when the shutdown
    # comes (a synthetic model makes 400 tokens within one default 100 ms batch).
    config = ServerConfig(drain_timeout_s=5, stream_interval_s=0.002)
    async with running_daemon(runtime, config) as (server, path), Client.connect(path) as client:
        streams = [client.generate(_prompt(i), max_tokens=400, temperature=0.0)
                   for i in range(SLOTS + 2)]  # two of them wait in the queue
        for s in streams:
            await s.start()
        # Which requests run first is up to the event loop (trio shuffles its tasks), so
        # wait for the scheduler's state, not for one particular stream's first token.
        with anyio.fail_after(10):
            while server.scheduler.active < SLOTS or server.scheduler.queued < 2:
                await anyio.sleep(0.001)
        server.shutdown(grace_s=0)
        for s in streams:
            async for _ in s:
                pass
            assert s.done is not None
            assert s.done.finish_reason is FinishReason.SHUTDOWN
        # The listener closed first: nobody new gets in while the rest drains.
        assert not os.path.exists(path)
        assert server.service.draining
    assert runtime.idle_slots == SLOTS


async def test_shutdown_grace_lets_running_requests_finish(runtime: ModelRuntime) -> None:
    """Within the grace period a running generation ends normally; nobody new gets in."""
    config = ServerConfig(shutdown_grace_s=60, stream_interval_s=0.002)
    async with running_daemon(runtime, config) as (server, path), Client.connect(path) as client:
        stream = client.generate(_prompt(1), max_tokens=400, temperature=0.0)
        await stream.start()
        with anyio.fail_after(10):
            while server.scheduler.active < 1:
                await anyio.sleep(0.001)
        server.shutdown()
        assert server.scheduler.active == 1  # still running when the shutdown began
        async for _ in stream:
            pass
        assert stream.done is not None
        assert stream.done.finish_reason is FinishReason.LENGTH
        assert len(stream.token_ids) == 400
        assert not os.path.exists(path)


async def test_logs_have_stats_but_no_prompt_text(runtime: ModelRuntime) -> None:
    secret = "the-secret-prompt-words"
    with capture_logs() as logs:
        async with running_daemon(runtime) as (_, path), Client.connect(path) as client:
            await client.generate(secret, max_tokens=8, temperature=0.0).collect()
            with pytest.raises(Exception):  # noqa: B017 - any refusal will do
                await client.generate(secret, max_tokens=10**6).collect()
    events = [e["event"] for e in logs]
    assert "ready" in events and "request_finished" in events and "request_rejected" in events
    finished = next(e for e in logs if e["event"] == "request_finished")
    assert finished["completion_tokens"] == 8 and finished["finish_reason"] == "length"
    for entry in logs:
        if entry["log_level"] in ("info", "warning", "error"):
            assert secret not in repr(entry), entry
