"""WebSocket transport over the same gateway: one text frame in, one out, many in flight."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import HttpVersion11, WSCloseCode, WSMsgType, web

from proxy import via
from proxy.credits.accounts import OPEN_ACCOUNT
from proxy.credits.allow_lists import origin_refusal
from proxy.gateway.gateway import Gateway, invalid_key_error
from proxy.gateway.hits import Lookup
from proxy.gateway.running import CUT_OFF, CUT_OFF_REASON
from proxy.http.answer_bytes import Account, Estimate
from proxy.http.app_keys import FRONT, GATEWAY, METRICS, SETTINGS, STREAMS, WEBSOCKETS, WS_HELD
from proxy.http.request_key import api_key, origin_check
from proxy.http.responses import error_response
from proxy.http.sockets import unsent_or_reset
from proxy.http.ws_connections import Connection
from proxy.http.ws_frames import Corked
from proxy.http.ws_masks import MaskedOnly, Unfinished
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import (
    INTERNAL_ERROR,
    INVALID_API_KEY,
    INVALID_REQUEST,
    LIMIT_EXCEEDED,
    Invalid,
    JsonRpcError,
)
from proxy.streams.outbox import CountedSocket
from proxy.streams.subscription import spawn, subscription_call
from proxy.streams.subscriptions import CLOSE_TIMEOUT, Session
from proxy.values import PaidHit, Reply

log = logging.getLogger("proxy.ws")

REVOKED = JsonRpcError(
    INVALID_API_KEY,
    "invalid API key: the key this connection opened with was removed or "
    "changed by a reload of the keys; reconnect with a valid key",
    http_status=401,
)
SHUTTING_DOWN = JsonRpcError(INVALID_REQUEST, "server is shutting down")
_closing: set[asyncio.Task[None]] = set()  # revoked sockets being closed (the loop keeps weak references)


async def websocket_handler(request: web.Request) -> web.StreamResponse:
    app = request.app
    gateway, settings = app[GATEWAY], app[SETTINGS]
    account = gateway.account(api_key(request))
    if account is None:
        # The upgrade is refused the same way as HTTP: 401 with a JSON-RPC error body.
        return error_response(invalid_key_error(), {"X-Credits-Charged": "0", "X-Credits-Remaining": "0"})
    refused = _refusal(request, account)
    if refused is not None:
        return refused
    # WS_MAX_CONNECTIONS_PER_KEY counts across the workers of a host and the replicas sharing Redis.
    cap, held = settings.ws_max_connections_per_key, app[WS_HELD]
    counted = bool(cap) and account != OPEN_ACCOUNT  # open mode: every client is one account
    hold = await held.take(account, cap) if counted else None
    if counted and hold is None:
        # One key cannot hold the connection slots every key shares (MAX_CONNECTIONS); refused unread.
        error = JsonRpcError(
            LIMIT_EXCEEDED,
            f"too many WebSocket connections for this key: at most {cap} (WS_MAX_CONNECTIONS_PER_KEY)",
            http_status=429,
        )
        return error_response(error, {"X-Credits-Charged": "0", "Retry-After": "5"})
    # Other rpc-proxies' marks, carried on by the socket's calls (via.py), every Via line read.
    received = via.marks(", ".join(request.headers.getall("Via"))) if "Via" in request.headers else None
    marks = via.RECEIVED.set(received) if received is not None else None
    try:
        return await _open(request, account)
    finally:
        if marks is not None:
            via.RECEIVED.reset(marks)
        if hold is not None:
            await held.release(account, hold)


async def _open(request: web.Request, account: str) -> web.StreamResponse:
    """The socket of `account`, admitted: served until either side closes it."""
    app = request.app
    gateway, metrics, settings = app[GATEWAY], app[METRICS], app[SETTINGS]
    network = gateway.router.network_for(request.host, request.match_info.get("network"), websocket=True)
    # aiohttp refuses a message of max_msg_size bytes itself; WS_MAX_MESSAGE_BYTES is the largest one served.
    ws = CountedSocket(max_msg_size=settings.ws_max_message_bytes + 1, heartbeat=30.0)
    refused = _not_an_upgrade(request)
    if refused is not None or not ws.can_prepare(request).ok:
        return refused or error_response(JsonRpcError(INVALID_REQUEST, "expected a WebSocket upgrade", http_status=400))
    masks = _masked_only(request, metrics)
    await ws.prepare(request)

    loop = asyncio.get_running_loop()
    connection = Connection(ws, account, loop.time())
    app[WEBSOCKETS].add(connection)
    metrics.ws_connections.inc()
    slots = asyncio.Semaphore(settings.ws_max_inflight)
    streams = app[STREAMS]
    session = Session(
        ws, request.transport, account, network, gateway, streams.feeds, streams.relays, settings, metrics, streams.held
    )
    session.start()
    connection.recheck = _rechecker(connection, session, gateway, api_key(request), request.headers.get("Origin"))
    idle = asyncio.create_task(_close_when_idle(connection, session, settings.ws_idle_timeout))
    corked = Corked(ws, request.transport, loop, session.room)
    # Its calls' answers in the process's count of answers not yet taken (per key, per process).
    transport = request.transport
    room = asyncio.Event()  # set when bytes are taken anywhere: its calls waiting for room look again
    owed = Account(app[FRONT].endpoint.answer_bytes, loop, lambda: unsent_or_reset(transport), room.set)
    sized = Estimate(settings.ws_send_buffer_bytes)  # its next answer, against the socket's own bound
    owed.keyed((None, api_key(request)))
    calls = _Calls(
        ws,
        connection,
        session,
        gateway,
        account,
        network,
        metrics,
        corked,
        owed,
        sized,
        slots,
        loop,
        room,
        settings.max_batch_size,
    )

    try:
        if masks is None or masks.opened():  # else closed with 1002: what it sent is never read
            try:
                async for message in ws:
                    if message.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
                        continue  # ERROR (e.g. a message over the size limit) ends the loop as aiohttp closes
                    await calls.take(message.data)
            except ConnectionError:  # a client going away is no internal error
                log.debug("a WebSocket closed while its messages were answered")
        if connection.draining:
            # close() from the shutdown hook woke this loop; returning now would drop the
            # connection before the close frame is written.
            await connection.closed.wait()
    finally:
        corked.flush()
        idle.cancel()
        owed.close()
        room.set()  # its calls waiting for room see it closed
        await session.close()
        if not connection.draining:
            for task in list(connection.tasks):
                task.cancel()  # the peer is gone: nobody to answer
        app[WEBSOCKETS].discard(connection)
        metrics.ws_connections.dec()
    return ws


def _not_an_upgrade(request: web.Request) -> web.Response | None:
    """What aiohttp would upgrade but RFC 6455 and RFC 9110 do not: version 13 only (426 naming it;
    aiohttp took 7 and 8 too), never an HTTP/1.0 request (RFC 9110 7.8: its Upgrade is ignored), never
    one with a body (read as frames, its framing and the WebSocket's disagreed)."""
    if request.headers.getall("Sec-WebSocket-Version", ["13"]) != ["13"]:  # aiohttp read the first of two
        error = JsonRpcError(INVALID_REQUEST, "expected WebSocket version 13", http_status=426)
        return error_response(error, {"Sec-WebSocket-Version": "13"})
    if (
        request.version < HttpVersion11
        or request.headers.get("Content-Length", "0") != "0"
        or request.headers.get("Transfer-Encoding")
    ):
        return error_response(JsonRpcError(INVALID_REQUEST, "expected a WebSocket upgrade", http_status=400))
    return None


def _masked_only(request: web.Request, metrics: Metrics) -> MaskedOnly | None:
    """RFC 6455 section 5.1: a client's frame not masked closes its connection with 1002; a message
    not yet whole holds room among the host's bodies and has BODY_TIMEOUT to finish (ws_masks.py).
    None: the connection is gone already (aiohttp's prepare says so)."""
    transport, peer, app = request.transport, request.remote, request.app
    settings = app[SETTINGS]

    def closed(reason: str) -> None:
        metrics.ws_protocol_closes.labels(reason).inc()
        log.debug("closing a WebSocket from %s for what it sent (%s)", peer, reason)

    if transport is None:
        return None
    # aiohttp refuses a larger message as its header comes: no more than that is ever held.
    unfinished = Unfinished(app[FRONT].endpoint.receiving, settings.ws_max_message_bytes + 1, settings.body_timeout)
    return MaskedOnly.install(request.protocol, transport, closed, unfinished)


ROOM_WAIT_MAX = 1.0  # seconds a call waiting for room goes without a look at its socket (closed?)


@dataclass(eq=False)
class _Calls:
    """One socket's messages: refused while it drains or once its key is revoked; a hit the hot path
    pays for sent at once (corked with its burst); any other served as a task, at most WS_MAX_INFLIGHT
    at once, its answer made in room (_made_in_room) and sent as the gateway encoded it."""

    ws: web.WebSocketResponse
    connection: Connection
    session: Session
    gateway: Gateway
    account: str
    network: NetworkRuntime | None
    metrics: Metrics
    corked: Corked
    owed: Account  # its calls' answers in the process's count of answers not yet taken
    sized: Estimate  # its next answer, against the socket's own bound
    slots: asyncio.Semaphore  # WS_MAX_INFLIGHT
    loop: asyncio.AbstractEventLoop
    room: asyncio.Event  # bytes were taken somewhere: a call waiting for room looks again
    max_batch: int  # MAX_BATCH_SIZE: a refused message is read as a served one is (refusal)
    messages: int = 0  # bytes of the messages its calls hold, from their reading to their end

    async def take(self, data: str | bytes) -> None:
        """One text or binary message read from the socket."""
        connection, ws = self.connection, self.ws
        if connection.draining or connection.revoked:  # a removed key never falls back to another's terms
            answer = refusal(data, REVOKED if connection.revoked else SHUTTING_DOWN, self.max_batch)
            if answer is not None:
                await ws.send_frame(answer, WSMsgType.TEXT)
            return
        connection.active_at = self.loop.time()
        lookup = memory_lookup(self.gateway, data, self.account, self.network)
        if not isinstance(lookup, Lookup) and self.owed.room():  # a PaidHit (values.py): now, no task
            await self._sent(lookup[4])
            return
        if not await self._messages_fit(len(data)):
            return
        await self.slots.acquire()
        self.messages += len(data)  # until its task ends (_serve)
        task = asyncio.create_task(self._serve(data, lookup))
        connection.tasks.add(task)
        connection.messages[task] = data
        task.add_done_callback(connection.tasks.discard)
        task.add_done_callback(connection.messages.pop)

    async def _messages_fit(self, size: int) -> bool:
        """Whether the messages its calls still hold, with one of `size` bytes, fit the socket's bound
        (MAX_PENDING_ANSWER_BYTES), waited for with the socket unread (a call's ending looks again).
        Up to WS_MAX_INFLIGHT messages of WS_MAX_MESSAGE_BYTES each waited for room, held where no
        count saw them (4 sockets of 60 messages of 4 MB: 570 MB). False: the socket closed meanwhile.
        (Not in the answer counts: a call waiting for room would wait for its own message.)"""
        while self.messages and self.messages + size > self.owed.budget.per_connection:
            if self.session.closed:
                return False
            self.room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.room.wait(), ROOM_WAIT_MAX)
        return True

    async def _sent(self, hit: bytes) -> None:
        """A memory hit's answer sent, in its key's and the process's count as any answer (a hit sent
        where no bound saw it let sockets that read nothing hold hundreds of MB in the kernel)."""
        owed = self.owed
        owed.enqueued(len(hit))
        try:
            await self.corked.send(hit)
        finally:
            owed.wrote(len(hit), dequeued=True)

    async def _serve(self, data: str | bytes, lookup: Lookup | PaidHit) -> None:
        ws, session, owed = self.ws, self.session, self.owed
        self.metrics.inflight.inc()
        try:
            if not isinstance(lookup, Lookup):  # a hit waiting for room, as a task: the socket is still read
                if await _room_for(owed, session, self.room):
                    await self._sent(lookup[4])
                return
            call = subscription_call(data)
            if call is not None:  # subscriptions are this connection's, never the gateway's
                await session.handle(call)
                return
            reply = await _made_in_room(
                owed,
                self.sized,
                session,
                self.room,
                len(data),
                lambda: self.gateway.handle(data, self.account, self.network, lookup, owed),
            )
            if reply is None or reply.body is None:
                return  # closed, or a slow consumer closed for it
            unsent = len(reply.body)
            try:
                if not ws.closed and await session.room():
                    await ws.send_frame(reply.body, WSMsgType.TEXT)  # the encoded answer, never decoded
                    owed.wrote(unsent, dequeued=True)
                    unsent = 0
            finally:
                owed.dropped(unsent)
        except ConnectionError:  # the peer left: aiohttp's drain raises a plain one ("Connection lost")
            log.debug("a WebSocket closed before its answer was written")
        except Exception:
            log.exception("internal error serving a WebSocket message")
            answer = refusal(data, JsonRpcError(INTERNAL_ERROR, "internal error"), self.max_batch)
            if answer is not None and not ws.closed:
                with contextlib.suppress(ConnectionError):  # the peer may be gone as well
                    await ws.send_frame(answer, WSMsgType.TEXT)
        finally:
            self.messages -= len(data)
            self.room.set()  # a message waiting to be read may fit now (_messages_fit)
            self.metrics.inflight.dec()
            self.slots.release()


