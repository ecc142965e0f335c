"""The scenes of ``meshd bench-e2e`` (:mod:`.e2e`): request sequences whose timing is
what a user notices, where a steady decode rate says nothing.

Why apart from the workloads: a workload is one request shape that N clients send at
once; a scene orders its requests (a long prompt sent while others stream, a chat whose
every turn resends its history), and its figures are waits, not rates. Each scene runs
on its own servers, started like every other arm's (:func:`.e2e._start_servers`:
defaults, clean environment, time to ready), with as many slots as it has clients at
once and a context raised to hold its longest request; arms are interleaved per
repetition. Named with ``--workload``:

* ``long-prompt``: a document of ``--prompt-tokens`` tokens (this repository's
  documentation, cut to length with the model's own tokenizer; no network) after a
  one-line instruction. Each repetition sends it alone (its TTFT: the prefill as a
  client waits for it), then again, with a new tag, once ``--bystanders`` streaming
  clients (a short prompt, a long answer) have received their first text. Per
  bystander: the longest and the median wait between two arrivals of its text that
  overlap the long prompt's prefill (from sending it to its first text; a wait that
  straddles either end counts whole), and the long prompt's TTFT beside them. A
  bystander hangs up at its first text after the long prompt's first text (the server
  abandons it); then the server must be quiet (its CPU time, ``/proc``) before the
  next run. A bystander that ended before the long prompt's first text is reported
  ``covered: false``: its waits miss the end of the prefill.
* ``multi-turn``: ``--chats`` chats, interleaved turn by turn (chat 1 turn 1, chat 2
  turn 1, chat 1 turn 2, ...), one request at a time, each under the same system
  prompt of ``--system-tokens`` tokens (the same documentation). Turn k sends the
  whole history, the server's own answers included, plus a new user message, as
  OpenAI clients do; each chat's first user message carries its tag, so no chat can
  reuse another's history, only the system prompt. TTFT per turn, the median over
  chats and repetitions: turns 2..N show what a server keeps of a conversation
  (meshd's prefix cache, llama-server's slots and ``cache_prompt``).

Ratios are meshd's figure over the other arm's: every figure here is a time, so below
1.00x meshd is faster (a shorter wait). The options of the scenes, of the busy machine
(``--busy``) and of start-up (``--start-timeout``) are here too, and the time-to-ready
ratios every block reports.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final

import attrs

from meshd.clients.argtypes import non_negative, positive, positive_seconds
from meshd.native.llama import ensure_backend, lc
from meshd.native.model import meta_value
from meshd.native.tokenizer import Tokenizer

from .e2e_arms import MAIN_ARM, E2eArm, E2eConfig, ModelUnderTest, prompt_tag, request_body
from .llama_server import ARM_PREFIX
from .processes import ServerProcess, check_alive
from .stream_client import (
    RequestRecord,
    gaps_within,
    median_or_none,
    records_from,
    run_clients,
    stream_request,
)
from .workloads import BenchError, Workload

__all__ = ["SCENE_NAMES", "LongPromptScene", "MultiTurnScene", "Scene", "TokenCounter",
           "add_scene_arguments", "document_text", "make_scene", "ready_ratios", "run_scene",
           "scene_options", "scene_ratios", "token_counter"]

LONG_PROMPT: Final = "long-prompt"
MULTI_TURN: Final = "multi-turn"
SCENE_NAMES: Final = (LONG_PROMPT, MULTI_TURN)

#: The repository's text the long prompts are made of (the docs, then each package's
#: README: what an installed package ships), relative to the package root.
_ROOT: Final = Path(__file__).resolve().parent.parent
#: Tokens beyond a scene's own text that a request may take: the template, the
#: instruction, the tag.
TEMPLATE_MARGIN: Final = 128
#: A bystander's request: a short prompt whose answer does not end soon.
BYSTANDER: Final = Workload(
    "bystander", "short prompt, long answer",
    (("user", "Count from 1 to 10000, one number per line, and write nothing else."),))
LONG_INSTRUCTION: Final = "Summarise the following documentation in three sentences.\n\n"
SYSTEM_INSTRUCTION: Final = ("You are the assistant of the meshd project. Answer questions "
                             "about its documentation below, briefly.\n\n")
#: The user's messages of a chat, turn by turn (then the last again).
QUESTIONS: Final = (
    "What is meshd, in one paragraph?",
    "How do I start the daemon, and which options matter most?",
    "How does it compare with llama-server?",
    "What does its prefix cache keep between requests?",
    "Which of these would you change first, and why?",
)
#: Seconds a server gets to become quiet after a run (hung-up bystanders abandoned).
QUIET_TIMEOUT_S: Final = 30.0


# --------------------------------------------------------------------------- text


@attrs.frozen
class TokenCounter:
    """Counts a text's tokens (no special tokens); ``trained_ctx``: the model's training
    context (0: not in its metadata)."""

    tokenizer: Tokenizer
    trained_ctx: int

    def __call__(self, text: str) -> int:
        return len(self.tokenizer.tokenize(text, add_special=False))


@contextlib.contextmanager
def token_counter(model: Path) -> Iterator[TokenCounter]:
    """A function counting a text's tokens in ``model``'s vocabulary (no special
    tokens), with the model's training context: llama.cpp's vocabulary-only load, no
    weights, a fraction of a second."""
    ensure_backend()
    params = lc.llama_model_default_params()
    params.vocab_only = True
    handle = lc.llama_model_load_from_file(str(model).encode(), params)
    if not handle:
        raise BenchError(f"cannot read the vocabulary of {model}")
    vocab = lc.llama_model_get_vocab(handle)
    tokenizer = Tokenizer(vocab, lc.llama_vocab_n_tokens(vocab), False)
    try:
        arch = meta_value(handle, "general.architecture") or ""
        trained = meta_value(handle, f"{arch}.context_length") or "0"
        yield TokenCounter(tokenizer, int(trained) if trained.isdigit() else 0)
    finally:
        tokenizer.close()
        lc.llama_model_free(handle)


def _corpus() -> str:
    """The repository's documentation, one file after another."""
    files = [*sorted((_ROOT / "docs").glob("*.md")), *sorted(_ROOT.glob("*/README.md"))]
    texts = [f.read_text(encoding="utf-8", errors="replace").strip() for f in files]
    corpus = "\n\n".join(t for t in texts if t)
    if not corpus:
        raise BenchError(f"no documentation under {_ROOT} to build a long prompt from")
    return corpus


