"""The same JSON-RPC over WebSocket: one text frame in, one out, several in flight."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from proxy.http.ws_frames import text_frame
from tests.support import Anvil, Proxy, ProxyFactory, word
from tests.test_cache import finalized_store, storage

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


async def test_a_message_over_the_size_limit_closes_with_1009_and_others_are_served(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, WS_MAX_MESSAGE_BYTES="1024")
    async with proxy.session.ws_connect(proxy.ws_url()) as ws:
        await ws.send_str(json.dumps({**CHAIN_ID, "params": ["x" * 4096]}))
        message = await ws.receive(timeout=5)
        assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
        assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG
    async with proxy.session.ws_connect(proxy.ws_url()) as other:
        await other.send_str(json.dumps(CHAIN_ID))
        assert json.loads((await other.receive(timeout=5)).data)["result"] == "0x7a69"


async def test_a_message_of_exactly_ws_max_message_bytes_is_served_and_one_byte_more_is_not(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    # The limit is the largest message served, as MAX_BODY_BYTES over HTTP (aiohttp's max_msg_size
    # refuses a message of that size itself: found by an outside attack).
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, WS_MAX_MESSAGE_BYTES="1024")
    head = json.dumps(CHAIN_ID)[:-1]
    for size, served in ((1024, True), (1025, False)):
        async with proxy.session.ws_connect(proxy.ws_url()) as ws:
            await ws.send_str(head + " " * (size - len(head) - 1) + "}")
            message = await ws.receive(timeout=5)
            if served:
                assert json.loads(message.data)["result"] == "0x7a69"
            else:
                assert ws.close_code == aiohttp.WSCloseCode.MESSAGE_TOO_BIG


async def test_the_largest_ws_max_message_bytes_allowed_still_serves_websockets(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    # Rule: WS_MAX_MESSAGE_BYTES is at most 2**31. 2**64 passed `check` and `serve` started, then
    # every WebSocket closed at once: aiohttp's reader takes the limit as a C unsigned int (an
    # OverflowError and a traceback per connection, an outside attack).
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, WS_MAX_MESSAGE_BYTES=str(2**31), MAX_RESPONSE_BYTES=str(2**31))
    async with proxy.session.ws_connect(proxy.ws_url()) as ws:
        await ws.send_str(json.dumps(CHAIN_ID))
        assert json.loads((await ws.receive(timeout=5)).data)["result"] == "0x7a69"


async def test_websocket_connections_are_counted_while_open(evm_proxy: Proxy) -> None:
    async with evm_proxy.session.ws_connect(evm_proxy.ws_url()) as ws:
        await ws.send_str(json.dumps(CHAIN_ID))
        await ws.receive(timeout=5)
        assert evm_proxy.metric("rpc_proxy_websocket_connections") == 1

    async def closed() -> None:
        while evm_proxy.metric("rpc_proxy_websocket_connections") != 0:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(closed(), 5)


async def test_pipelined_memory_hits_are_each_answered_once_compressed_socket_or_not(
    anvil: Anvil,
    evm_proxy: Proxy,
) -> None:
    # Hits made while one burst of frames is read leave in one write (ws_frames.py): every call of a
    # burst is answered exactly once, with its id, on a socket that agreed compression too.
    store, block = await finalized_store(anvil, evm_proxy)
    await evm_proxy.post(storage(store, "0x0", hex(block)))  # now in memory
    for compress in (0, 15):
        async with evm_proxy.session.ws_connect(evm_proxy.ws_url(), compress=compress) as ws:
            await asyncio.gather(
                *(ws.send_str(json.dumps(storage(store, "0x0", hex(block), rid=i))) for i in range(200))
            )
            replies = [json.loads((await ws.receive(timeout=10)).data) for _ in range(200)]
            assert sorted(r["id"] for r in replies) == list(range(200))
            assert {r["result"] for r in replies} == {"0x" + word(7)}
    assert evm_proxy.upstreams["evm"].calls["eth_getStorageAt"] == 1


def test_a_text_frame_carries_its_length_in_the_form_rfc_6455_gives_it() -> None:
    assert text_frame(b"x" * 125)[:2] == b"\x81\x7d"
    assert text_frame(b"x" * 126)[:4] == b"\x81\x7e\x00\x7e"
    assert text_frame(b"x" * 70000)[:10] == b"\x81\x7f" + (70000).to_bytes(8, "big")


async def test_the_handshake_and_aiohttps_answers_name_no_library_or_interpreter_version(evm_proxy: Proxy) -> None:
    # Server: a version invites attacks aimed at it; the fast server sends none, aiohttp's answers no version.
    async with evm_proxy.session.ws_connect(evm_proxy.ws_url()) as ws:
        await ws.send_json({"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []})
        assert "result" in await ws.receive_json()
        server = ws._response.headers.get("Server", "")
    assert "aiohttp" not in server and "Python" not in server, server
    async with evm_proxy.session.get(evm_proxy.base + "/healthz") as response:
        server = response.headers.get("Server", "")
    assert "aiohttp" not in server and "Python" not in server, server
