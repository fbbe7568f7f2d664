"""A WebSocket connection's small answers made while one burst of frames is read, written together
once the burst is read: a client that pipelines 64 calls gets one write, not 64 (each write is a
system call, and was most of a cache hit's cost on a WebSocket)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from aiohttp import WSMsgType

from proxy.streams.outbox import CountedSocket

MAX_CORKED = 4096  # larger answers go through aiohttp's writer, compressed when the client asked
HIGH_WATER = 64 * 1024  # bytes waiting in the socket's buffer past which answers wait for it (flow control)


def text_frame(payload: bytes) -> bytes:
    """A server's frame: final, text, unmasked (RFC 6455 section 5.2; RFC 7692 section 6: a message
    may go uncompressed even when compression was agreed)."""
    size = len(payload)
    if size < 126:
        return bytes((0x81, size)) + payload
    if size < 1 << 16:
        return b"\x81\x7e" + size.to_bytes(2, "big") + payload
    return b"\x81\x7f" + size.to_bytes(8, "big") + payload


class Corked:
    def __init__(
        self,
        ws: CountedSocket,
        transport: asyncio.Transport | None,
        loop: asyncio.AbstractEventLoop,
        room: Callable[[], Awaitable[bool]],
    ) -> None:
        self._ws = ws
        self._transport = transport
        self._loop = loop
        self._room = room  # waits until the client has room for an answer (False: it was closed as too slow)
        self._frames: list[bytes] = []

    async def send(self, payload: bytes) -> None:
        """Queued for the burst's write, or sent through aiohttp's writer (add) once the client has room
        for it (WS_SEND_BUFFER_BYTES within WS_MAX_LAG: else it is closed as a slow consumer)."""
        if not self.add(payload) and await self._room():
            # The peer left (a reset, aiohttp's "Connection lost"): the reading loop ends too.
            with contextlib.suppress(ConnectionError):
                await self._ws.send_frame(payload, WSMsgType.TEXT)

    def add(self, payload: bytes) -> bool:
        """Queued for the burst's write (True); False when the answer is large or the socket's buffer
        is full: the caller sends it through aiohttp's writer, which waits for the socket to drain."""
        transport = self._transport
        if transport is None or len(payload) > MAX_CORKED or transport.get_write_buffer_size() > HIGH_WATER:
            self.flush()
            return False
        if not self._frames:
            self._loop.call_soon(self.flush)  # runs once the reader has no frame left to hand out
        self._frames.append(text_frame(payload))
        return True

    def flush(self) -> None:
        frames = self._frames
        if not frames:
            return
        self._frames = []
        transport = self._transport
        if transport is not None and not transport.is_closing() and not self._ws.closed:
            data = frames[0] if len(frames) == 1 else b"".join(frames)
            self._ws.data_sent += len(data)  # data the client is sent (the slow-consumer timer's sign)
            transport.write(data)
