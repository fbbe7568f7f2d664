"""A fast connection's answers (front.py): written in request order (HTTP/1.1 pipelining), its
reading paused while too many wait or while the transport's buffer is full, the requests read
meanwhile held back until then, and its idle deadline."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import socket
import struct
import termios
from collections import deque
from typing import Any, Protocol

from proxy.http.endpoint import NO_CHARGE, error_reply
from proxy.http.wire import Request
from proxy.rpc.jsonrpc import INTERNAL_ERROR, JsonRpcError
from proxy.values import Reply

log = logging.getLogger("proxy.front")

KEEPALIVE_TIMEOUT = 75.0  # an idle connection, or a request head not complete, is closed after it
MAX_WAITING = 64  # answers one connection may have waiting before its reading pauses

# An answer in request order: its bytes and whether the connection closes after them, or (until its
# task writes them in) the task making them.
Waiting = list[Any]
# A request read while its connection's answers could not go out, made when they can (a Request), or
# an answer that must follow theirs (its bytes and whether the connection closes after them).
Held = Request | tuple[bytes, bool]


def unsent_bytes(transport: asyncio.Transport) -> int:
    """Bytes written to the connection that its client has not yet taken: the transport's buffer and
    the kernel's send queue (SIOCOUTQ), which holds megabytes before the transport's buffer moves."""
    unsent = int(transport.get_write_buffer_size())
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError, ValueError):
            unsent += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return unsent


def drop(transport: asyncio.Transport) -> None:
    """Closed with a reset: what its client did not read is dropped, the kernel's copy too (a plain
    close, or abort, leaves the socket sending it for as long as the client's window stays shut)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class Server(Protocol):
    """What a connection reads of its server (front.Front)."""

    stopping: bool
    renew_at: float  # the loop time at which its Date line and hit heads are made again
    open_answer: bytes  # an open hit's answer as a %-format of (length, body)
    paid_answer: bytes  # a paid hit's: (charged, remaining, length, body)

    def date(self, loop_now: float) -> bytes: ...


