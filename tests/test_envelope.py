"""JSON-RPC 2.0 envelope rules through HTTP: codes, statuses, ids, batches, notifications, bounds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from proxy.rpc import jsonrpc
from tests.support import Anvil, Proxy, ProxyFactory, eventually

CHAIN_ID = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}


class TestParse:
    def test_notification_has_no_id_member(self) -> None:
        body = jsonrpc.parse_body(b'{"jsonrpc":"2.0","method":"m"}', max_batch=10)
        assert body.entries[0].notification

    def test_null_id_is_not_a_notification(self) -> None:
        body = jsonrpc.parse_body(b'{"jsonrpc":"2.0","method":"m","id":null}', max_batch=10)
        assert not body.entries[0].notification

    def test_result_bytes_are_spliced_with_the_callers_id(self) -> None:
        assert jsonrpc.encode_result("x", b'"0x1"') == b'{"jsonrpc":"2.0","id":"x","result":"0x1"}'

    def test_a_batch_is_its_answers_between_brackets_and_commas(self) -> None:
        assert [jsonrpc.encode_batch([b"1", b"22", b"333"][:n]) for n in range(4)] == [
            b"[]",
            b"[1]",
            b"[1,22]",
            b"[1,22,333]",
        ]


@pytest.mark.parametrize("rid", [7, "seven", None, 1.5])
async def test_id_is_echoed_as_given(evm_proxy: Proxy, rid: Any) -> None:
    status, body, _ = await evm_proxy.post({**CHAIN_ID, "id": rid})
    assert status == 200 and body["id"] == rid and body["result"] == "0x7a69"


async def test_invalid_json_is_a_parse_error(evm_proxy: Proxy) -> None:
    status, body, _ = await evm_proxy.post(b'{"jsonrpc": "2.0", "method": ')
    assert status == 400 and body["error"]["code"] == -32700 and body["id"] is None


@pytest.mark.parametrize(
    "request_body",
    [
        {"jsonrpc": "1.0", "id": 1, "method": "eth_chainId"},
        {"id": 1, "method": "eth_chainId"},
        {"jsonrpc": "2.0", "id": 1},
        {"jsonrpc": "2.0", "id": 1, "method": 5},
        {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": "x"},
        {"jsonrpc": "2.0", "id": {"a": 1}, "method": "eth_chainId"},
        b'"a string"',
    ],
)
async def test_malformed_request_is_invalid_request(evm_proxy: Proxy, request_body: Any) -> None:
    status, body, _ = await evm_proxy.post(request_body)
    assert status == 400 and body["error"]["code"] == -32600


@pytest.mark.parametrize(
    "request_body",
    [
        {"jsonrpc": "1.0", "id": 7, "method": "eth_chainId"},
        {"id": 7, "method": "eth_chainId"},
        {"jsonrpc": "2.0", "id": 7, "method": 1},
        {"jsonrpc": "2.0", "id": "seven", "method": "eth_chainId", "params": "x"},
    ],
)
async def test_an_invalid_request_with_a_valid_id_is_answered_with_that_id(evm_proxy: Proxy, request_body: Any) -> None:
    # spec: the response id is the request's id; it is echoed whenever the id itself is valid, as in a batch.
    status, body, _ = await evm_proxy.post(request_body)
    assert status == 400 and body["error"]["code"] == -32600 and body["id"] == request_body["id"]
    async with evm_proxy.session.ws_connect(evm_proxy.ws_url("test-key")) as ws:
        await ws.send_str(orjson.dumps(request_body).decode())
        reply = orjson.loads((await ws.receive(timeout=10)).data)
    assert reply["error"]["code"] == -32600 and reply["id"] == request_body["id"]


async def test_batch_answers_in_order_with_invalid_elements_answered_in_place(evm_proxy: Proxy) -> None:
    batch = [
        {**CHAIN_ID, "id": "a"},
        {"jsonrpc": "2.0", "id": "b", "method": "eth_getStorageAt", "params": ["0x12", "0x0", "latest"]},
        42,
        {**CHAIN_ID, "id": "c"},
    ]
    status, body, _ = await evm_proxy.post(batch)
    assert status == 200
    assert [item["id"] for item in body] == ["a", "b", None, "c"]
    assert body[0]["result"] == body[3]["result"] == "0x7a69"
    assert body[1]["error"]["code"] == -32602 and body[2]["error"]["code"] == -32600


async def test_empty_batch_gets_a_single_invalid_request(evm_proxy: Proxy) -> None:
    status, body, _ = await evm_proxy.post([])
    assert status == 400 and isinstance(body, dict) and body["error"]["code"] == -32600


async def test_notifications_get_no_reply(evm_proxy: Proxy) -> None:
    notification = {"jsonrpc": "2.0", "method": "eth_chainId", "params": []}
    status, body, _ = await evm_proxy.post(notification)
    assert status == 204 and body is None
    status, body, _ = await evm_proxy.post([notification, CHAIN_ID])
    assert status == 200 and len(body) == 1 and body[0]["id"] == 1


async def test_batch_size_has_a_configured_maximum(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, MAX_BATCH_SIZE="3")
    status, body, _ = await proxy.post([CHAIN_ID] * 4)
    assert status == 400 and body["error"]["code"] == -32600 and "limit of 3" in body["error"]["message"]
    status, body, _ = await proxy.post([CHAIN_ID] * 3)
    assert status == 200 and len(body) == 3


async def test_unknown_method_is_method_not_found(evm_proxy: Proxy) -> None:
    reply = await evm_proxy.call("eth_noSuchMethod", [])
    assert reply["error"]["code"] == -32601


@pytest.mark.parametrize(
    "method", ["admin_nodeInfo", "debug_traceCall", "personal_listAccounts", "miner_start", "engine_getPayloadV1"]
)
async def test_privileged_namespaces_are_refused(evm_proxy: Proxy, method: str) -> None:
    reply = await evm_proxy.call(method, [])
    assert reply["error"]["code"] == -32601 and "namespace is disabled" in reply["error"]["message"]
    assert evm_proxy.upstreams["evm"].calls[method] == 0


async def test_a_setting_allows_a_refused_namespace(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, ALLOW_NAMESPACES="debug,admin_")
    reply = await proxy.call("debug_traceTransaction", ["0x" + "00" * 32])
    assert proxy.upstreams["evm"].calls["debug_traceTransaction"] == 1
    assert "namespace is disabled" not in str(reply)


@pytest.mark.parametrize(
    ("method", "params", "name"),
    [
        ("eth_getStorageAt", ["0x1234", "0x0", "latest"], "address"),
        ("eth_getStorageAt", ["0x" + "11" * 20, "0x0", "soon"], "block"),
        ("eth_getLogs", [{"blockHash": "0x" + "11" * 32, "fromBlock": "0x1"}], "blockHash"),
        ("eth_getLogs", [{"topics": [None, None, None, None, None]}], "topics"),
        ("eth_getLogs", [{"fromBlock": "0x9", "toBlock": "0x2"}], "fromBlock"),
        ("eth_getUncleByBlockHashAndIndex", ["0x12", "0x0"], "blockHash"),
        ("eth_call", [{"to": "0x" + "11" * 20, "from": "0x12"}, "latest"], "from"),
        ("eth_getBlockReceipts", ["yesterday"], "block"),
        ("eth_getBlockReceipts", [], "block"),
        ("eth_getStorageAt", {"address": "0x" + "11" * 20}, "params"),
    ],
)
async def test_invalid_params_name_the_parameter_and_never_reach_upstream(
    evm_proxy: Proxy, method: str, params: Any, name: str
) -> None:
    status, body, _ = await evm_proxy.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    assert status == 200
    assert body["error"]["code"] == -32602 and name in body["error"]["message"]
    assert evm_proxy.upstreams["evm"].calls[method] == 0


async def test_solana_method_on_an_evm_network_is_not_found(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url)
    reply = await proxy.call("getLargestAccounts", [])
    assert reply["error"]["code"] == -32601


@pytest.fixture
async def small_proxy(anvil: Anvil, make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy(EVM_UPSTREAM=anvil.url, MAX_BODY_BYTES="2048")


async def test_body_over_the_limit_is_413_and_the_server_keeps_serving(small_proxy: Proxy) -> None:
    big = {**CHAIN_ID, "params": ["x" * 4096]}
    status, body, _ = await small_proxy.post(big)
    assert status == 413 and body["error"]["code"] == -32600 and "too large" in body["error"]["message"]
    status, body, _ = await small_proxy.post(CHAIN_ID)
    assert status == 200 and body["result"] == "0x7a69"


async def test_a_body_still_arriving_is_counted_in_flight_then_read_whole(small_proxy: Proxy) -> None:
    rest = asyncio.Event()

    async def parts() -> AsyncIterator[bytes]:  # chunked: the handler starts before the body ends
        yield b'{"jsonrpc": "2.0", "id": 5, '
        await rest.wait()
        yield b'"method": "eth_chainId", "params": []}'

    posting = asyncio.create_task(small_proxy.session.post(small_proxy.url(), data=parts()))

    async def in_flight() -> bool:
        return small_proxy.metric("rpc_proxy_inflight_requests") == 1

    await eventually(in_flight, 10, "the request to wait for its body")
    rest.set()
    async with await posting as resp:
        assert resp.status == 200 and await resp.json() == {"jsonrpc": "2.0", "id": 5, "result": "0x7a69"}
    assert small_proxy.metric("rpc_proxy_inflight_requests") == 0


async def test_a_chunked_body_over_the_limit_is_413(small_proxy: Proxy) -> None:
    async def parts() -> AsyncIterator[bytes]:
        yield b'{"jsonrpc": "2.0", "id": 5, "method": "eth_chainId", "params": ["'
        for _ in range(4):
            yield b"x" * 1024
        yield b'"]}'

    async with small_proxy.session.post(small_proxy.url(), data=parts()) as resp:
        assert resp.status == 413 and (await resp.json())["error"]["code"] == -32600


async def test_wrong_http_method_and_unknown_paths_get_json_errors(evm_proxy: Proxy) -> None:
    async with evm_proxy.session.get(evm_proxy.url()) as resp:
        assert resp.status == 405 and (await resp.json())["error"]["code"] == -32600
    async with evm_proxy.session.post(evm_proxy.base + "/nope") as resp:
        assert resp.status == 404 and "error" in await resp.json()


@pytest.mark.parametrize(
    "path", ["/nowhere/v3/test-key", "/WS/v3/test-key", "/nowhere/ws/v3/test-key", "/ws/ws/v3/test-key"]
)
async def test_a_path_naming_a_network_not_served_is_404_whatever_the_method(evm_proxy: Proxy, path: str) -> None:
    """Rule (errors.md): an unknown network is 404, as a POST to it is, never 405 (an outside attack)."""
    for method in ("GET", "POST", "PUT"):
        async with evm_proxy.session.request(method, evm_proxy.base + path, json=CHAIN_ID) as resp:
            body = await resp.json()
            assert resp.status == 404 and body["error"]["code"] == -32600, (method, resp.status, body)
    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13"}
    headers = {**upgrade, "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    async with evm_proxy.session.get(evm_proxy.base + path, headers=headers) as resp:
        assert resp.status == 404, (path, resp.status)


@pytest.mark.parametrize("path", ["/ws/v3/test-key", "/evm/ws/v3/test-key", "/ws/v3"])
async def test_a_post_to_a_websocket_path_is_405_naming_the_upgrade_and_the_http_path(
    evm_proxy: Proxy, path: str
) -> None:
    """Rule: a wrong HTTP method is 405 with Allow (RFC 9110 15.5.6), and its message says where
    JSON-RPC goes; /ws/v3 is no network called "ws"."""
    call = {"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}
    async with evm_proxy.session.post(evm_proxy.base + path, json=call) as resp:
        error = (await resp.json())["error"]
        assert resp.status == 405 and resp.headers["Allow"] == "GET", (resp.status, error)
        assert error["code"] == -32600 and "WebSocket" in error["message"] and "POST /v3/" in error["message"]
    async with evm_proxy.session.put(evm_proxy.base + path, json=call) as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "GET"
    async with evm_proxy.session.get(evm_proxy.url()) as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"


async def test_health_and_readiness(evm_proxy: Proxy) -> None:
    async with evm_proxy.session.get(evm_proxy.base + "/healthz") as resp:
        assert resp.status == 200
    async with evm_proxy.session.get(evm_proxy.base + "/readyz") as resp:
        assert resp.status == 200 and (await resp.json())["networks"] == {"evm": "ok"}


async def test_an_integer_id_past_64_bits_is_refused_not_echoed_changed(evm_proxy: Proxy) -> None:
    # orjson reads such an integer as a float, which came back as 1.8446744073709552e+19.
    for rid in ("18446744073709551616", "-9223372036854775809", "1e300"):
        single = f'{{"jsonrpc":"2.0","id":{rid},"method":"eth_chainId","params":[]}}'
        status, body, _ = await evm_proxy.post(single)
        assert status == 400 and body["error"]["code"] == -32600 and body["id"] is None, rid
        status, body, _ = await evm_proxy.post(f'[{single},{{"jsonrpc":"2.0","id":2,"method":"eth_chainId"}}]')
        assert status == 200 and body[0]["error"]["code"] == -32600 and body[1]["result"] == "0x7a69", rid
    for rid in ("18446744073709551615", "-9223372036854775808", "1.5"):  # within 64 bits, or not an integer
        status, body, _ = await evm_proxy.post(f'{{"jsonrpc":"2.0","id":{rid},"method":"eth_chainId","params":[]}}')
        assert status == 200 and body["id"] == orjson.loads(rid), rid


class TestPlainCall:
    def test_a_plain_single_call_is_recognised(self) -> None:
        assert jsonrpc.plain_call(b'{"jsonrpc":"2.0","id":7,"method":"m","params":[1]}') == (7, "m", [1])

    def test_anything_else_is_left_to_parse_body(self) -> None:
        for body in (
            b'[{"jsonrpc":"2.0","id":1,"method":"m","params":[]}]',  # a batch
            b'{"jsonrpc":"2.0","method":"m","params":[]}',  # a notification
            b'{"jsonrpc":"2.0","id":true,"method":"m","params":[]}',  # a bool id
            b'{"jsonrpc":"2.0","id":1.5,"method":"m","params":[]}',  # valid, but not plain
            b'{"jsonrpc":"2.0","id":1,"method":"m","params":{}}',
            b'{"jsonrpc":"1.0","id":1,"method":"m","params":[]}',
            b'{"jsonrpc":"2.0","id":1,"method":"m","params":["' + b"x" * 2000 + b'"]}',
            b'{"jsonrpc":"2.0","id":"1","method":["m"],"params":[]}',
            b'"jsonrpc"',
            b"3",
            b"null",
            b"{}",  # JSON, but not an object with the members
            b"{not json",
        ):
            assert jsonrpc.plain_call(body) is None, body[:40]
