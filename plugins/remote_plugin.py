"""The daemon's side of out-of-process proposer plugins: links, rules, quarantine, restart.

Why this shape: a plugin process is untrusted and may be slow, wrong, crashed or
malicious, yet it must never change the output or stall the daemon. So a plugin is only
ever *asked* (``propose`` with an absolute deadline), every answer is validated, and
whatever goes wrong is a counted, logged fault (:class:`PluginCounters`: ``late``,
``stale``, ``empty``, ``oversize``, ``negative``, ``out_of_vocab``, ``plugin_error``;
``garbage``, ``flood``, ``disconnected`` and ``hung`` also close the link). After
``max_faults`` strikes the plugin is quarantined for a backoff that doubles each time,
then a spawned one is restarted and a connecting one may connect again. Output is
identical whatever a plugin does, since every draft is verified. Plugins see token ids;
the prompt's text only with ``allow_prompt_text``, and then only if spawned or pinned to
a uid/gid. A name has one link at a time (``name_in_use``), so a plugin cannot be taken
over by whoever connects next.
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
from .peer import Peer, pin_mismatch
from .resources import Need, TokenizerLike, requires
from .spawn import spawn

log = structlog.get_logger("meshd.plugins.remote_plugin")

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
    """A plugin's set-up failed (bad hello, unknown name, timeout); the message says why
    and ``code`` is the ``plugin_reject`` code (``meshd.protocol.plugin.REJECT_CODES``)."""

    def __init__(self, message: str, code: str = "bad_setup") -> None:
        super().__init__(message)
        self.code = code


def refuse(channel: PluginChannel, exc: PluginRefused) -> None:
    """Tell the plugin why it is refused (best effort: it may be gone already)."""
    with contextlib.suppress(ChannelClosed, SendTimeout):
        channel.send(PluginReject(str(exc), exc.code))


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
    """One live, set-up connection to a plugin process (spawned or connected).

    ``sees_text``: whether the prompt's text may go to this process (when the config
    allows it at all): a spawned one, or a connecting one whose uid/gid is pinned.
    """

    def __init__(self, channel: PluginChannel, hello: PluginHello,
                 process: subprocess.Popen[bytes] | None = None, *,
                 pid: int | None = None, sees_text: bool = False) -> None:
        self.channel = channel
        self.hello = hello
        self.process = process
        self.pid = process.pid if process is not None else pid
        self.sees_text = process is not None or sees_text
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
        raise PluginRefused(f"daemon speaks plugin protocol {PLUGIN_PROTOCOL_VERSION}, "
                            f"not {hello.plugin_protocol_version}", "unsupported_version")
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
        self._adopting = False  # a connection's set-up holds the name
        #: Why the last start of a spawned plugin failed (None once one succeeds): the
        #: runtime lists the plugin as unavailable meanwhile.
        self.start_error: str | None = None
        self._closed = False
        self.log = log.bind(plugin=self.name)
        if config.connect and config.allow_prompt_text and not config.pinned:
            self.log.warning("plugin_prompt_text_withheld",
                             reason="an unpinned connecting plugin gets token ids only; "
                                    "pin it with uid or gid")

    # ------------------------------------------------------------------ links

    @property
    def quarantined(self) -> bool:
        return self.link is None and time.monotonic() < self.retry_at

    def start(self, *, wait: bool = False) -> None:
        """Spawn the plugin (if it has a ``command``) on the host's own thread."""
        if self.config.command is None or self._closed:
            return
        with self._lock:
            if self.link is not None or self._adopting or (
                    self._starter and self._starter.is_alive()):
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
            proc, stderr = spawn(self.config.command, env=env, pass_fds=(child.fileno(),),
                                 log=self.log)
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
            if isinstance(exc, PluginRefused):
                refuse(channel, exc)
            Link(channel, PluginHello(self.name), proc).close()
            last = stderr.wait(timeout=1.0)  # the process is gone: its last words
            self._failed_start(f"{type(exc).__name__}: {exc}", stderr=last)
            return
        self._install(link)

    def _failed_start(self, why: str, *, stderr: str | None = None) -> None:
        self.start_error = why
        self.counters.faults["start_failed"] += 1
        self.log.warning("plugin_start_failed", error=why,
                         **({"stderr": stderr} if stderr else {}))
        with self._lock:
            self._penalize()

    def _setup(self, link: Link) -> None:
        if link.hello.name != self.name:
            raise PluginRefused(f"expected plugin {self.name!r}, "
                                f"the plugin says it is {link.hello.name!r}")
        handshake(link.channel, link.hello, model=self.model, eog=self.eog,
                  options=dict(self.config.options), tokenizer=self.tokenizer)

    def _install(self, link: Link) -> bool:
        """Make ``link`` the live link unless one is up already (the first one stays);
        whether it was installed."""
        with self._lock:
            installed = self.link is None and not self._closed
            if installed:
                self.link = link
                self.start_error = None
                self.counters.starts += 1
                if self.counters.starts > 1:
                    self.counters.restarts += 1
        if not installed:
            link.close()
            return False
        self.log.info("plugin_ready", version=link.hello.version,
                      **({"pid": link.pid} if link.pid is not None else {}))
        return True

    def adopt(self, channel: PluginChannel, hello: PluginHello, peer: Peer | None) -> None:
        """A plugin connected to the daemon's socket: set it up and make it the link.

        ``peer``: the connection's SO_PEERCRED credentials (None: unknown). Blocking
        (runs on a worker thread); raises PluginRefused (with its reject code) when it
        may not: connecting not enabled, a pinned uid/gid it does not have, the name
        already up (the first plugin keeps it), or quarantined.
        """
        if not self.config.connect:
            raise PluginRefused(f"plugin {self.name!r} may not connect (its table has no "
                                "connect = true)", "not_configured")
        mismatch = pin_mismatch(self.config, peer)
        if mismatch is not None:
            raise PluginRefused(f"plugin {self.name!r} is pinned: {mismatch}",
                                "peer_not_allowed")
        self._reap_dead_link()
        with self._lock:
            busy = self.link is not None or self._adopting or bool(
                self._starter and self._starter.is_alive())
            self._adopting = self._adopting or not busy
        if busy:
            raise PluginRefused(f"plugin {self.name!r} is already up; a second connection "
                                "under its name is refused", "name_in_use")
        try:
            if self.quarantined:
                raise PluginRefused("quarantined; try again later", "quarantined")
            link = Link(channel, hello, pid=peer.pid if peer is not None else None,
                        sees_text=self.config.pinned)
            self._setup(link)
            if not self._install(link):
                raise PluginRefused(f"plugin {self.name!r} is already up", "name_in_use")
        finally:
            with self._lock:
                self._adopting = False

    def _reap_dead_link(self) -> None:
        """Drop the live link if its process has gone unnoticed (no request asked it
        since), so that a plugin that restarts can connect again at once."""
        link = self.link
        if link is None or not link.lock.acquire(blocking=False):
            return  # a request is using it: that request notices a dead link
        try:
            dead = link.channel.peer_closed()
        finally:
            link.lock.release()
        if not dead:
            return
        self.counters.faults["disconnected"] += 1
        self.log.warning("plugin_fault", kind="disconnected", detail="found closed",
                         link=link.id)
        with self._lock:
            if self.link is link:
                self.link = None
        link.close()

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


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def invalid_proposal(tokens: Sequence[int], *, max_tokens: int,
                     n_vocab: int) -> tuple[str, str] | None:
    """The fault kind and its detail for a proposal the daemon must discard, or None."""
    if not tokens:
        return "empty", "no tokens"
    if len(tokens) > max_tokens:
        return "oversize", (f"{_count(len(tokens), 'token')}, "
                            f"at most {_count(max_tokens, 'token')} asked for")
    low, high = min(tokens), max(tokens)
    if low < 0:
        return "negative", f"token id {low}"
    if high >= n_vocab:
        return "out_of_vocab", f"token id {high}, the vocabulary has {_count(n_vocab, 'id')}"
    return None


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
                text = self.env.resources.prompt_text if link.sees_text else None
                begin = Begin(
                    request=self.request_id, prompt=tuple(request.tokens[: request.n_prompt]),
                    n_vocab=self.env.vocab_size, eog=host.eog,
                    prompt_text=text, options=dict(self.env.options),
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
        fault = invalid_proposal(tokens, max_tokens=k, n_vocab=self.env.vocab_size)
        if fault is not None:
            host.fault(link, *fault)
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