class Answers(asyncio.Protocol):
    """A connection's answers, written in request order (HTTP/1.1 pipelining), its reading paused
    while too many wait or while the transport's buffer is full, and its idle deadline."""

    _front: Server
    _loop: asyncio.AbstractEventLoop
    _transport: asyncio.Transport | None
    _request: Request | None
    _waiting: deque[Waiting]
    _held: deque[Held]
    _idle: asyncio.TimerHandle | None
    _active_at: float
    _done: bool
    _read_paused: bool
    _write_paused: bool
    _unsent: int  # bytes its client had not taken at the last idle check (unsent_bytes)
    _handover: bytes | None

    def _encoded(self, request: Request, reply: Reply) -> tuple[bytes, bool]:
        raise NotImplementedError

    def _hand_over(self) -> None:
        raise NotImplementedError

    def _make_held(self, request: Request) -> None:
        raise NotImplementedError

    def pause_writing(self) -> None:
        self._write_paused = True
        self._pause()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._active_at = self._loop.time()  # its client reads: the connection is not idle
        if self._waiting or self._go_on():  # with answers being made, the last one goes on (_flush)
            self._resume()

    def _go_on(self) -> bool:
        """Nothing waits to be written: the requests held back are made, then a pending handover is
        done. Whether the connection reads on (False: answers are being made, a request is still held,
        or aiohttp has it)."""
        if self._held:
            self._run_held()
            if self._held or self._waiting:
                return False
        if self._handover is not None:
            self._hand_over()
            return False
        return True

    def _holds(self) -> bool:
        """Whether a request read now waits to be made: its client reads none of the answers already
        written (the transport's buffer is full), MAX_WAITING are being made, or others wait before it.
        Reading is paused then, but llhttp goes on through the rest of the read: without this, one
        read of small requests for a large answer made thousands of answers nobody read."""
        return bool(self._held) or self._write_paused or len(self._waiting) >= MAX_WAITING

    def _run_held(self) -> None:
        """The requests held back, made in order while their answers can go out."""
        held = self._held
        transport = self._transport
        # Not `_done`: that is also a last answer decided (a refusal queued behind these), not yet sent.
        while (
            held
            and not self._write_paused
            and len(self._waiting) < MAX_WAITING
            and transport is not None
            and not transport.is_closing()
        ):
            item = held.popleft()
            if isinstance(item, Request):
                self._make_held(item)
            else:
                self._send(*item)
        if transport is None or transport.is_closing():
            held.clear()

    def _pause(self) -> None:
        if not self._read_paused and self._transport is not None:
            self._read_paused = True
            self._transport.pause_reading()

    def _resume(self) -> None:
        if (
            self._read_paused
            and self._transport is not None
            and not self._write_paused
            and not self._done
            and self._handover is None
            and not self._held
            and len(self._waiting) < MAX_WAITING // 2
        ):
            self._read_paused = False
            self._transport.resume_reading()

    def stop(self) -> None:
        """Shutting down: closed now when idle, else once its answers are written."""
        if (self._request is None or not self._request.kind) and not self._waiting and not self._held:
            self.abort()

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _idle_out(self) -> None:
        """KEEPALIVE_TIMEOUT after the last head completed or answer was written (or its client last
        read), with no request in progress: closed. A client that reads none of its answers for as
        long is dropped with what it was not sent, whatever waits: a close would keep those bytes
        until it reads them, which it may never do. One timer per connection, moved on when it fires."""
        request = self._request
        transport = self._transport
        unsent = unsent_bytes(transport) if transport is not None else 0
        if unsent and unsent < self._unsent:  # its client reads, slowly (a large answer): not idle
            self._active_at = self._loop.time()
        self._unsent = unsent
        left = self._active_at + KEEPALIVE_TIMEOUT - self._loop.time()
        if not self._write_paused and (self._waiting or (request is not None and request.kind)):
            left = KEEPALIVE_TIMEOUT  # busy: its body and its answers have deadlines of their own
        if left > 0:
            self._idle = self._loop.call_later(left, self._idle_out)
            return
        self._idle = None
        if transport is not None and unsent:
            self._done = True
            self._held.clear()
            drop(transport)
        else:
            self.abort()

    def _answer(self, request: Request, reply: Reply | Any) -> None:
        if isinstance(reply, Reply):
            self._send(*self._encoded(request, reply))
            return
        entry: Waiting = [None, False]
        entry[0] = self._loop.create_task(self._awaited(request, reply, entry))
        self._waiting.append(entry)
        if len(self._waiting) >= MAX_WAITING:
            self._pause()

    async def _awaited(self, request: Request, pending: Any, entry: Waiting) -> None:
        """The answer's bytes, written into its `entry`, and written out at once when every answer
        before it is out: from the task itself, not from a done callback a loop turn later."""
        reply: Reply | None = None
        try:
            reply = await pending
        except Exception:
            log.exception("internal error serving %s", request.method)
        finally:
            # Cancelled: Front.shutdown cancels only the answers of clients gone, and those are not
            # written (nor logged); one cancelled otherwise still answers, so none behind it waits forever.
            if reply is not None or self._transport is not None:
                if reply is None:
                    reply = error_reply(JsonRpcError(INTERNAL_ERROR, "internal error", http_status=500), NO_CHARGE)
                entry[0], entry[1] = self._encoded(request, reply)
                waiting = self._waiting
                if waiting and waiting[0] is entry:
                    self._flush()

    def _prebuilt(self, paid: bool, values: tuple[object, ...]) -> None:
        """A memory hit's answer after its pre-built head (`Front.date` renews the heads each second)."""
        front = self._front
        now = self._loop.time()
        if now >= front.renew_at:
            front.date(now)
        data = (front.paid_answer if paid else front.open_answer) % values
        transport = self._transport
        if self._waiting or transport is None:
            self._send(data, False)
            return
        transport.write(data)
        if front.stopping and not self._held:
            self.abort()
        else:
            self._active_at = now

    def _after_held(self, data: bytes, close: bool) -> None:
        """An answer made while reading (an interim 100, a refusal): behind the requests held back, if any."""
        if self._held:
            self._held.append((data, close))
        else:
            self._send(data, close)

    def _send(self, data: bytes, close: bool) -> None:
        """An answer, written now when nothing before it waits, else queued behind."""
        if self._waiting:
            self._waiting.append([data, close])
            return
        transport = self._transport
        if transport is None:
            return
        transport.write(data)
        if close:
            self._done = True
            transport.close()
        elif self._request is None:
            self._idle_or_stop()

    def _flush(self) -> None:
        """Answers that are ready, written in request order (by the task whose answer was first)."""
        waiting = self._waiting
        transport = self._transport
        while waiting and transport is not None:
            item, close = waiting[0]
            if not isinstance(item, bytes):
                return  # still being made: its task writes it, and those after it
            waiting.popleft()
            transport.write(item)
            if close:
                self._done = True
                waiting.clear()
                transport.close()
                return
        if not self._go_on():
            return
        self._resume()
        if self._request is None:
            self._idle_or_stop()

    def _idle_or_stop(self) -> None:
        if self._front.stopping and not self._held:
            self.abort()
        else:
            self._active_at = self._loop.time()

    @staticmethod
    def _closing(reply: Reply) -> Reply:
        reply.close = True
        return reply
