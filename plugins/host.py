"""The daemon's side of out-of-process proposer plugins: links, rules, quarantine, restart.

Why this shape: a plugin process is untrusted and may be slow, wrong, crashed or
malicious, yet it must never change the output or stall the daemon. So a plugin is only
ever *asked* (``propose`` with an absolute deadline, from the engine's worker thread),
every answer is validated, and whatever goes wrong is a counted, logged fault:

- ``late``: no answer by the deadline; decoding goes on without a draft (a late answer
  that turns up later is discarded as ``stale``);
- ``empty``, ``oversize``, ``negative``, ``out_of_vocab``: the proposal is discarded;
- ``plugin_error``: the plugin's own code raised (the SDK reports it);
- ``garbage`` (not a plugin message, or an over-long frame), ``flood`` (more than
  ``MAX_STALE_PER_STEP`` answers to other steps while one is awaited), ``disconnected``
  (exited, crashed, closed), ``hung`` (stopped reading): the link is closed.

Each fault is a strike; after ``max_faults`` strikes the plugin is quarantined: its
link is closed (a spawned process is killed) for a backoff that doubles each time. A
spawned plugin is then restarted (on a thread the host owns), a connecting one may
connect again. Proposals never bypass verification: the engine verifies whatever is
proposed, so output is identical whatever a plugin does. Plugins see token ids; the
prompt's text only where the config says ``allow_prompt_text``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import structlog

from meshd.protocol.plugin import (
    PLUGIN_PROTOCOL_VERSION,
    Abstain,
    Begin,
    End,
    PluginError,
    PluginHello,
    PluginMessage,
    PluginProtocolError,
    PluginReject,
    PluginWelcome,
    Propose,
    Ready,
    Tokenize,
    Tokenized,
)
from meshd.protocol.plugin import (
    Outcome as WireOutcome,
)
from meshd.protocol.plugin import (
    Proposal as WireProposal,
)
from meshd.protocol.plugin_channel import ChannelClosed, PluginChannel, SendTimeout

from .base import Capabilities, ModelDescription, Outcome, Proposal, ProposalRequest, ProposerEnv
from .config import PluginConfig
from .resources import Need, TokenizerLike, requires

log = structlog.get_logger("meshd.plugins.host")

#: Faults that end the link (nothing more from it can be trusted).
FATAL = frozenset({"garbage", "disconnected", "hung", "flood"})
#: Answers to other steps tolerated while waiting for one answer (more is flooding).
MAX_STALE_PER_STEP = 64
#: Valid answers in a row after which earlier strikes are forgiven (strikes are not
#: reset by a restart, so a plugin that crashes on every request is still quarantined).
CLEAN_RUN = 32
#: How long a plugin has for its set-up (hello .. ready).
SETUP_TIMEOUT_S = 10.0
#: Set-up texts a plugin may ask to tokenize, in characters.
MAX_TOKENIZE_CHARS = 8 << 20

_ids = itertools.count(1)


class PluginRefused(Exception):
    """A plugin's set-up failed (bad hello, unknown name, timeout); the message says why."""


@attrs.define
class PluginCounters:
    """Per-plugin figures (``stats`` counters ``plugin.NAME.*``)."""

    proposals: int = 0
    abstains: int = 0
    faults: collections.Counter[str] = attrs.field(factory=collections.Counter)
    stale: int = 0
    quarantines: int = 0
    starts: int = 0
    restarts: int = 0

    def flat(self, name: str) -> dict[str, int]:
        out = {f"plugin.{name}.{k}": v for k, v in (
            ("proposals", self.proposals), ("abstains", self.abstains),
            ("stale", self.stale), ("quarantines", self.quarantines),
            ("starts", self.starts), ("restarts", self.restarts),
        )}
        out.update({f"plugin.{name}.faults.{k}": v for k, v in sorted(self.faults.items())})
        return out


class Link:
    """One live, set-up connection to a plugin process (spawned or connected)."""

    def __init__(self, channel: PluginChannel, hello: PluginHello,
                 process: subprocess.Popen[bytes] | None = None) -> None:
        self.channel = channel
        self.hello = hello
        self.process = process
        self.id = next(_ids)
        self.lock = threading.Lock()
        caps = hello.capabilities.get("max_len", 16)
        self.max_len = caps if isinstance(caps, int) and not isinstance(caps, bool) else 16

    def close(self) -> None:
        self.channel.close()
        proc = self.process
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)


