"""The soak's workload: the request pool, single-client references, the clients' mixed
actions, and the judgement of every answer (see :mod:`.soak` for the run as a whole).

Why its own module: what the clients do and how each answer is judged is the part of
the soak that grows (new kinds of abuse); starting and stopping the daemon is not.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import AsyncIterator, Sequence
from typing import Final

import anyio
import attrs

from meshd.protocol import (
    Cancel,
    ChatMessage,
    Detokenize,
    Done,
    ErrorMessage,
    Generate,
    Health,
    Models,
    SamplingParams,
    SpeculativeOverrides,
    Stats,
    StatsReply,
    Tokenize,
    TokenizeReply,
    encode,
)

from .probe import ProbeConnection, Record, Refused
from .report import SoakReport, sample_process

__all__ = ["ACTIONS", "Soak", "SoakConfig"]

_ANSWER_TIMEOUT_S: Final = 120.0
"""A request unanswered this long under soak load is a hang, reported as a violation."""

_PROMPTS: Final = (
    "the cat sat on the mat and the cat sat on the hat",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
    '{"name": "soak", "items": [1, 2, 3], "nested": {"a": 1, "b": 2}}',
    "abc abc abc abc abc abc abc abc",
    "Once upon a time there was a daemon that never slept.",
)

ACTIONS: Final = {
    # name: weight
    "generate": 30, "chat": 6, "cancel_op": 10, "disconnect": 8, "tokenize": 10,
    "stats": 8, "garbage": 6, "big_reply": 1, "slow_frame": 1, "idle": 1,
}


@attrs.frozen
class SoakConfig:
    """One soak run."""

    seconds: float = 60.0
    clients: int = 8
    skip: tuple[str, ...] = ()
    """Action kinds left out (e.g. ``big_reply``, whose multi-megabyte allocations make
    RSS swing by hundreds of MB and hide a slow trend)."""
    model: str | None = None
    """GGUF path; ``None``: the synthetic hybrid qwen35 (MTP acceptance 0.74) with two
    synthetic draft models."""
    slots: int = 4
    threads: int = 1
    seed: int = 0
    max_queue: int = 6
    """Small, so that load produces ``busy`` refusals."""
    draft_max: int = 12
    sample_interval_s: float = 2.0
    frame_timeout_s: float = 10.0
    """Short, so stalled frames are seen closed; long enough for a 4 MiB frame under load."""
    idle_timeout_s: float = 4.0


@attrs.frozen
class Item:
    """One request of the pool, with its single-client reference once recorded."""

    key: str
    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    max_tokens: int
    sampling: SamplingParams
    proposer: str
    draft_max: int | None

    @property
    def comparable(self) -> bool:
        """Outputs are reproducible (greedy or seeded), so they must equal the reference."""
        return self.sampling.temperature == 0 or self.sampling.seed is not None

    def request(self, rid: str, max_tokens: int | None = None) -> Generate:
        return Generate(
            id=rid, prompt=self.prompt, messages=self.messages,
            max_tokens=max_tokens or self.max_tokens, sampling=self.sampling,
            speculative=SpeculativeOverrides(proposer=self.proposer, draft_max=self.draft_max),
        )


@attrs.define
class Reference:
    tokens: list[int]
    finish: str
    error: str | None = None


def _pool(rng: random.Random, draft_max: int, drafts: Sequence[str]) -> list[Item]:
    items: list[Item] = []
    # composite: the MTP head, prompt lookup and history lookup (earlier answers)
    proposers = ("off", "ngram", "mtp", "auto", "composite", *(f"draft:{d}" for d in drafts))
    for i, text in enumerate(_PROMPTS):
        for j, proposer in enumerate(proposers):
            seeded = (i + j) % 2 == 1
            sampling = SamplingParams(temperature=0.8, seed=1000 + i * 10 + j) if seeded \
                else SamplingParams(temperature=0.0)
            items.append(Item(
                key=f"p{i}-{proposer[:8]}{j}-{'seeded' if seeded else 'greedy'}", prompt=text,
                messages=None, max_tokens=rng.randint(16, 40), sampling=sampling,
                proposer=proposer, draft_max=rng.choice((None, 2, 6, draft_max)),
            ))
    items.append(Item(key="unseeded", prompt=_PROMPTS[0], messages=None, max_tokens=24,
                      sampling=SamplingParams(temperature=0.8), proposer="auto",
                      draft_max=None))
    return items


def _chat_pool() -> list[Item]:
    return [Item(
        key=f"chat{i}", prompt=None,
        messages=(ChatMessage(role="system", content="Answer briefly."),
                  ChatMessage(role="user", content=text)),
        max_tokens=24, sampling=SamplingParams(temperature=0.0), proposer="auto",
        draft_max=None,
    ) for i, text in enumerate(_PROMPTS[:2])]


class Soak:
    """One run: the daemon child, the pool and its references, the clients."""

    def __init__(self, config: SoakConfig, path: str, pid: int, model: str,
                 drafts: Sequence[str]) -> None:
        self.config = config
        self.path = path
        self.pid = pid
        self.report = SoakReport(clients=config.clients, model=model)
        rng = random.Random(config.seed)
        self.items = _pool(rng, config.draft_max, drafts)
        self.chat_items = _chat_pool()
        self.refs: dict[str, Reference] = {}
        self.token_refs: dict[str, tuple[int, ...]] = {}
        self.text_refs: dict[str, str] = {}
        self.t0 = time.monotonic()
        self.max_frame_size = 0

    # ------------------------------------------------------------------ phases

    async def references(self) -> None:
        """Every pool request alone, one after another: the outputs to match."""
        async with self.probe("ref") as conn:
            self.max_frame_size = conn.max_frame_size
            for item in [*self.items, *self.chat_items]:
                record = await conn.request(item.request(conn.new_id()))
                await self.answered(conn, record, item.key)
                final = record.final
                if isinstance(final, Done):
                    self.refs[item.key] = Reference(record.tokens, final.finish_reason.value)
                else:
                    code = record.error_code or "none"
                    self.refs[item.key] = Reference([], "error", code)
            for text in _PROMPTS:
                tok = await conn.request(Tokenize(id=conn.new_id(), text=text))
                await self.answered(conn, tok, "tokenize")
                assert isinstance(tok.final, TokenizeReply), tok.final
                self.token_refs[text] = tok.final.tokens
                det = await conn.request(Detokenize(id=conn.new_id(), tokens=tok.final.tokens))
                await self.answered(conn, det, "detokenize")
                self.text_refs[text] = getattr(det.final, "text", "")
        for key, ref in self.refs.items():
            chat_refused = key.startswith("chat") and ref.error == "bad_request"
            if ref.error is not None and not chat_refused:
                self.report.unexpected_errors.append(f"reference {key}: {ref.error}")

    async def load(self, monitor: ProbeConnection) -> None:
        """``clients`` concurrent clients for ``seconds``, the daemon sampled meanwhile."""
        end = time.monotonic() + self.config.seconds
        async with anyio.create_task_group() as outer:
            outer.start_soon(self._keep_alive, monitor)
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._sample_until, end)
                for i in range(self.config.clients):
                    tg.start_soon(self._client, i, end)
            outer.cancel_scope.cancel()

    async def _keep_alive(self, monitor: ProbeConnection) -> None:
        """Health checks keep the monitor connection from being closed as idle."""
        while True:
            await self.answered(monitor, await monitor.request(Health(id=monitor.new_id())),
                                "monitor health")
            await anyio.sleep(self.config.idle_timeout_s / 4)

    async def settle(self, monitor: ProbeConnection) -> StatsReply | None:
        """Wait (bounded) until nothing is in flight and only ``monitor`` is connected."""
        stats: StatsReply | None = None
        with anyio.move_on_after(60):
            while True:
                stats = await self.stats(monitor)
                if stats is None:
                    return None
                c = stats.counters
                if (c.get("active_requests") == 0 and c.get("queued_requests") == 0
                        and c.get("connections_open") == 1):
                    return stats
                await anyio.sleep(0.2)
        return stats

    def check_leaks(self, stats: StatsReply | None, fd_end: int) -> None:
        rep = self.report
        if stats is None:
            rep.leaks["stats_unanswered"] = 1
            return
        c = stats.counters
        rep.leaks["active_requests"] = c.get("active_requests", 0)
        rep.leaks["queued_requests"] = c.get("queued_requests", 0)
        rep.leaks["connections"] = c.get("connections_open", 0) - 1
        rep.leaks["slots"] = self.config.slots - c.get("idle_slots", 0)
        rep.leaks["sessions"] = max(0.0, c.get("cached_sessions", 0) - self.config.slots)
        rep.leaks["unaccounted_requests"] = c.get("requests_total", 0) - (
            c.get("requests_completed", 0) + c.get("requests_cancelled", 0)
            + c.get("requests_failed", 0))
        rep.fd_end = fd_end
        if rep.fd_baseline is not None:
            rep.leaks["fds"] = max(0, fd_end - rep.fd_baseline)

    async def still_serves(self) -> None:
        """After the load, one reference request alone still gives its reference."""
        item = next(i for i in self.items if i.comparable and self.refs[i.key].error is None)
        async with self.probe("after") as conn:
            record = await conn.request(item.request(conn.new_id()))
            await self.answered(conn, record, item.key)
            self.evaluate(item, record)

    # ------------------------------------------------------------------ helpers

    @contextlib.asynccontextmanager
    async def probe(self, name: str) -> AsyncIterator[ProbeConnection]:
        async with ProbeConnection.open(self.path, self.report, name) as conn:
            yield conn

    async def answered(self, conn: ProbeConnection, record: Record, what: str) -> bool:
        with anyio.move_on_after(_ANSWER_TIMEOUT_S):
            await record.finished.wait()
        if record.final is None and not conn.closed_by_peer.is_set():
            conn.violation(f"{what}: no final frame within {_ANSWER_TIMEOUT_S:g} s")
            return False
        return record.final is not None

    async def stats(self, conn: ProbeConnection) -> StatsReply | None:
        record = await conn.request(Stats(id=conn.new_id()))
        await self.answered(conn, record, "stats")
        return record.final if isinstance(record.final, StatsReply) else None

    def evaluate(self, item: Item, record: Record, *, cancelled: bool = False) -> None:
        """Judge one generation: its outcome, and its tokens against the reference."""
        rep = self.report
        final = record.final
        if final is None:
            return
        if isinstance(final, ErrorMessage):
            code = final.code.value
            rep.outcomes[f"error:{code}"] += 1
            ref = self.refs.get(item.key)
            if code != "busy" and not (ref is not None and ref.error == code):
                rep.unexpected_errors.append(f"{item.key}: {code}: {final.message[:100]}")
            return
        if not isinstance(final, Done):
            rep.violations.append(f"{item.key}: generate answered with {final.OP}")
            return
        finish = final.finish_reason.value
        rep.outcomes[finish] += 1
        rep.tokens += len(record.tokens)
        rep.checkpoints += final.speculation.checkpoints
        rep.restores += final.speculation.restores
        if final.usage.completion_tokens != len(record.tokens):
            rep.violations.append(f"{item.key}: done says {final.usage.completion_tokens} "
                                  f"tokens, {len(record.tokens)} were streamed")
        if finish == "error":
            rep.unexpected_errors.append(f"{item.key}: done with error: {final.error_message}")
            return
        ref = self.refs.get(item.key)
        if ref is None or not item.comparable or ref.error is not None:
            return
        if finish == "cancelled" or cancelled:
            if record.tokens != ref.tokens[: len(record.tokens)]:
                rep.mismatches.append(f"{item.key}: cancelled output is not a prefix")
            return
        rep.compared += 1
        if record.tokens != ref.tokens:
            n = next((i for i, (a, b) in enumerate(zip(record.tokens, ref.tokens, strict=False))
                      if a != b), min(len(record.tokens), len(ref.tokens)))
            rep.mismatches.append(f"{item.key}: differs from the single-client run at {n}")

    async def _sample_until(self, end: float) -> None:
        """Sample the daemon's RSS and open descriptors until ``end``."""
        while True:
            with contextlib.suppress(OSError, ValueError):
                self.report.samples.append(
                    sample_process(self.pid, time.monotonic() - self.t0))
            if time.monotonic() >= end:
                return
            await anyio.sleep(min(self.config.sample_interval_s,
                                  max(0.0, end - time.monotonic())))

    # ------------------------------------------------------------------ clients

    async def _client(self, index: int, end: float) -> None:
        rng = random.Random(self.config.seed * 1000 + index)
        names = [name for name in ACTIONS if name not in self.config.skip]
        weights = [ACTIONS[name] for name in names]
        n = 0
        while time.monotonic() < end:
            n += 1
            action = rng.choices(names, weights)[0]
            self.report.actions[action] += 1
            try:
                await getattr(self, f"_do_{action}")(rng, f"c{index}.{n}")
            except Refused as exc:
                self.report.outcomes["connection_refused"] += 1
                if "busy" not in repr(exc.frame):
                    self.report.unexpected_errors.append(f"handshake refused: {exc.frame!r}")
            except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
                self.report.unexpected_errors.append(f"{action}: {type(exc).__name__}: {exc}")
                await anyio.sleep(0.5)

    async def _do_generate(self, rng: random.Random, name: str) -> None:
        async with self.probe(name) as conn:
            chosen = rng.sample(self.items, rng.randint(1, 3))
            records = [(item, await conn.request(item.request(conn.new_id())))
                       for item in chosen]
            for item, record in records:
                if await self.answered(conn, record, item.key):
                    self.evaluate(item, record)
            await self.answered(conn, await conn.request(Health(id=conn.new_id())), "health")

    async def _do_chat(self, rng: random.Random, name: str) -> None:
        item = rng.choice(self.chat_items)
        async with self.probe(name) as conn:
            record = await conn.request(item.request(conn.new_id()))
            if await self.answered(conn, record, item.key):
                self.evaluate(item, record)

    async def _do_cancel_op(self, rng: random.Random, name: str) -> None:
        item = rng.choice(self.items)
        async with self.probe(name) as conn:
            rid = conn.new_id()
            record = await conn.request(item.request(rid))
            with anyio.move_on_after(_ANSWER_TIMEOUT_S):
                await record.first.wait()
            await anyio.sleep(rng.random() * 0.05)
            await conn.send_raw(encode(Cancel(id=rid)))
            if await self.answered(conn, record, item.key):
                self.evaluate(item, record, cancelled=True)

    async def _do_disconnect(self, rng: random.Random, name: str) -> None:
        item = rng.choice(self.items)
        async with self.probe(name) as conn:
            record = await conn.request(item.request(conn.new_id(), max_tokens=64))
            if rng.random() < 0.5:
                with anyio.move_on_after(_ANSWER_TIMEOUT_S):
                    await record.first.wait()
        # leaving the block closes the socket mid-stream

    async def _do_tokenize(self, rng: random.Random, name: str) -> None:
        text = rng.choice(_PROMPTS)
        async with self.probe(name) as conn:
            tok = await conn.request(Tokenize(id=conn.new_id(), text=text))
            det = await conn.request(Detokenize(id=conn.new_id(), tokens=self.token_refs[text]))
            for record, what in ((tok, "tokenize"), (det, "detokenize")):
                if not await self.answered(conn, record, what):
                    continue
                code = record.error_code
                if code is not None:
                    if code != "busy":
                        self.report.unexpected_errors.append(f"{what}: {code}")
                elif what == "tokenize" and getattr(record.final, "tokens", None) \
                        != self.token_refs[text]:
                    self.report.mismatches.append(f"tokenize of {text[:20]!r} differs")
                elif what == "detokenize" and getattr(record.final, "text", None) \
                        != self.text_refs[text]:
                    self.report.mismatches.append(f"detokenize of {text[:20]!r} differs")

    async def _do_stats(self, rng: random.Random, name: str) -> None:
        async with self.probe(name) as conn:
            for msg in (Stats(id=conn.new_id()), Health(id=conn.new_id()),
                        Models(id=conn.new_id())):
                await self.answered(conn, await conn.request(msg), msg.OP)

    async def _do_garbage(self, rng: random.Random, name: str) -> None:
        """Bad frames each get their typed error; the connection then still serves."""
        anonymous = [b"this is not json\n", b"\xff\xfe\x00garbage\n", b"[1, 2, 3]\n",
                     b'{"op": "generate", "prompt": 12}\n']
        with_id = [(b'{"op":"frobnicate","id":"%s"}\n', "bad_request"),
                   (b'{"op":"generate","id":"%s","prompt":"x","max_tokens":-1}\n',
                    "bad_request"),
                   (b'{"op":"tokenize","id":"%s","text":"x","colour":"red"}\n',
                    "bad_request")]
        async with self.probe(name) as conn:
            frames: list[tuple[bytes, str | None]] = [
                (line, None) for line in rng.sample(anonymous, 2)]
            frames += [(line, code) for line, code in rng.sample(with_id, 2)]
            if rng.random() < 0.3:  # a line longer than the frame limit
                frames.append((b'{"op":"tokenize","text":"' + b"a" * self.max_frame_size
                               + b'"}\n', "too_large"))
            records: list[tuple[Record, str]] = []
            n_anonymous = 0
            for line, code in frames:
                if code is None or code == "too_large":
                    n_anonymous += 1
                    await conn.send_raw(line)
                else:
                    rid = conn.new_id()
                    record = Record("garbage")
                    conn.records[rid] = record
                    records.append((record, code))
                    await conn.send_raw(line.replace(b"%s", rid.encode()))
            for _ in range(n_anonymous):
                if await conn.expect_anonymous_error(_ANSWER_TIMEOUT_S) is None:
                    conn.violation("a bad frame got no error frame")
            for record, code in records:
                if await self.answered(conn, record, "garbage") and record.error_code != code:
                    conn.violation(f"bad frame answered {record.error_code}, not {code}")
            health = await conn.request(Health(id=conn.new_id()))
            await self.answered(conn, health, "health after garbage")

    async def _do_big_reply(self, rng: random.Random, name: str) -> None:
        """A legal tokenize whose token list would not fit in one frame: ``too_large``."""
        async with self.probe(name) as conn:
            unit = "a1 "
            text = unit * ((self.max_frame_size * 4 // 5) // len(unit))
            record = await conn.request(Tokenize(id=conn.new_id(), text=text))
            if await self.answered(conn, record, "big tokenize") \
                    and record.error_code not in ("too_large", "busy"):
                conn.violation(f"oversized tokenize reply answered {record.final!r:.80}")

    async def _do_slow_frame(self, rng: random.Random, name: str) -> None:
        """A frame that never ends gets an error and a close after the frame timeout."""
        async with self.probe(name) as conn:
            conn.may_close = True
            await conn.send_raw(b'{"op":"health","id":"never-end')
            error = await conn.expect_anonymous_error(self.config.frame_timeout_s + 30)
            if error is None or error.code.value != "bad_request":
                conn.violation(f"a stalled partial frame got {error!r}")
            with anyio.move_on_after(10):
                await conn.closed_by_peer.wait()
            if not conn.closed_by_peer.is_set():
                conn.violation("a stalled partial frame did not close the connection")

    async def _do_idle(self, rng: random.Random, name: str) -> None:
        """A connection that says nothing after hello is closed after the idle timeout."""
        async with self.probe(name) as conn:
            conn.may_close = True
            with anyio.move_on_after(self.config.idle_timeout_s + 30):
                await conn.closed_by_peer.wait()
            if not conn.closed_by_peer.is_set():
                conn.violation("an idle connection was not closed")
