"""A fast connection's answers (front.py): written in request order (HTTP/1.1 pipelining), its
reading paused while too many wait or while the transport's buffer is full, the requests read
meanwhile held back until then, and its idle deadline."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from proxy.gateway.running import CUT_OFF, CUT_OFF_REASON
from proxy.http.answer_bytes import Account, AnswerBytes
from proxy.http.endpoint import NO_CHARGE, BodyBudget, error_reply
from proxy.http.sockets import (
    TCP_CLOSE,
    TCP_CLOSE_WAIT,
    aborted_if_reset,
    drop,
    tcp_info,
    unread_bytes,
    unsent_bytes,
    unsent_or_reset,
    written,
)
from proxy.http.waiting_body import Reader, WaitingBody, busy
from proxy.http.wire import OTHER, RPC, SPLIT_FROM, Out, Request, out_size
from proxy.rpc.jsonrpc import INTERNAL_ERROR, JsonRpcError
from proxy.values import PaidHit, Reply

log = logging.getLogger("proxy.front")

INTERNAL = JsonRpcError(INTERNAL_ERROR, "internal error", http_status=500)
KEEPALIVE_TIMEOUT = 75.0  # an idle connection, or a request head not complete, is closed after it
LINGER_SECONDS = 1.0  # after the last answer: what its client still sends is read and dropped this long
HALF_OPEN = 1 << 62  # Pipeline.ended_at once its client took an answer after its last byte: it waits for the rest
MAX_WAITING = 64  # answers one connection may have waiting before its reading pauses
COUNTED_HIT = 64 * 1024  # a memory hit written at once is counted in its connection's bytes from this size

# An answer in request order: its bytes and whether the connection closes after them, or (until its
# task writes them in) the task making them.
Waiting = list[Any]
# A request read while its connection's answers could not go out, made when they can (a Request), or
# an answer that must follow theirs (its bytes and whether the connection closes after them).
Held = Request | tuple[Out, bool]


def closing(reply: Reply) -> Reply:
    reply.close = True
    return reply


class Server(Protocol):
    """What a connection reads of its server (front.Front)."""

    stopping: bool
    renew_at: float  # the loop time at which its Date line and hit heads are made again
    open_answer: bytes  # an open hit's answer as a %-format of (id number, verified, length, body)
    paid_answer: bytes  # a paid hit's: (id number, charged, remaining, verified, length, body)
    open_answer_sent: bytes  # as open_answer, with the client's own id (bytes) for the number
    paid_answer_sent: bytes
    answer_bytes: AnswerBytes  # answers made and not yet taken, every connection's
    bodies: BodyBudget  # bytes of request bodies being read, every connection's

    def date(self, loop_now: float) -> bytes: ...


class Pipeline:
    """A connection's answers, written in request order (HTTP/1.1 pipelining), its reading paused
    while too many wait or while the transport's buffer is full, the requests read meanwhile held
    back until then, and its idle deadline. Its connection (the Reader) reads; this writes."""

    def __init__(self, reader: Reader, front: Server, loop: asyncio.AbstractEventLoop) -> None:
        self._reader = reader
        self.front = front
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[Waiting] = deque()
        self.held: deque[Held] = deque()
        self.deadline = IdleDeadline(self, reader, loop)
        self.active_at = 0.0
        self.done = False  # answered for the last time: nothing more is read
        self.read_paused = False
        self.write_paused = False
        self.handover: bytes | None = None  # an upgrade's bytes, handed to aiohttp once its answers are out
        self.cut = False  # SHUTDOWN_TIMEOUT reached: answers still being made are cancelled, each answered 503
        self.input_ended = False  # its client sends nothing more (a half-close): closed once answered
        self.ended_at = -1  # bytes its client had acknowledged when its end was seen (_one_at_a_time)
        self.account = Account(front.answer_bytes, loop, lambda: unsent_or_reset(self.transport), self._room_made)
        self.waiting_body = WaitingBody(self.account, reader, front.bodies)  # a body left unread until it has room
        self.account.first = partial(_first_unwritten, self.waiting)  # a batch's turn (answer_bytes.Batch)

    def opened(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        if self.front.stopping:
            transport.close()
            return
        self.active_at = self.loop.time()
        self.deadline.start()

    def lost(self, orphans: set[asyncio.Task[None]]) -> None:
        """The connection is gone: answers being made finish unwritten (Front.shutdown waits: `orphans`)."""
        self.transport = None
        self._end()
        _orphaned(self.waiting, orphans)
        self.waiting.clear()
        self.clear_held()

    def handed_over(self) -> tuple[asyncio.Transport | None, bytes]:
        """Its transport and the upgrade's bytes, for aiohttp: nothing more is answered here."""
        data = self.handover
        assert data is not None
        self._end()
        return self.transport, data

    def _end(self) -> None:
        self.done = True
        self.waiting_body.end()
        self.deadline.cancel()
        self.account.close()

    def pause_writing(self) -> None:
        self.write_paused = True
        self.deadline.writes_paused()
        self.pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        self.active_at = self.loop.time()  # its client reads: the connection is not idle
        if self.waiting or self._go_on():  # with answers being made, the last one goes on (_flush)
            self.resume()

    def _go_on(self) -> bool:
        """Nothing waits to be written: the requests held back are made, then a pending handover is
        done. Whether the connection reads on (False: answers are being made, a request is still held,
        or aiohttp has it)."""
        if self.held:
            self._run_held()
            if self.held or self.waiting:
                return False
        if self.handover is not None:
            self._reader.hand_over()
            return False
        return True

    def holds(self, request: Request) -> bool:
        """Whether a request read now waits, unmade: its client reads nothing (the transport's buffer is
        full), MAX_WAITING are being made, others wait before it, or there is no room for its answer's
        bytes (answer_bytes.py). Reading is paused, but llhttp goes on through the rest of a read. Not a
        call, it waits as one only behind answers being made (a scrape's is not counted while made)."""
        if self.held or self.write_paused or len(self.waiting) >= MAX_WAITING or self.done:
            return True
        if not self.account.budget.held:  # no answer is held anywhere (a hit's common case: one look)
            return False
        account = self.account
        account.keyed(request.target, request.headers)
        call = request.kind == RPC or bool(self.waiting)
        if account.room_or_wait(request.body_held(account.budget.coded_body), call):
            return False
        self.pause()
        return True

    def hold(self, request: Request) -> None:
        """`request` held back, what it holds (Request.reckoned) in the body budget meanwhile; without room
        there, answered 503 in its turn, its connection's last answer (uncounted, 200 connections each
        pipelining 4,000 bodiless requests in one read held 421 MB; 600 of 60 KB bodies, 39 MB)."""
        if self.done:
            return  # after the connection's last answer: no request's
        self.account.keyed(request.target, request.headers)
        if not request.hold_read(self.waiting_body.bodies, self.account.key):
            busy(self, request)
            return
        self.held.append(request)
        self.account.budget.waiting += 1

    def clear_held(self) -> None:
        for item in self.held:
            if isinstance(item, Request):
                self.account.budget.waiting -= 1
                item.let_go(self.waiting_body.bodies)
        self.held.clear()

    def _room_made(self) -> None:  # bytes were taken somewhere (AnswerBytes.wait): held requests go on if they fit
        if aborted_if_reset(self.transport):  # its client left: nothing it waits with is made
            return
        if self.held:
            if not self.write_paused and not self.waiting and self._go_on():
                self.resume()
        elif self.waiting_body.request is not None:
            self.resume()  # its body is read once it has room

    def _run_held(self) -> None:
        """The requests held back, made in order while their answers can go out."""
        held = self.held
        transport = self.transport
        # Not `_done`: that is also a last answer decided (a refusal queued behind these), not yet sent.
        account = self.account
        while (
            held
            and not self.write_paused
            and len(self.waiting) < MAX_WAITING
            and transport is not None
            and not transport.is_closing()
            and not _one_at_a_time(self, transport)
        ):
            item = held[0]
            if isinstance(item, Request):
                call = item.kind == RPC or bool(self.waiting)
                if not account.room_or_wait(item.body_held(account.budget.coded_body), call):
                    break
                held.popleft()
                self.account.budget.waiting -= 1
                item.let_go(self.waiting_body.bodies)
                self._reader.make_held(item)
            else:
                held.popleft()
                self.send(*item)
        if transport is None or transport.is_closing():
            self.clear_held()

    def pause(self) -> None:
        if not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if (
            self.read_paused
            and self.transport is not None
            and not self.write_paused
            and not self.done
            and self.handover is None
            and not self.held
            and len(self.waiting) < MAX_WAITING // 2
            and self.waiting_body.read_on()
        ):
            self.read_paused = False
            self.transport.resume_reading()

    def run_held(self) -> None:
        """Draining: the requests held while a read was parsed (front.on_message_complete), made in order."""
        if not self.done:
            self._run_held()

    def last_of_drain(self, entry: Waiting | None) -> bool:
        """Draining: whether an answer (`entry`, or None: one added now) is the last, Connection: close (9112 9.6)."""
        if not self.front.stopping or self.held or self._reader.request is not None:
            return False
        # Not while its client's bytes lie unread: a request sent before this answer is answered last.
        if (entry is not None and (not self.waiting or self.waiting[-1] is not entry)) or unread_bytes(self.transport):
            return False
        self.done = True
        return True

    def stop(self) -> None:
        """Shutting down: closed now when idle, else once its answers are written."""
        if (self._reader.request is None or not self._reader.request.kind) and not self.waiting and not self.held:
            self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def answer(self, request: Request, reply: Reply | Any, body: int = 0) -> None:
        if self.cut and not isinstance(reply, Reply):  # read after SHUTDOWN_TIMEOUT: cut off unmade
            reply.close()
            reply = error_reply(CUT_OFF, NO_CHARGE)
        if isinstance(reply, Reply):
            self.send(*self._reader.encoded(request, reply, self.last_of_drain(None)))
            return
        entry: Waiting = [None, False]
        entry[0] = self.loop.create_task(self._awaited(request, reply, entry, body))
        self.waiting.append(entry)
        self.account.keyed(request.target, request.headers)
        if request.kind == RPC:  # reckoned while made (a scrape of /metrics does not see its own answer)
            self.account.making_one(body)
        if len(self.waiting) >= MAX_WAITING:
            self.pause()

    async def _awaited(self, request: Request, pending: Any, entry: Waiting, body: int) -> None:
        """The answer's bytes, written into its `entry` (the reply let go: not held while they are written),
        and out at once when every answer before it is: from the task, not a done callback a turn later."""
        reply: Reply | None = None
        try:
            reply = await pending
        except Exception:
            log.exception("internal error serving %s", request.method)
        finally:
            # Cancelled: an answer whose client left is not written (nor logged); one cut off at
            # SHUTDOWN_TIMEOUT is answered 503, any other 500, so none behind it waits forever.
            if reply is not None or self.transport is not None:
                if reply is None:
                    reply = error_reply(CUT_OFF if self.cut else INTERNAL, NO_CHARGE)
                last = self.last_of_drain(entry)
                entry[0], entry[1], reply = *self._reader.encoded(request, reply, last), None
                if self.transport is not None:  # counted once, here, where it is encoded
                    self.account.made(out_size(entry[0]), request.kind == RPC, body)
                waiting = self.waiting
                if waiting and waiting[0] is entry:
                    self._flush()

    def last(self, data: Out, close: bool) -> None:
        """The connection's last answer (a refusal): nothing more is read, and it follows the others."""
        if self.done:  # decided already (Connection: close): what follows it is no request's
            return
        self.done = True
        self.pause()
        self.after_held(data, close)

    def after_held(self, data: Out, close: bool) -> None:
        """An answer made while reading (an interim 100, a refusal): behind the requests held back, if any."""
        if self.held:
            self.held.append((data, close))
        else:
            self.send(data, close)

    def send(self, data: Out, close: bool) -> None:
        """An answer, written now when nothing before it waits, else queued behind."""
        if self.waiting:
            self.waiting.append([data, close])
            self.account.enqueued(len(data) if isinstance(data, bytes) else out_size(data))
            return
        transport = self.transport
        if transport is None or transport.is_closing():  # its client is gone: nothing written reaches it
            return
        if isinstance(data, bytes):  # inline: every answer but a pre-built hit's passes here
            transport.write(data)
            self.account.wrote(len(data))
        else:
            self.account.wrote(written(transport, data))  # a large answer: its head, then its body
        if close:
            self.deadline.linger(transport)
        elif self._reader.request is None:
            self._idle_or_stop()

    def _flush(self) -> None:
        """Answers that are ready, written in request order (by the task whose answer was first)."""
        waiting = self.waiting
        transport = self.transport
        # Not once its client is gone (asyncio warned at each write from the fifth: a log filled at will).
        while waiting and transport is not None and not transport.is_closing():
            item, close = waiting[0]
            if isinstance(item, asyncio.Task):
                return  # still being made: its task writes it, and those after it
            waiting.popleft()
            if isinstance(item, bytes):
                transport.write(item)
                self.account.wrote(len(item), dequeued=True)
            else:
                self.account.wrote(written(transport, item), dequeued=True)
            if close:
                waiting.clear()
                self.deadline.linger(transport)
                return
        if not self._go_on():
            return
        self.resume()
        if self._reader.request is None:
            self._idle_or_stop()

    def _idle_or_stop(self) -> None:
        if (self.front.stopping or self.input_ended) and not self.held and not unread_bytes(self.transport):
            self.abort()
        else:  # draining with bytes unread: read (resume), they are answered before it closes
            self.active_at = self.loop.time()
            self.resume()


