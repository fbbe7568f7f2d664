"""Where a request's API key comes from: the path (`/v3/<KEY>`), else `Authorization: Bearer <KEY>`,
else `X-Api-Key: <KEY>` (as hosted providers accept it), on POST and on the WebSocket handshake alike.
A header keeps the key out of URLs, so out of access logs and proxies in between."""

from __future__ import annotations

from aiohttp import web

from proxy.credits.allow_lists import origin_refusal
from proxy.gateway.gateway import Gateway
from proxy.http.endpoint import key_of
from proxy.rpc.jsonrpc import JsonRpcError


def api_key(request: web.Request) -> str:
    """The secret the request presents; "" when it presents none."""
    return key_of(request.match_info.get("api_key"), request.headers)


def origin_check(gateway: Gateway, account: str, request: web.Request) -> JsonRpcError | None:
    """The refusal of a key's allowed_origins list, if it has one that this request's Origin is not on."""
    lists = gateway.key_lists.get(account)
    return None if lists is None else origin_refusal(lists, request.headers.get("Origin"))
