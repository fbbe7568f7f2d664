"""What a WebSocket client sends, read frame by frame before aiohttp reads it: RFC 6455 section 5.1
(every frame a client sends is masked; a connection that sends one that is not is closed with 1002,
protocol error), and the bytes of a message not yet whole, held against MAX_INFLIGHT_BODY_BYTES with
HTTP bodies as they arrive (a connection whose next read finds no room on the host is closed with
1013, try again later; counted as declared, 26 headers of 5 MB frames took the host's room for
nothing) and within BODY_TIMEOUT (closed with 1008): aiohttp holds a message's frames until its last,
WS_MAX_MESSAGE_BYTES a connection, and 250 connections each stopping 100 bytes short of a 5 MB
message held 1.3 GB.

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
from typing import TYPE_CHECKING

from aiohttp import WSCloseCode, web

if TYPE_CHECKING:
    from proxy.http.endpoint import BodyBudget

log = logging.getLogger("proxy.ws")

UNMASKED_REASON = b"client frame not masked (RFC 6455 section 5.1)"
NO_ROOM_REASON = b"the host is receiving too many bytes (MAX_INFLIGHT_BODY_BYTES): try again later"


def close_frame(code: int, reason: bytes) -> bytes:
    """A server's Close frame: final, unmasked, the status code then the reason (RFC 6455 section 5.5.1)."""
    return bytes((0x88, 2 + len(reason))) + code.to_bytes(2, "big") + reason


class MaskScan:
    """Where the frames begin in a client's byte stream, fed one read at a time: each header's mask
    bit is read, each payload skipped, and the payload bytes of the message not yet whole counted as
    they come (`message`: what aiohttp holds of it, until its last frame is whole)."""

    __slots__ = ("_data", "_head", "_header_left", "_last", "_open", "_skip", "message")

    def __init__(self) -> None:
        self._skip = 0  # bytes of the current frame still to come (its payload) before the next header
        self._header_left = 0  # ... of them, what is left of its header (its mask key, cut by a read)
        self._head = b""  # the start of a header the last read ended in
        self._data = False  # the current frame is a data frame (text, binary, continuation)
        self._last = False  # ... and its message's last
        self._open = False  # a message begun (its first data frame's header read) is not whole yet
        self.message = 0  # payload bytes received of the message in progress

    @property
    def pending(self) -> bool:
        """Something begun and not whole: a message, a frame's payload, or a header cut by a read."""
        return self._open or self._skip > 0 or bool(self._head)

    def feed(self, data: bytes) -> bool:
        """False once a frame's header shows it unmasked (the mask bit, its second byte's highest)."""
        if self._head:
            data, self._head = self._head + data, b""
        end = len(data)
        at, last = self._skip, end - 1
        if at:  # the payload of a frame begun in an earlier read
            if self._data:
                self.message += max(0, min(at, end) - self._header_left)
            self._header_left = max(0, self._header_left - end)
            if self._last and at <= end:
                self.message, self._open = 0, False  # the message's last frame is whole
        while at < last:  # the header's first two bytes are here
            second = data[at + 1]  # the mask bit, then the payload's length (or 126, 127: more bytes say it)
            if 0x80 <= second < 0xFE:
                length, header = second - 0x80, 6  # 2 header bytes, 4 of the mask key
            elif second == 0xFE:
                if at + 4 > end:
                    break
                length, header = data[at + 2] << 8 | data[at + 3], 8
            elif second == 0xFF:
                if at + 10 > end:
                    break
                length, header = int.from_bytes(data[at + 2 : at + 10], "big"), 14
            else:
                return False
            first = data[at]
            self._data = first & 0x0F < 8  # control frames are at most 125 bytes, never held
            # FIN: the last frame of its message, whatever its RSV bits (RSV1: compressed, RFC 7692).
            self._last = self._data and first >= 0x80
            if self._data:
                self.message += max(0, min(length, end - at - header))
                self._open = True
            self._header_left = max(0, at + header - end)
            at += header + length
            if self._last and at <= end:
                self.message, self._open = 0, False
        if at < end:  # a header not whole yet: kept for the next read
            self._head, self._skip = data[at:], 0
        else:
            self._skip = at - end
        return True


class Unfinished:
    """Where a socket's message not yet whole is held: room in the host's count of bodies being
    received (MAX_INFLIGHT_BODY_BYTES), at most `cap` bytes of it, and BODY_TIMEOUT to finish in."""

    __slots__ = ("budget", "cap", "timeout")

    def __init__(self, budget: BodyBudget, cap: int, timeout: float) -> None:
        self.budget = budget
        self.cap = cap  # aiohttp refuses a larger message (max_msg_size) as its header comes
        self.timeout = timeout


