"""The HTTP routes: JSON-RPC over POST (the hot path: a cache hit answered without awaiting), health,
readiness, /metrics, and a JSON-RPC error for every other path."""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.config import Settings
from proxy.http.access_log import UPSTREAM_SECONDS, logged
from proxy.http.compression import Compressor, accepts_gzip
from proxy.http.cors import Cors
from proxy.http.gateway import Gateway, Reply, invalid_key_error
from proxy.http.listeners import Exposition
from proxy.http.request_key import api_key, origin_check
from proxy.http.responses import JSON_CONTENT_TYPE, NO_CHARGE, error_response, json_response
from proxy.logs import redacted
from proxy.metrics import Metrics
from proxy.network import NetworkRuntime
from proxy.rpc.jsonrpc import INTERNAL_ERROR, INVALID_REQUEST, JsonRpcError
from proxy.state import SERVICE

log = logging.getLogger("proxy.app")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RPC_PATH = re.compile(r"^(/[^/]+)?(/ws)?/v3(/[^/]*)?$")

_HTTP_ERRORS = {
    404: "not found: send JSON-RPC to POST /v3/<API_KEY> or WebSocket /ws/v3/<API_KEY>",
    405: "method not allowed: send JSON-RPC with POST",
    413: "request body too large",
}


class BodyBudget:
    """Bytes that request bodies being received may hold, all clients together."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held and self.held + size > self.limit:  # one body of any allowed size always fits
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


def guarded(handler: Handler) -> Handler:
    """Every failure leaves as a JSON-RPC error body, never a traceback.

    A wrapper on the two JSON-RPC routes rather than a middleware: middlewares cost every
    request a little, and the hot path is a cache hit that takes microseconds.
    """

    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ConnectionResetError:
            raise
        except Exception as exc:
            return failure_response(request, exc)

    return run


def failure_response(request: web.Request, exc: Exception) -> web.Response:
    """A JsonRpcError as its own response; anything else as -32603, with the details in the log only."""
    if isinstance(exc, JsonRpcError):
        return error_response(exc, NO_CHARGE)
    log.exception("internal error serving %s", redacted(request.path))
    return error_response(JsonRpcError(INTERNAL_ERROR, "internal error", http_status=500), NO_CHARGE)


async def fallback(request: web.Request) -> web.StreamResponse:
    """Any other path or HTTP method: a JSON-RPC error, not aiohttp's text page."""
    rpc_path = RPC_PATH.match(request.path) is not None
    status = 405 if rpc_path else 404
    return error_response(JsonRpcError(INVALID_REQUEST, _HTTP_ERRORS[status], http_status=status), NO_CHARGE)


