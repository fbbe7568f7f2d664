"""One WebSocket connection's outgoing queue and its writer (subscriptions.Session owns one).

Replies, notifications and a block's shared log batches wait here in order, and one writer task
sends them: each notification is charged as it is written, a log batch is expanded for this
connection's subscriptions (fanout.py). How far behind the consumer may fall is the Session's
decision, from what this queue owes the client (`owed`, `oldest`), when output is made or queued;
while anything waits for the client a timer looks whether it takes bytes at all (`watch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import struct
import termios
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import WSCloseCode, web

from proxy.rpc import jsonrpc
from proxy.streams.fanout import LogBatch, expand
from proxy.streams.subscription import Subscription

log = logging.getLogger("proxy.subscriptions")  # the Session's logger: one name for a connection's streams


class CountedSocket(web.WebSocketResponse):
    """A client's WebSocket that counts the data it is sent (`data_sent`), not aiohttp's pongs: a data
    frame written while the socket's buffers are full went out after a drain, so the client took
    bytes (Outbox._look). Pongs answer the client's own pings: a client that never reads could make
    them by the hundred, so they never count. The frames a connection writes itself (ws_frames.Corked)
    count there."""

    data_sent = 0

    async def send_frame(self, message: bytes, opcode: web.WSMsgType, compress: int | None = None) -> None:
        self.data_sent += len(message)
        await super().send_frame(message, opcode, compress)

    async def send_str(self, data: str, compress: int | None = None) -> None:
        self.data_sent += len(data)
        await super().send_str(data, compress)


@dataclass(slots=True)
class Outgoing:
    """One message owed to the client."""

    payload: bytes
    sub: Subscription | None = None  # None: a reply, never charged
    cost: int = 0
    queued: float = 0.0  # monotonic time it was queued: how far behind its consumer is
    logs: LogBatch | None = None  # a shared batch for `subs`, expanded by the writer (payload is b"")
    subs: tuple[Subscription, ...] = ()


class Outbox:
    """A connection's messages in the order they are owed, sent by one writer task."""

    def __init__(
        self,
        ws: web.WebSocketResponse,
        transport: Any,
        credits: Mapping[str, int],
        paid: Callable[[Subscription, int], Awaitable[bool]],
        lag: float,
        behind: Callable[[float, bool], None],
    ) -> None:
        self.ws = ws
        self.transport = transport  # asyncio transport of the connection: its write buffer is owed too
        self._credits = credits  # SUBSCRIPTION_CREDITS: what one log costs
        self._paid = paid  # charges one notification (Session._paid); False: do not send it
        self._items: deque[Outgoing] = deque()
        self._pending_bytes = 0
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._sending: float | None = None  # queued time of the item being written
        self._lag = lag  # WS_MAX_LAG
        self._behind = behind  # the Session's decision, asked (now, True) once the socket took no byte for `lag`
        self._timer: asyncio.TimerHandle | None = None
        self._taken_at = 0.0  # when the client last took bytes from the socket's buffers
        self._last_outstanding = (0, 0)  # (the transport's buffer, the kernel's send queue) at the last look
        self._last_sent = 0  # the data frames' bytes sent at the last look (CountedSocket)
        self._stopped = False

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write(), name="ws-subscription-writer")

    def put(self, item: Outgoing, now: float) -> None:
        item.queued = now
        self._items.append(item)
        self._pending_bytes += len(item.payload)
        self._wake.set()
        self.watch()

    def discard(self, sub: Subscription) -> None:
        """Drop what waits for `sub` (a subscription that ended)."""
        self._items = deque(i for i in self._items if i.sub is not sub)
        self._pending_bytes = sum(len(i.payload) for i in self._items)

    def clear(self) -> None:
        self._items.clear()
        self._pending_bytes = 0

    def owed(self) -> int:
        """Bytes that wait for the client: queued here and in the socket's buffer."""
        return self._pending_bytes + self._buffered()

    @property
    def busy(self) -> bool:
        """Whether a message is queued or being written."""
        return bool(self._items) or self._sending is not None

    @property
    def oldest(self) -> float:
        """When the oldest message still owed to the client was queued (now if none is)."""
        if self._sending is not None:
            return self._sending
        return self._items[0].queued if self._items else time.monotonic()

    def watch(self) -> None:
        """WS_MAX_LAG by time, for a client that takes nothing at all: while anything waits for the
        client, one timer per connection (no task per message) looks every quarter of it whether the
        client took bytes. A client that reads nothing blocks a send for ever, and may never be sent
        more. How far behind a reader is, in bytes or age, the Session looks at only when output is made."""
        if self._timer is None and not self._stopped:
            self._taken_at, self._last_outstanding = time.monotonic(), self.outstanding()
            self._last_sent = int(getattr(self.ws, "data_sent", 0))
            self._timer = asyncio.get_running_loop().call_later(self._lag / 4, self._look)

    def _look(self) -> None:
        now, outstanding = time.monotonic(), self.outstanding()
        (buffered, queued), (last_buffered, last_queued) = outstanding, self._last_outstanding
        self._last_outstanding = outstanding
        sent, last_sent = int(getattr(self.ws, "data_sent", 0)), self._last_sent
        self._last_sent = sent
        taken = buffered < last_buffered or queued < last_queued  # it read: either part shrank
        written = sent > last_sent  # a data frame went out: after a drain, or into room the buffers had
        if taken or written or not buffered + queued:
            self._taken_at = now  # the client took bytes, or none wait in the socket: not stalled
        if not buffered + queued and not self.busy:
            self._timer = None  # nothing waits: the next output (put, Session.room) arms it again
            return
        self._timer = asyncio.get_running_loop().call_later(self._lag / 4, self._look)
        if now - self._taken_at >= self._lag:
            self._behind(now, True)

    def outstanding(self) -> tuple[int, int]:
        """Bytes the client has not taken: in the transport's buffer, and in the kernel's send queue
        (unsent or unacknowledged: SIOCOUTQ, Linux's TIOCOUTQ on a TCP socket). The kernel's part
        matters: a reader empties it while the transport's buffer stays put until a third of the
        kernel's buffer is free (megabytes). Where the ioctl fails, the transport's buffer alone."""
        transport = self.transport
        if transport is None:
            return 0, 0
        queued, sock = 0, transport.get_extra_info("socket")
        if sock is not None and not transport.is_closing():
            with contextlib.suppress(OSError, ValueError):
                (queued,) = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))
        return int(transport.get_write_buffer_size()), queued

    def _buffered(self) -> int:
        transport = self.transport
        return int(transport.get_write_buffer_size()) if transport is not None else 0

    async def _write(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._items:
                    item = self._items.popleft()
                    self._pending_bytes -= len(item.payload)
                    self._sending = item.queued
                    if item.logs is not None:
                        await expand(item.logs, item.subs, self._send_log)
                        continue
                    sub = item.sub
                    if sub is not None and not await self._paid(sub, item.cost):
                        continue
                    if self.ws.closed:
                        return
                    await self.ws.send_frame(item.payload, web.WSMsgType.TEXT)
                self._sending = None
        except ConnectionError:
            return  # the peer is gone; the handler's close() ends the subscriptions
        except Exception:
            log.exception("internal error writing subscription messages")
            await self.ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error")

    async def _send_log(self, sub: Subscription, payload: bytes) -> bool:
        """One log of a shared batch to one subscription (fanout.expand); False: the socket is gone.
        send_frame waits while the client's socket is full: this writer alone."""
        if not await self._paid(sub, self._credits.get("logs", 0)):
            return True
        if self.ws.closed:
            return False
        await self.ws.send_frame(jsonrpc.encode_notification(sub.method, sub.id, payload), web.WSMsgType.TEXT)
        return True

    async def stop(self) -> None:
        """Stop writing (not from the writer itself)."""
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()
        if self._writer is not None and self._writer is not asyncio.current_task():
            self._writer.cancel()
            with contextlib.suppress(BaseException):
                await self._writer