def cut_off(pipeline: Pipeline) -> list[asyncio.Task[None]]:
    """SHUTDOWN_TIMEOUT: answers being made cancelled, each answered 503 (a batch: BodyRun._cut)."""
    pipeline.cut = True
    return [item for item, _ in pipeline.waiting if isinstance(item, asyncio.Task) and item.cancel(CUT_OFF_REASON)]


def cut_short(pipeline: Pipeline, request: Request | None, release: Callable[[Request], None]) -> None:
    """The request being read when its client closed or sent its last byte: never whole, dropped
    (`release` lets its shares go)."""
    if request is not None and request.kind in (RPC, OTHER):  # (OTHER: a body no route reads, timed too)
        log.debug("client closed the connection before its request body arrived")  # routine: no error line
        pipeline.waiting_body.end(request)
        release(request)


def ended(pipeline: Pipeline) -> bool:
    """Its client sent its last byte (a half-close, RFC 9112 9.6): whether answers to what it sent
    whole are still to come (the connection then closes after the last, _idle_or_stop), else it
    closes now."""
    pipeline.input_ended = True
    return bool(pipeline.waiting or pipeline.held) and pipeline.handover is None


def _one_at_a_time(pipeline: Pipeline, transport: asyncio.Transport) -> bool:
    """Whether a held request waits for the answers before it to be written, or for nothing (closed
    now), as its client sent its last byte, read or not (its reading paused). One that left cannot be
    told from one that half-closed and waits until an answer written after its last byte draws a
    reset (it left: made all at once, its held requests all went to the node for nobody) or an
    acknowledgement (it waits: made as any connection's from then on, not one round trip each)."""
    if pipeline.ended_at == HALF_OPEN:
        return False
    state, acked = tcp_info(transport)
    if not pipeline.input_ended and state != TCP_CLOSE_WAIT and state != TCP_CLOSE:
        return False
    if state == TCP_CLOSE:
        transport.abort()
        return True
    if pipeline.ended_at < 0:
        pipeline.ended_at = acked
    elif acked > pipeline.ended_at:
        pipeline.ended_at = HALF_OPEN
        return False
    return bool(pipeline.waiting)


