"""The public HTTP/1.1 server: an asyncio Protocol on httptools (llhttp), with no web framework per
request. A cache hit is answered inside data_received with pre-built header bytes; a miss runs as a
task, and answers leave in request order (HTTP/1.1 pipelining). A WebSocket upgrade is handed, with
the bytes already received, to aiohttp's handler on the same transport.

Every limit has one named check: the request line and header sizes, the time a head may take
(KEEPALIVE_TIMEOUT, also the idle keep-alive), the body size (MAX_BODY_BYTES), the bytes all bodies
being received may hold (MAX_INFLIGHT_BODY_BYTES), the time a body may take (BODY_TIMEOUT), and the
answers one connection may have waiting (reading pauses). Modelled on uvicorn's httptools_impl.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from email.utils import formatdate
from typing import Any, cast

import httptools

from proxy import via
from proxy.http.access_log import log_front_request
from proxy.http.endpoint import (
    BUSY_BODIES,
    NO_CHARGE,
    PAID_NUMBERS,
    body_timeout_error,
    error_reply,
    paid_reply,
)
from proxy.http.front_routes import FrontRoutes, request_path
from proxy.http.head_limit import MAX_HEAD_BYTES as MAX_HEAD_BYTES  # re-exported: the limit is the front's
from proxy.http.head_limit import HeadLimit, host_fault_of
from proxy.http.pipeline import Pipeline, closing, cut_off, cut_short, ended, write_hit
from proxy.http.waiting_body import body_waits
from proxy.http.wire import (
    MAX_LINE,
    OTHER,
    RPC,
    UPGRADE,
    Out,
    Refused,
    Request,
    bodiless_upgrade,
    encoded_answer,
    expects_continue,
    header_template,
    looped,
    parse_failure,
    refusal,
    request_head,
    served_target,
    take_over,
    websocket,
)
from proxy.request_ids import IDS, REQUEST_ID, identified, sane
from proxy.rpc.jsonrpc import INVALID_REQUEST, UPSTREAM_UNAVAILABLE
from proxy.values import Reply

log = logging.getLogger("proxy.front")

# The header fields anything reads (lower-case); the others are kept raw, for a WebSocket handover only.
READ_HEADERS = (
    "host",
    "origin",
    "authorization",
    "x-api-key",
    "accept-encoding",
    "content-encoding",
    "content-length",
    "transfer-encoding",
    "expect",
    "access-control-request-headers",
    "connection",
    "x-request-id",
    "via",
)
MAX_TARGETS = 1024  # request targets remembered with their path and route (clients reuse a few)
MAX_HEADS = 512  # request heads remembered for Front.learn, each in a read of at most MAX_REPLAY_BYTES
MAX_REPLAY_BYTES = 4096
_OK = b"HTTP/1.1 200 OK\r\n"
CLOCK_STEP = 0.002  # seconds: twice the resolution of uvloop's loop.time() (libuv's uv_now)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
CUT_OFF_SECONDS = 0.5  # what answers cut off at SHUTDOWN_TIMEOUT get to write their 503
_HIT_HEAD = b"%bX-Request-Id: %b\r\n%b%bContent-Length: %%d\r\n\r\n%%b"  # status, id, fields, Date


# A head ends at the first empty line; partitioned there, the same way for the heads learned and
# those looked up (Front.learn), it is remembered and looked up without that line.
HEAD_END = b"\r\n\r\n"


class Front:
    """The server's side of every fast connection: what it answers with, the open ones, the drain."""

    def __init__(self, routes: FrontRoutes, make_handler: Callable[[], Any]) -> None:
        self.routes = routes
        self.make_handler = make_handler  # aiohttp's handler, for a WebSocket upgrade
        self.connections: set[FrontProtocol] = set()
        self.orphans: set[asyncio.Task[None]] = set()  # answers whose client left
        self.stopping = False
        self.answer_bytes = routes.endpoint.answer_bytes
        self.bodies = routes.endpoint.receiving  # request bodies being read (MAX_INFLIGHT_BODY_BYTES)
        self._date = b""
        self.date_at = 0  # the wall-clock second of the Date line and hit heads
        self.renew_at = 0.0  # the loop time (monotonic) at which that second ends
        # The whole head of a memory hit but its numbers, for `bytes % (...)`: open hits' headers are
        # fixed, paid hits' differ only in their credit figures (rebuilt each second, with the Date);
        # the request id comes first, so a hit's values are `(id, *figures)`.
        endpoint = routes.endpoint
        # X-Verified comes last of them, its value a hit's own (%b).
        self._open_fields = header_template(endpoint.open_headers) + b"X-Verified: %b\r\n"
        paid = {k: v for k, v in paid_reply((0, 0, b"", 0, b"")).headers.items() if k != "X-Verified"}
        self._paid_fields = header_template(paid, PAID_NUMBERS) + b"X-Verified: %b\r\n"
        self.open_answer = self.paid_answer = self.open_answer_sent = self.paid_answer_sent = b""
        self.limit_digits = len(str(endpoint.max_body_bytes))
        wanted = [*READ_HEADERS, *([routes.trusted_header] if routes.trusted_header else [])]
        self._read_headers = {name.encode("latin-1"): name for name in wanted}
        # Field names as clients spell them -> the lower-case name read, or "" (not read): a client
        # spells its few names the same way every time, so one lookup replaces lower() and a lookup.
        self.header_names: dict[bytes, str] = {}
        self.targets: dict[bytes, tuple[str, tuple[str | None, str | None] | None]] = {}  # request target memo
        self.request_heads: dict[bytes, Request] = {}  # Front.learn (a key in a head: forgotten with the keys)
        endpoint.gateway.forget_keys.append(self.request_heads.clear)

    def read_fields(self, request: Request) -> bool:
        """A head's fields into `request.headers`: only those something reads (lower-case), and the
        first of repeated ones, as aiohttp, but Content-Encoding's, Transfer-Encoding's and Via's lines
        joined as one list (a Via mark in any line is seen: via.py); whether Host was repeated (only a
        repeat costs a look). A transfer coding other than chunked alone is 501 (RFC 9112 section 6.1):
        llhttp frames `gzip, chunked` as chunked and the gzip was never undone."""
        names, headers = self.header_names, request.headers
        repeated_host = False
        for name, value in request.raw:
            key = names.get(name)
            if key is None:
                key = self.header_name(name)
            if key:
                if key not in headers:
                    headers[key] = value.decode("latin-1")
                elif key == "host":
                    repeated_host = True
                elif key in ("content-encoding", "transfer-encoding", "via"):  # RFC 9110 5.3: one list
                    headers[key] += ", " + value.decode("latin-1")
        coding = headers.get("transfer-encoding")
        if coding is not None and request.http10:  # RFC 9112 6.1: an HTTP/1.0 message so framed is faulty
            raise refusal(INVALID_REQUEST, "bad request: Transfer-Encoding in an HTTP/1.0 request", 400)
        if coding is not None and coding.strip().lower() != "chunked":
            raise refusal(INVALID_REQUEST, f"bad request: transfer coding {coding[:40]!r} (only chunked is read)", 501)
        return repeated_host

    def target(self, url: bytes) -> tuple[str, tuple[str | None, str | None] | None]:
        """A request target's path, and its (network, key) when it is a JSON-RPC path (remembered)."""
        targets = self.targets
        known = targets.get(url)
        if known is None:
            path = request_path(url)
            known = path, self.routes.rpc_target(path, self.routes.root_rpc)
            if len(targets) >= MAX_TARGETS:
                targets.clear()
            targets[url] = known
        return known

    def header_name(self, name: bytes) -> str:
        """The lower-case name of a field something reads, or "" (remembered per spelling)."""
        key = self._read_headers.get(name.lower(), "")
        if len(self.header_names) < MAX_TARGETS:
            self.header_names[name] = key
        return key

    def learn(self, data: bytes, request: Request) -> None:
        """`data` was one whole request, begun and complete in it, answered from memory or sent on as a
        miss, kept alive, with no access log (its start time is each request's own): its head is
        remembered with what llhttp's callbacks made of it. Read from a message boundary, the same head
        followed by exactly as many body bytes is the same request but its body, and FrontProtocol
        answers it without the parser (clients send the same head again and again on a connection).
        A head is remembered only when it ends at the first empty line and the rest of `data` is the
        body as llhttp gave it (no chunks, nothing after it), and never with Expect (its 100 Continue)."""
        head, end, body = data.partition(HEAD_END)
        if not end or len(data) > MAX_REPLAY_BYTES or "expect" in request.headers:
            return
        if len(body) != request.size or body != b"".join(request.parts):
            return
        if len(self.request_heads) >= MAX_HEADS:
            self.request_heads.clear()
        request.parts, request.raw = [], []  # the body is each replay's own; raw fields serve a handover only
        self.request_heads[head] = request

    def date(self, loop_now: float) -> bytes:
        """The Date header's line, made once a second (with the hit heads that carry it). `loop_now`:
        the event loop's time, which a hit reads anyway: the wall clock is read once a second."""
        if loop_now >= self.renew_at:
            wall = time.time()
            second = int(wall)
            # 2 ms early: uvloop's time has millisecond steps, and a late renewal would show the last second.
            self.renew_at = loop_now + (second + 1 - wall) - CLOCK_STEP
            if second != self.date_at:
                self.date_at = second
                self._date = date = b"Date: " + formatdate(second, usegmt=True).encode() + b"\r\n"
                # A new id's head holds this process's prefix and takes the number (%x); a client's
                # own id's head takes the whole id (%b).
                new = IDS.prefix.encode() + b"%x"
                self.open_answer = _HIT_HEAD % (_OK, new, self._open_fields, date)
                self.paid_answer = _HIT_HEAD % (_OK, new, self._paid_fields, date)
                self.open_answer_sent = _HIT_HEAD % (_OK, b"%b", self._open_fields, date)
                self.paid_answer_sent = _HIT_HEAD % (_OK, b"%b", self._paid_fields, date)
        return self._date

    def protocol(self) -> FrontProtocol:
        return FrontProtocol(self)

    async def shutdown(self, timeout: float) -> None:
        """Requests already read are answered, the last answer of each connection saying Connection:
        close (RFC 9112 9.6), within `timeout` seconds; answers still being made then are cut off,
        each answered 503 (Pipeline.cut_off), and every connection closes."""
        self.stopping = True
        for connection in list(self.connections):
            connection.pipeline.stop()  # closed now when idle, else once its answers are written
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        cut = [task for connection in list(self.connections) for task in cut_off(connection.pipeline)]
        if cut:  # each writes its 503 as it ends (Pipeline._awaited)
            await asyncio.wait(cut, timeout=CUT_OFF_SECONDS)
        for connection in list(self.connections):
            connection.pipeline.abort()
        for task in list(self.orphans):
            task.cancel()


