"""One streamed OpenAI completion as a user's client sees it, and the rates made from it.

Why times of text and not of chunks: servers batch differently (meshd sends what it
committed since its last write, at most ``--stream-interval-ms`` apart; llama-server one
chunk per token), so a chunk count is no token count. The token count is the final
``usage`` chunk's (asked for with ``stream_options.include_usage``); a server that sends
none falls back to its ``timings.predicted_n``, then to the chunks, and the record says
which it was.

Rates: a request's decode rate is ``(tokens - 1) / (t_last - t_first)`` — the first
token's time is the prompt's (TTFT), every later one is decoding; N clients' aggregate
rate is ``sum(tokens_i - 1) / (max t_last - min t_first)``.

A constrained request's answer from meshd also carries what the constraint did (the
finish chunk's ``meshd.extra``: forced drafts, grammar time); other servers' do not.
"""

from __future__ import annotations

import http.client
import itertools
import json
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from .processes import REQUEST_TIMEOUT_S

__all__ = ["GrammarStats", "RequestRecord", "StreamResult", "aggregate_decode_rate",
           "answer_tokens_and_span",
           "decode_rate", "decode_tokens_and_span", "gaps_within", "grammar_per_token",
           "median_or_none", "parse_sse", "records_from", "run_clients", "stream_request"]


@attrs.frozen
class GrammarStats:
    """What meshd's output constraint did in one request (its ``meshd.extra`` counters)."""

    #: Drafted tokens the constraint forced, and how many of them were accepted.
    forced_drafted: int = 0
    forced_accepted: int = 0
    #: Drafted tokens copied from the prompt into a JSON string value, and accepted.
    copy_drafted: int = 0
    copy_accepted: int = 0
    #: Draft tokens cut because the constraint forbade them.
    grammar_cut: int = 0
    #: Time choosing tokens under the constraint, and rows that needed a full mask.
    grammar_ms: float = 0.0
    grammar_masks: int = 0

    @classmethod
    def from_extra(cls, extra: object) -> GrammarStats | None:
        """From a ``meshd.extra`` dict; None where it has no grammar counters (an
        unconstrained request, another server, a malformed block)."""
        if not isinstance(extra, Mapping) or "grammar_ms" not in extra:
            return None
        try:
            return cls(forced_drafted=int(extra.get("forced_drafted", 0)),
                       forced_accepted=int(extra.get("forced_accepted", 0)),
                       copy_drafted=int(extra.get("copy_drafted", 0)),
                       copy_accepted=int(extra.get("copy_accepted", 0)),
                       grammar_cut=int(extra.get("grammar_cut", 0)),
                       grammar_ms=float(extra["grammar_ms"]),
                       grammar_masks=int(extra.get("grammar_masks", 0)))
        except (TypeError, ValueError):
            return None


@attrs.frozen
class StreamResult:
    """What one SSE stream carried (times are the caller's clock, when a line arrived)."""

    text: str = ""
    #: When the first and the last non-empty piece of text arrived.
    t_first: float | None = None
    t_last: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    #: ``usage``, ``timings`` or ``chunks``: where ``completion_tokens`` came from.
    tokens_from: str | None = None
    content_chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    #: meshd's constraint counters (None: unconstrained, or a server without them).
    grammar: GrammarStats | None = None
    #: When each non-empty piece of text arrived (``t_first`` .. ``t_last``).
    piece_times: tuple[float, ...] = ()


def _piece(choice: Mapping[str, Any]) -> str:
    """A choice's text: ``delta.content`` (chat) or ``text`` (completions)."""
    delta = choice.get("delta")
    if isinstance(delta, Mapping):
        content = delta.get("content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def parse_sse(lines: Iterable[tuple[float, bytes]],
              on_piece: Callable[[float], None] | None = None) -> StreamResult:
    """Read ``data:`` records (each with the time its line arrived) up to ``[DONE]``;
    ``on_piece`` is called with the time of each non-empty piece of text as it comes."""
    parts: list[str] = []
    times: list[float] = []
    t_first = t_last = None
    chunks = 0
    usage: Mapping[str, Any] | None = None
    predicted_n: int | None = None
    finish: str | None = None
    error: str | None = None
    grammar: GrammarStats | None = None
    for t, raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, event names
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        try:
            record = json.loads(data)
        except ValueError:
            error = f"not JSON: {data[:200]!r}"
            break
        if not isinstance(record, Mapping):
            continue
        if "error" in record:
            error = json.dumps(record["error"])[:500]
            break
        if isinstance(record.get("usage"), Mapping):
            usage = record["usage"]
        timings = record.get("timings")
        if isinstance(timings, Mapping) and isinstance(timings.get("predicted_n"), int):
            predicted_n = timings["predicted_n"]
        grammar = _grammar(record) or grammar
        for choice in record.get("choices") or ():
            if not isinstance(choice, Mapping):
                continue
            piece = _piece(choice)
            if piece:
                parts.append(piece)
                times.append(t)
                chunks += 1
                t_first = t if t_first is None else t_first
                t_last = t
                if on_piece is not None:
                    on_piece(t)
            if choice.get("finish_reason"):
                finish = str(choice["finish_reason"])
    tokens, source = _token_count(usage, predicted_n, chunks)
    prompt = usage.get("prompt_tokens") if usage is not None else None
    return StreamResult(
        text="".join(parts), t_first=t_first, t_last=t_last, completion_tokens=tokens,
        prompt_tokens=prompt if isinstance(prompt, int) else None, tokens_from=source,
        content_chunks=chunks, finish_reason=finish, error=error, grammar=grammar,
        piece_times=tuple(times))