def handshake(channel: PluginChannel, hello: PluginHello, *, model: ModelDescription,
              eog: Sequence[int], options: dict[str, Any],
              tokenizer: TokenizerLike | None) -> None:
    """Welcome a plugin and serve its set-up (``tokenize`` .. ``ready``); raises
    PluginRefused, ChannelClosed, SendTimeout or PluginProtocolError."""
    if hello.plugin_protocol_version != PLUGIN_PROTOCOL_VERSION:
        why = (f"daemon speaks plugin protocol {PLUGIN_PROTOCOL_VERSION}, "
               f"not {hello.plugin_protocol_version}")
        channel.send(PluginReject(why))
        raise PluginRefused(why)
    channel.send(PluginWelcome(
        plugin_protocol_version=PLUGIN_PROTOCOL_VERSION,
        model={"name": model.name, "n_vocab": model.n_vocab, "eog": sorted(eog),
               "bos": model.bos_token, "eos": model.eos_token},
        options=options,
    ))
    deadline = time.monotonic() + SETUP_TIMEOUT_S
    while True:
        got = channel.recv(deadline)
        if got is None:
            raise PluginRefused("set-up timed out (no ready)")
        if isinstance(got, Ready):
            return
        if not isinstance(got, Tokenize) or tokenizer is None:
            raise PluginRefused(f"unexpected {got.OP} during set-up")
        msg = got
        if sum(len(t) for t in msg.texts) > MAX_TOKENIZE_CHARS:
            raise PluginRefused("tokenize: more text than the set-up allows")
        channel.send(Tokenized(tuple(
            tuple(tokenizer.tokenize(t, add_special=False)) for t in msg.texts)))


