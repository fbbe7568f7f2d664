"""Which calls are charged: a node reached is charged, no node reached is free (charging.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from proxy.credits.charging import refunded
from proxy.credits.prices import METHOD_CREDITS
from proxy.rpc.jsonrpc import INTERNAL_ERROR, UPSTREAM_UNAVAILABLE, JsonRpcError
from tests.support import Anvil, ProxyFactory, free_port, serving
from tests.test_credits import keys_file, storage


class TestChargingRule:
    def test_no_node_reached_is_refunded(self) -> None:
        assert refunded(JsonRpcError(UPSTREAM_UNAVAILABLE, "down", http_status=502))

    def test_a_node_reached_that_then_timed_out_is_charged(self) -> None:
        assert not refunded(JsonRpcError(UPSTREAM_UNAVAILABLE, "timeout", http_status=504, reached=True))

    def test_answers_and_other_errors_are_charged(self) -> None:
        assert not refunded(None)
        assert not refunded(JsonRpcError(INTERNAL_ERROR, "internal error", http_status=500))


@asynccontextmanager
async def dropping_relay(target: str, position: str) -> AsyncIterator[str]:
    """A node that leaves the storage read of `position` out of its batch replies."""
    session = aiohttp.ClientSession()

    async def handle(request: web.Request) -> web.Response:
        payload = json.loads(await request.read())
        async with session.post(target, json=payload) as resp:
            reply = await resp.json()
        if isinstance(payload, list):
            dropped = {p["id"] for p in payload if p["method"] == "eth_getStorageAt" and p["params"][1] == position}
            reply = [item for item in reply if item["id"] not in dropped]
        return web.json_response(reply)

    try:
        async with serving(handle) as url:
            yield url
    finally:
        await session.close()


async def test_a_call_left_out_of_a_batch_reply_is_asked_again_alone_and_charged_as_answered(
    anvil: Anvil,
    tmp_path: Path,
    make_proxy: ProxyFactory,
) -> None:
    # A batch reply without one of its ids is an upstream fault (issue 9): nothing of it is kept,
    # and its calls are asked again one by one (issue 10), so every caller gets the node's answer
    # and pays for that answer only.
    path = keys_file(tmp_path, alice={"daily_credits": 10_000})
    async with dropping_relay(anvil.url, "0x" + "0" * 63 + "2") as url:
        proxy = await make_proxy(EVM_UPSTREAM=url, API_KEYS_FILE=path)
        await proxy.head_at(0)
        batch = [storage(i, hex(i)) for i in range(1, 4)]  # three misses: one upstream batch
        status, body, headers = await proxy.post(batch, key="alice")
        assert status == 200
        assert [item["id"] for item in body if "result" in item] == [1, 2, 3], body
        assert headers["X-Credits-Charged"] == "240" and headers["X-Credits-Remaining"] == str(10_000 - 240)
        assert proxy.metric("rpc_proxy_upstream_errors_total", network="evm", upstream="0", kind="mismatch") >= 1


async def test_a_call_that_reached_a_node_and_timed_out_is_charged(tmp_path: Path, make_proxy: ProxyFactory) -> None:
    path = keys_file(tmp_path, alice={"daily_credits": 10_000})
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        await request.read()
        await release.wait()  # the node is busy with it (an eth_estimateGas, say) past the timeout
        return web.json_response({"jsonrpc": "2.0", "id": 1, "result": "0x5208"})

    app = web.Application()
    app.router.add_post("/", slow)
    node = TestServer(app, host="127.0.0.1", port=free_port())
    await node.start_server()
    proxy = await make_proxy(EVM_UPSTREAM=f"http://127.0.0.1:{node.port}/", API_KEYS_FILE=path, UPSTREAM_TIMEOUT="0.3")
    try:
        call = {"jsonrpc": "2.0", "id": 7, "method": "eth_estimateGas", "params": [{"from": "0x" + "11" * 20}]}
        status, reply, headers = await proxy.post(call, key="alice")
        assert status == 504 and reply["error"]["code"] == -32002
        cost = METHOD_CREDITS["eth_estimateGas"]  # the credits table (docs/keys-and-credits.md)
        assert headers["X-Credits-Charged"] == str(cost) and headers["X-Credits-Remaining"] == str(10_000 - cost)
        assert proxy.metric("rpc_proxy_credits_charged_total", method="eth_estimateGas") == cost
    finally:
        release.set()
        await node.close()
