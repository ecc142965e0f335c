"""A long prompt is prefilled a chunk at a time between the other requests' decode
steps: a streaming client keeps getting tokens while it prefills, a client that leaves
during it is let go between two chunks, and its text is the one it gets alone.

On the default model through both front ends (what a user sees), and on the synthetic
models through the scheduler (the ``n`` choices sharing one prefill; a hybrid model
whose MTP head follows the prompt chunk by chunk)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import numpy as np
import pytest

from meshd.daemon.engine import prefill
from meshd.daemon.models.runtime import ModelRuntime, RuntimeConfig
from meshd.daemon.models.scheduler import (
    Finished,
    GenerationFailed,
    GenerationHandle,
    GenerationRequest,
    Scheduler,
)
from meshd.native.context import TargetContext
from meshd.native.prefill_chunks import (
    prefill_chunk_rows,
    prefill_forward_rows,
    prefill_merges_chunks,
)
from meshd.native.session import SequenceSession, prefill_parts
from meshd.policy.decision import FinishReason
from meshd.protocol import Client
from meshd.protocol import FinishReason as WireFinish
from meshd.testing import testmodels
from tests.integration.helpers.daemon import assert_no_leaks, running_daemon, wait_idle
from tests.integration.helpers.http_api import http_daemon

pytestmark = pytest.mark.anyio

#: A bystander that goes on for a long while: greedy SmolLM2 keeps counting.
COUNTING = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4, 5, 6, 7,"


def _long_prompt(sentences: int) -> str:
    colours = ["red", "blue", "green", "yellow", "black", "white", "grey"]
    fruit = ["apples", "pears", "plums", "cherries", "lemons"]
    lines = [f"Crate {i} is {colours[i % 7]} and holds {(i * 37) % 91 + 3} "
             f"{fruit[i % 5]} and {(i * 53) % 47 + 2} {fruit[(i + 2) % 5]}."
             for i in range(sentences)]
    return "Inventory of the warehouse.\n" + "\n".join(lines) + \
        "\nQuestion: which crate holds the most apples? Answer:"


#: About 1,200 tokens of SmolLM2: ten chunks on the CPU (three forwards alone).
LONG = _long_prompt(60)
#: About 800 tokens: seven chunks.
MEDIUM = _long_prompt(40)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def smol() -> Iterator[ModelRuntime]:
    rt = ModelRuntime(RuntimeConfig(n_ctx_seq=2048, n_seq_max=3, draft_max=4,
                                    calibrate=False, threads=2))
    yield rt
    assert rt.idle_slots == 3
    rt.close()


def _chunk(rt: ModelRuntime) -> int:
    return prefill_chunk_rows(rt.context)


async def _prefilled(server: Any, n_prompt: int, n: int) -> None:
    """Wait until the request with an ``n_prompt``-token prompt holds ``n`` of them."""
    with anyio.fail_after(300):
        while not any(len(g.prompt) == n_prompt and g.session.n_past >= n
                      for g in server.scheduler.running()):
            await anyio.sleep(0.005)


async def test_a_streaming_client_gets_tokens_while_a_long_prompt_prefills(
        smol: ModelRuntime) -> None:
    """The bystander's tokens keep coming between the long request's submission and its
    first token, never held for more than a fraction of that prefill."""
    smol.prefix_cache.clear()
    n_prompt = len(smol.model.tokenizer.tokenize(MEDIUM))
    assert n_prompt >= 6 * _chunk(smol)
    arrivals: list[float] = []
    sent = first = 0.0
    async with running_daemon(smol) as (server, path), Client.connect(path) as client:
        async with client.generate(COUNTING, max_tokens=1800, temperature=0.0) as bystander:
            async for _ in bystander:
                arrivals.append(time.monotonic())
                if len(arrivals) >= 3:
                    break
            async with anyio.create_task_group() as tg:
                async def listen() -> None:
                    async for _ in bystander:
                        arrivals.append(time.monotonic())

                tg.start_soon(listen)
                sent = time.monotonic()
                async with client.generate(MEDIUM, max_tokens=4, temperature=0.0) as long:
                    async for _ in long:
                        first = first or time.monotonic()
                assert long.done is not None and long.done.usage.prompt_tokens == n_prompt
                tg.cancel_scope.cancel()
            assert bystander.done is None, "the bystander ended before the long prompt did"
        await wait_idle(server, timeout=60)
        assert_no_leaks(server)
    during = [t for t in arrivals if sent < t < first]
    gaps = [b - a for a, b in zip([sent, *during], [*during, first], strict=True)]
    ttft = first - sent
    print(f"\nlong prompt {n_prompt} tokens: first token after {ttft:.2f}s; bystander "
          f"got {len(during)} token frames meanwhile, longest wait {max(gaps):.2f}s")
    assert len(during) >= 3
    assert max(gaps) < ttft / 2


async def test_a_client_that_cancels_during_a_long_prefill_is_let_go_between_chunks(
        smol: ModelRuntime) -> None:
    """Alone (its prompt prefilled ``n_batch`` rows a forward): it gets ``cancelled``,
    no token, its slot is free, and the prompt was not prefilled to its end: the
    sequence it leaves in the prefix cache stops short."""
    smol.prefix_cache.clear()
    n_prompt = len(smol.model.tokenizer.tokenize(LONG))
    rows = prefill_forward_rows(smol.context)
    assert n_prompt > 2 * rows
    async with running_daemon(smol) as (server, path), Client.connect(path) as client:
        before = server.scheduler.statistics()
        stream = client.generate(LONG, max_tokens=8, temperature=0.0)
        await stream.start()
        await _prefilled(server, n_prompt, rows)
        await stream.cancel()
        tokens = [tok async for tok in stream]
        assert tokens == []
        assert stream.done is not None and stream.done.finish_reason is WireFinish.CANCELLED
        await wait_idle(server, timeout=60)
        assert_no_leaks(server)
        after = server.scheduler.statistics()
        assert after.cancelled == before.cancelled + 1
    held = smol.prefix_cache.tokens
    assert rows <= held <= 2 * rows < n_prompt, (held, n_prompt)


async def test_an_http_client_that_leaves_during_a_long_prefill_frees_its_slot(
        smol: ModelRuntime) -> None:
    """Beside a streaming client (its prompt prefilled a chunk a step): a streamed
    completion's response starts with its first token, and a client that closes its
    connection before then is cancelled between two chunks; the other goes on."""
    smol.prefix_cache.clear()
    n_prompt = len(smol.model.tokenizer.tokenize(LONG))
    chunk = _chunk(smol)
    data = json.dumps({"prompt": LONG, "max_tokens": 8, "temperature": 0,
                       "stream": True}).encode()
    async with http_daemon(smol) as (server, path, _http):
        async with Client.connect(path) as client, \
                client.generate(COUNTING, max_tokens=1800, temperature=0.0) as bystander:
            async for _ in bystander:
                if len(bystander.token_ids) >= 3:
                    break
            before = server.scheduler.statistics()
            stream = await anyio.connect_unix(path)
            await stream.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                              b"Content-Type: application/json\r\nContent-Length: "
                              + str(len(data)).encode() + b"\r\n\r\n" + data)
            await _prefilled(server, n_prompt, 2 * chunk)
            await stream.aclose()
            with anyio.fail_after(60):
                while server.scheduler.active > 1:
                    await anyio.sleep(0.005)
            assert server.scheduler.statistics().cancelled == before.cancelled + 1
            assert [g.prompt for g in server.scheduler.running()] == \
                [smol.model.tokenizer.tokenize(COUNTING)]
            held = smol.prefix_cache.tokens  # the prompt as far as it was prefilled
            assert 2 * chunk <= held <= n_prompt - 2 * chunk, (held, n_prompt)
            n = len(bystander.token_ids)
            async for _ in bystander:
                if len(bystander.token_ids) >= n + 3:
                    break
            assert bystander.done is None
        await wait_idle(server, timeout=60)
        assert_no_leaks(server)


async def test_a_long_prompt_gives_the_same_text_beside_a_streaming_client(
        smol: ModelRuntime) -> None:
    """Over HTTP: greedy text alone, and again while another client streams (its
    prompt chunks the same, its decode steps beside the other's)."""
    body = {"prompt": MEDIUM, "max_tokens": 24, "temperature": 0}
    async with http_daemon(smol) as (server, path, http):
        smol.prefix_cache.clear()
        alone = (await http.post("/v1/completions", json=body)).json()
        smol.prefix_cache.clear()
        async with Client.connect(path) as client, \
                client.generate(COUNTING, max_tokens=1800, temperature=0.0) as bystander:
            async for _ in bystander:
                if len(bystander.token_ids) >= 3:
                    break
            beside = (await http.post("/v1/completions", json=body)).json()
            assert bystander.done is None
        await wait_idle(server, timeout=60)
        assert_no_leaks(server)
    for answer in (alone, beside):
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert beside["choices"][0]["text"] == alone["choices"][0]["text"]


# ------------------------------------------------------------------ synthetic models


@pytest.fixture(scope="module", params=["llama", "qwen35"])
def synthetic(request: pytest.FixtureRequest) -> Iterator[ModelRuntime]:
    path = str(testmodels.test_model_path(request.param, acceptance=1.0))
    rt = ModelRuntime(RuntimeConfig(model_path=path, n_ctx_seq=2048, n_seq_max=4,
                                    draft_max=4, calibrate=False))
    yield rt
    assert rt.idle_slots == 4
    rt.close()


def _synthetic_prompt(rt: ModelRuntime, tokens: int) -> tuple[int, ...]:
    tok = rt.model.tokenizer
    text = " ".join(f"line {i} says {'abcdefgh'[i % 8] * (i % 5 + 1)}" for i in range(tokens))
    return tuple(tok.tokenize(text)[:tokens])


async def _collect(handle: GenerationHandle, order: list[str], name: str,
                   ) -> tuple[list[int], Finished]:
    tokens: list[int] = []
    async with handle.events:
        async for ev in handle.events:
            if isinstance(ev, Finished):
                return tokens, ev
            assert not isinstance(ev, GenerationFailed), ev
            tokens.extend(ev.tokens)
            order.extend([name] * len(ev.tokens))
    raise AssertionError("no final event")


async def test_choices_share_one_chunked_prefill_beside_a_decoding_request(
        synthetic: ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two generations of one long prompt (a request's ``n`` choices) are prefilled
    once, a chunk per step of the request already decoding, which gets tokens between
    the chunks; each text is the one the prompt gets alone. On the hybrid model each
    prompt is prefilled on its own, and the MTP head follows it chunk by chunk."""
    rt = synthetic
    monkeypatch.setattr(prefill, "PREFILL_SLICE_S", 0.0)  # one chunk a step, however fast
    prompt = _synthetic_prompt(rt, 5 * _chunk(rt) + 17)
    other = _synthetic_prompt(rt, 40)[::-1]
    proposer = "mtp" if rt.model.info.has_mtp else "off"
    request = GenerationRequest(prompt, max_tokens=24, proposer=proposer)
    sched = Scheduler(rt, step_budget_s=0.0)
    order: list[str] = []
    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        rt.prefix_cache.clear()
        alone, fin = await _collect(sched.submit(request), [], "alone")
        assert fin.finish is FinishReason.LENGTH
        assert fin.stats.session.prefill_tokens == len(prompt)
        rt.prefix_cache.clear()
        bystander = sched.submit(GenerationRequest(other, max_tokens=1000, proposer="off"))
        ended: list[Finished] = []

        async def watch() -> None:
            ended.append((await _collect(bystander, order, "bystander"))[1])

        tg.start_soon(watch)
        with anyio.fail_after(60):
            while "bystander" not in order:
                await anyio.sleep(0.001)
        order.append("submitted")
        choices = [sched.submit(request) for _ in range(2)]
        results: dict[int, tuple[list[int], Finished]] = {}

        async def choice(i: int) -> None:
            results[i] = await _collect(choices[i], order, f"choice{i}")

        async with anyio.create_task_group() as inner:
            for i in range(2):
                inner.start_soon(choice, i)
        assert not ended, "the bystander ended before the choices did"
        bystander.cancel()
        with anyio.fail_after(60):
            while not ended:
                await anyio.sleep(0.001)
        assert ended[0].finish is FinishReason.CANCELLED
        tg.cancel_scope.cancel()
    for tokens, fin in results.values():
        assert tokens == alone
        assert fin.finish is FinishReason.LENGTH
    prefilled = sum(fin.stats.session.prefill_tokens for _, fin in results.values())
    if rt.context.recurrent or rt.model.info.has_mtp:
        assert prefilled == 2 * len(prompt)  # each its own (no sequence copies there)
    else:
        assert prefilled == len(prompt)
        assert sorted(fin.stats.reused_prompt_tokens for _, fin in results.values()) == \
            [0, len(prompt)]
    if proposer == "mtp":
        assert all(fin.stats.drafted > 0 and fin.stats.accepted > 0
                   for _, fin in results.values())
    # The bystander decoded between the chunks: tokens of its own after the submission
    # and before either choice's first token (a step, then a chunk, ...).
    start = order.index("submitted")
    first = min(order.index(f"choice{i}") for i in range(2))
    assert order[start + 1:first].count("bystander") >= 4, order[start:first + 1]
    assert rt.idle_slots == 4


def _chunks_match_whole(ctx: TargetContext, prompt: Sequence[int],
                        other_prompt: Sequence[int]) -> None:
    """A prompt prefilled whole (``n_batch`` rows a forward where chunks merge), and
    again a chunk a forward between another sequence's decode steps: the same last
    logits bit for bit, and the same MTP head state and drafts where it has one."""
    rows = prefill_chunk_rows(ctx)
    with SequenceSession.open(ctx) as whole, SequenceSession.open(ctx) as parts, \
            SequenceSession.open(ctx, mtp=False) as other:
        want = whole.prefill(prompt)
        tok = int(np.argmax(other.prefill(other_prompt)))
        got = None
        for at in range(0, len(prompt), rows):
            tok = int(np.argmax(other.decode(tok)))
            other.retire()
            (got,) = prefill_parts([(parts, prompt[at:at + rows], at + rows >= len(prompt))])
        assert got is not None and np.array_equal(got, want)
        assert parts.counters.prefill_forwards == -(-len(prompt) // rows)
        assert whole.counters.prefill_forwards == -(-len(prompt) // prefill_forward_rows(ctx))
        if whole.mtp is not None:
            assert parts.mtp is not None
            assert np.array_equal(whole.mtp.pending_h, parts.mtp.pending_h)
            last = int(np.argmax(want))
            drafts = whole.mtp.draft(last, len(prompt), 3)[0]
            assert drafts and parts.mtp.draft(last, len(prompt), 3)[0] == drafts


async def test_a_prompt_prefilled_a_chunk_at_a_time_is_its_whole_prefill(
        synthetic: ModelRuntime) -> None:
    """The runtime's side, on the synthetic models (the hybrid one with its MTP head
    fed chunk by chunk)."""
    synthetic.prefix_cache.clear()  # its sessions hold slots
    rows = prefill_chunk_rows(synthetic.context)
    _chunks_match_whole(synthetic.context, _synthetic_prompt(synthetic, 5 * rows + 5),
                        _synthetic_prompt(synthetic, 30)[::-1])


async def test_a_prompt_prefilled_a_chunk_at_a_time_is_its_whole_prefill_on_smollm2(
        smol_ctx: TargetContext) -> None:
    """The same on the default model (a real one: no margins by design)."""
    tok = smol_ctx.model.tokenizer
    prompt = tok.tokenize(_long_prompt(40))
    assert len(prompt) > prefill_forward_rows(smol_ctx) > prefill_chunk_rows(smol_ctx)
    _chunks_match_whole(smol_ctx, prompt, tok.tokenize(COUNTING))


async def test_long_prompts_admitted_together_take_turns(
        synthetic: ModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two long prompts beside a decoding request get a chunk each in turn (neither
    waits for the other's whole prefill), and each text is the one it gets alone."""
    rt = synthetic
    monkeypatch.setattr(prefill, "PREFILL_SLICE_S", 0.0)  # one chunk a step
    rows = prefill_chunk_rows(rt.context)
    prompts = [_synthetic_prompt(rt, 4 * rows + 9), _synthetic_prompt(rt, 4 * rows + 20)[::-1]]
    requests = [GenerationRequest(p, max_tokens=12, proposer="off") for p in prompts]
    sched = Scheduler(rt, step_budget_s=0.0)
    calls: list[list[tuple[int, int]]] = []  # each prefill forward's (sequence, rows)
    real = prefill.prefill_parts

    def spy(items: Any) -> Any:
        calls.append([(session.seq_id, len(tokens)) for session, tokens, _ in items])
        return real(items)

    async with anyio.create_task_group() as tg:
        await tg.start(sched.run)
        alone = []
        for r in requests:
            rt.prefix_cache.clear()
            alone.append((await _collect(sched.submit(r), [], "alone"))[0])
        rt.prefix_cache.clear()
        bystander = sched.submit(GenerationRequest(_synthetic_prompt(rt, 20), max_tokens=1000,
                                                   proposer="off"))
        order: list[str] = []
        tg.start_soon(_collect, bystander, order, "bystander")
        with anyio.fail_after(60):
            while not order:
                await anyio.sleep(0.001)
        monkeypatch.setattr(prefill, "prefill_parts", spy)
        handles = [sched.submit(r) for r in requests]
        together = [(await _collect(h, [], "long"))[0] for h in handles]
        bystander.cancel()
        tg.cancel_scope.cancel()
    assert together == alone
    # A chunk of one, then of the other, ...; their short last chunks share a forward
    # where chunks merge.
    first, second = calls[0][0][0], calls[1][0][0]
    assert first != second
    assert calls[:8] == [[(first, rows)], [(second, rows)]] * 4, calls
    assert sorted(n for call in calls[8:] for _, n in call) == [9, 20]
    assert len(calls) == (9 if prefill_merges_chunks(rt.context) else 10)