async def _room_for(owed: Account, session: Session, room: asyncio.Event) -> bool:
    """Whether its key and the process (MAX_PENDING_ANSWER_BYTES_PER_KEY, _PER_PROCESS) have room for
    the socket's next answer, waited for (counted in rpc_proxy_requests_waiting_for_room) until bytes
    are taken anywhere, not on a timer: thousands of waiting calls cost nothing while none are; a look
    every ROOM_WAIT_MAX seconds at most sees the socket closed. False: the socket closed meanwhile."""
    if owed.room():
        return True
    budget = owed.budget
    budget.waiting += 1
    try:
        while not owed.room():
            if session.closed:
                return False
            room.clear()
            owed.wait()  # room.set once bytes are taken anywhere (its own measured meanwhile)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(room.wait(), ROOM_WAIT_MAX)
        return True
    finally:
        budget.waiting -= 1


async def _made_in_room(
    owed: Account,
    sized: Estimate,
    session: Session,
    room: asyncio.Event,
    body: int,
    make: Callable[[], Awaitable[Reply]],
) -> Reply | None:
    """A call's answer, made once its key and the process (MAX_PENDING_ANSWER_BYTES_PER_KEY,
    _PER_PROCESS) and its socket (WS_SEND_BUFFER_BYTES) have room for it, reckoned at the socket's
    largest recent answer while it is made: an answer made and unsent held memory no bound saw.
    None: the socket closed meanwhile."""
    if not await _room_for(owed, session, room):
        return None
    reserved = sized.size
    if not await session.room(reserved):
        return None
    session.making += reserved
    owed.making_one(body)
    reply: Reply | None = None
    try:
        reply = await make()
    finally:
        session.making -= reserved
        size = len(reply.body) if reply is not None and reply.body is not None else 0
        sized.saw(size)
        owed.made(size, True, body)
    return reply