class FrontProtocol(asyncio.Protocol):
    """One client connection of the fast server: llhttp's callbacks read its requests, its Pipeline
    writes their answers in order."""

    def __init__(self, front: Front) -> None:
        self._front = front
        self._routes = front.routes
        self._endpoint = front.routes.endpoint
        self._access_log = front.routes.access_log
        self.parser = httptools.HttpRequestParser(self)
        self._loop = asyncio.get_running_loop()
        self._delegate: Any = None  # aiohttp's handler, once the connection is handed over
        self._peer: str | None = None
        self.request: Request | None = None  # the request being read, from its first byte to its last
        self._begun = 0  # requests begun in the data being fed
        self._kept_alive = True  # every request so far keeps the connection open
        self._learnable: Request | None = None  # ...and the one answered as a memory hit or a miss (Front.learn)
        self.upgrading: Request | None = None
        self._limit = HeadLimit()
        self.pipeline = Pipeline(self, front, self._loop)
        self._counted = front.answer_bytes  # answers made and not yet taken (answer_bytes.py)

    def pause_writing(self) -> None:
        self.pipeline.pause_writing()

    def resume_writing(self) -> None:
        self.pipeline.resume_writing()

    @property
    def transport(self) -> Any:
        """The connection's transport while it is open (PeerCounts asks), whoever serves it."""
        return self._delegate.transport if self._delegate is not None else self.pipeline.transport

    # --- the connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        address = transport.get_extra_info("peername")
        self._peer = str(address[0]) if isinstance(address, tuple) and address else None
        self._front.connections.add(self)
        self.pipeline.opened(cast(asyncio.Transport, transport))

    def connection_lost(self, exc: Exception | None) -> None:
        self._front.connections.discard(self)
        request, self.request = self.request, None  # its body's pieces let go (PeerCounts keeps it until a sweep)
        cut_short(self.pipeline, request, self._release)
        self.pipeline.lost(self._front.orphans)

    def eof_received(self) -> bool:
        """Its client sends nothing more: what it sent whole is answered, then it closes (pipeline.ended)."""
        request, self.request = self.request, None
        cut_short(self.pipeline, request, self._release)
        return ended(self.pipeline)

    # --- bytes in -----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.pipeline.done:
            return
        # At a message boundary of a connection kept alive: `data` starts a request (after one that
        # closes the connection, llhttp takes no more, and nor does a replay).
        fresh = self.request is None and self._kept_alive
        if fresh:
            if len(data) <= MAX_REPLAY_BYTES and not self._front.stopping:
                head, end, body = data.partition(HEAD_END)
                known = self._front.request_heads.get(head)
                # Not when it must wait for room (answer_bytes.py; one look while no answer is held).
                if (
                    known is not None
                    and end  # else `head` is all of `data`, a head not yet whole
                    and len(body) == known.size
                    and (not self._counted.held or not self.pipeline.holds(known))
                ):
                    self._rpc(known, body)  # the head llhttp accepted before, and its whole body
                    return
            self._begun = begun = 0
            self._learnable = None
        else:
            begun = self._begun
        limit = self._limit
        limit.body_read = limit.heads_read = 0  # (HeadLimit's counts of this read; inline: every read)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            if self.upgrading is not None:  # else a CONNECT, answered as any other request and closed after it
                upgraded(self, data[upgrade.args[0] :])
            return
        except httptools.HttpParserError as exc:
            self._last(parse_failure(exc, self._peer))
            return
        request = self.request
        learnable, self._learnable = self._learnable, None  # held no longer than the read that answered it
        if request is None:
            if fresh and learnable is not None and self._begun == 1:
                self._front.learn(data, learnable)
            return
        if not request.kind:  # its head is still arriving
            if limit.over(data, self._begun != begun):
                self._last(refusal(INVALID_REQUEST, "request header fields too large", 431).reply)
        elif request.timer is None and (
            request.kind == OTHER  # a body nothing reads: within BODY_TIMEOUT all the same
            or (request.kind == RPC and not body_waits(self.pipeline, request))  # else read on once there is room
        ):
            self.receive(request)

    def receive(self, request: Request) -> bool:
        """A body still arriving is read on, room found for it: it holds its share of the body budget
        and is reckoned in its answer bytes, within BODY_TIMEOUT (one nothing reads: that alone). False: refused."""
        endpoint, account = self._endpoint, self.pipeline.account
        if request.kind == RPC and not request.hold_body(endpoint.receiving, endpoint.max_body_bytes, account):
            self._last(error_reply(BUSY_BODIES, NO_CHARGE, close=True))
            return False
        request.timer = self._loop.call_later(endpoint.body_timeout, self._body_late, request)
        endpoint.inflight.inc()  # a request waiting for its body is being served
        return True

    def _body_late(self, request: Request) -> None:
        if self.request is request and self.pipeline.read_paused:  # not late while none of it is read
            request.timer = self._loop.call_later(self._endpoint.body_timeout, self._body_late, request)
        elif self.request is request:
            self._last(error_reply(body_timeout_error(self._endpoint.body_timeout), NO_CHARGE, close=True))

    def _release(self, request: Request) -> None:
        if request.release_body(self._endpoint.receiving, self.pipeline.account):
            self._endpoint.inflight.dec()

    # --- parser callbacks (httptools) ---------------------------------------------------------

    def on_message_begin(self) -> None:
        # From its first byte, which leaves no doubt whether a request is under way (data_received).
        self.request = Request()
        self._limit.begin()
        self._begun += 1

    def on_url(self, url: bytes) -> None:
        request = self.request
        assert request is not None
        request.url += url
        if len(request.url) > MAX_LINE:
            raise refusal(INVALID_REQUEST, f"request target too long: at most {MAX_LINE} bytes", 414)

    def on_header(self, name: bytes, value: bytes) -> None:
        raw = self.request.raw  # type: ignore[union-attr]
        self._limit.field(name, value, len(raw))
        raw.append((name, value))

    def on_headers_complete(self) -> None:
        request, parser = self.request, self.parser
        assert request is not None
        limit = self._limit  # at most its bytes in this read (HeadLimit.heads_read; inline: every head)
        limit.heads_read += len(request.url) + limit.field_bytes + 2 * len(request.raw) + 13 - limit.head_bytes
        request.http10 = parser.get_http_version() == "1.0"
        repeated_host = self._front.read_fields(request)
        headers = request.headers
        if self._access_log:
            request.started = time.perf_counter()
        request.keep_alive = parser.should_keep_alive()
        host_fault = host_fault_of(headers.get("host"), repeated_host, request.http10)
        if host_fault:
            raise refusal(INVALID_REQUEST, host_fault, 400)
        if "via" in headers:
            if via.looped(headers["via"]):
                raise looped()
            if via.too_many(headers["via"]):
                raise refusal(UPSTREAM_UNAVAILABLE, f"loop detected: Via names over {via.MAX_PROXIES} proxies", 508)
            if via.exhausted(headers["via"]):  # its upstream would refuse it once this proxy's mark is added
                raise refusal(UPSTREAM_UNAVAILABLE, f"loop detected: Via has {via.MAX_PROXIES} rpc-proxy marks", 508)
        request.prebuildable = not self._access_log and ("connection" not in headers or not request.http10)
        sent = headers.get("x-request-id")
        request.sent_id = sent.encode() if sent is not None and sane(sent) else None
        request.method = parser.get_method().decode("ascii")
        if parser.should_upgrade():
            if request.method != "CONNECT":  # llhttp reads no body after such a head (upgraded)
                request.kind = bodiless_upgrade(request)
                return
            request.keep_alive = False  # answered as any other request (a JSON-RPC error), then closed
        request.path, target = self._front.target(served_target(request.url, request.method, parser))
        if target is None or request.method != "POST":
            request.kind = OTHER
            if "expect" in headers and expects_continue(request):  # answered once its body is read
                self.pipeline.after_held(_CONTINUE, False)
            return
        request.kind, request.target = RPC, target
        declared = headers.get("content-length")
        # Refused before a byte of it is read; a length of fewer digits than the limit's is within it.
        if (
            declared is not None
            and len(declared) >= self._front.limit_digits
            and declared.isdigit()
            and int(declared) > self._endpoint.max_body_bytes
        ):
            raise Refused(closing(self._endpoint.too_large()))
        if "expect" in headers and expects_continue(request):
            if (refused := self._endpoint.refused_head(target[1], headers)) is not None:
                raise Refused(closing(refused))  # a final answer, not 100 (RFC 9110 10.1.1)
            self.pipeline.after_held(_CONTINUE, False)  # after the answers before it

    def on_body(self, body: bytes) -> None:
        request = self.request
        assert request is not None
        self._limit.body_read += len(body)  # (a body no route reads too: none of it is the next head's)
        if request.kind != RPC:
            return  # nothing else reads a body
        request.size += len(body)
        if request.size > self._endpoint.max_body_bytes:
            raise Refused(closing(self._endpoint.too_large()))
        request.add(body)

    def on_message_complete(self) -> None:
        request = self.request
        assert request is not None
        self.request = None
        self.pipeline.waiting_body.end(request)  # if its body waited for room, read whole
        if request.timer is not None or request.held:
            self._release(request)
        if request.kind == UPGRADE:
            self.upgrading = request  # handed over when feed_data raises HttpParserUpgrade
            return
        self._kept_alive = request.keep_alive
        if self._front.stopping:
            # Draining: the requests of this read are made once it is read whole, so the last one's
            # answer is known as the last (Pipeline.last_of_drain: it says Connection: close).
            self.pipeline.hold(request)
            self._loop.call_soon(self.pipeline.run_held)
            return
        if self.pipeline.holds(request):
            self.pipeline.hold(request)
            return
        self._dispatch(request)

    def make_held(self, request: Request) -> None:
        self._dispatch(request)
        self._learnable = None  # made after its read: Front.learn is for a request and its own read

    def _dispatch(self, request: Request) -> None:
        if request.kind == RPC:
            body = request.body()
            if self._access_log:
                identified(request.headers.get("x-request-id"), self._rpc, request, body)
            else:
                self._rpc(request, body)
        else:
            answer = self._routes.answer(request.method, request.path, request.headers, request.url)
            self.pipeline.answer(request, answer)

    # --- answers out --------------------------------------------------------------------------

    def _rpc(self, request: Request, body: bytes) -> None:
        """A JSON-RPC request's answer: `request` is read, never changed (a replayed head's is shared)."""
        headers = request.headers
        endpoint = self._endpoint
        # A hit's head is pre-built for a keep-alive answer with no Connection header and no log line.
        prebuilt = request.keep_alive and request.prebuildable and not self._front.stopping
        if "content-encoding" in headers:
            decoded = self._routes.decoded(request, body)
            if isinstance(decoded, Reply):
                self.pipeline.answer(request, decoded)
                return
            body = decoded
        network, key = request.target  # type: ignore[misc]
        answer = endpoint.serve(key, network, headers, body, request.path, self.pipeline.account)
        if type(answer) is tuple:  # a memory hit (values.PaidHit), needing neither gzip nor CORS headers
            # Its id: the client's own, or a number after this process's prefix (request_ids.py).
            if prebuilt and write_hit(self.pipeline, answer, endpoint.open_mode, request.sent_id or IDS.count()):
                self._learnable = request
                return
            answer = endpoint.hit_reply(answer)
        elif prebuilt and len(body) <= MAX_REPLAY_BYTES and not isinstance(answer, Reply):
            self._learnable = request  # a miss: its head, kept alive with no log line, is as a hit's
        self.pipeline.answer(request, answer, len(body))

    def encoded(self, request: Request, reply: Reply, last: bool = False) -> tuple[Out, bool]:
        """The answer's bytes, and whether the connection closes after it (`last`: of a drain)."""
        rid = REQUEST_ID.get() or IDS.of(request.headers.get("x-request-id"))
        if self._routes.access_log:  # every answer's line, not only JSON-RPC's
            log_front_request(self._endpoint.gateway, self._routes.trusted_header, self._peer, request, reply, rid)
        return encoded_answer(reply, request, self._front.date(self._loop.time()), rid, last)

    def _last(self, reply: Reply) -> None:
        """The connection's last answer: nothing more is read from it."""
        request = self.request
        if request is not None:
            self._release(request)
            self.request = None
        reply.close = True
        self.pipeline.last(*self.encoded(request or Request(), reply))

    # --- a WebSocket upgrade: handed to aiohttp (upgraded) -------------------------------------

    def hand_over(self) -> None:
        transport, data = self.pipeline.handed_over()
        self._front.connections.discard(self)
        if transport is None:
            return
        self._delegate = handler = self._front.make_handler()
        take_over(handler, transport, data, self.pipeline.write_paused)


def upgraded(connection: FrontProtocol, rest: bytes) -> None:
    """An upgrade's head was read (llhttp stops there; `rest`: the bytes after it). A WebSocket one is
    handed to aiohttp once the answers before it are written. Another protocol's (h2c, as curl --http2
    sends over http://) is read again by a new parser as a plain request, its Upgrade left out (RFC 9110
    7.8): aiohttp, handed it, dropped its body and the requests after it and held the connection 75 s."""
    request, connection.upgrading = connection.upgrading, None
    assert request is not None
    data = request_head(request, connection.parser.get_http_version()) + rest
    if not websocket(request):
        connection.parser, Refused.latest = httptools.HttpRequestParser(connection), None
        connection.data_received(data)
        return
    connection.pipeline.pause()
    connection.pipeline.handover = data
    if not connection.pipeline.waiting and not connection.pipeline.held:
        connection.hand_over()
