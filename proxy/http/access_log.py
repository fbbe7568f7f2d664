"""ACCESS_LOG's line per HTTP request: key name (never the secret), client IP, HTTP status, total ms,
cache outcome and upstream ms; the calls inside it have their own lines (gateway.py) as before.

Only wrapped around the JSON-RPC route when ACCESS_LOG is on: off (the default), a cache hit pays
nothing for it. The client IP is the peer's, or, behind a proxy named by TRUSTED_PROXY_HEADER, what
that proxy wrote: the last X-Forwarded-For entry (the one the trusted proxy appended; entries before
it are the client's to forge) or X-Real-IP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

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


def client_ip(request: web.Request, trusted_header: str | None) -> str | None:
    if trusted_header:
        value = request.headers.get(trusted_header)
        if value:
            return value.rsplit(",", 1)[-1].strip()[:64]
    return request.remote


def log_request(
    key: str,
    client: str | None,
    status: int,
    started: float,
    cache: str | None,
    upstream: float | None,
    request_id: str | None,
) -> None:
    log.info(
        "request",
        extra={
            "request_id": request_id,
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
    account = gateway.account(key_of(target[1] if target else None, headers))
    log_request(
        account or "invalid",
        client,
        reply.status,
        request.started,
        reply.headers.get("X-Cache"),
        reply.upstream_seconds,
        request_id,
    )


def logged(handler: Handler, gateway: Gateway, trusted_header: str | None) -> Handler:
    async def run(request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        response = await handler(request)
        log_request(
            gateway.account(api_key(request)) or "invalid",
            client_ip(request, trusted_header),
            response.status,
            started,
            response.headers.get("X-Cache"),
            response.get(UPSTREAM_SECONDS),
            REQUEST_ID.get(),
        )
        return response

    return run