class BodyReader:
    """The body of a request whose body is still arriving: within BODY_TIMEOUT, and within the bytes
    all bodies being received may hold together (MAX_INFLIGHT_BODY_BYTES)."""

    def __init__(self, settings: Settings) -> None:
        self.max_body_bytes = settings.max_body_bytes
        self._timeout = settings.body_timeout
        self._receiving = BodyBudget(settings.max_inflight_body_bytes)

    def too_large(self) -> web.Response:
        error = JsonRpcError(INVALID_REQUEST, f"request body too large: the limit is {self.max_body_bytes} bytes",
                             http_status=413)
        return error_response(error, NO_CHARGE)

    @staticmethod
    def _closing(code: int, message: str, status: int, headers: dict[str, str] | None = None) -> web.Response:
        """An answer after which the connection is closed: the rest of its body is never read."""
        response = error_response(JsonRpcError(code, message, http_status=status, headers=headers), NO_CHARGE)
        response.force_close()
        return response

    async def read(self, request: web.Request) -> bytes | web.Response:
        declared = request.content_length
        if declared is not None and declared > self.max_body_bytes:
            return self.too_large()  # refused before a byte of it is buffered
        held = declared if declared is not None else self.max_body_bytes
        if not self._receiving.take(held):
            return self._closing(INTERNAL_ERROR, "server busy: too many request bodies being received", 503,
                                 {"Retry-After": "1"})
        try:
            async with asyncio.timeout(self._timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self.too_large()
        except TimeoutError:
            return self._closing(INVALID_REQUEST, f"request body not received within {self._timeout:g}s", 408)
        except ConnectionResetError:
            # A client that goes away mid-body is routine on the internet: no traceback, no error line.
            log.debug("client closed the connection before its request body arrived")
            return self._closing(INVALID_REQUEST, "request body incomplete", 400)
        finally:
            self._receiving.give(held)


def rpc_route(gateway: Gateway, metrics: Metrics, settings: Settings, cors: Cors | None = None) -> Handler:
    """The JSON-RPC POST handler, bound to its collaborators (no app lookups per request)."""
    inflight = metrics.inflight
    open_hit_headers = {**gateway.open_hit_headers, "Content-Type": JSON_CONTENT_TYPE}
    reader = BodyReader(settings)
    max_body_bytes = reader.max_body_bytes
    compressor = Compressor(settings.compress_min_bytes, settings.compress_cache_bytes)
    compress_from = settings.compress_min_bytes or sys.maxsize  # one comparison for every small answer

    def replied(request: web.Request, reply: Reply) -> web.StreamResponse:
        if reply.body is not None and len(reply.body) >= compress_from and accepts_gzip(request):
            reply.headers["Content-Type"] = JSON_CONTENT_TYPE
            response = compressor.respond(reply.body, reply.status, reply.headers)
        else:
            response = json_response(reply)
        if reply.upstream_seconds is not None:
            response[UPSTREAM_SECONDS] = reply.upstream_seconds
        return response

    async def awaited(
        request: web.Request, body: bytes | None, account: str, network: NetworkRuntime | None, memory_checked: bool,
    ) -> web.StreamResponse:
        """Everything that awaits: counted in flight while it runs."""
        inflight.inc()
        try:
            if body is None:
                read = await reader.read(request)
                if isinstance(read, web.Response):
                    return read
                body = read
            return replied(request, await gateway.handle(body, account, network, memory_checked=memory_checked))
        finally:
            inflight.dec()

    async def rpc_handler(request: web.Request, browser: bool = True) -> web.StreamResponse:
        if browser and cors is not None and "Origin" in request.headers:
            # A page's request: answered the same way, then given its CORS headers. cors.wrap()
            # written out, so a request without Origin takes no extra coroutine.
            return cors.decorate(request, await rpc_handler(request, False))
        # guarded() written out: one coroutine fewer on the path every cache hit takes.
        try:
            match = request.match_info
            account = gateway.account(match.get("api_key") or api_key(request))
            if account is None:
                return error_response(invalid_key_error(), {"X-Credits-Charged": "0", "X-Credits-Remaining": "0"})
            if account in gateway.key_lists:
                refusal = origin_check(gateway, account, request)
                if refusal is not None:
                    return error_response(refusal, NO_CHARGE)
            network = gateway.router.network_for(request.host, match.get("network"))
            content = request.content
            if not content.is_eof():  # the body is still arriving
                return await awaited(request, None, account, network, False)
            body = content.read_nowait()  # the whole body is here (the usual case): no await
            if len(body) > max_body_bytes:
                return reader.too_large()
            # A cache hit is answered right here when nothing needs awaiting: always in open mode,
            # and with API keys when the key's credit lease covers it. It never yields to the loop,
            # so no scrape could ever see it in flight, and the in-flight gauge is left alone.
            if gateway.open_mode:
                encoded = gateway.open_hit(body, network)
                if encoded is not None:
                    if len(encoded) >= compress_from and accepts_gzip(request):
                        return compressor.respond(encoded, 200, dict(open_hit_headers))
                    return web.Response(body=encoded, headers=open_hit_headers)  # copied, never changed
                return await awaited(request, body, account, network, True)
            hit = gateway.keyed_hit(body, account, network)
            if hit.__class__ is tuple:  # a paid hit: its body and headers
                encoded, headers = hit
                headers["Content-Type"] = JSON_CONTENT_TYPE
                if len(encoded) >= compress_from and accepts_gzip(request):
                    return compressor.respond(encoded, 200, headers)
                return web.Response(body=encoded, headers=headers)
            if isinstance(hit, Reply):
                return json_response(hit)
            return await awaited(request, body, account, network, hit is True)
        except ConnectionResetError:
            raise
        except Exception as exc:
            return failure_response(request, exc)

    return logged(rpc_handler, gateway, settings.trusted_proxy_header) if settings.access_log else rpc_handler


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Ready when every network's tracker has a fresh view. Answered from the trackers' state: no
    upstream call per request, and no upstream's text or URL in the answer (upstreams by index only)."""
    service = request.app[SERVICE]
    now = time.time()
    networks = {name: runtime.health(now) or "ok" for name, runtime in service.networks.items()}
    ready = all(state == "ok" for state in networks.values())
    return web.json_response({"status": "ready" if ready else "unavailable", "networks": networks},
                             status=200 if ready else 503)


def metrics_route(exposition: Exposition) -> Handler:
    async def metrics_handler(request: web.Request) -> web.Response:
        response = web.Response(body=await exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return metrics_handler