def _refusal(request: web.Request, account: str) -> web.Response | None:
    """An origin the key does not allow."""
    refusal = origin_check(request.app[GATEWAY], account, request)  # a browser's handshake carries its page's Origin
    return error_response(refusal, {"X-Credits-Charged": "0"}) if refusal is not None else None


def _rechecker(
    connection: Connection, session: Session, gateway: Gateway, secret: str, origin: str | None
) -> Callable[[], None]:
    """What a reload of keys does to this socket: a key removed, or whose secret changed, is refused at
    once (its subscriptions end with an error notification, then close 1008); an Origin its new
    allowed_origins refuses is closed the same way; a subscription its new lists refuse is ended.
    New balances and rates need nothing here: every call and notification is charged under them."""

    def recheck() -> None:
        if connection.revoked or connection.draining:
            return
        if gateway.account(secret) != connection.account:
            _revoke(connection, session, REVOKED, b"API key revoked: removed or changed by a reload")
            return
        lists = gateway.key_lists.get(connection.account)
        refusal = None if lists is None else origin_refusal(lists, origin)
        if refusal is not None:
            _revoke(connection, session, refusal, b"origin no longer allowed for this API key")
            return
        session.recheck()

    return recheck


def _revoke(connection: Connection, session: Session, error: JsonRpcError, reason: bytes) -> None:
    connection.revoked = True
    log.warning("closing a WebSocket of account %s: %s", connection.account, reason.decode())

    async def close() -> None:
        await session.revoke(error)
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await connection.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=reason)
        except (TimeoutError, ConnectionError):
            if session.transport is not None:
                session.transport.abort()  # a peer that reads nothing gets no close frame either

    spawn(_closing, close())


