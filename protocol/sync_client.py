"""The blocking client: the async :class:`~meshd.protocol.async_client.Client` on an
event loop in a helper thread (an anyio blocking portal), for scripts and ``meshctl``.

Why a wrapper rather than a second implementation: the protocol's rules and the
request plumbing live once, in the async client and the sans-I/O connection under it;
this module only carries calls across the portal.
"""

from __future__ import annotations

import functools
import os
import sys
import types
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Self, TypeVar

import anyio
import anyio.from_thread

from .async_client import DEFAULT_CLIENT_NAME, Client, Completion, GenerationStream
from .errors import ConnectionClosed
from .messages import (
    DEFAULT_MAX_FRAME_SIZE,
    PROTOCOL_VERSION,
    ChatMessage,
    Constraint,
    Done,
    HealthReply,
    ModelInfo,
    SamplingParams,
    StatsReply,
    Token,
    ToolFunction,
    UnloadReply,
    Welcome,
)

__all__ = ["SyncClient", "SyncGenerationStream", "connect_sync"]

T = TypeVar("T")


class SyncGenerationStream:
    """Blocking iterator over a generation's tokens (see :class:`GenerationStream`).

    Use ``with``: leaving it early sends ``cancel``.
    """

    def __init__(self, portal: anyio.from_thread.BlockingPortal, stream: GenerationStream):
        self._portal = portal
        self._stream = stream

    @property
    def id(self) -> str:
        return self._stream.id

    @property
    def done(self) -> Done | None:
        return self._stream.done

    @property
    def text(self) -> str:
        return self._stream.text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self._stream.token_ids

    def __enter__(self) -> Self:
        self._portal.call(self._stream.start)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Token:
        token = self._portal.call(_next_or_none, self._stream)
        if token is None:
            raise StopIteration
        return token

    def cancel(self) -> None:
        """Ask the server to stop; keep iterating to receive the ``cancelled`` done."""
        self._portal.call(self._stream.cancel)

    def close(self) -> None:
        """Stop listening; send ``cancel`` if the generation is still running."""
        self._portal.call(self._stream.aclose)

    def collect(self) -> Completion:
        """Consume the stream and return the whole generation."""
        return self._portal.call(self._stream.collect)


async def _next_or_none(stream: GenerationStream) -> Token | None:
    # StopAsyncIteration is turned into None so it never has to cross the portal.
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


class SyncClient:
    """Blocking client: the async :class:`Client` on an event loop in a helper thread.

    ::

        with SyncClient.connect("/run/meshd.sock") as client:
            for token in client.generate("Hello", max_tokens=16):
                print(token.text, end="")
            print(client.health().status)
    """

    def __init__(
        self,
        portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal],
        portal: anyio.from_thread.BlockingPortal,
        client_cm: AbstractContextManager[Client],
        client: Client,
    ) -> None:
        self._portal_cm = portal_cm
        self._portal = portal
        self._client_cm = client_cm
        self._client = client
        self._closed = False

    @classmethod
    def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        client_name: str = DEFAULT_CLIENT_NAME,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        protocol_version: int = PROTOCOL_VERSION,
        connect_timeout: float | None = 10.0,
        backend: str = "asyncio",
    ) -> SyncClient:
        """Connect and handshake; ``backend`` is the anyio backend of the helper loop."""
        portal_cm = anyio.from_thread.start_blocking_portal(backend)
        portal = portal_cm.__enter__()
        try:
            client_cm = portal.wrap_async_context_manager(
                Client.connect(
                    path,
                    client_name=client_name,
                    max_frame_size=max_frame_size,
                    protocol_version=protocol_version,
                    connect_timeout=connect_timeout,
                )
            )
            client = client_cm.__enter__()
        except BaseException:
            portal_cm.__exit__(*sys.exc_info())
            raise
        return cls(portal_cm, portal, client_cm, client)

    def close(self) -> None:
        """Close the connection and stop the helper thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._client_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        self.close()

    @property
    def welcome(self) -> Welcome:
        return self._client.welcome

    def _call(self, func: Callable[..., Awaitable[T]], *args: object) -> T:
        """Run ``func(*args)`` on the client's loop thread and wait for its result."""
        if self._closed:
            raise ConnectionClosed("client closed")
        return self._portal.call(func, *args)

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[ChatMessage | Mapping[str, str]] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        sampling: SamplingParams | None = None,
        stop: Sequence[str] = (),
        proposer: str | None = None,
        draft_max: int | None = None,
        request_id: str | None = None,
        constraint: Constraint | None = None,
        logprobs: int | None = None,
        model: str | None = None,
        keep_alive: float | None = None,
        tools: Sequence[ToolFunction] | None = None,
        tool_choice: str = "auto",
        tool_name: str | None = None,
    ) -> SyncGenerationStream:
        """Like :meth:`Client.generate`; returns a blocking iterator of tokens."""
        if self._closed:
            raise ConnectionClosed("client closed")
        stream = self._client.generate(
            prompt,
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            sampling=sampling,
            stop=stop,
            proposer=proposer,
            draft_max=draft_max,
            constraint=constraint,
            logprobs=logprobs,
            model=model,
            keep_alive=keep_alive,
            request_id=request_id,
            tools=tools,
            tool_choice=tool_choice,
            tool_name=tool_name,
        )
        return SyncGenerationStream(self._portal, stream)

    def cancel(self, request_id: str) -> None:
        """Ask the server to cancel a running request."""
        self._call(self._client.cancel, request_id)

    def cancel_confirmed(self, request_id: str) -> bool:
        """Cancel and return whether a request with that id was in flight."""
        return self._call(self._client.cancel_confirmed, request_id)

    def stats(self) -> StatsReply:
        """Daemon-wide counters and per-proposer acceptance."""
        return self._call(self._client.stats)

    def health(self) -> HealthReply:
        """Status, uptime and load."""
        return self._call(self._client.health)

    def models(self) -> tuple[ModelInfo, ...]:
        """The models the daemon serves, loaded or not."""
        return self._call(self._client.models)

    def load(self, name: str, *, keep_alive: float | None = None) -> ModelInfo:
        """Load model ``name`` (or set how long it stays loaded); returns it once loaded."""
        return self._call(functools.partial(self._client.load, keep_alive=keep_alive), name)

    def unload(self, name: str) -> UnloadReply:
        """Unload model ``name``: at once if idle, else once its requests end."""
        return self._call(self._client.unload, name)

    def tokenize(self, text: str, *, add_special: bool = True) -> tuple[int, ...]:
        """Token ids of ``text`` under the server's model."""
        return self._call(functools.partial(self._client.tokenize, add_special=add_special), text)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` under the server's model."""
        return self._call(self._client.detokenize, tokens)


@contextmanager
def connect_sync(
    path: str | os.PathLike[str],
    *,
    client_name: str = DEFAULT_CLIENT_NAME,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    protocol_version: int = PROTOCOL_VERSION,
    connect_timeout: float | None = 10.0,
    backend: str = "asyncio",
) -> Iterator[SyncClient]:
    """``with connect_sync(path) as client``: a SyncClient closed on exit."""
    client = SyncClient.connect(
        path,
        client_name=client_name,
        max_frame_size=max_frame_size,
        protocol_version=protocol_version,
        connect_timeout=connect_timeout,
        backend=backend,
    )
    try:
        yield client
    finally:
        client.close()
