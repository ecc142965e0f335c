"""The plugin SDK: write one ``propose(context) -> tokens`` function, run it anywhere.

Why: a proposer author should think about drafting, not about the proposer protocol,
wire messages, deadlines or token bookkeeping. :class:`Plugin` wraps the function with
two faces that behave the same: in-process (:attr:`Plugin.factory`, a
``meshd.proposers`` entry point) and out-of-process (:meth:`Plugin.main`, the plugin
messages of PROTOCOL.md on a spawned socketpair or ``--socket PATH``)::

    def propose(ctx: sdk.Context) -> list[int]:
        return ctx.tokens[-3:]          # a silly guess; verification makes it harmless

    plugin = sdk.Plugin("echo", propose, version="1.0")

Whatever ``propose`` returns is verified, so a wrong draft costs time, never output.
What a plugin declares it needs follows from what it uses (a ``corpus``, or
``@requires(Need.PROMPT_TEXT)`` from :mod:`meshd.plugins.resources`).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from meshd.protocol.plugin import (
    PLUGIN_PROTOCOL_VERSION,
    Abstain,
    Begin,
    End,
    Outcome,
    PluginError,
    PluginHello,
    PluginReject,
    PluginWelcome,
    Proposal,
    Propose,
    Ready,
    Tokenize,
    Tokenized,
)
from meshd.protocol.plugin_channel import ChannelClosed, PluginChannel, PluginProtocolError

from . import base
from .resources import Need, needs_of, requires

__all__ = ["FD_ENV", "Context", "Plugin"]

#: The environment variable a spawned plugin finds its socketpair end in.
FD_ENV = "MESHD_PLUGIN_FD"


@attrs.define
class Context:
    """What ``propose`` sees for one step of one request.

    ``tokens`` is the prompt followed by every committed token; ``max_tokens`` bounds
    the answer; ``state`` is the plugin's scratch space for this request (kept until
    the request ends). ``prompt_text`` is None unless ``propose`` declares
    ``@requires(Need.PROMPT_TEXT)`` (in-process) and the daemon's config for this plugin
    says ``allow_prompt_text = true`` (out-of-process: and the plugin is spawned or its
    connection is pinned to a uid/gid).
    """

    request_id: str
    tokens: Sequence[int]
    n_prompt: int
    max_tokens: int
    n_vocab: int
    eog: frozenset[int]
    options: Mapping[str, Any]
    corpus: Sequence[Sequence[int]]
    prompt_text: str | None = None
    deadline: float = float("inf")
    state: dict[str, Any] = attrs.field(factory=dict)

    @property
    def committed(self) -> Sequence[int]:
        """Tokens generated so far (after the prompt)."""
        return self.tokens[self.n_prompt:]


ProposeFn = Callable[[Context], Sequence[int] | None]
CorpusFn = Callable[[Mapping[str, Any]], Sequence[str]]


def sdk_needs(propose: ProposeFn, *, corpus: bool) -> frozenset[Need]:
    """The resources an SDK plugin needs: the tokenizer for a corpus, the prompt's text
    if ``propose`` declares it. ``Context`` carries nothing else, so declaring anything
    else is a mistake, reported now rather than silently ignored."""
    declared = needs_of(propose)
    extra = declared - {Need.PROMPT_TEXT}
    if extra:
        names = ", ".join(sorted(n.value for n in extra))
        raise ValueError(f"an SDK plugin's propose can declare only prompt_text, not {names}")
    return declared | ({Need.TOKENIZER} if corpus else frozenset())


class Plugin:
    """A proposer written as one function; see the module docstring."""

    def __init__(self, name: str, propose: ProposeFn, *, version: str = "0",
                 max_len: int = 16, corpus: CorpusFn | None = None) -> None:
        if not name or ":" in name:
            raise ValueError("a plugin name must be non-empty and contain no ':'")
        self.name = name
        self.propose = propose
        self.version = version
        self.max_len = max_len
        self.corpus = corpus
        self.capabilities = base.Capabilities(max_len=max_len)
        self._corpus_cache: dict[tuple[int, str], list[list[int]]] = {}
        #: What the in-process face asks the daemon for (see the module docstring).
        self.needs = sdk_needs(propose, corpus=corpus is not None)

        @requires(*sorted(self.needs, key=lambda n: n.value))
        def factory(env: base.ProposerEnv) -> _InProcess:
            return _InProcess(self, env, self._tokenized_corpus(env))

        factory.capabilities = self.capabilities  # type: ignore[attr-defined]
        factory.__qualname__ = f"{name} (meshd.plugins.sdk)"
        #: The in-process factory (publish it as a ``meshd.proposers`` entry point).
        self.factory: Callable[[base.ProposerEnv], base.Proposer] = factory

    def _texts(self, options: Mapping[str, Any]) -> list[str]:
        return [str(t) for t in self.corpus(options)] if self.corpus is not None else []

    def _tokenized_corpus(self, env: base.ProposerEnv) -> list[list[int]]:
        """The corpus tokenized by the model's tokenizer, cached per tokenizer/options."""
        if self.corpus is None or env.resources.tokenizer is None:
            return []
        tok = env.resources.tokenizer
        key = (id(tok), repr(sorted(env.options.items())))
        if key not in self._corpus_cache:
            self._corpus_cache[key] = [tok.tokenize(t, add_special=False)
                                       for t in self._texts(env.options)]
        return self._corpus_cache[key]

    def call(self, ctx: Context) -> tuple[int, ...]:
        """Run ``propose`` and normalize its answer (at most ``max_len`` ids)."""
        out = self.propose(ctx)
        if not out:
            return ()
        return tuple(int(t) for t in list(out)[: min(ctx.max_tokens, self.max_len)])

    # ------------------------------------------------------------ out of process

    def main(self, argv: Sequence[str] | None = None) -> int:
        """Command line of an out-of-process plugin: ``--socket PATH`` connects to a
        running daemon; without it the socketpair in ``$MESHD_PLUGIN_FD`` is used."""
        parser = argparse.ArgumentParser(prog=self.name,
                                         description=f"meshd proposer plugin {self.name}")
        parser.add_argument("--socket", help="connect to the daemon at this socket path")
        args = parser.parse_args(argv)
        if args.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(args.socket)
            except OSError as exc:
                print(f"{self.name}: cannot connect to {args.socket}: {exc}", file=sys.stderr)
                return 1
        elif os.environ.get(FD_ENV, "").isdigit():
            sock = socket.socket(fileno=int(os.environ[FD_ENV]))
        else:
            parser.error(f"give --socket PATH (or run under meshd, which sets {FD_ENV})")
        return self.serve(PluginChannel(sock))

    def serve(self, channel: PluginChannel) -> int:
        """Speak the plugin messages on ``channel`` until the daemon closes it."""
        try:
            channel.send(PluginHello(
                name=self.name, version=self.version,
                plugin_protocol_version=PLUGIN_PROTOCOL_VERSION,
                capabilities={"max_len": self.max_len},
            ))
            welcome = channel.recv(None)
            if isinstance(welcome, PluginReject):
                print(f"{self.name}: refused by the daemon ({welcome.code}): "
                      f"{welcome.message}", file=sys.stderr)
                return 1
            if not isinstance(welcome, PluginWelcome):
                print(f"{self.name}: expected plugin_welcome", file=sys.stderr)
                return 1
            corpus: list[list[int]] = []
            texts = self._texts(welcome.options)
            if texts:
                channel.send(Tokenize(tuple(texts)))
                reply = channel.recv(None)
                if not isinstance(reply, Tokenized):
                    print(f"{self.name}: expected tokenized", file=sys.stderr)
                    return 1
                corpus = [list(t) for t in reply.tokenized]
            channel.send(Ready())
            self._loop(channel, welcome, corpus)
        except ChannelClosed:
            pass
        except PluginProtocolError as exc:
            print(f"{self.name}: the daemon sent something that is not a plugin message: "
                  f"{exc}", file=sys.stderr)
            return 1
        finally:
            channel.close()
        return 0

    def _loop(self, channel: PluginChannel, welcome: PluginWelcome,
              corpus: list[list[int]]) -> None:
        contexts: dict[str, Context] = {}
        while True:
            msg = channel.recv(None)
            if isinstance(msg, Begin):
                contexts[msg.request] = Context(
                    request_id=msg.request, tokens=list(msg.prompt), n_prompt=len(msg.prompt),
                    max_tokens=0, n_vocab=msg.n_vocab, eog=frozenset(msg.eog),
                    options={**welcome.options, **msg.options}, corpus=corpus,
                    prompt_text=msg.prompt_text,
                )
            elif isinstance(msg, Propose):
                ctx = contexts.get(msg.request)
                if ctx is None:
                    continue
                assert isinstance(ctx.tokens, list)
                ctx.tokens.extend(msg.tokens)
                ctx.max_tokens, ctx.deadline = msg.max_tokens, msg.deadline
                try:
                    tokens = self.call(ctx)
                except Exception as exc:  # the author's code: report, keep serving
                    channel.send(PluginError(msg.request, msg.step,
                                             f"{type(exc).__name__}: {exc}"[:500]))
                    continue
                channel.send(Proposal(msg.request, msg.step, tokens) if tokens
                             else Abstain(msg.request, msg.step))
            elif isinstance(msg, Outcome):
                ctx = contexts.get(msg.request)
                if ctx is not None:
                    assert isinstance(ctx.tokens, list)
                    ctx.tokens.extend(msg.committed)
            elif isinstance(msg, End):
                contexts.pop(msg.request, None)


class _InProcess:
    """The in-process face: a :class:`meshd.plugins.base.Proposer` over the function."""

    def __init__(self, plugin: Plugin, env: base.ProposerEnv,
                 corpus: list[list[int]]) -> None:
        self.plugin = plugin
        self.name = plugin.name
        self.capabilities = plugin.capabilities
        self._env = env
        self._corpus = corpus
        self._state: dict[str, Any] = {}

    def propose(self, request: base.ProposalRequest) -> base.Proposal | None:
        env = self._env
        ctx = Context(
            request_id="", tokens=request.tokens, n_prompt=request.n_prompt,
            max_tokens=request.max_len, n_vocab=env.vocab_size, eog=env.eog_tokens,
            options=env.options, corpus=self._corpus, prompt_text=env.resources.prompt_text,
            deadline=request.deadline, state=self._state,
        )
        tokens = self.plugin.call(ctx)
        return base.Proposal(tokens) if tokens else None

    def observe(self, outcome: base.Outcome) -> None:
        """The next ``propose`` sees the committed tokens in ``Context.tokens``."""

    def close(self) -> None:
        self._state.clear()


def monotonic() -> float:
    """The clock ``Context.deadline`` is on (the host's CLOCK_MONOTONIC)."""
    return time.monotonic()