def _grammar(record: Mapping[str, Any]) -> GrammarStats | None:
    """The constraint counters of a record's ``meshd`` block (meshd's finish chunk)."""
    block = record.get("meshd")
    return GrammarStats.from_extra(block.get("extra")) if isinstance(block, Mapping) \
        else None


def _token_count(usage: Mapping[str, Any] | None, predicted_n: int | None, chunks: int,
                 ) -> tuple[int | None, str | None]:
    if usage is not None and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"]), "usage"
    if predicted_n is not None:
        return predicted_n, "timings"
    return (chunks, "chunks") if chunks else (None, None)


@attrs.frozen
class RequestRecord:
    """One request of one run: when it was sent and what its stream said (seconds on
    the run's clock, 0 = when the run began)."""

    client: int
    prompt_tag: str
    t_sent: float
    result: StreamResult

    @property
    def ttft_s(self) -> float | None:
        t = self.result.t_first
        return None if t is None else t - self.t_sent

    @property
    def decode_tok_s(self) -> float | None:
        r = self.result
        return decode_rate(r.completion_tokens, r.t_first, r.t_last)

    def as_dict(self) -> dict[str, Any]:
        r = self.result
        return {"client": self.client, "prompt_tag": self.prompt_tag, "t_sent": self.t_sent,
                "t_first": r.t_first, "t_last": r.t_last, "ttft_s": self.ttft_s,
                "decode_tok_s": self.decode_tok_s, "completion_tokens": r.completion_tokens,
                "prompt_tokens": r.prompt_tokens, "tokens_from": r.tokens_from,
                "content_chunks": r.content_chunks, "finish_reason": r.finish_reason,
                "error": r.error, "text": r.text,
                "grammar": None if r.grammar is None else attrs.asdict(r.grammar)}


def decode_rate(tokens: int | None, t_first: float | None, t_last: float | None,
                ) -> float | None:
    """``(tokens - 1) / (t_last - t_first)``; ``None`` when it is not defined (one
    token, or all text in one chunk)."""
    if tokens is None or tokens < 2 or t_first is None or t_last is None \
            or t_last <= t_first:
        return None
    return (tokens - 1) / (t_last - t_first)


def grammar_per_token(records: Sequence[RequestRecord],
                      ) -> tuple[float, float, float] | None:
    """``(sum forced_accepted, sum grammar_ms, sum copy_accepted)`` over the tokens of
    the requests whose answer carried meshd's constraint counters (None: none did): what
    share of the answer the constraint forced, what choosing under it cost per token,
    and what share meshd copied from the prompt into string values."""
    carried = [(g, r.result.completion_tokens) for r in records
               if (g := r.result.grammar) is not None and r.result.error is None]
    tokens = sum(n or 0 for _, n in carried)
    if not carried or tokens <= 0:
        return None
    return (sum(g.forced_accepted for g, _ in carried) / tokens,
            sum(g.grammar_ms for g, _ in carried) / tokens,
            sum(g.copy_accepted for g, _ in carried) / tokens)


