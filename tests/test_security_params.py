"""Validation that cannot be slipped past: bounded numbers, whole-string matches, per-element errors."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import pytest

from proxy.rpc.jsonrpc import BATCH_SCAN_FROM, JsonRpcError, parse_body
from tests.support import Anvil, Proxy, ProxyFactory

ADDRESS = "0x" + "11" * 20


def call(method: str, params: Any, rid: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "method": method, "params": params}


@pytest.mark.parametrize("block", ["999999999999999999999999999999", 2**64, "18446744073709551616", "9" * 4301])
async def test_a_decimal_block_number_is_bounded_to_64_bits(evm_proxy: Proxy, block: Any) -> None:
    status, reply, _ = await evm_proxy.post(call("eth_getBlockReceipts", [block]))
    assert status == 200 and reply["error"]["code"] == -32602, reply
    assert evm_proxy.upstreams["evm"].calls["eth_getBlockReceipts"] == 0


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("eth_getStorageAt", [ADDRESS + "\n", "0x0", "latest"]),
        ("eth_getStorageAt", [ADDRESS, "0x0\n", "latest"]),
        ("eth_getStorageAt", [ADDRESS, "0x0", "0x1\n"]),
        ("eth_call", [{"from": ADDRESS, "to": ADDRESS, "data": "0x12\n"}, "latest"]),
        ("eth_getUncleByBlockHashAndIndex", ["0x" + "ab" * 32 + "\n", "0x0"]),
        ("eth_getBlockReceipts", ["12\n"]),
        ("eth_getLogs", [{"topics": ["0x" + "ab" * 32 + "\n"]}]),
    ],
)
async def test_hex_and_decimal_values_must_match_whole_with_no_trailing_newline(
    evm_proxy: Proxy, method: str, params: Any
) -> None:
    reply = await evm_proxy.call(method, params)
    assert reply["error"]["code"] == -32602, reply
    assert evm_proxy.upstreams["evm"].calls[method] == 0


async def test_a_huge_decimal_or_deep_params_fail_their_own_batch_element_only(evm_proxy: Proxy) -> None:
    deep: Any = "0x0"
    for _ in range(300):
        deep = [deep]
    batch = [
        call("eth_chainId", [], 1),
        call("eth_getBlockReceipts", ["9" * 4301], 2),
        call("eth_getStorageAt", [ADDRESS, "0x0", deep], 3),
        call("eth_blockNumber", [deep], 4),
        call("eth_chainId", [], 5),
    ]
    status, replies, _ = await evm_proxy.post(batch)
    assert status == 200, replies
    by_id = {r["id"]: r for r in replies}
    assert by_id[1]["result"] == by_id[5]["result"] == "0x7a69"
    assert [by_id[i]["error"]["code"] for i in (2, 3, 4)] == [-32602] * 3
    assert "nested deeper" in by_id[3]["error"]["message"]


@pytest.mark.parametrize(
    ("params", "limit"),
    [("[" * 1100 + "]" * 1100, "nested deeper than 1024 levels"), ("[1e400]", "past a 64-bit float's range")],
)
async def test_json_past_the_parsers_limits_is_a_parse_error_that_names_the_limit(
    evm_proxy: Proxy, params: str, limit: str
) -> None:
    """Rule (docs/errors.md -32700): JSON nested deeper than 1,024 levels, or with a number past a
    64-bit float's range, is not read (RFC 8259 section 9): the whole body, a batch included, is
    -32700 naming the limit. It was "body is not valid JSON", which it is (outside attack)."""
    bad = '{"jsonrpc":"2.0","id":1,"method":"eth_getBlockReceipts","params":' + params + "}"
    for body in (bad, "[" + bad + ',{"jsonrpc":"2.0","id":7,"method":"eth_chainId","params":[]}]'):
        status, reply, _ = await evm_proxy.post(body)
        assert status == 400 and reply["id"] is None and reply["error"]["code"] == -32700, reply
        assert limit in reply["error"]["message"], reply
    status, reply, _ = await evm_proxy.post('{"jsonrpc":"2.0","id":1,')
    assert status == 400 and reply["error"]["message"] == "parse error: body is not valid JSON"
    assert evm_proxy.upstreams["evm"].calls["eth_getBlockReceipts"] == 0


async def test_deep_params_on_the_cache_hit_path_are_an_invalid_params_error(evm_proxy: Proxy) -> None:
    body = '{"jsonrpc":"2.0","id":1,"method":"eth_getStorageAt","params":' + "[" * 400 + "]" * 400 + "}"
    status, reply, _ = await evm_proxy.post(body)
    assert status == 200 and reply["error"]["code"] == -32602 and reply["id"] == 1


@pytest.mark.parametrize(
    "tx",
    [
        {"gas": "1000000000000"},  # decimal string
        {"gas": 1000000000000000},  # JSON number
        {"gas": "0XFFFFFFFFFFFF"},  # upper-case prefix
        {"gasLimit": "0xffffffffffff"},  # not a call-object field
        {"gas": "0xffffffffffff\n"},
    ],
)
async def test_eth_estimate_gas_validates_its_call_object_like_eth_call(evm_proxy: Proxy, tx: dict[str, Any]) -> None:
    reply = await evm_proxy.call("eth_estimateGas", [{"from": ADDRESS, "to": ADDRESS, **tx}])
    assert reply["error"]["code"] == -32602, reply
    assert evm_proxy.upstreams["evm"].calls["eth_estimateGas"] == 0


async def test_eth_estimate_gas_is_capped_with_or_without_a_block_parameter(evm_proxy: Proxy) -> None:
    tx = {"from": ADDRESS, "to": ADDRESS, "gas": "0x" + "f" * 20}
    for params in ([tx], [tx, "latest"], [tx, {"blockNumber": "0x0"}]):
        assert (await evm_proxy.call("eth_estimateGas", params))["result"] == "0x5208"
    sent = [p for m, p in evm_proxy.upstreams["evm"].params if m == "eth_estimateGas"]
    assert [p[0]["gas"] for p in sent] == [hex(10 * 30_000_000)] * 3
    assert [p[1:] for p in sent] == [[], ["latest"], [{"blockNumber": "0x0"}]]


class TestBatchBodies:
    def test_a_huge_batch_is_refused_before_its_elements_are_built(self) -> None:
        body = b"[" + b",".join([b"{}"] * 1_700_000) + b"]"  # 5 MB, 1.7 million objects
        tracemalloc.start()
        try:
            with pytest.raises(JsonRpcError) as caught:
                parse_body(body, max_batch=100)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert caught.value.code == -32600 and "limit of 100" in caught.value.message
        assert peak < 4 * len(body)  # the body's text once, not 1.7 million dicts (over 100 MB)

    def test_a_large_batch_within_the_limit_parses_as_before(self) -> None:
        element = {"jsonrpc": "2.0", "id": 1, "method": "eth_call", "params": [{"data": "0x" + "00" * 2000}]}
        body = json.dumps([element] * 100).encode()
        assert len(body) > BATCH_SCAN_FROM and len(parse_body(body, max_batch=100).entries) == 100
        for bad in (b"[" + b" " * BATCH_SCAN_FROM + b"1,]", b"[" + b"[" * 2000 + b"]" * 2000 + b"]" + b" " * 70_000):
            with pytest.raises(JsonRpcError) as caught:
                parse_body(bad, max_batch=100)
            assert caught.value.code == -32700


# Runtime code that returns storage slot 0: PUSH1 0 SLOAD PUSH1 0 MSTORE PUSH1 32 PUSH1 0 RETURN.
SLOT0_READER = "0x60005460005260206000f3"
TARGET = "0x52908400098527886E0F7030069857D2E4169EE7"  # checksummed; the lower-case form is the same account


async def test_override_spellings_of_one_account_are_keyed_as_the_node_reads_them(
    anvil: Anvil, redis_url: str, make_proxy: ProxyFactory
) -> None:
    # Issue 19, item 8: key B primed the cache with {Checksummed: bb, lowercase: 0b}; the node keeps
    # the last spelling, but the sorted key made A's reversed object hit B's answer, forever.
    anvil.mine(3)
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, REDIS_URL=redis_url, API_KEYS="key-a,key-b")

    def account(value: str) -> dict[str, Any]:
        return {"code": SLOT0_READER, "stateDiff": {"0x" + "0" * 64: "0x" + value.rjust(64, "0")}}

    tx, block = {"to": TARGET}, "0x1"  # a final block: kept forever
    primed = {TARGET: account("bb"), TARGET.lower(): account("0b")}
    victim = {TARGET.lower(): account("0b"), TARGET: account("bb")}
    for key, overrides in (("key-b", primed), ("key-a", victim), ("key-b", primed)):
        node_says = anvil.rpc("eth_call", tx, block, overrides)
        assert await proxy.result("eth_call", [tx, block, overrides], key) == node_says
    assert int(node_says, 16) == 0x0B and int(anvil.rpc("eth_call", tx, block, victim), 16) == 0xBB
    # The merged object is what the node was sent: one account, slots as 32-byte words.
    sent = [p[2] for m, p in proxy.upstreams["evm"].params if m == "eth_call"]
    assert sent[0] == {TARGET.lower(): account("0b")}
    reply = await proxy.call("eth_call", [tx, block, {TARGET: {"Balance": "0x1", "balance": "0x2"}}], "key-a")
    assert reply["error"]["code"] == -32602 and "Balance" in reply["error"]["message"]
    reply = await proxy.call("eth_call", [tx, block, None, {"time": "0x1", "Time": "0x2"}], "key-a")
    assert reply["error"]["code"] == -32602 and "duplicates 'time'" in reply["error"]["message"]


@pytest.mark.parametrize("method", ["eth_getLogs", "eth_newFilter"])
async def test_5001_given_log_filter_values_are_refused_though_they_spell_one_address_and_one_topic(
    evm_proxy: Proxy, method: str
) -> None:
    """spec (Limits): eth_getLogs takes at most 5,000 parameters in one request; every value given
    counts (addresses plus topic values, before dedupe), for eth_newFilter's criteria too."""
    mixed_case = [ADDRESS if i % 2 else ADDRESS.upper().replace("0X", "0x") for i in range(5001)]
    topic = "0x" + "ab" * 32
    for criteria in ({"address": mixed_case}, {"topics": [[topic] * 5001]}):
        reply = await evm_proxy.call(method, [{"fromBlock": "0x0", "toBlock": "0x0", **criteria}])
        assert reply["error"]["code"] == -32005 and "5001 parameters" in reply["error"]["message"], reply
    assert evm_proxy.upstreams["evm"].calls[method] == 0
    reply = await evm_proxy.call(method, [{"fromBlock": "0x0", "toBlock": "0x0", "address": mixed_case[:5000]}])
    assert "result" in reply, reply  # 5,000 given values are within the limit
