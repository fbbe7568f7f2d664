"""The upstream HTTP/1.1 client: a POST on a kept-alive connection, its answer read by httptools
(llhttp), the parser the public server uses. aiohttp's client spent about 110 µs of CPU per call on
layers a node call never needs (a request object, cookies, redirects, traces); this spends about 25.

Every answer is read under a byte bound the caller gives (no post without one): a body declared
larger is refused at its headers, one that grows past it (chunked, or ending with the connection)
as soon as it does, and the connection is dropped at once, never read further. Only identity
bodies are read: `Accept-Encoding: identity` is asked, and an answer in any other Content-Encoding
is refused at its headers (a few hundred compressed kilobytes may inflate to gigabytes).

One pool per upstream URL: idle connections are reused (newest first), at most `limit` are open,
and callers beyond it wait for one. A connection is never reused after an answer it did not finish
(a timeout, a cancelled hedge, a parse error) or one that said `Connection: close`, nor when idle
longer than `idle_timeout`. `on_connect(alone)` hears of every new connection, and whether no other
post was in flight when it began to be opened (a post that ends while it connects leaves the pool
growing, not reconnecting): a new connection opened alone may reach a restarted node (upstream/state.py
checks its identity again).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Callable
from typing import Protocol
from urllib.parse import urlsplit

import httptools

from proxy import via
from proxy.forwarded import forwarding
from proxy.upstream.scrubbing import basic_credentials


class ClientFault(Exception):
    """A call that got no answer. `unsent`: the node provably never got it (no connection)."""

    def __init__(self, reason: str, *, unsent: bool = False) -> None:
        super().__init__(reason)
        self.unsent = unsent


class TooLarge(Exception):
    """The answer's body passed the caller's limit: `declared` its Content-Length, else `size` the
    bytes read when it was cut off."""

    def __init__(self, size: int, *, declared: bool = False) -> None:
        super().__init__(size)
        self.size = size
        self.declared = declared


class Unreadable(Exception):
    """The answer's headers say its body is not one this client reads (a Content-Encoding it never asked for)."""


class Response:
    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: dict[str, str], body: bytes | bytearray) -> None:
        self.status = status
        self.headers = headers  # lower-case names: those in READ_FIELDS
        self.body = body  # bytes when it came in one read, else the one buffer it was read into

    def take_body(self) -> bytes | bytearray:
        """The body, no longer held here: the future that brought this response is held until its
        reader's turn of the loop ends, and with it the body, after the reply is read from it."""
        body, self.body = self.body, b""
        return body


# Bytes an answer may take on the wire beyond its body's bound: its head and trailers (httptools holds
# a field's value whole until it ends) and chunked framing; a node that sends more is cut off too.
WIRE_SLACK = 64 * 1024


def wire_limit(limit: int) -> int:
    """The most bytes read for an answer whose body is bounded at `limit` (a 1/16 share for framing)."""
    return limit + limit // 16 + WIRE_SLACK