def median_or_none(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None (None if there are none)."""
    good = [v for v in values if v is not None]
    return statistics.median(good) if good else None


def gaps_within(times: Sequence[float], start: float, end: float) -> list[float]:
    """The waits between consecutive arrivals ``times`` that overlap ``(start, end)``:
    what a streaming client waited for text while something else happened (a wait that
    began before ``start`` or ended after ``end`` counts whole)."""
    return [b - a for a, b in itertools.pairwise(times) if b > start and a < end]


def decode_tokens_and_span(records: Sequence[RequestRecord]) -> tuple[int, float] | None:
    """``sum(tokens_i - 1)`` and ``max t_last - min t_first`` over requests served
    together (``None`` if any of them failed, or nothing was decoded)."""
    rs = [r.result for r in records]
    if not rs or any(r.error is not None or r.completion_tokens is None
                     or r.t_first is None or r.t_last is None for r in rs):
        return None
    span = max(r.t_last for r in rs if r.t_last is not None) \
        - min(r.t_first for r in rs if r.t_first is not None)
    total = sum(max(0, (r.completion_tokens or 0) - 1) for r in rs)
    return (total, span) if span > 0 and total > 0 else None


def answer_tokens_and_span(records: Sequence[RequestRecord]) -> tuple[int, float] | None:
    """``sum(tokens_i)`` and ``max t_last - min t_sent`` over requests served together:
    the answers' tokens over the time their clients waited for them, prompts included
    (``None`` if any of them failed). Beside the decode span, which starts at the first
    text of any: a server that gives some clients their first text early and prefills
    the others between their decode steps starts that clock early."""
    if not records or any(r.result.error is not None or r.result.completion_tokens is None
                          or r.result.t_last is None for r in records):
        return None
    span = max(r.result.t_last for r in records if r.result.t_last is not None) \
        - min(r.t_sent for r in records)
    total = sum(r.result.completion_tokens or 0 for r in records)
    return (total, span) if span > 0 and total > 0 else None


def aggregate_decode_rate(records: Sequence[RequestRecord]) -> float | None:
    """``sum(tokens_i - 1) / (max t_last - min t_first)`` over requests served together
    (``None`` if any of them failed)."""
    decoded = decode_tokens_and_span(records)
    return None if decoded is None else decoded[0] / decoded[1]


def _timed_lines(resp: http.client.HTTPResponse, stop: threading.Event | None = None,
                 ) -> Iterator[tuple[float, bytes]]:
    """The response's lines with their arrival times; with ``stop``, the reading ends
    after the first line read once it is set (the connection is closed, and the server
    abandons the request)."""
    while line := resp.readline():
        yield time.perf_counter(), line
        if stop is not None and stop.is_set():
            return


def stream_request(port: int, path: str, body: Mapping[str, Any], *,
                   start: threading.Barrier | None = None,
                   timeout: float = REQUEST_TIMEOUT_S,
                   on_piece: Callable[[float], None] | None = None,
                   stop: threading.Event | None = None) -> tuple[float, StreamResult]:
    """POST ``body`` to ``127.0.0.1:port`` and read its stream; returns the
    ``perf_counter`` time it was sent and what came back. With ``start``, the connection
    is opened first and the request sent when every client's is open. ``on_piece``: see
    :func:`parse_sse`; ``stop``: hang up after the next line once it is set (the result
    is what came until then)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t_sent = time.perf_counter()
    try:
        try:
            conn.connect()
        finally:
            if start is not None:
                start.wait(timeout)
        t_sent = time.perf_counter()
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json",
                              "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            return t_sent, StreamResult(error=f"HTTP {resp.status}: {resp.read()[:500]!r}")
        return t_sent, parse_sse(_timed_lines(resp, stop), on_piece)
    except (OSError, http.client.HTTPException, threading.BrokenBarrierError) as exc:
        return t_sent, StreamResult(error=f"{type(exc).__name__}: {exc}")
    finally:
        conn.close()


def run_clients(port: int, path: str, bodies: Sequence[Mapping[str, Any]], *,
                tags: Sequence[str], timeout: float = REQUEST_TIMEOUT_S,
                ) -> list[RequestRecord]:
    """Every body at once, one thread and connection each, released together.

    Interrupted (Ctrl-C, SIGTERM), it does not wait for the streams: the caller's
    cleanup stops the server, which ends them."""
    start = threading.Barrier(len(bodies))
    pool = ThreadPoolExecutor(max_workers=len(bodies))
    try:
        futures = [pool.submit(stream_request, port, path, b, start=start, timeout=timeout)
                   for b in bodies]
        results = [f.result() for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return records_from(results, tags)


def records_from(results: Sequence[tuple[float, StreamResult]], tags: Sequence[str],
                 ) -> list[RequestRecord]:
    """:func:`stream_request`'s answers as one run's records, client ``i`` the ``i``-th,
    their times on the run's clock (0 = the first request sent)."""
    t0 = min(t for t, _ in results)
    return [RequestRecord(i, tags[i], t - t0, _shifted(r, t0))
            for i, (t, r) in enumerate(results)]


def _shifted(r: StreamResult, t0: float) -> StreamResult:
    """``r`` with its times on the run's clock (0 = the first request sent)."""
    return attrs.evolve(r, t_first=None if r.t_first is None else r.t_first - t0,
                        t_last=None if r.t_last is None else r.t_last - t0,
                        piece_times=tuple(t - t0 for t in r.piece_times))