def recheck_websockets(connections: set[Connection]) -> None:
    """After a reload of keys (Gateway.reloaded): every open socket checks its key again."""
    for connection in list(connections):
        if connection.recheck is not None:
            connection.recheck()


def memory_lookup(
    gateway: Gateway, data: str | bytes, account: str, network: NetworkRuntime | None
) -> PaidHit | Lookup:
    """The hot path's answer to one message (open mode; a keyed hit its lease pays for), as the HTTP
    endpoint makes it: a PaidHit to send now, else what the general path takes (Hits)."""
    hits = gateway.hits
    return hits.open(data, network) if gateway.open_mode else hits.keyed(data, account, network)


async def _close_when_idle(connection: Connection, session: Session, timeout: float) -> None:
    """WS_IDLE_TIMEOUT: a connection with no subscription, no call in flight and no message for
    `timeout` seconds is closed (1000): answering pings alone does not hold a connection slot."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(max(0.0, connection.active_at + timeout - loop.time()))
        if session.subs or connection.tasks:
            connection.active_at = loop.time()
        elif loop.time() - connection.active_at >= timeout:
            await connection.ws.close(
                code=WSCloseCode.OK, message=f"idle for {timeout:g}s: no subscription and no call".encode()
            )
            return


def refusal(data: str | bytes, error: JsonRpcError, max_batch: int) -> bytes | None:
    """The answer of a message refused whole (its key revoked, the socket draining, its calls cut off
    or failed): `error` for each call with an id, under that id (a batch's in one array), an invalid
    element answered as it would be served; None for notifications only. A message that cannot be
    read at all is answered as when served (-32700 or -32600, id null)."""
    try:
        body = jsonrpc.parse_body(data, max_batch=max_batch)
    except JsonRpcError as unread:
        return jsonrpc.encode_error(None, unread)
    errors = [
        jsonrpc.encode_error(entry.id, entry.error if isinstance(entry, Invalid) else error)
        for entry in body.entries
        if not entry.notification
    ]
    if not errors:
        return None
    return jsonrpc.encode_batch(errors) if body.batch else errors[0]


async def close_websockets(app: web.Application, timeout: float | None = None) -> None:
    """On shutdown: answer what is in flight within `timeout` (SHUTDOWN_TIMEOUT), each call still
    being made then with an error (CUT_OFF), then close each connection with a close frame (1001).
    A connection already drained (CappedSite.stop drains them with the fast connections) is skipped."""
    if timeout is None:
        timeout = app[SETTINGS].shutdown_timeout

    async def drain(connection: Connection) -> None:
        connection.draining = True
        if connection.tasks:
            await asyncio.wait(list(connection.tasks), timeout=timeout)
        try:
            # A batch cut off answers what it made so far (running.BodyRun); any other message, the error.
            cut = dict(connection.messages)
            for task in cut:
                task.cancel(CUT_OFF_REASON)
            if cut:
                await asyncio.wait(list(cut), timeout=CLOSE_TIMEOUT)
            for task, data in cut.items():
                if not task.done():
                    task.cancel()
                elif not task.cancelled():
                    continue  # answered
                answer = refusal(data, CUT_OFF, max_batch)
                if answer is not None and not connection.ws.closed:
                    async with asyncio.timeout(CLOSE_TIMEOUT):
                        await connection.ws.send_frame(answer, WSMsgType.TEXT)
            async with asyncio.timeout(CLOSE_TIMEOUT):  # a peer that never answers the close is not waited for
                await connection.ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
        except (TimeoutError, ConnectionError):
            pass
        finally:
            connection.closed.set()

    connections: set[Connection] = app[WEBSOCKETS]
    max_batch = app[SETTINGS].max_batch_size
    await asyncio.gather(*(drain(c) for c in list(connections) if not c.draining), return_exceptions=True)
