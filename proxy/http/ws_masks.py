"""RFC 6455 section 5.1 on the server's side of a WebSocket: every frame a client sends is masked,
and a connection that sends one that is not is closed with 1002 (protocol error).

aiohttp's reader (the Python one and the C one alike) takes an unmasked frame as a masked one, so
the check sits in front of it, on the bytes as they arrive: the transport hands them to `MaskedOnly`,
which reads the mask bit of each frame's header (a header may be split across reads) before it
passes them on to aiohttp's handler unchanged. A read holding an unmasked frame is not passed on:
the connection is failed (RFC 6455 section 7.1.7), a Close frame with 1002 then the transport closed,
and nothing more it sends is read."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import WSCloseCode, web

log = logging.getLogger("proxy.ws")

UNMASKED_REASON = b"client frame not masked (RFC 6455 section 5.1)"


def close_frame(code: int, reason: bytes) -> bytes:
    """A server's Close frame: final, unmasked, the status code then the reason (RFC 6455 section 5.5.1)."""
    return bytes((0x88, 2 + len(reason))) + code.to_bytes(2, "big") + reason


class MaskScan:
    """Where the frames begin in a client's byte stream, fed one read at a time: each header's mask
    bit is read, each payload skipped."""

    __slots__ = ("_head", "_skip")

    def __init__(self) -> None:
        self._skip = 0  # bytes of the current frame still to come (its payload) before the next header
        self._head = b""  # the start of a header the last read ended in

    def feed(self, data: bytes) -> bool:
        """False once a frame's header shows it unmasked (the mask bit, its second byte's highest)."""
        if self._head:
            data, self._head = self._head + data, b""
        end = len(data)
        at, last = self._skip, end - 1
        while at < last:  # the header's first two bytes are here
            second = data[at + 1]  # the mask bit, then the payload's length (or 126, 127: more bytes say it)
            if 0x80 <= second < 0xFE:
                at += second - 0x7A  # 2 header bytes, 4 of the mask key, a payload under 126 bytes
            elif second == 0xFE:
                if at + 4 > end:
                    break
                at += 8 + (data[at + 2] << 8 | data[at + 3])
            elif second == 0xFF:
                if at + 10 > end:
                    break
                at += 14 + int.from_bytes(data[at + 2 : at + 10], "big")
            else:
                return False
        if at < end:  # a header not whole yet: kept for the next read
            self._head, self._skip = data[at:], 0
        else:
            self._skip = at - end
        return True


class MaskedOnly(asyncio.Protocol):
    """The transport's protocol while a WebSocket is open: aiohttp's handler behind a MaskScan."""

    def __init__(self, handler: web.RequestHandler, transport: asyncio.Transport, unmasked: Callable[[], None]) -> None:
        self.handler = handler
        self.transport = transport
        self.scan = MaskScan()
        self.unmasked = unmasked  # counts and logs a connection failed for an unmasked frame
        self.open = False  # the handshake's answer (101) is sent: a Close frame may follow it
        self.failed = False

    @classmethod
    def install(
        cls, handler: web.RequestHandler, transport: asyncio.Transport, unmasked: Callable[[], None]
    ) -> MaskedOnly:
        """Put in front of aiohttp's handler once it has read the upgrade request, before the
        handshake is answered: the bytes it holds already (a client that did not wait for the 101)
        are the stream's first and are scanned first."""
        guard = cls(handler, transport, unmasked)
        # aiohttp keeps what followed the upgrade request here until its WebSocket reader starts
        # (tests/test_ws_masks.py fails if that changes).
        if not guard.scan.feed(handler._message_tail):
            guard.failed = True
        transport.set_protocol(guard)
        return guard

    def opened(self) -> bool:
        """Called once the 101 is sent: False if the connection failed already (what it sent before
        is not to be read)."""
        self.open = True
        if self.failed:
            self._fail()
        return not self.failed

    def data_received(self, data: bytes) -> None:
        if self.failed:
            return  # RFC 6455 section 7.1.7: nothing more is processed, not even a Close frame
        if self.scan.feed(data):
            self.handler.data_received(data)
            return
        self.failed = True
        if self.open:
            self._fail()

    def _fail(self) -> None:
        self.unmasked()
        transport = self.transport
        if not transport.is_closing():
            transport.write(close_frame(WSCloseCode.PROTOCOL_ERROR, UNMASKED_REASON))
            transport.close()

    # The rest of asyncio.Protocol, as the handler has it.
    def connection_lost(self, exc: Exception | None) -> None:
        self.handler.connection_lost(exc)

    def eof_received(self) -> None:
        self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()
