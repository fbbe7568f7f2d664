"""The JSON-RPC POST endpoint whatever carries it: a request's key, headers and whole body in, a Reply
out. The fast server (front.py) and aiohttp's route (routes.py) are thin adapters over it.

Header names are read lower-case (`headers.get("origin")`): the fast server keeps them so, and
aiohttp's headers are case-insensitive anyway.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Container, Coroutine, Mapping
from functools import partial
from typing import Any

from proxy import via
from proxy.config import Settings
from proxy.credits.accounts import OPEN_ACCOUNT
from proxy.credits.allow_lists import origin_refusal
from proxy.gateway.gateway import Gateway, invalid_key_error
from proxy.gateway.hits import Lookup
from proxy.gateway.network_routing import websocket_only
from proxy.gateway.running import AnswerRoom
from proxy.http.answer_bytes import AnswerBytes, key_share
from proxy.http.compression import APART_BYTES, Compressor, accepts_gzip
from proxy.http.cors import Cors
from proxy.http.first_answers import key_most
from proxy.logs import redacted
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, JsonRpcError
from proxy.values import PaidHit, Reply
from proxy.workers.host_bytes import HostBytes

log = logging.getLogger("proxy.app")

NO_CHARGE = {"X-Credits-Charged": "0"}
JSON_CONTENT_TYPE = "application/json"
Headers = Mapping[str, str]
Pending = Coroutine[Any, Any, Reply]

RPC_PATH = re.compile(r"^(/[^/]+)?(/ws)?/v3(/[^/]*)?$")  # an answer of 405, not 404, to other methods
BUSY_BODIES = JsonRpcError(
    INTERNAL_ERROR, "server busy: too many request bodies being received", http_status=503, headers={"Retry-After": "1"}
)
HTTP_ERRORS = {
    404: "not found: send JSON-RPC to POST /v3/<API_KEY> or WebSocket /ws/v3/<API_KEY>",
    405: "method not allowed: send JSON-RPC with POST",
}


def body_timeout_error(seconds: float) -> JsonRpcError:
    return JsonRpcError(INVALID_REQUEST, f"request body not received within {seconds:g}s", http_status=408)


def error_reply(error: JsonRpcError, headers: Mapping[str, str] | None = None, *, close: bool = False) -> Reply:
    """A JsonRpcError as its own answer (id null), with its HTTP status and headers."""
    return Reply(
        jsonrpc.encode_error(None, error),
        error.http_status,
        {**error.headers, **(headers or {}), "Content-Type": JSON_CONTENT_TYPE},
        close=close,
    )


def failure_reply(exc: Exception, path: str) -> Reply:
    """A JsonRpcError as its own answer; anything else as -32603, with the details in the log only."""
    if isinstance(exc, JsonRpcError):
        return error_reply(exc, NO_CHARGE)
    log.exception("internal error serving %s", redacted(path))
    return error_reply(JsonRpcError(INTERNAL_ERROR, "internal error", http_status=500), NO_CHARGE)


def fallback_reply(path: str, root_rpc: bool = False, served: Container[str] | None = None) -> Reply:
    """Any other path or HTTP method: a JSON-RPC error, not a framework's text page. `root_rpc`: "/"
    is a JSON-RPC path too (open mode). `served`: the networks' names, where a path's network that is
    none of them is the unknown path it is (404), whatever the method."""
    match = RPC_PATH.match(path)
    network = match[1] if match is not None and (match[2] or match[1] != "/ws") else None
    if network is not None and served is not None and network[1:] not in served:
        match = None  # /<unknown network>/v3/..., /WS/v3/..., /ws/ws/v3/...
    if match is not None and (match[2] or match[1] == "/ws"):  # /<network>/ws/v3/..., /ws/v3/...
        return error_reply(websocket_only(), NO_CHARGE)
    if match is None and not (root_rpc and path == "/"):
        return error_reply(JsonRpcError(INVALID_REQUEST, HTTP_ERRORS[404], http_status=404), NO_CHARGE)
    return error_reply(JsonRpcError(INVALID_REQUEST, HTTP_ERRORS[405], http_status=405), {**NO_CHARGE, "Allow": "POST"})


PAID_NUMBERS = ("X-Credits-Charged", "X-Credits-Remaining")  # a paid hit's figures, in its headers' order


def paid_reply(hit: PaidHit) -> Reply:
    """A paid memory hit as a Reply (for aiohttp, gzip, CORS or the access log)."""
    _, _, verified, _, body = hit
    headers = Gateway.paid_hit_headers(hit)
    headers["Content-Type"] = JSON_CONTENT_TYPE
    headers["X-Verified"] = verified.decode()
    return Reply(body, 200, headers)


def key_of(in_path: str | None, headers: Headers) -> str:
    """The secret a request presents: the path (`/v3/<KEY>`), else `Authorization: Bearer <KEY>`,
    else `X-Api-Key: <KEY>`; "" when it presents none."""
    if in_path:
        return in_path
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return headers.get("x-api-key", "").strip()


class BodyBudget:
    """Bytes that request bodies being received may hold, all clients together: those of the host's
    every worker when `host` is given (WORKERS > 1), else of this process."""

    def __init__(self, limit: int, host: HostBytes | None = None) -> None:
        self.limit = limit
        self.held = 0  # this process's
        self.host = host
        self.waiting: dict[str | None, int] = {}  # of it, by key: what its requests waiting for room hold

    def take_waiting(self, key: str | None, size: int) -> bool:
        """`size` bytes for a request of `key` waiting for room: each key's at most a quarter of the
        budget in this process, so one key's requests left waiting (its connections read nothing)
        cannot fill it (every other key's bodies were answered 503 until those were let go)."""
        held = self.waiting.get(key, 0)
        if (held and held + size > self.limit // 4) or not self.take(size):
            return False
        self.waiting[key] = held + size
        return True

    def give_waiting(self, key: str | None, size: int) -> None:
        self.give(size)
        left = self.waiting[key] - size
        if left:
            self.waiting[key] = left
        else:
            del self.waiting[key]

    def take(self, size: int) -> bool:
        if self.host is not None:
            return self._take_on_host(self.host, size)
        if self.held and self.held + size > self.limit:  # one body of any allowed size always fits
            return False
        self.held += size
        return True

    def _take_on_host(self, host: HostBytes, size: int) -> bool:
        with host.locked():  # two workers cannot both take the last room
            held = self.held + host.others()
            if held and held + size > self.limit:  # one body of any allowed size always fits the host
                return False
            self.held += size
            host.add(size)
        return True

    def give(self, size: int) -> None:
        self.held -= size
        if self.host is not None:
            self.host.add(-size)


class RpcEndpoint:
    """Authorization, routing, the hit paths and the awaited path of one JSON-RPC POST body."""

    def __init__(
        self, gateway: Gateway, metrics: Metrics, settings: Settings, cors: Cors | None, host: HostBytes | None = None
    ) -> None:
        self.gateway = gateway
        self.cors = cors
        self.inflight = metrics.inflight
        self.open_mode = gateway.open_mode
        self.open_headers: dict[str, str] = {**gateway.open_hit_headers, "Content-Type": JSON_CONTENT_TYPE}
        self.max_body_bytes = settings.max_body_bytes
        self.body_timeout = settings.body_timeout
        # Shared by every transport; with workers, the bodies are counted for the host (one flock per
        # body not received in its first read) and a key's answers split evenly (nothing shared on a hit).
        self.receiving = BodyBudget(settings.max_inflight_body_bytes, host)
        self.answer_bytes = AnswerBytes(
            settings.max_pending_answer_bytes,
            key_share(settings.max_pending_answer_bytes_per_key, settings.workers),
            settings.max_pending_answer_bytes_per_process,
        )
        self.answer_bytes.coded_body = settings.max_body_bytes
        first = self.answer_bytes.first
        first.per_key = key_most(settings.upstream_key_concurrency, first.most)
        # A key's account is its count's; in open mode, whatever a path (or header) names: no account is
        # refused, and with none, one client's connections that read nothing held every other's calls.
        if not gateway.open_mode:
            self.answer_bytes.account_of = gateway.account
        self.answer_bytes.secret_of = partial(key_of, None)
        metrics.answer_bytes_pending.set_function(self.answer_bytes.measured)
        metrics.requests_waiting_for_room.set_function(lambda: self.answer_bytes.waiting)
        self.compressor = Compressor(settings.compress_min_bytes, settings.compress_cache_bytes)
        self.compress_from = settings.compress_min_bytes or sys.maxsize  # one comparison per small answer

    def too_large(self) -> Reply:
        return error_reply(
            JsonRpcError(
                INVALID_REQUEST, f"request body too large: the limit is {self.max_body_bytes} bytes", http_status=413
            ),
            NO_CHARGE,
        )

    def authorize(self, key: str, headers: Headers) -> str | Reply:
        """The account the key opens, or its refusal (an unknown key, an origin the key does not allow)."""
        gateway = self.gateway
        account = gateway.account(key)
        if account is None:
            return error_reply(invalid_key_error(), {"X-Credits-Charged": "0", "X-Credits-Remaining": "0"})
        lists = gateway.key_lists.get(account)
        if lists is not None:
            refusal = origin_refusal(lists, headers.get("origin"))
            if refusal is not None:
                return error_reply(refusal, NO_CHARGE)
        return account

    def refused_head(self, in_path: str | None, headers: Headers) -> Reply | None:
        """The refusal a request's head alone earns (an unknown key, an origin its key does not allow),
        answered instead of 100 Continue: a client is not asked for a body that would be refused."""
        if self.open_mode:
            return None
        key = key_of(in_path, headers)
        if key in self.gateway.tabs:
            return None
        authorized = self.authorize(key, headers)
        return self.finish(authorized, headers) if isinstance(authorized, Reply) else None

    def respond(self, key: str, path_network: str | None, headers: Headers, body: bytes, path: str) -> Reply | Pending:
        """The answer to a whole body: a Reply when nothing needs awaiting (a cache hit, a refusal),
        else the coroutine that makes it (counted in flight while it runs)."""
        answer = self.serve(key, path_network, headers, body, path)
        return self.hit_reply(answer) if isinstance(answer, tuple) else answer

    def serve(
        self,
        key: str | None,
        path_network: str | None,
        headers: Headers,
        body: bytes,
        path: str,
        room: AnswerRoom | None = None,
    ) -> PaidHit | Reply | Pending:
        """As `respond`, but a memory hit that needs neither gzip nor CORS headers is its PaidHit,
        which the fast server writes after a pre-built head (no headers dict). `key`: the one in the
        path, if any (else the headers'). Open mode has no key to check; a key with a tab (its checks
        made once: Hits) is not authorized again. `room`: the connection's count of answers not yet
        taken, which a batch's calls wait for room in (gateway/running.py)."""
        gateway = self.gateway
        try:
            if self.open_mode:
                network = gateway.router.network_for(headers.get("host"), path_network)
                if len(body) > self.max_body_bytes:
                    return self.finish(self.too_large(), headers)
                lookup = gateway.hits.open(body, network)
                if isinstance(lookup, Lookup):
                    return self._awaited(body, OPEN_ACCOUNT, network, lookup, headers, path, room)
            else:
                key = key or key_of(key, headers)
                tab = gateway.tabs.get(key)
                if tab is None:
                    authorized = self.authorize(key, headers)
                    if isinstance(authorized, Reply):
                        return self.finish(authorized, headers)
                    account = authorized
                else:
                    account = tab.account
                network = gateway.router.network_for(headers.get("host"), path_network)
                if len(body) > self.max_body_bytes:
                    return self.finish(self.too_large(), headers)
                if tab is not None:
                    lookup = gateway.hits.by_tab(body, tab, network)
                else:
                    lookup = gateway.hits.keyed(body, account, network, key)
                if isinstance(lookup, Lookup):
                    return self._awaited(body, account, network, lookup, headers, path, room)
            length = lookup[3]
            if length < self.compress_from and "origin" not in headers:
                return lookup
            if length >= APART_BYTES:
                return self.finish_apart(self.hit_reply(lookup), headers)
            return self.finish(self.hit_reply(lookup), headers)
        except Exception as exc:
            return self.finish(failure_reply(exc, path), headers)

    def hit_reply(self, hit: PaidHit) -> Reply:
        """A memory hit as a Reply (for aiohttp, gzip, CORS or the access log)."""
        if self.open_mode:
            _, _, verified, _, body = hit
            return Reply(body, 200, {**self.open_headers, "X-Verified": verified.decode()})
        return paid_reply(hit)

    async def _awaited(
        self,
        body: bytes,
        account: str,
        network: NetworkRuntime | None,
        lookup: Lookup,
        headers: Headers,
        path: str,
        room: AnswerRoom | None,
    ) -> Reply:
        self.inflight.inc()
        received = via.marks(headers.get("via"))  # other rpc-proxies' marks, forwarded with this one's (via.py)
        marks = via.RECEIVED.set(received) if received is not None else None
        try:
            reply = await self.gateway.handle(body, account, network, lookup, room)
            if reply.body is not None:
                reply.headers["Content-Type"] = JSON_CONTENT_TYPE
                if len(reply.body) >= APART_BYTES:
                    return await self.finish_apart(reply, headers)
            return self.finish(reply, headers)
        except Exception as exc:
            return self.finish(failure_reply(exc, path), headers)
        finally:
            self.inflight.dec()
            if marks is not None:
                via.RECEIVED.reset(marks)

    def finish(self, reply: Reply, headers: Headers) -> Reply:
        """gzip for a large answer its client accepts, and CORS headers for a page's request (every
        miss passes here: inline, as `finish_apart` is not)."""
        body = reply.body
        if body is not None and len(body) >= self.compress_from and accepts_gzip(headers.get("accept-encoding")):
            reply.headers = {**reply.headers, "Content-Encoding": "gzip", "Vary": "Accept-Encoding"}
            reply.body = self.compressor.gzip(body)
        if "origin" in headers and self.cors is not None:
            return self._cors(reply, headers)
        return reply

    async def finish_apart(self, reply: Reply, headers: Headers) -> Reply:
        """As `finish`, for an answer of APART_BYTES or more: compressed in a worker thread."""
        body = self._gzipped(reply, headers)
        if body is not None:
            reply.body = await self.compressor.gzip_apart(body)
        return self._cors(reply, headers)

    def _gzipped(self, reply: Reply, headers: Headers) -> bytes | None:
        """The body to compress, if it is large and its client accepts gzip (its headers say so now)."""
        body = reply.body
        if body is None or len(body) < self.compress_from or not accepts_gzip(headers.get("accept-encoding")):
            return None
        reply.headers = {**reply.headers, "Content-Encoding": "gzip", "Vary": "Accept-Encoding"}
        return body

    def _cors(self, reply: Reply, headers: Headers) -> Reply:
        origin = headers.get("origin")
        if origin is not None and self.cors is not None:
            reply.headers = dict(reply.headers)  # never the shared open-hit headers
            self.cors.add_headers(origin, reply.headers)
        return reply