class MaskedOnly(asyncio.Protocol):
    """The transport's protocol while a WebSocket is open: aiohttp's handler behind a MaskScan."""

    def __init__(
        self,
        handler: web.RequestHandler,
        transport: asyncio.Transport,
        closed: Callable[[str], None],
        unfinished: Unfinished | None = None,
    ) -> None:
        self.handler = handler
        self.transport = transport
        self.scan = MaskScan()
        self.closed = closed  # counts and logs a connection closed for what it sent, by reason
        self.unfinished = unfinished
        self.held = 0  # room taken for the message in progress
        self.timer: asyncio.TimerHandle | None = None  # its BODY_TIMEOUT
        self.open = False  # the handshake's answer (101) is sent: a Close frame may follow it
        self.failure: tuple[str, int, bytes] | None = None  # why it is closed: nothing more it sends is read

    @classmethod
    def install(
        cls,
        handler: web.RequestHandler,
        transport: asyncio.Transport,
        closed: Callable[[str], None],
        unfinished: Unfinished | None = None,
    ) -> MaskedOnly:
        """Put in front of aiohttp's handler once it has read the upgrade request, before the
        handshake is answered: the bytes it holds already (a client that did not wait for the 101)
        are the stream's first and are scanned first."""
        guard = cls(handler, transport, closed, unfinished)
        # aiohttp keeps what followed the upgrade request here until its WebSocket reader starts
        # (tests/test_ws_masks.py fails if that changes).
        guard.scanned(handler._message_tail)
        transport.set_protocol(guard)
        return guard

    def opened(self) -> bool:
        """Called once the 101 is sent: False if the connection failed already (what it sent before
        is not to be read)."""
        self.open = True
        if self.failure is not None:
            self._close(*self.failure)
        return self.failure is None

    def data_received(self, data: bytes) -> None:
        if self.failure is None and self.scanned(data):
            self.handler.data_received(data)
        # else RFC 6455 section 7.1.7: nothing more is processed, not even a Close frame

    def scanned(self, data: bytes) -> bool:
        """Whether `data` may be read: its frames masked, room for a message it leaves unfinished."""
        if not self.scan.feed(data):
            self._fail("unmasked", WSCloseCode.PROTOCOL_ERROR, UNMASKED_REASON)
            return False
        scan = self.scan
        return (scan.message == self.held and scan.pending == (self.timer is not None)) or self._held()

    def _held(self) -> bool:
        """Room for what has come of the message in progress (none once it is whole): False, and the
        connection closed, when the host has none for its next read."""
        unfinished = self.unfinished
        if unfinished is None:
            return True
        held = min(self.scan.message, unfinished.cap)
        if held > self.held and not unfinished.budget.take(held - self.held):
            self._fail("no_room", WSCloseCode.TRY_AGAIN_LATER, NO_ROOM_REASON)
            return False
        if held < self.held:
            unfinished.budget.give(self.held - held)
        self.held = held
        # BODY_TIMEOUT from the first byte of anything not whole: a frame's header alone holds no room,
        # but it held the socket (until WS_IDLE_TIMEOUT).
        pending = self.scan.pending
        if pending and self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(unfinished.timeout, self._late, unfinished.timeout)
        elif not pending and self.timer is not None:
            self.timer.cancel()
            self.timer = None
        return True

    def _late(self, timeout: float) -> None:
        """BODY_TIMEOUT passed with a message not whole: the client's fault unless the proxy stopped
        reading meanwhile (its calls in flight at WS_MAX_INFLIGHT, or waiting their key's turn), when
        the client gets the timeout again from now."""
        self.timer = None
        if not self.transport.is_reading():
            self.timer = asyncio.get_running_loop().call_later(timeout, self._late, timeout)
            return
        reason = f"message not finished within {timeout:g}s (BODY_TIMEOUT)".encode()
        self._fail("unfinished", WSCloseCode.POLICY_VIOLATION, reason)

    def _fail(self, reason: str, code: int, text: bytes) -> None:
        """Closed for what it sent (RFC 6455 section 7.1.7): now, or once the 101 is sent."""
        if self.failure is not None:
            return
        self.failure = (reason, code, text)
        self._release()
        if self.open:
            self._close(reason, code, text)

    def _close(self, reason: str, code: int, text: bytes) -> None:
        """A Close frame, then the transport closed."""
        self.closed(reason)
        transport = self.transport
        if not transport.is_closing():
            transport.write(close_frame(code, text))
            transport.close()

    def _release(self) -> None:
        """The room the message in progress held given back, its timer stopped."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.held and self.unfinished is not None:
            self.unfinished.budget.give(self.held)
        self.held = 0

    # The rest of asyncio.Protocol, as the handler has it.
    def connection_lost(self, exc: Exception | None) -> None:
        self._release()
        self.handler.connection_lost(exc)

    def eof_received(self) -> None:
        self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()
