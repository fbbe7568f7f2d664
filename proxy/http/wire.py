"""The HTTP/1.1 bytes of the fast server (front.py) beside the parser's: a request as its callbacks
fill it, an answer's bytes, and a request head written again for a handover to aiohttp."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

import httptools

from proxy.http.answer_bytes import Account
from proxy.http.endpoint import NO_CHARGE, BodyBudget, error_reply
from proxy.logs import Throttled
from proxy.rpc.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, UPSTREAM_UNAVAILABLE, JsonRpcError
from proxy.values import Reply

MAX_LINE = 8190  # bytes of a request target, and of a header value (aiohttp's limits)
MAX_HEADERS = 128
RPC, OTHER, UPGRADE = 1, 2, 3  # what a request is, once its head is complete
log = logging.getLogger("proxy.front")  # the front's: what it refuses and why
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}


class Refused(Exception):
    """Raised in a parser callback: the request is answered with `reply` and the connection closed."""

    latest: Refused | None = None  # the last made: parse_failure's when llhttp's error lost it (a re-read)

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.status)
        self.reply = reply
        Refused.latest = self


def refusal(code: int, message: str, status: int) -> Refused:
    return Refused(error_reply(JsonRpcError(code, message, http_status=status), NO_CHARGE, close=True))


def served_target(url: bytes, method: str, parser: Any) -> bytes:
    """A request target, if served: origin or absolute form, * (asterisk form) for OPTIONS alone and
    authority form for CONNECT (answered 405) (RFC 9112 3.2), any other target read as the root before
    (a JSON-RPC endpoint in open mode); and an
    HTTP version of major 1 (llhttp reads HTTP/2.0's head too: answered as HTTP/1.1 before)."""
    version = parser.get_http_version()
    if version[:2] != "1.":
        raise refusal(INVALID_REQUEST, f"HTTP/{version} is not supported: send HTTP/1.1", 505)
    if url[:1] != b"/" and b"://" not in url and (url != b"*" or method != "OPTIONS") and method != "CONNECT":
        raise refusal(INVALID_REQUEST, "bad request: the request target is a path (or * for OPTIONS)", 400)
    return url


# Pieces of a body under this many bytes are joined as they come: each piece kept apart costs a bytes
# object and a list slot, about 50 bytes, so a body sent in 2-byte chunks held 25 times its bytes.
PIECE = 4096
# A request's own memory beyond its body and its head's bytes (measured: about 1.3 KB for a head of
# two short fields), and each field's (its tuple, its name and value as read and in `headers`).
REQUEST_BYTES = 1536
FIELD_BYTES = 128


class Request:
    __slots__ = (
        "headers",
        "held",
        "http10",
        "keep_alive",
        "kind",
        "method",
        "parts",
        "path",
        "prebuildable",
        "raw",
        "reading",
        "sent_id",
        "size",
        "started",
        "target",
        "timer",
        "url",
        "waits_as",
    )

    def __init__(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.raw: list[tuple[bytes, bytes]] = []
        self.parts: list[bytes | bytearray] = []  # its body's pieces as read (add)
        self.size = 0
        self.kind = 0  # 0 until its head is complete
        self.target: tuple[str | None, str | None] | None = None
        self.path = ""
        self.method = ""
        self.keep_alive = True
        self.http10 = False  # HTTP/1.0: a kept-alive answer says so (read once its head is complete)
        # Read once its head is complete, for a memory hit's pre-built head (front.py): whether its
        # answer may have one while it is kept alive (no access log, no Connection line to write),
        # and the client's own X-Request-Id when it sent a sane one (None: each answer a new id).
        self.prebuildable = False
        self.sent_id: bytes | None = None
        self.started = 0.0
        self.held = 0  # bytes of the body budget it holds
        self.waits_as: tuple[str | None] | None = None  # (its key,) while `held` is a waiting request's
        self.reading = 0  # bytes reckoned in its connection's answer bytes while its body arrives
        self.timer: asyncio.TimerHandle | None = None  # BODY_TIMEOUT's, while its body arrives

    def add(self, piece: bytes) -> None:
        """A piece of its body, joined to the last one while both are small (PIECE)."""
        parts = self.parts
        if parts and len(piece) < PIECE and len(parts[-1]) < PIECE:
            last = parts[-1]
            if isinstance(last, bytes):
                last = parts[-1] = bytearray(last)
            last.extend(piece)
            return
        parts.append(piece)

    def body(self) -> bytes:
        """Its body whole, its pieces let go (the request lives until its answer is written)."""
        parts = self.parts
        if len(parts) == 1 and isinstance(first := parts[0], bytes):
            return first
        body = b"".join(parts)
        self.parts = [body]
        return body

    def hold_read(self, budget: BodyBudget, key: str | None) -> bool:
        """What it holds (reckoned) held in the body budget, as `key`'s, while it (or the rest of its
        body) waits for room."""
        size = self.reckoned()
        if not budget.take_waiting(key, size):
            return False
        self.held, self.waits_as = size, (key,)
        return True

    def reckoned(self) -> int:
        """What it holds: its body as read, its own objects, and its head's fields, each twice (as read,
        and in `headers`). Reckoned by its body alone, held requests of no body were counted as nothing
        (200 connections pipelining 4,000 each in one read: RSS +421 MB)."""
        fields = sum(FIELD_BYTES + 2 * (len(name) + len(value)) for name, value in self.raw)
        return self.size + REQUEST_BYTES + len(self.url) + fields

    def let_go(self, budget: BodyBudget) -> None:
        """Its share of the body budget given back."""
        if self.waits_as is not None:
            budget.give_waiting(self.waits_as[0], self.held)
            self.held, self.waits_as = 0, None
        elif self.held:
            budget.give(self.held)
            self.held = 0

    def hold_body(self, budget: BodyBudget, limit: int, account: Account) -> bool:
        """Its share of the body budget while its body arrives (its declared length, else the limit),
        in place of what it held while it waited, and its body reckoned in its connection's answer
        bytes meanwhile (body_coming)."""
        declared = self.headers.get("content-length")
        held = int(declared) if declared is not None and declared.isdigit() else limit
        self.let_go(budget)
        if not budget.take(held):
            return False
        self.held = held
        self.reading = self.body_coming(limit)
        account.reading(self.reading)
        return True

    def body_coming(self, limit: int) -> int:
        """body_held as its head tells it, before the body is read: its declared length, else (a
        chunked body, a coded one) the most it may hold, `limit` (MAX_BODY_BYTES)."""
        declared = self.headers.get("content-length")
        if "content-encoding" in self.headers or declared is None or not declared.isdigit():
            return limit
        return int(declared)

    def body_held(self, coded: int) -> int:
        """Its body as it will hold memory while made: as decoded, at most `coded` (MAX_BODY_BYTES)."""
        return self.size if "content-encoding" not in self.headers else coded

    def release_body(self, budget: BodyBudget, account: Account) -> bool:
        """Its shares given back and its timer stopped; whether a timer ran (it was counted in flight)."""
        if self.reading:
            account.reading(-self.reading)
            self.reading = 0
        self.let_go(budget)
        timer, self.timer = self.timer, None
        if timer is None:
            return False
        timer.cancel()
        return True


# An answer as written: its bytes, or from SPLIT_FROM bytes of body its head and its body, written
# one after the other, never copied into one: a 30 MB answer was held twice while it was written.
Out = bytes | list[bytes]
SPLIT_FROM = 64 * 1024


def out_size(out: Out) -> int:
    return len(out) if isinstance(out, bytes) else sum(map(len, out))


def encoded_answer(
    reply: Reply, request: Request, date: bytes, request_id: str, last: bool = False
) -> tuple[Out, bool]:
    """An answer as written (Out), and whether the connection closes after it. `request_id`: its
    X-Request-Id (a line of its own: an answer's headers may be a dict shared by many answers);
    `last`: the connection's last answer of a drain (Pipeline.last_of_drain)."""
    close = last or reply.close or not request.keep_alive
    status = reply.status
    body = reply.body or b""
    # "name: value" joined in C (no Python frame per field): every answer but a pre-built hit's comes here.
    fields = "".join(map("%s: %s\r\n".__mod__, reply.headers.items())) + f"X-Request-Id: {request_id}\r\n"
    if status != 204:
        fields += f"Content-Length: {len(body)}\r\n"
    if close:
        fields += "Connection: close\r\n"
    elif request.http10:
        fields += "Connection: keep-alive\r\n"
    lines = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status, fields.encode("latin-1"), date, b"\r\n"]
    if request.method != "HEAD":
        if len(body) >= SPLIT_FROM:
            return [b"".join(lines), body], close
        lines.append(body)
    return b"".join(lines), close


def header_template(headers: Mapping[str, str], numbers: tuple[str, ...] = ()) -> bytes:
    """Header lines for a bytes %-format: the fields named in `numbers` hold a %d each (in the
    headers' order), and any other % is doubled."""
    lines = [f"{name}: {'%d' if name in numbers else value.replace('%', '%%')}\r\n" for name, value in headers.items()]
    return "".join(lines).encode("latin-1")


def request_head(request: Request, version: str) -> bytes:
    """A request's head as llhttp accepted it, read again: by aiohttp's parser (a WebSocket upgrade), or,
    an upgrade to another protocol (h2c), by a new parser here as a plain request, its Upgrade left out
    (RFC 9110 7.8: an Upgrade may be ignored)."""
    head = [b"%s %s HTTP/%s\r\n" % (request.method.encode(), request.url, version.encode())]
    plain = not websocket(request)
    for name, value in request.raw:
        if plain and name.lower() == b"upgrade":
            continue
        if plain and name.lower() == b"connection":
            value = b",".join(t for t in value.split(b",") if t.strip().lower() != b"upgrade")
            if not value.strip():
                continue
        head.append(name + b": " + value + b"\r\n")
    head.append(b"\r\n")
    return b"".join(head)


def take_over(handler: Any, transport: Any, data: bytes, write_paused: bool) -> None:
    """aiohttp's handler takes a connection over, with the bytes already read from it (an upgrade's)."""
    transport.set_protocol(handler)
    handler.connection_made(transport)
    if write_paused:  # the transport calls its resume_writing next: it must have paused
        handler.pause_writing()
    transport.resume_reading()
    handler.data_received(data)


def websocket(request: Request) -> bool:
    return any(name.lower() == b"upgrade" and b"websocket" in value.lower() for name, value in request.raw)


def bodiless_upgrade(request: Request) -> int:
    """UPGRADE, raising Refused (400, closed) for a WebSocket upgrade that declares a body: llhttp ends an
    upgrade at its head, so a body sent apart from it was read as the next request's bytes."""
    length, chunked = request.headers.get("content-length"), "transfer-encoding" in request.headers
    if websocket(request) and (chunked or (length is not None and length.strip() not in ("0", ""))):
        raise refusal(INVALID_REQUEST, "bad request: a WebSocket upgrade carries no body", 400)
    return UPGRADE


def expects_continue(request: Request) -> bool:
    """The client waits for 100 Continue before its body (RFC 9110 10.1.1); never said to HTTP/1.0,
    whose expectation is ignored (15.2: no 1xx to an HTTP/1.0 client)."""
    expect = request.headers.get("expect")
    return expect is not None and expect.lower() == "100-continue" and not request.http10


def parse_failure(exc: httptools.HttpParserError, peer: str | None) -> Reply:
    """The connection's last answer when llhttp stops: a callback's refusal (431, 413...), a fault of
    ours (500, logged), or a request that is not HTTP/1.1 (400)."""
    if isinstance(exc, httptools.HttpParserCallbackError):
        refused = exc.__context__
        if isinstance(refused, httptools.HttpParserUpgrade):
            # A re-read within the upgrade's except (front.upgraded): httptools gives that as the context.
            refused, Refused.latest = Refused.latest, None
        if isinstance(refused, Refused):
            return refused.reply
        log.error("internal error parsing a request", exc_info=refused)
        return error_reply(JsonRpcError(INTERNAL_ERROR, "internal error", http_status=500), NO_CHARGE)
    log.debug("bad request from %s: %s", peer, exc)  # llhttp's reason names no part of the request
    return error_reply(JsonRpcError(INVALID_REQUEST, "bad request: not valid HTTP/1.1", http_status=400), NO_CHARGE)


looping = Throttled(log)


def looped() -> Refused:
    """A request this proxy sent upstream came back to it (via.py): refused at once, never forwarded
    again, as a failed upstream (508 Loop Detected, RFC 5842 7.2)."""
    looping.error("via", "an upstream of this proxy is this proxy itself (its own Via came back): fix the upstream URL")
    return refusal(UPSTREAM_UNAVAILABLE, "loop detected: the upstream is this proxy itself", 508)