def document_text(n_tokens: int, count: Callable[[str], int]) -> tuple[str, int]:
    """A text of about ``n_tokens`` tokens (within 1%, cut at a word's end) from the
    repository's documentation, repeated if it is shorter; and its exact count."""
    base = _corpus()
    corpus, total = base, count(base)
    while total < n_tokens:
        corpus = f"{corpus}\n\n{base}"
        total = count(corpus)
    # Interpolation within a bracket that only narrows: the tokens per character vary
    # (a table of figures tokenizes far denser than prose), so a step from the origin
    # can swing between two sides of the goal.
    lo, lo_got, hi, hi_got = 0, 0, len(corpus), total
    text, got = corpus, total
    for _ in range(24):
        chars = lo + max(1, (hi - lo) * (n_tokens - lo_got) // max(hi_got - lo_got, 1))
        cut = corpus.rfind(" ", 0, min(chars, hi - 1) + 1)
        text = corpus[:cut if cut > lo else chars].rstrip()
        got = count(text)
        if abs(got - n_tokens) <= max(4, n_tokens // 100):
            break
        if got < n_tokens:
            lo, lo_got = max(lo + 1, len(text)), got
        else:
            hi, hi_got = min(hi - 1, len(text)), got
        if hi <= lo:
            break
    return text, got


# --------------------------------------------------------------------------- scenes


class Scene(abc.ABC):
    """One scene on one model: its servers' shape, its runs, its figures."""

    name: str
    #: Figures of an arm's summary that get a ratio (meshd's over each arm's).
    ratio_keys: tuple[str, ...] = ()

    def __init__(self, mut: ModelUnderTest, cfg: E2eConfig) -> None:
        self.mut = mut
        self.cfg = cfg

    @property
    @abc.abstractmethod
    def clients(self) -> int:
        """Requests served at once: the servers' slots."""

    @property
    @abc.abstractmethod
    def ctx(self) -> int:
        """Context per session that holds the scene's longest request."""

    @property
    def warm_up(self) -> Workload:
        return BYSTANDER

    @abc.abstractmethod
    def run(self, server: ServerProcess, arm: str, rep: int) -> dict[str, Any]:
        """One repetition on one arm's server (JSON-ready)."""

    @abc.abstractmethod
    def summary(self, runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """An arm's medians over its runs (with the runs)."""

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """What the scene sent (for the report's heading)."""

    @abc.abstractmethod
    def run_text(self, run: Mapping[str, Any]) -> str:
        """One line of progress for a run."""


def scene_ratios(summaries: Mapping[str, Mapping[str, Any]], keys: Sequence[str],
                 ) -> dict[str, dict[str, float | None]]:
    """Per other arm, per figure: meshd's over the arm's (a time: below 1, meshd's is
    shorter). A key ``a.b`` reads ``summary[a][b]``; ``a.N.b`` a list's N-th item."""
    main = summaries.get(MAIN_ARM)
    if main is None:
        return {}
    out: dict[str, dict[str, float | None]] = {}
    for arm, s in summaries.items():
        if arm == MAIN_ARM:
            continue
        ratios: dict[str, float | None] = {}
        for key in keys:
            mine, theirs = _get(main, key), _get(s, key)
            ratios[key] = mine / theirs if mine is not None and theirs else None
        out[arm] = ratios
    return out


def ready_ratios(started: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Each meshd arm's time to ready over plain llama-server's (below 1: sooner)."""
    peer = started.get(ARM_PREFIX, {}).get("ready_s")
    if not peer:
        return {}
    return {name: info["ready_s"] / peer for name, info in started.items()
            if name.startswith("meshd") and info.get("ready_s") is not None}


def _get(value: Any, key: str) -> float | None:
    for part in key.split("."):
        if isinstance(value, Mapping):
            value = value.get(part)
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return float(value) if isinstance(value, int | float) else None


class LongPromptScene(Scene):
    """A long prompt alone, then beside streaming bystanders (see the module's doc)."""

    name = LONG_PROMPT

    def __init__(self, mut: ModelUnderTest, cfg: E2eConfig, document: str,
                 document_tokens: int, *, trained_ctx: int = 0) -> None:
        super().__init__(mut, cfg)
        self.document = document
        self.document_tokens = document_tokens
        self.trained_ctx = trained_ctx
        self.long = Workload(LONG_PROMPT, "a long document to summarise",
                             (("user", LONG_INSTRUCTION + document),))
        self.ratio_keys = ("ttft_alone_s", "ttft_beside_s", *(
            f"bystanders.{i}.{k}" for i in range(cfg.bystanders)
            for k in ("max_gap_s", "median_gap_s")))

    @property
    def clients(self) -> int:
        return self.cfg.bystanders + 1

    @property
    def ctx(self) -> int:
        return max(self.cfg.ctx, self.document_tokens + TEMPLATE_MARGIN + self.cfg.tokens)

    @property
    def bystander_tokens(self) -> int:
        """As long an answer as the context holds (and the model was trained for): it
        must outlast the prefill."""
        ctx = min(self.ctx, self.trained_ctx) if self.trained_ctx > 0 else self.ctx
        return ctx - TEMPLATE_MARGIN

    def describe(self) -> dict[str, Any]:
        return {"scene": self.name, "document_tokens": self.document_tokens,
                "bystanders": self.cfg.bystanders, "ctx": self.ctx,
                "bystander_max_tokens": self.bystander_tokens}

    def _body(self, workload: Workload, tag: str, tokens: int) -> dict[str, Any]:
        return request_body(self.mut, workload, tag, tokens)

    def run(self, server: ServerProcess, arm: str, rep: int) -> dict[str, Any]:
        cfg = self.cfg
        # Alone: the tag of client 1; beside: the tag after the bystanders' (new prompt).
        tag = prompt_tag(rep, 0)
        (alone,) = run_clients(server.port, self.mut.path,
                               [self._body(self.long, tag, cfg.tokens)], tags=[tag],
                               timeout=cfg.timeout_s)
        quiet_alone = server.wait_quiet(QUIET_TIMEOUT_S)
        long_rec, bystanders = self._beside(server.port, rep)
        quiet = server.wait_quiet(QUIET_TIMEOUT_S)
        window = (long_rec.t_sent, long_rec.result.t_first)
        return {
            "arm": arm, "rep": rep, "ttft_alone_s": alone.ttft_s,
            "ttft_beside_s": long_rec.ttft_s,
            "prompt_tokens": long_rec.result.prompt_tokens or alone.result.prompt_tokens,
            "bystanders": [_bystander_figures(b, *window) for b in bystanders],
            "quiet_after": quiet_alone and quiet,
            "alone": alone.as_dict(), "beside": long_rec.as_dict(),
            "bystander_requests": [b.as_dict() for b in bystanders],
        }

    def _beside(self, port: int, rep: int) -> tuple[RequestRecord, list[RequestRecord]]:
        """The bystanders started; once each has text, the long prompt sent; each
        bystander hangs up at its first text after the long prompt's first text (or
        after the long request ended, should it fail)."""
        cfg, path, n = self.cfg, self.mut.path, self.cfg.bystanders
        started = [threading.Event() for _ in range(n)]
        stops = [threading.Event() for _ in range(n)]
        long_first: list[float] = []
        long_over = threading.Event()

        def bystander_piece(i: int) -> Callable[[float], None]:
            def on_piece(t: float) -> None:
                started[i].set()
                if (long_first and t > long_first[0]) or long_over.is_set():
                    stops[i].set()
            return on_piece

        def long_piece(t: float) -> None:
            if not long_first:
                long_first.append(t)

        tags = [prompt_tag(rep, c) for c in range(n + 1)]
        pool = ThreadPoolExecutor(max_workers=n + 1)
        try:
            futures = [pool.submit(stream_request, port, path,
                                   self._body(BYSTANDER, tags[i], self.bystander_tokens),
                                   timeout=cfg.timeout_s, on_piece=bystander_piece(i),
                                   stop=stops[i]) for i in range(n)]
            deadline = time.monotonic() + cfg.timeout_s
            for i, future in enumerate(futures):
                while not started[i].wait(0.02) and not future.done():
                    if time.monotonic() > deadline:
                        break
            long_future = pool.submit(stream_request, port, path,
                                      self._body(self.long, tags[n], cfg.tokens),
                                      timeout=cfg.timeout_s, on_piece=long_piece)
            long_result = long_future.result()
            long_over.set()
            results = [f.result() for f in futures]
        finally:
            long_over.set()
            for stop in stops:  # an error here: every bystander hangs up
                stop.set()
            pool.shutdown(wait=False, cancel_futures=True)
        records = records_from([*results, long_result], tags)
        return records[n], records[:n]

    def summary(self, runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        per_bystander = []
        for i in range(self.cfg.bystanders):
            figures = [r["bystanders"][i] for r in runs if len(r["bystanders"]) > i]
            per_bystander.append({
                "max_gap_s": median_or_none(f["max_gap_s"] for f in figures),
                "median_gap_s": median_or_none(f["median_gap_s"] for f in figures),
                "covered": bool(figures) and all(f["covered"] for f in figures),
                "errors": [f["error"] for f in figures if f["error"]]})
        return {
            "ttft_alone_s": median_or_none(r["ttft_alone_s"] for r in runs),
            "ttft_beside_s": median_or_none(r["ttft_beside_s"] for r in runs),
            "prompt_tokens": median_or_none(r["prompt_tokens"] for r in runs),
            "bystanders": per_bystander,
            "failed_runs": sum(r["ttft_alone_s"] is None or r["ttft_beside_s"] is None
                               for r in runs),
            "quiet_after": all(r["quiet_after"] for r in runs),
            "runs": list(runs),
        }

    def run_text(self, run: Mapping[str, Any]) -> str:
        gaps = ", ".join(_ms(b["max_gap_s"]) for b in run["bystanders"])
        return (f"TTFT alone {_ms(run['ttft_alone_s'])} ms, beside {_ms(run['ttft_beside_s'])}"
                f" ms; bystanders' longest wait {gaps} ms")


def _bystander_figures(record: RequestRecord, start: float, end: float | None,
                       ) -> dict[str, Any]:
    """A bystander's waits between arrivals of text during ``(start, end)``."""
    r = record.result
    gaps = [] if end is None else gaps_within(r.piece_times, start, end)
    return {"client": record.client, "max_gap_s": max(gaps) if gaps else None,
            "median_gap_s": median_or_none(gaps), "gaps": len(gaps),
            "covered": end is not None and any(t >= end for t in r.piece_times),
            "pieces": len(r.piece_times), "error": r.error}


class MultiTurnScene(Scene):
    """Chats interleaved turn by turn, each turn resending its history (module doc)."""

    name = MULTI_TURN

    def __init__(self, mut: ModelUnderTest, cfg: E2eConfig, system: str,
                 system_tokens: int) -> None:
        super().__init__(mut, cfg)
        self.system = SYSTEM_INSTRUCTION + system
        self.system_tokens = system_tokens
        self.ratio_keys = tuple(f"turns.{t}.ttft_s" for t in range(cfg.turns))

    @property
    def clients(self) -> int:
        return self.cfg.chats

    @property
    def ctx(self) -> int:
        per_turn = self.cfg.tokens + 64  # a question, its answer, the template's marks
        return max(self.cfg.ctx,
                   self.system_tokens + TEMPLATE_MARGIN + self.cfg.turns * per_turn)

    def describe(self) -> dict[str, Any]:
        return {"scene": self.name, "chats": self.cfg.chats, "turns": self.cfg.turns,
                "system_tokens": self.system_tokens, "ctx": self.ctx}

    def run(self, server: ServerProcess, arm: str, rep: int) -> dict[str, Any]:
        cfg = self.cfg
        history: list[list[tuple[str, str]]] = [[] for _ in range(cfg.chats)]
        turns: list[list[dict[str, Any]]] = []
        for turn in range(cfg.turns):
            row = []
            question = QUESTIONS[min(turn, len(QUESTIONS) - 1)]
            for chat in range(cfg.chats):
                tag = prompt_tag(rep, chat)
                messages = (("system", self.system), *history[chat], ("user", question))
                workload = Workload(MULTI_TURN, "", messages)
                (rec,) = run_clients(server.port, self.mut.path,
                                     [request_body(self.mut, workload, tag, cfg.tokens)],
                                     tags=[tag], timeout=cfg.timeout_s)
                history[chat] += [("user", question), ("assistant", rec.result.text)]
                row.append({"chat": chat, **rec.as_dict()})
            turns.append(row)
        return {"arm": arm, "rep": rep, "turns": turns,
                "ttft_s": [median_or_none(q["ttft_s"] for q in row) for row in turns]}

    def summary(self, runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        turns = []
        for t in range(self.cfg.turns):
            reqs = [q for r in runs for q in r["turns"][t]]
            turns.append({"turn": t + 1,
                          "ttft_s": median_or_none(q["ttft_s"] for q in reqs),
                          "prompt_tokens": median_or_none(q["prompt_tokens"] for q in reqs),
                          "completion_tokens": median_or_none(q["completion_tokens"]
                                                              for q in reqs),
                          "failed": sum(q["error"] is not None or q["ttft_s"] is None
                                        for q in reqs)})
        return {"turns": turns, "failed_runs": sum(
            any(q["error"] is not None for row in r["turns"] for q in row) for r in runs),
            "runs": list(runs)}

    def run_text(self, run: Mapping[str, Any]) -> str:
        return "TTFT per turn " + " / ".join(_ms(t) for t in run["ttft_s"]) + " ms"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f}"


def make_scene(name: str, mut: ModelUnderTest, cfg: E2eConfig) -> Scene:
    """The scene ``name`` on ``mut``, its text cut to length in the model's tokens."""
    with token_counter(mut.spec.path) as count:
        if name == LONG_PROMPT:
            text, n = document_text(cfg.prompt_tokens, count)
            _check_fits(mut, n + cfg.tokens, count.trained_ctx, "--prompt-tokens")
            return LongPromptScene(mut, cfg, text, n, trained_ctx=count.trained_ctx)
        if name == MULTI_TURN:
            text, n = document_text(cfg.system_tokens, count)
            _check_fits(mut, n + cfg.turns * cfg.tokens, count.trained_ctx,
                        "--system-tokens or --turns")
            return MultiTurnScene(mut, cfg, text, n)
    raise BenchError(f"unknown scene {name!r}; known: {', '.join(SCENE_NAMES)}")


def _check_fits(mut: ModelUnderTest, tokens: int, trained_ctx: int, option: str) -> None:
    """A scene whose requests outgrow the model's training context would only measure
    the servers' refusals: say so before any server starts."""
    if 0 < trained_ctx < tokens:
        raise BenchError(
            f"{mut.spec.name} was trained for a {trained_ctx}-token context; this scene's "
            f"longest request needs more than {tokens} (the text and its answers, "
            f"--tokens each): lower {option}")


def run_scene(scene: Scene, arms: Sequence[E2eArm], servers: dict[str, ServerProcess],
              unavailable: dict[str, str], log: Callable[[str], None]) -> dict[str, Any]:
    """Every repetition of the scene on every server arm, interleaved (A B C A B C ...);
    each arm's medians and meshd's ratios to the others."""
    cfg = scene.cfg
    names = {a.name for a in arms}
    not_run = {n: why for n, why in unavailable.items() if n not in names}
    active = []
    for arm in arms:
        if arm.name in unavailable:
            not_run[arm.name] = unavailable[arm.name]
        elif arm.name in servers:
            active.append(arm)
        else:
            not_run[arm.name] = "a scene runs on servers only" if arm.kind == "generate" \
                else "runs only on workloads that copy their prompt or constrain the answer"
    runs: dict[str, list[dict[str, Any]]] = {a.name: [] for a in active}
    for rep in range(cfg.reps):
        for arm in active:
            if arm.name in unavailable:
                continue  # its server died in an earlier run
            run = scene.run(servers[arm.name], arm.name, rep)
            check_alive(arm.name, servers, unavailable)
            runs[arm.name].append(run)
            log(f"  {scene.mut.spec.name} {scene.name} {arm.name} rep {rep + 1}: "
                f"{scene.run_text(run)}")
    summaries = {name: scene.summary(rs) for name, rs in runs.items()}
    for name in summaries:
        if name in unavailable:
            summaries[name]["error"] = unavailable[name]
    return {**scene.describe(), "reps": cfg.reps, "tokens": cfg.tokens, "arms": summaries,
            "not_run": not_run, "meshd_over": scene_ratios(summaries, scene.ratio_keys)}


# --------------------------------------------------------------------------- command


def add_scene_arguments(p: argparse.ArgumentParser) -> None:
    """``meshd bench-e2e``'s options for the scenes, the busy machine and start-up."""
    p.add_argument("--start-timeout", type=positive_seconds, default=180.0, metavar="S",
                   help="give up on a server that is not ready (/health 200) after this long")
    p.add_argument("--prompt-tokens", type=positive, default=3000, metavar="N",
                   help="long-prompt scene: the document's length in the model's tokens")
    p.add_argument("--bystanders", type=positive, default=1, metavar="N",
                   help="long-prompt scene: streaming clients already decoding when the "
                        "long prompt is sent")
    p.add_argument("--chats", type=positive, default=2, metavar="N",
                   help="multi-turn scene: chats interleaved turn by turn")
    p.add_argument("--turns", type=positive, default=4, metavar="N",
                   help="multi-turn scene: turns per chat")
    p.add_argument("--system-tokens", type=positive, default=1000, metavar="N",
                   help="multi-turn scene: the system prompt's length in tokens")
    p.add_argument("--busy", type=non_negative, default=0, metavar="N",
                   help="run N 'python -c \"while True: pass\"' processes beside the "
                        "servers for the whole measurement (killed after)")


def scene_options(args: argparse.Namespace) -> dict[str, Any]:
    """Those options as :class:`E2eConfig` fields."""
    return {"start_timeout_s": args.start_timeout, "prompt_tokens": args.prompt_tokens,
            "bystanders": args.bystanders, "chats": args.chats, "turns": args.turns,
            "system_tokens": args.system_tokens, "busy": args.busy}
