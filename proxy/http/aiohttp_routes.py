"""The HTTP routes: JSON-RPC over POST (the hot path: a cache hit answered without awaiting), health,
readiness, /metrics, and a JSON-RPC error for every other path."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import HttpVersion11, hdrs, web
from prometheus_client import CONTENT_TYPE_LATEST

from proxy.config import Settings
from proxy.http.access_log import UPSTREAM_SECONDS
from proxy.http.app_keys import SERVICE
from proxy.http.endpoint import (
    BUSY_BODIES,
    NO_CHARGE,
    RpcEndpoint,
    body_timeout_error,
    error_reply,
    failure_reply,
    fallback_reply,
)
from proxy.http.front_routes import Exposition, decoded_or_refused, readiness
from proxy.http.head_limit import host_fault_of
from proxy.http.request_key import api_key
from proxy.http.responses import error_response, json_response
from proxy.request_ids import HEADER, IDS, REQUEST_ID
from proxy.rpc.jsonrpc import INVALID_REQUEST, JsonRpcError
from proxy.values import Reply

log = logging.getLogger("proxy.app")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
__all__ = [
    "fallback",
    "guarded",
    "healthz",
    "metrics_route",
    "readiness",
    "readyz",
    "request_ids",
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
    return json_response(fallback_reply(request.path))


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
    """X-Request-Id on every answer aiohttp serves (request_ids.py), and the id of its log lines."""
    rid = IDS.of(request.headers.get(HEADER))
    REQUEST_ID.set(rid)  # this request's own task: its context ends with it
    response = await handler(request)
    if not response.prepared:  # a WebSocket's handshake carries it already (ws.py)
        response.headers[HEADER] = rid
    return response


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
    status, answer = readiness(request.app[SERVICE])
    return web.json_response(answer, status=status)


def metrics_route(exposition: Exposition) -> Handler:
    async def metrics_handler(request: web.Request) -> web.Response:
        response = web.Response(body=await exposition())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    return metrics_handler