# The fields anything reads of an answer (lower-case); the rest are skipped.
READ_FIELDS = frozenset({"content-length", "content-encoding", "transfer-encoding", "retry-after"})
_NAMES: dict[bytes, str] = {}  # field names as nodes spell them -> lower-case if read, else ""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Response] | None = None
        self.headers: dict[str, str] = {}
        self.body: bytes | bytearray = b""
        self.size = 0
        self.received = 0  # bytes of this answer off the wire, head and framing included
        self.limit = 0
        self.wire_limit = 0
        self.headers_done = False
        self.interim = False  # the head read is a 1xx's: ignored, the final answer follows
        self.reusable = False
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.reusable = False
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if (
                self.headers_done
                and "content-length" not in self.headers
                and "chunked" not in self.headers.get("transfer-encoding", "").lower()
            ):
                self._complete(False)  # a body that ends with the connection (HTTP/1.0 style)
            else:
                waiter.set_exception(ClientFault("the node closed the connection before its answer was complete"))
        self.body = b""  # a partial answer's bytes go with the connection (see _fail)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > self.wire_limit:  # an endless head or framing: the body's own bound never sees it
            self._fail(TooLarge(self.received))
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            self._fail(cause if isinstance(cause, TooLarge | Unreadable) else ClientFault("bad answer"))
        except httptools.HttpParserError as exc:
            self._fail(ClientFault(f"not valid HTTP/1.1: {exc}"))
        except httptools.HttpParserUpgrade:  # (no HttpParserError) a 101, its call answered 101: dropped
            self._fail(ClientFault("an answer switching protocols (101), never asked for"))

    def _fail(self, exc: Exception) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        # Freed now: the parser and this protocol hold each other, so the bytes read so far (up to
        # the bound) would otherwise wait for the cyclic collector, which bytes never prompt.
        self.body = b""
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()  # at once: what the node still sends is never read nor buffered
            self.transport = None

    def close(self) -> None:
        self.body = b""  # an answer left unread (a timeout, a cancelled hedge) is dropped with it
        self.reusable = False
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def on_header(self, name: bytes, value: bytes) -> None:
        key = _NAMES.get(name)
        if key is None:
            key = name.decode("latin-1").lower()
            key = key if key in READ_FIELDS else ""
            if len(_NAMES) < 256:  # a node spells its few field names the same way every time
                _NAMES[name] = key
        if key and key not in self.headers:
            self.headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:  # RFC 9110 15.2: parsed and ignored (100, 103 Early Hints)
            self.interim = True
            return
        self.headers_done = True
        encoding = self.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":  # never asked for: a compressed body's size says nothing of its own
            raise Unreadable(f"an answer in Content-Encoding {encoding[:32]!r}, never asked for")
        declared = self.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            raise TooLarge(int(declared), declared=True)  # not read: no client may be sent it

    def on_body(self, body: bytes) -> None:
        if self.interim:  # a 1xx has no content (RFC 9110 15.2): what llhttp framed as one is dropped
            return
        self.size += len(body)
        if self.size > self.limit:
            raise TooLarge(self.size)
        read = self.body
        if not read:
            self.body = body  # a body in one read is kept as it came
        elif type(read) is bytearray:
            read += body
        else:
            # Then one buffer, grown as reads come: reads kept in a list and joined at the end
            # cost twice the body. Not made at the declared length: a node that declares the
            # bound and sends little would cost the bound.
            buffer = bytearray(read)
            buffer += body
            self.body = buffer

    def on_message_complete(self) -> None:
        if self.interim:  # its fields are not the answer's
            self.interim, self.headers = False, {}
            return
        self._complete(self.parser.should_keep_alive())

    def _complete(self, keep_alive: bool) -> None:
        waiter = self.waiter
        body, self.body = self.body, b""  # an idle connection holds no answer's bytes
        self.reusable = keep_alive and self.transport is not None
        if waiter is not None and not waiter.done():
            waiter.set_result(Response(self.parser.get_status_code(), self.headers, body))

    def begin(self, waiter: asyncio.Future[Response], limit: int) -> None:
        self.waiter = waiter
        self.headers = {}
        self.body = b""
        self.size = 0
        self.received = 0
        self.limit = limit
        self.wire_limit = wire_limit(limit)
        self.headers_done = False
        self.interim = False
        self.reusable = False


class Late(Protocol):
    """Told when a cancelled post's answer came or its deadline passed (HostPool.post)."""

    waits: bool

    def __call__(self, answered: bool) -> None: ...