class PluginHost:
    """One configured out-of-process plugin: its link, its rules and its counters."""

    def __init__(self, config: PluginConfig, *, model: ModelDescription,
                 eog: Sequence[int], tokenizer: TokenizerLike | None,
                 spawn_env: dict[str, str] | None = None) -> None:
        self.config = config
        self.name = config.name
        self.model = model
        self.eog = tuple(sorted(eog))
        self.tokenizer = tokenizer
        self.spawn_env = spawn_env
        self.counters = PluginCounters()
        self.link: Link | None = None
        self.strikes = 0
        self.clean = 0  # answers since the last fault
        self.retry_at = 0.0
        self.backoff = config.restart_backoff_s
        self._lock = threading.Lock()
        self._starter: threading.Thread | None = None
        self._closed = False
        self.log = log.bind(plugin=self.name)

    # ------------------------------------------------------------------ links

    @property
    def quarantined(self) -> bool:
        return self.link is None and time.monotonic() < self.retry_at

    def start(self, *, wait: bool = False) -> None:
        """Spawn the plugin (if it has a ``command``) on the host's own thread."""
        if self.config.command is None or self._closed:
            return
        with self._lock:
            if self.link is not None or (self._starter and self._starter.is_alive()):
                return
            self._starter = threading.Thread(target=self._spawn, name=f"plugin-{self.name}",
                                             daemon=True)
            self._starter.start()
            starter = self._starter
        if wait:
            starter.join()

    def _spawn(self) -> None:
        assert self.config.command is not None
        parent, child = socket.socketpair()
        env = dict(self.spawn_env if self.spawn_env is not None else os.environ)
        env["MESHD_PLUGIN_FD"] = str(child.fileno())
        try:
            proc = subprocess.Popen(list(self.config.command), pass_fds=(child.fileno(),),
                                    env=env, stdin=subprocess.DEVNULL)
        except OSError as exc:
            child.close()
            parent.close()
            self._failed_start(f"cannot run {self.config.command[0]}: {exc}")
            return
        child.close()
        channel = PluginChannel(parent)
        try:
            first = channel.recv(time.monotonic() + SETUP_TIMEOUT_S)
            if not isinstance(first, PluginHello):
                raise PluginRefused("the first frame must be plugin_hello")
            link = Link(channel, first, proc)
            self._setup(link)
        except (PluginRefused, ChannelClosed, SendTimeout, PluginProtocolError) as exc:
            Link(channel, PluginHello(self.name), proc).close()
            self._failed_start(f"{type(exc).__name__}: {exc}")
            return
        self._install(link)

    def _failed_start(self, why: str) -> None:
        self.counters.faults["start_failed"] += 1
        self.log.warning("plugin_start_failed", error=why)
        with self._lock:
            self._penalize()

    def _setup(self, link: Link) -> None:
        if link.hello.name != self.name:
            link.channel.send(PluginReject(f"expected plugin {self.name!r}"))
            raise PluginRefused(f"plugin says it is {link.hello.name!r}")
        handshake(link.channel, link.hello, model=self.model, eog=self.eog,
                  options=dict(self.config.options), tokenizer=self.tokenizer)

    def _install(self, link: Link) -> None:
        with self._lock:
            old, self.link = self.link, link
            if self._closed:
                self.link = None
                old = link
            else:
                self.counters.starts += 1
                if self.counters.starts > 1:
                    self.counters.restarts += 1
        if old is not None:
            old.close()
        self.log.info("plugin_ready", version=link.hello.version,
                      pid=link.process.pid if link.process else None)

    def adopt(self, channel: PluginChannel, hello: PluginHello) -> None:
        """A plugin connected to the daemon's socket: set it up and make it the link.

        Blocking (runs on a worker thread); raises PluginRefused when it may not.
        """
        if not self.config.connect:
            channel.send(PluginReject(f"plugin {self.name!r} may not connect"))
            raise PluginRefused("connecting is not enabled for this plugin")
        if self.quarantined:
            channel.send(PluginReject("quarantined; try again later"))
            raise PluginRefused("quarantined")
        link = Link(channel, hello)
        self._setup(link)
        self._install(link)

    def current(self) -> Link | None:
        """The live link; starts a spawned plugin again once its backoff has passed."""
        link = self.link
        if link is None and self.config.command is not None and not self.quarantined:
            self.start()
        return link

    # ------------------------------------------------------------------ faults

    def fault(self, link: Link, kind: str, detail: str = "") -> None:
        """Count and log one fault of ``link``; close it on a fatal fault or quarantine."""
        self.counters.faults[kind] += 1
        self.clean = 0
        self.log.warning("plugin_fault", kind=kind, detail=detail[:200], link=link.id)
        close = kind in FATAL
        with self._lock:
            if self.link is not link:
                return
            self.strikes += 1
            if self.strikes >= self.config.max_faults:
                self.counters.quarantines += 1
                self.log.warning("plugin_quarantined", strikes=self.strikes,
                                 backoff_s=self.backoff)
                self._penalize()
                close = True
            elif close:
                # A dead link is restarted after the backoff, without waiting for N.
                self.retry_at = time.monotonic() + self.backoff
            if close:
                self.link = None
        if close:
            link.close()

    def answered(self) -> None:
        """A valid answer (proposal or abstain): a long clean run forgives old strikes."""
        self.clean += 1
        if self.clean >= CLEAN_RUN:
            self.strikes = 0

    def _penalize(self) -> None:
        self.retry_at = time.monotonic() + self.backoff
        self.backoff = min(max(self.backoff * 2, 0.05), self.config.restart_backoff_max_s)
        self.strikes = 0

    def close(self) -> None:
        self._closed = True
        starter = self._starter
        if starter is not None:
            starter.join(timeout=SETUP_TIMEOUT_S + 1)
        with self._lock:
            link, self.link = self.link, None
        if link is not None:
            link.close()

    # ------------------------------------------------------------------ proposers

    def factory(self) -> Callable[[ProposerEnv], RemoteProposer]:
        """The registry factory for this plugin (declares the prompt text)."""

        @requires(Need.PROMPT_TEXT)
        def make(env: ProposerEnv) -> RemoteProposer:
            return RemoteProposer(self, env)

        make.__qualname__ = f"{self.name} (out-of-process)"
        return make


