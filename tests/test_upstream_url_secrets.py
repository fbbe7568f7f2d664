"""An upstream URL's secrets in every form it may be echoed in (as written, percent-decoded,
plus-decoded) are redacted from node errors before clients, logs or metrics see them."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import WSMsgType, web

from tests.support import ProxyFactory, fake_server
from tests.ws_client import connect

# Each secret part of the URL and every form a node may echo it in.
URL_TAIL = "alice:p%40ssw0rd@127.0.0.1:{port}/v2/PATH%2Bkey77?api-key=KEY%2BPLUS123&sig=SIG+PLAIN456&token=TOK"
FORMS = (
    "KEY%2BPLUS123",
    "KEY+PLUS123",
    "SIG+PLAIN456",
    "SIG PLAIN456",
    "PATH%2Bkey77",
    "PATH+key77",
    "p%40ssw0rd",
    "p@ssw0rd",
    base64.b64encode(b"alice:p@ssw0rd").decode(),
)
SOCKETS = web.AppKey("sockets", set[web.WebSocketResponse])


def _echo(request: web.Request) -> str:
    """What a careless provider says when it refuses a call: the request as it arrived, decoded too."""
    auth = request.headers.get("Authorization", "")
    basic = base64.b64decode(auth.split()[-1]).decode() if auth else ""
    values = [piece.partition("=")[2] for piece in request.rel_url.raw_query_string.split("&")]
    return f"denied {request.method} {request.raw_path} ({request.path} {dict(request.query)}) {values} {auth} {basic}"


async def _handle(request: web.Request) -> web.StreamResponse:
    if request.method == "POST":
        body = await request.json()
        rid = body.get("id") if isinstance(body, dict) else None
        return web.json_response({"jsonrpc": "2.0", "id": rid, "error": {"code": -32000, "message": _echo(request)}})
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    request.app[SOCKETS].add(ws)
    async for message in ws:
        if message.type is WSMsgType.TEXT:
            rid = json.loads(message.data).get("id")
            await ws.send_json({"jsonrpc": "2.0", "id": rid, "error": {"code": -32000, "message": _echo(request)}})
    return ws


@asynccontextmanager
async def echoing_node() -> AsyncIterator[int]:
    app = web.Application()
    app[SOCKETS] = set()
    app.router.add_route("*", "/{tail:.*}", _handle)
    server = await fake_server(app)
    try:
        yield server.port
    finally:
        for ws in list(app[SOCKETS]):  # the proxy's socket: closed here, so the server stops at once
            await ws.close()
        await server.close()


@pytest.mark.parametrize(("family", "method"), [("EVM", "eth_getBalance"), ("SOLANA", "getBalance")])
async def test_every_form_of_an_upstream_urls_secrets_is_redacted_from_node_errors(
    family: str, method: str, make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Rule: a URL's user, password, path segments and query values are redacted raw, percent- and plus-decoded."""
    caplog.set_level(logging.DEBUG)
    params = ["0x" + "11" * 20, "latest"] if family == "EVM" else ["4Nd1mBQtrMJVYVfKf2PJy9NZUZdTAsp7D4xWLs4gDB4T"]
    async with echoing_node() as port:
        proxy = await make_proxy(**{f"{family}_UPSTREAM": "http://" + URL_TAIL.format(port=port)})
        reply = await proxy.call(method, params)
        async with proxy.session.get(proxy.base + "/metrics") as resp:
            metrics = await resp.text()
    message = reply["error"]["message"]
    assert "denied POST /v2/<redacted>?" in message and "<redacted>" in message  # the node's text, scrubbed
    seen = [json.dumps(reply), metrics, *(r.getMessage() for r in caplog.records if r.name.startswith("proxy"))]
    assert [form for form in FORMS if any(form in text for text in seen)] == []


async def test_every_form_of_a_websocket_upstream_urls_secrets_is_redacted_from_node_errors(
    make_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Rule: an upstream WebSocket's URL secrets are redacted from the errors it answers subscriptions with."""
    caplog.set_level(logging.DEBUG)
    async with echoing_node() as port:
        proxy = await make_proxy(
            SOLANA_UPSTREAM=f"http://127.0.0.1:{port}/", SOLANA_UPSTREAM_WS="ws://" + URL_TAIL.format(port=port)
        )
        client = await connect(proxy)
        reply = await client.call("slotSubscribe")
        await client.ws.close()
    assert "denied GET /v2/<redacted>?" in reply["error"]["message"]
    seen = [json.dumps(reply), *(r.getMessage() for r in caplog.records if r.name.startswith("proxy"))]
    assert [form for form in FORMS if any(form in text for text in seen)] == []