def write_hit(pipeline: Pipeline, hit: PaidHit, open_mode: bool, rid: int | bytes) -> bool:
    """A memory hit's answer after its pre-built head (`Front.date` renews the heads each second), on
    `pipeline`'s connection: now when nothing waits before it, else queued behind. False for a body
    of SPLIT_FROM bytes or more: as a Reply, it is written after its head, not copied behind it."""
    front = pipeline.front
    loop_now = pipeline.loop.time()
    if loop_now >= front.renew_at:
        front.date(loop_now)
    charged, remaining, verified, length, body = hit
    if length >= SPLIT_FROM:
        return False
    if type(rid) is int:  # a new id's number
        data = (
            front.open_answer % (rid, verified, length, body)
            if open_mode
            else front.paid_answer % (rid, charged, remaining, verified, length, body)
        )
    elif open_mode:  # the client's own id
        data = front.open_answer_sent % (rid, verified, length, body)
    else:
        data = front.paid_answer_sent % (rid, charged, remaining, verified, length, body)
    transport = pipeline.transport
    if pipeline.waiting or transport is None:
        pipeline.send(data, False)
        return True
    transport.write(data)
    if length >= COUNTED_HIT:
        pipeline.account.wrote(len(data))
    if front.stopping and not pipeline.held:
        pipeline.abort()
    else:
        pipeline.active_at = loop_now
    return True


