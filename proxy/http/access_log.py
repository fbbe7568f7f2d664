"""ACCESS_LOG's line per HTTP answer, whoever gave it (the fast server, aiohttp: a WebSocket's
handshake, a health check, an unknown path, a parser's 400, the METRICS_PORT and ADMIN_PORT
listeners): HTTP method, path without the key, key name (never the secret), client IP, HTTP status,
total ms, cache outcome and upstream ms; the calls inside it have their own lines (gateway.py) as
before.

Only written when ACCESS_LOG is on: off (the default), a cache hit pays nothing for it. The client
IP is the peer's, or, behind a proxy named by TRUSTED_PROXY_HEADER, what that proxy wrote: the last
X-Forwarded-For entry (the one the trusted proxy appended; entries before it are the client's to
forge) or X-Real-IP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Container

from aiohttp import web

from proxy.gateway.gateway import Gateway
from proxy.http.endpoint import key_of
from proxy.http.request_key import api_key
from proxy.http.wire import Request
from proxy.request_ids import REQUEST_ID
from proxy.values import Reply

log = logging.getLogger("proxy.access")
# Set on a response by the route: the slowest upstream call's seconds.
UPSTREAM_SECONDS = web.ResponseKey("upstream_seconds", float)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# The words of the paths the proxy serves: a path's other segments are the client's (a key sent to
# the wrong path, or in the wrong case, may be any of them) and are not shown.
ROUTE_WORDS = frozenset({"v3", "ws", "healthz", "readyz", "metrics", "reload", "upstreams", "cordon", "uncordon"})
MAX_PATH = 128


def shown_path(path: str, served: Container[str] = ()) -> str | None:
    """A request's path fit for its line (pure): the first segment after a `v3` as `<key>`, the route's
    words and the `served` networks' names as they are, any other segment `<redacted>`, at most 128
    characters; None for none (a parser's 400)."""
    if not path:
        return None
    shown: list[str] = []
    key_next = False
    for segment in path[: MAX_PATH * 8].split("/"):
        if key_next and segment:
            shown.append("<key>")
            key_next = False
            continue
        word = segment.lower()
        shown.append(segment if not segment or word in ROUTE_WORDS or segment in served else "<redacted>")
        key_next = key_next or word == "v3"
    return "/".join(shown)[:MAX_PATH]


def client_ip(request: web.Request, trusted_header: str | None) -> str | None:
    if trusted_header:
        value = request.headers.get(trusted_header)
        if value:
            return value.rsplit(",", 1)[-1].strip()[:64]
    return request.remote


def log_request(
    key: str | None,
    client: str | None,
    status: int,
    started: float,
    cache: str | None,
    upstream: float | None,
    request_id: str | None,
    method: str | None = None,
    path: str | None = None,
    served: Container[str] = (),
) -> None:
    log.info(
        "request",
        extra={
            "request_id": request_id,
            "method": method or None,
            "path": shown_path(path or "", served),
            "key": key,
            "client": client,
            "status": status,
            "total_ms": round((time.perf_counter() - started) * 1000, 2),
            "cache": cache,
            "upstream_ms": None if upstream is None else round(upstream * 1000, 2),
        },
    )


def log_front_request(
    gateway: Gateway, trusted_header: str | None, peer: str | None, request: Request, reply: Reply, request_id: str
) -> None:
    """The line for a request the fast server answered (front.py): header names are lower-case there."""
    headers = request.headers
    forwarded = headers.get(trusted_header) if trusted_header else None
    client = forwarded.rsplit(",", 1)[-1].strip()[:64] if forwarded else peer
    target = request.target
    # A JSON-RPC path names a key or is refused for its lack; no other path is served for one.
    account = gateway.account(key_of(target[1], headers)) or "invalid" if target else None
    log_request(
        account,
        client,
        reply.status,
        request.started or time.perf_counter(),  # 0: refused before its head was read whole
        reply.headers.get("X-Cache"),
        reply.upstream_seconds,
        request_id,
        request.method,
        request.path,
        gateway.router.networks,
    )


def access_logged(gateway: Gateway, trusted_header: str | None) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The middleware writing the line of each answer aiohttp gives (after request_ids, whose id it
    names): a WebSocket's handshake (refused, or accepted: its line when the socket closes) and what
    the fast server hands over."""

    @web.middleware
    async def log_answer(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        status, cache, upstream = 500, None, None
        try:
            response = await handler(request)
            status, cache, upstream = response.status, response.headers.get("X-Cache"), response.get(UPSTREAM_SECONDS)
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            keyed = "api_key" in request.match_info or "/v3" in request.path
            log_request(
                gateway.account(api_key(request)) or "invalid" if keyed else None,
                client_ip(request, trusted_header),
                status,
                started,
                cache,
                upstream,
                REQUEST_ID.get(),
                request.method,
                request.path,
                gateway.router.networks,
            )

    return log_answer
