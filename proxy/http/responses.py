"""Turning a Reply or a JsonRpcError into an aiohttp response."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from proxy.http.endpoint import JSON_CONTENT_TYPE, NO_CHARGE, error_reply
from proxy.rpc.jsonrpc import JsonRpcError
from proxy.values import Reply

__all__ = ["JSON_CONTENT_TYPE", "NO_CHARGE", "error_response", "json_response"]


def json_response(reply: Reply) -> web.Response:
    if reply.body is None:
        return web.Response(status=reply.status, headers=reply.headers)
    if "Content-Type" not in reply.headers:
        # Set in a (fresh) headers dict rather than through content_type=: aiohttp then has nothing
        # to parse or merge.
        reply.headers = {**reply.headers, "Content-Type": JSON_CONTENT_TYPE}
    response = web.Response(body=reply.body, status=reply.status, headers=reply.headers)
    if reply.close:
        response.force_close()
    return response


def error_response(error: JsonRpcError, headers: Mapping[str, str] | None = None) -> web.Response:
    return json_response(error_reply(error, headers))
