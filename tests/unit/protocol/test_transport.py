"""StreamReceiver: socket reads, EOF, close while blocked, non-socket fallback."""

from __future__ import annotations

import socket

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.stapled import StapledByteStream

from meshd.protocol import StreamReceiver

pytestmark = pytest.mark.anyio


async def _pair() -> tuple[anyio.abc.UNIXSocketStream, anyio.abc.UNIXSocketStream]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return (
        await anyio.abc.UNIXSocketStream.from_socket(a),
        await anyio.abc.UNIXSocketStream.from_socket(b),
    )


async def test_reads_data_then_end_of_stream() -> None:
    a, b = await _pair()
    receiver = StreamReceiver(b)
    async with a:
        await a.send(b"hello")
        assert await receiver.receive() == b"hello"
    with pytest.raises(anyio.EndOfStream):
        await receiver.receive()
    await receiver.aclose()
    with pytest.raises(anyio.BrokenResourceError):
        await receiver.receive()


async def test_aclose_wakes_a_blocked_reader() -> None:
    a, b = await _pair()
    receiver = StreamReceiver(b)
    outcome: list[type[BaseException]] = []

    async def read() -> None:
        try:
            await receiver.receive()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
            outcome.append(type(exc))

    with anyio.fail_after(5):
        async with a, anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.wait_all_tasks_blocked()
            await receiver.aclose()
    assert outcome


async def test_cancelling_a_reader_while_data_arrives_is_quiet() -> None:
    """The race StreamReceiver exists for. The canceller is woken (call_soon) in the same
    loop iteration in which the selector reports the bytes; with anyio's own
    ``receive()`` every round logs InvalidStateError on asyncio, which the anyio test
    runner turns into a failure."""
    for _ in range(5):
        a, b = await _pair()
        receiver = StreamReceiver(b)
        sent = anyio.Event()

        async def send(stream: anyio.abc.ByteStream, done: anyio.Event) -> None:
            await stream.send(b"x" * 100)
            done.set()

        async with a, anyio.create_task_group() as tg:
            tg.start_soon(_read_forever, receiver)
            for _ in range(3):
                await anyio.sleep(0)  # let the reader block
            tg.start_soon(send, a, sent)
            await sent.wait()
            tg.cancel_scope.cancel()
        await receiver.aclose()


async def _read_forever(receiver: StreamReceiver) -> None:
    while True:
        await receiver.receive()


async def test_non_socket_streams_use_their_own_receive() -> None:
    send, receive = anyio.create_memory_object_stream[bytes](1)
    stream = StapledByteStream(_NullSend(), BufferedByteReceiveStream(receive))
    receiver = StreamReceiver(stream)
    await send.send(b"abc")
    assert await receiver.receive() == b"abc"
    send.close()
    with pytest.raises(anyio.EndOfStream):
        await receiver.receive()
    await receiver.aclose()


class _NullSend(anyio.abc.ByteSendStream):
    async def send(self, item: bytes) -> None:
        pass

    async def aclose(self) -> None:
        pass
