"""The HTTP routes: JSON-RPC over POST (the hot path: a cache hit answered without awaiting), health,
readiness, /metrics, and a JSON-RPC error for every other path."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import HttpVersion11, hdrs, web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST

from proxy import via
from proxy.config import Settings
from proxy.gateway.gateway import Gateway
from proxy.http.access_log import UPSTREAM_SECONDS, access_logged
from proxy.http.app_keys import GATEWAY, SERVICE
from proxy.http.endpoint import (
    BUSY_BODIES,
    NO_CHARGE,
    RpcEndpoint,
    body_timeout_error,
    error_reply,
    failure_reply,
    fallback_reply,
)
from proxy.http.front_routes import Exposition, decoded_or_refused, readiness, started_asked
from proxy.http.head_limit import host_fault_of
from proxy.http.request_key import api_key
from proxy.http.responses import error_response, json_response
from proxy.request_ids import HEADER, IDS, REQUEST_ID
from proxy.rpc.jsonrpc import INVALID_REQUEST, JsonRpcError
from proxy.values import Reply

log = logging.getLogger("proxy.app")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
__all__ = [
    "answering_app",
    "fallback",
    "guarded",
    "healthz",
    "metrics_route",
    "readiness",
    "readyz",
    "rpc_route",
]


def guarded(handler: Handler) -> Handler:
    """Every failure leaves as a JSON-RPC error body, never a traceback."""

    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ConnectionResetError:
            raise
        except Exception as exc:
            return json_response(failure_reply(exc, request.path))

    return run


async def fallback(request: web.Request) -> web.StreamResponse:
    """Any other path or HTTP method: a JSON-RPC error, not aiohttp's text page."""
    return json_response(fallback_reply(request.path, served=request.app[GATEWAY].router.networks))


class BodyReader:
    """The body of a request whose body is still arriving: within BODY_TIMEOUT, and within the bytes
    all bodies being received may hold together (MAX_INFLIGHT_BODY_BYTES)."""

    def __init__(self, endpoint: RpcEndpoint) -> None:
        self._endpoint = endpoint

    async def read(self, request: web.Request) -> bytes | Reply:
        endpoint = self._endpoint
        declared = request.content_length
        if declared is not None and declared > endpoint.max_body_bytes:
            return endpoint.too_large()  # refused before a byte of it is buffered
        held = declared if declared is not None else endpoint.max_body_bytes
        if not endpoint.receiving.take(held):
            return error_reply(BUSY_BODIES, NO_CHARGE, close=True)
        try:
            async with asyncio.timeout(endpoint.body_timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            return endpoint.too_large()
        except TimeoutError:
            return error_reply(body_timeout_error(endpoint.body_timeout), NO_CHARGE, close=True)
        except ConnectionResetError:
            # A client that goes away mid-body is routine on the internet: no traceback, no error line.
            log.debug("client closed the connection before its request body arrived")
            return error_reply(
                JsonRpcError(INVALID_REQUEST, "request body incomplete", http_status=400), NO_CHARGE, close=True
            )
        finally:
            endpoint.receiving.give(held)


def rpc_route(endpoint: RpcEndpoint, settings: Settings) -> Handler:
    """The JSON-RPC POST handler on aiohttp (a connection aiohttp serves: one that began with another
    request); the fast server (front.py) serves the rest."""
    reader = BodyReader(endpoint)

    async def rpc_handler(request: web.Request) -> web.StreamResponse:
        content = request.content
        if content.is_eof():
            body = content.read_nowait()
        else:  # the body is still arriving
            read = await reader.read(request)
            if isinstance(read, Reply):
                return json_response(endpoint.finish(read, request.headers))
            body = read
        codings = request.headers.getall(hdrs.CONTENT_ENCODING, ())
        if codings:  # left coded by aiohttp (auto_decompress=False): decoded as the front decodes it
            decoded = decoded_or_refused(endpoint, body, ", ".join(codings))
            if isinstance(decoded, Reply):
                return json_response(endpoint.finish(decoded, request.headers))
            body = decoded
        reply = endpoint.respond(
            api_key(request), request.match_info.get("network"), request.headers, body, request.path
        )
        if not isinstance(reply, Reply):
            reply = await reply
        response = json_response(reply)
        if reply.upstream_seconds is not None:
            response[UPSTREAM_SECONDS] = reply.upstream_seconds
        return response

    return rpc_handler  # its ACCESS_LOG line: the app's middleware (access_log.access_logged)


@web.middleware
async def request_ids(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The id of a request aiohttp serves (request_ids.py): of its log lines, and of its answer
    (answer_headers writes it there)."""
    REQUEST_ID.set(IDS.of(request.headers.get(HEADER)))  # this request's own task: its context ends with it
    return await handler(request)


async def answer_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every answer aiohttp writes, a handler's or its own (a 404 or 405 it raised,
    the 500 of a failed handler, in that request's task as well), carries X-Request-Id and names no
    library or interpreter version in `Server` (the fast server sends no `Server` at all)."""
    response.headers[HEADER] = REQUEST_ID.get() or IDS.of(request.headers.get(HEADER))
    response.headers[hdrs.SERVER] = via.SERVER  # a proxy whose WebSocket upstream this is knows it (via.py)


def answering_app(gateway: Gateway, settings: Settings, *inner: Middleware, **options: Any) -> web.Application:
    """An aiohttp application answering as the public port does: X-Request-Id and `Server`
    (answer_headers) and, with ACCESS_LOG, the `request` line (access_log.py) on every answer. The
    public port's application and the internal listeners' (METRICS_PORT, ADMIN_PORT) are made here."""
    logged = [access_logged(gateway, settings.trusted_proxy_header)] if settings.access_log else []
    app = web.Application(middlewares=[request_ids, *logged, *inner], **options)
    app.on_response_prepare.append(answer_headers)
    return app


@web.middleware
async def host_rule(request: web.Request, handler: Handler) -> web.StreamResponse:
    """RFC 9112 section 3.2 on a connection aiohttp serves (a head the front handed over, and every
    request after it there): the front's rule (head_limit.host_fault_of) and answer, 400 -32600 and
    the connection closed. (A missing or repeated Host aiohttp's own parser refuses first: 400.)"""
    hosts = request.headers.getall(hdrs.HOST, ())
    fault = host_fault_of(hosts[0] if hosts else None, len(hosts) > 1, request.version < HttpVersion11)
    if not fault:
        return await handler(request)
    response = error_response(JsonRpcError(INVALID_REQUEST, fault, http_status=400))
    response.force_close()
    return response


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    status, answer = readiness(request.app[SERVICE], started_asked(request.rel_url.raw_query_string))
    return web.json_response(answer, status=status)


def metrics_route(exposition: Exposition) -> Handler:
    async def metrics_handler(request: web.Request) -> web.Response:
        response = web.Response(body=await exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return metrics_handler