def _expire(waiter: asyncio.Future[Response]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class HostPool:
    """Kept-alive connections to one upstream URL."""

    def __init__(
        self,
        url: str,
        *,
        limit: int,
        idle_timeout: float,
        on_connect: Callable[[bool], None],
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        parts = urlsplit(url)
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or "localhost"
        self._port = parts.port or (443 if self._tls else 80)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host_field = parts.netloc.rpartition("@")[2]
        credentials = basic_credentials(parts)  # user:password@host, as aiohttp sends it
        auth = f"Authorization: Basic {credentials}\r\n" if credentials is not None else ""
        # NETWORKS_FILE `headers` (checked there: field names, one line of ASCII each).
        auth += "".join(f"{name}: {value}\r\n" for name, value in headers)
        self._fields = (
            f"POST {target} HTTP/1.1\r\nHost: {host_field}\r\n{auth}Content-Type: application/json\r\n"
            "Accept: */*\r\nAccept-Encoding: identity\r\nUser-Agent: rpc-cache-proxy\r\n"
        )
        # An upstream that is this proxy refuses it (via.py); prebuilt for calls that came with no Via.
        self._head = f"{self._fields}Via: {via.field()}\r\nContent-Length: ".encode("latin-1")
        self._limit = limit
        self._idle_timeout = idle_timeout
        self._on_connect = on_connect
        self._posting = 0  # posts in flight
        self._idle: list[_Connection] = []
        self._open = 0
        self._queue: list[asyncio.Future[None]] = []
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self._tls else None
        self._closed = False
        self._late: set[_Connection] = set()  # cancelled posts whose answers are still read (_read_late)

    def _marked(self, received: str) -> bytes:
        """The head of a request made for a call that arrived with a Via: its marks, then this proxy's."""
        return f"{self._fields}Via: {via.forwarded(received)}\r\nContent-Length: ".encode("latin-1", "replace")

    async def post(self, body: bytes, timeout: float, limit: int, late: Late | None = None) -> Response:
        """The node's answer to one POST within `timeout` seconds (TimeoutError, connecting included),
        ClientFault when none came, TooLarge when its body passes `limit` bytes (read no further),
        Unreadable when it comes in a Content-Encoding. The deadline is one timer
        on the answer's future (no timeout scope per call); an idle connection is taken without awaiting.

        `late`: a post cancelled once its request is sent is still being worked on by the node, so its
        answer is read (and dropped) until it comes or the deadline passes; `late` is told then,
        and `late.waits` set at the cancel (a provider's budget counts the call until its answer)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        connection = self._idle_one()
        self._posting += 1
        try:
            if connection is None:
                async with asyncio.timeout_at(deadline):
                    connection = await self._checkout()
            transport = connection.transport
            if transport is None:
                raise ClientFault("the node closed the connection")
            # From here the node may work on it: a caller that leaves now is charged (charging.py); one
            # that left while it waited (a budget, a connection) is not, and it is not written (Abandoned).
            forwarding()
            waiter: asyncio.Future[Response] = loop.create_future()
            timer = loop.call_at(deadline, _expire, waiter)
            connection.begin(waiter, limit)
            received = via.RECEIVED.get()
            head = self._head if received is None else self._marked(received)
            transport.write(b"%s%d\r\n\r\n%s" % (head, len(body), body))
            try:
                return await waiter
            except asyncio.CancelledError:
                # (A waiter done with its answer: it came whole as the cancel did.)
                if late is not None and connection.transport is not None and waiter.cancelled():
                    self._read_late(connection, deadline, late)
                    connection = None  # checked in once its answer is read
                raise
            finally:
                timer.cancel()
        finally:
            self._posting -= 1
            if connection is not None:
                connection.waiter = None
                self._checkin(connection)  # closed unless its answer was read whole

    def _read_late(self, connection: _Connection, deadline: float, late: Late) -> None:
        """A cancelled post's answer, read on (and dropped) until it comes or `deadline` passes; then
        `late` is told whether it came, and the connection checked in (closed unless read whole)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Response] = loop.create_future()
        connection.waiter = waiter  # the answer's reading goes on where it was
        timer = loop.call_at(deadline, _expire, waiter)
        late.waits = True
        self._late.add(connection)

        def done(future: asyncio.Future[Response]) -> None:
            timer.cancel()
            self._late.discard(connection)
            answered = not future.cancelled() and future.exception() is None
            connection.waiter = None
            self._checkin(connection)
            late(answered)

        waiter.add_done_callback(done)

    def _idle_one(self) -> _Connection | None:
        """The newest idle connection still fresh, or None (the older ones past idle_timeout are closed)."""
        if not self._idle:
            return None
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if connection.transport is not None and now - connection.idle_since < self._idle_timeout:
                return connection
            self._dropped(connection)
        return None

    async def _checkout(self) -> _Connection:
        """A connection when none was idle (post looked): one freed while waiting, or a new one."""
        while self._open >= self._limit:
            ready = asyncio.get_running_loop().create_future()
            self._queue.append(ready)
            try:
                await ready
            finally:
                if ready in self._queue:
                    self._queue.remove(ready)
            if self._idle:
                return self._idle.pop()
        self._open += 1
        alone = self._posting <= 1  # judged now: a post that ends while this one connects leaves it not alone
        try:
            _, connection = await asyncio.get_running_loop().create_connection(
                _Connection, self._host, self._port, ssl=self._ssl
            )
        except asyncio.CancelledError:
            self._open -= 1
            self._wake()
            raise
        except OSError as exc:
            self._open -= 1
            self._wake()
            # The kind, not the message (which names the host): a name that does not resolve said so.
            why = "the host name does not resolve" if isinstance(exc, socket.gaierror) else type(exc).__name__
            raise ClientFault(f"cannot connect: {why}", unsent=True) from None
        self._on_connect(alone)
        return connection

    def _checkin(self, connection: _Connection) -> None:
        if connection.reusable and not self._closed:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()
            self._open -= 1
        if self._queue:  # callers waiting for a connection (past `limit`): most posts find none
            self._wake()

    def _dropped(self, connection: _Connection) -> None:
        connection.close()
        self._open -= 1

    def _wake(self) -> None:
        for ready in self._queue:
            if not ready.done():
                ready.set_result(None)
                return

    def close(self) -> None:
        self._closed = True
        for connection in self._idle:
            self._dropped(connection)
        self._idle.clear()
        for connection in list(self._late):  # their answers are read no longer: the node is left
            waiter = connection.waiter
            connection.close()
            if waiter is not None and not waiter.done():
                waiter.set_exception(ClientFault("the pool is closed"))