def _first_unwritten(waiting: deque[Waiting]) -> object:
    """What makes a connection's first answer not yet written: a task while it is made."""
    return waiting[0][0] if waiting else None


def _orphaned(waiting: deque[Waiting], orphans: set[asyncio.Task[None]]) -> None:
    """A lost connection's answers still being made, left to finish unwritten (Front.shutdown waits)."""
    for item, _close in waiting:
        if isinstance(item, asyncio.Task) and not item.done():
            orphans.add(item)
            item.add_done_callback(orphans.discard)


class IdleDeadline:
    """A connection's one keep-alive timer (KEEPALIVE_TIMEOUT): its Pipeline's idle deadline."""

    def __init__(self, pipeline: Pipeline, reader: Reader, loop: asyncio.AbstractEventLoop) -> None:
        self._pipeline = pipeline
        self._reader = reader
        self.loop = loop
        self.timer: asyncio.TimerHandle | None = None
        self._acked = -1  # bytes its client had acknowledged at the last look; none yet: the first counts as progress

    def start(self) -> None:
        self.timer = self.loop.call_later(KEEPALIVE_TIMEOUT, self.fire)

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def writes_paused(self) -> None:
        """Its client's window is shut, or nearly: what it has acknowledged now is what its next look
        measures progress by. Unmeasured, that look counted as progress, so a client that took nothing
        was dropped after twice the keep-alive time (150 s, an outside attack), not once."""
        self._acked = tcp_info(self._pipeline.transport)[1]

    def linger(self, transport: asyncio.Transport) -> None:
        """The connection's last answer is written; it closes in stages (RFC 9112 9.6): the write side
        shut after it (a FIN once it is out), what the client still sends read and dropped (nothing is
        read once `done`) until its own end (the transport closes on it) or LINGER_SECONDS, then closed.
        A close with unread bytes would reset the connection, and a reset can wipe answers not yet read."""
        self._pipeline.done = True
        self._pipeline.read_paused = False
        self.cancel()
        if not transport.can_write_eof():
            transport.close()
            return
        try:
            transport.write_eof()
        except OSError:  # its client reset it meanwhile (asyncio's transport raises ENOTCONN)
            transport.abort()
            return
        transport.resume_reading()
        self.timer = self.loop.call_later(LINGER_SECONDS, transport.close)

    def fire(self) -> None:
        """KEEPALIVE_TIMEOUT after the last head completed or answer was written (or its client last
        read), with no request in progress: closed. A client that reads none of its answers for as
        long is dropped with what it was not sent, whatever waits: a close would keep those bytes
        until it reads them, which it may never do. One timer per connection, moved on when it fires."""
        pipeline = self._pipeline
        request = self._reader.request
        transport = pipeline.transport
        unsent = unsent_bytes(transport) if transport is not None else 0
        acked = tcp_info(transport)[1]
        # Its client took bytes since the last look (TCP acknowledged them): it reads, slowly, not idle.
        # Not "fewer bytes wait unsent": answers written as it reads kept those as many, and a client
        # reading 20 KB/s was dropped.
        if unsent and acked > self._acked:
            pipeline.active_at = self.loop.time()
        self._acked = acked
        left = pipeline.active_at + KEEPALIVE_TIMEOUT - self.loop.time()
        busy = (
            pipeline.waiting
            or (request and request.kind and request is not pipeline.waiting_body.request)
            or (not unsent and pipeline.account.others_hold(pipeline.held or pipeline.waiting_body.request))
        )
        if not pipeline.write_paused and busy:  # its body, its answers, others' bytes have deadlines of their own
            left = KEEPALIVE_TIMEOUT
        if left > 0:
            self.timer = self.loop.call_later(left, self.fire)
            return
        self.timer = None
        if transport is not None and unsent:
            pipeline.done = True
            pipeline.clear_held()
            drop(transport)
        else:
            pipeline.abort()
