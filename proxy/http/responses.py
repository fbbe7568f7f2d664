"""Turning a gateway Reply or a JsonRpcError into an aiohttp response."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from proxy.http.gateway import Reply
from proxy.rpc import jsonrpc
from proxy.rpc.jsonrpc import JsonRpcError

NO_CHARGE = {"X-Credits-Charged": "0"}
JSON_CONTENT_TYPE = "application/json"


def json_response(reply: Reply) -> web.Response:
    if reply.body is None:
        return web.Response(status=reply.status, headers=reply.headers)
    # Set in the (fresh) headers dict rather than through content_type=: aiohttp then has nothing
    # to parse or merge, which the cache-hit path notices.
    reply.headers["Content-Type"] = JSON_CONTENT_TYPE
    return web.Response(body=reply.body, status=reply.status, headers=reply.headers)


def error_response(error: JsonRpcError, headers: Mapping[str, str] | None = None) -> web.Response:
    return json_response(Reply(jsonrpc.encode_error(None, error), error.http_status,
                               {**error.headers, **(headers or {})}))
