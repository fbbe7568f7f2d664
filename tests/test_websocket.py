"""The same JSON-RPC over WebSocket: one text frame in, one out, several in flight."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from tests.support import Anvil, Proxy, settings_for, start_proxy

CHAIN_ID = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}


async def test_a_request_frame_gets_a_response_frame(evm_proxy: Proxy) -> None:
    async with evm_proxy.session.ws_connect(evm_proxy.ws_url()) as ws:
        await ws.send_str(json.dumps(CHAIN_ID))
        message = await ws.receive(timeout=5)
        assert message.type is aiohttp.WSMsgType.TEXT
        assert json.loads(message.data) == {"jsonrpc": "2.0", "id": 1, "result": "0x7a69"}


async def test_many_requests_in_flight_each_answered_with_its_id(evm_proxy: Proxy) -> None:
    async with evm_proxy.session.ws_connect(evm_proxy.ws_url()) as ws:
        for i in range(20):
            await ws.send_str(json.dumps({**CHAIN_ID, "id": i}))
        replies = [json.loads((await ws.receive(timeout=5)).data) for _ in range(20)]
        assert sorted(r["id"] for r in replies) == list(range(20))


async def test_batches_errors_and_notifications_over_websocket(evm_proxy: Proxy) -> None:
    async with evm_proxy.session.ws_connect(evm_proxy.ws_url()) as ws:
        await ws.send_str(json.dumps([CHAIN_ID, {**CHAIN_ID, "id": 2}]))
        assert [r["id"] for r in json.loads((await ws.receive(timeout=5)).data)] == [1, 2]
        await ws.send_str("{not json")
        assert json.loads((await ws.receive(timeout=5)).data)["error"]["code"] == -32700
        await ws.send_str(json.dumps({"jsonrpc": "2.0", "method": "eth_chainId", "params": []}))
        await ws.send_str(json.dumps({**CHAIN_ID, "id": 3}))
        # The notification produced no frame: the next frame answers id 3.
        assert json.loads((await ws.receive(timeout=5)).data)["id"] == 3


async def test_a_message_over_the_size_limit_closes_with_1009_and_others_are_served(anvil: Anvil) -> None:
    proxy = await start_proxy(settings_for(EVM_UPSTREAM=anvil.url, WS_MAX_MESSAGE_BYTES="1024"))
    try:
        async with proxy.session.ws_connect(proxy.ws_url()) as ws:
            await ws.send_str(json.dumps({**CHAIN_ID, "params": ["x" * 4096]}))
            message = await ws.receive(timeout=5)
            assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
        async with proxy.session.ws_connect(proxy.ws_url()) as other:
            await other.send_str(json.dumps(CHAIN_ID))
            assert json.loads((await other.receive(timeout=5)).data)["result"] == "0x7a69"
    finally:
        await proxy.close()


async def test_websocket_connections_are_counted_while_open(evm_proxy: Proxy) -> None:
    async with evm_proxy.session.ws_connect(evm_proxy.ws_url()) as ws:
        await ws.send_str(json.dumps(CHAIN_ID))
        await ws.receive(timeout=5)
        assert evm_proxy.metric("rpc_proxy_websocket_connections") == 1

    async def closed() -> None:
        while evm_proxy.metric("rpc_proxy_websocket_connections") != 0:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(closed(), 5)