class RemoteProposer:
    """One request's proposer backed by a :class:`PluginHost`'s link."""

    def __init__(self, host: PluginHost, env: ProposerEnv) -> None:
        self.host = host
        self.name = host.name
        self.capabilities = Capabilities(max_len=16)
        self.env = env
        self.request_id = f"r{next(_ids)}"
        self._link_id = 0  # the link ``begin`` was sent on
        self._sent = 0  # tokens of the sequence the plugin has
        self._step = 0
        self._n_prompt = 0

    def _send(self, link: Link, message: PluginMessage) -> bool:
        try:
            link.channel.send(message)
        except SendTimeout as exc:
            self.host.fault(link, "hung", str(exc))
            return False
        except ChannelClosed as exc:
            self.host.fault(link, "disconnected", str(exc))
            return False
        return True

    def propose(self, request: ProposalRequest) -> Proposal | None:
        host = self.host
        link = host.current()
        if link is None:
            return None
        deadline = time.monotonic() + host.config.deadline_ms / 1e3
        with link.lock:
            if self._link_id != link.id:  # first step, or the plugin was restarted
                self._n_prompt = request.n_prompt
                begin = Begin(
                    request=self.request_id, prompt=tuple(request.tokens[: request.n_prompt]),
                    n_vocab=self.env.vocab_size, eog=host.eog,
                    prompt_text=self.env.resources.prompt_text, options=dict(self.env.options),
                )
                if not self._send(link, begin):
                    return None
                self._link_id, self._sent = link.id, request.n_prompt
            self._step += 1
            k = min(request.max_len, link.max_len)
            tail = tuple(request.tokens[self._sent:])
            query = Propose(request=self.request_id, step=self._step,
                            committed=len(request.tokens) - self._n_prompt, tokens=tail,
                            max_tokens=k, deadline=deadline)
            if not self._send(link, query):
                return None
            self._sent = len(request.tokens)
            return self._answer(link, k, deadline)

    def _answer(self, link: Link, k: int, deadline: float) -> Proposal | None:
        host = self.host
        stale = 0
        while True:
            try:
                msg = link.channel.recv(deadline)
            except ChannelClosed as exc:
                host.fault(link, "disconnected", str(exc))
                return None
            except PluginProtocolError as exc:
                host.fault(link, "garbage", str(exc))
                return None
            if msg is None:
                host.fault(link, "late", f"step {self._step}")
                return None
            if not isinstance(msg, WireProposal | Abstain | PluginError):
                host.fault(link, "garbage", f"unexpected {msg.OP}")
                return None
            if msg.request != self.request_id or msg.step != self._step:
                host.counters.stale += 1  # an answer to an earlier (late) question
                stale += 1
                if stale > MAX_STALE_PER_STEP:
                    host.fault(link, "flood", f"more than {MAX_STALE_PER_STEP} stale answers")
                    return None
                continue
            if isinstance(msg, Abstain):
                host.counters.abstains += 1
                host.answered()
                return None
            if isinstance(msg, PluginError):
                host.fault(link, "plugin_error", msg.message)
                return None
            return self._validated(link, msg.tokens, k)

    def _validated(self, link: Link, tokens: tuple[int, ...], k: int) -> Proposal | None:
        host = self.host
        reason = None
        if not tokens:
            reason = "empty"
        elif len(tokens) > k:
            reason = "oversize"
        elif min(tokens) < 0:
            reason = "negative"
        elif max(tokens) >= self.env.vocab_size:
            reason = "out_of_vocab"
        if reason is not None:
            host.fault(link, reason, f"{len(tokens)} tokens, at most {k}")
            return None
        host.counters.proposals += 1
        host.answered()
        return Proposal(tokens)

    def observe(self, outcome: Outcome) -> None:
        link = self.host.link
        if link is None or link.id != self._link_id:
            return
        with link.lock:
            if self._send(link, WireOutcome(self.request_id, self._step, outcome.proposed,
                                            outcome.accepted, tuple(outcome.committed))):
                self._sent += len(outcome.committed)

    def close(self) -> None:
        link = self.host.link
        if link is None or link.id != self._link_id:
            return
        with link.lock:
            self._send(link, End(self.request_id))
