"""The spec's per-method limits: eth_getLogs results, time and parameters; the eth_call gas cap."""

from __future__ import annotations

import time

import pytest

from tests.fake_upstream import bad_upstream
from tests.support import DEV_ACCOUNT, Anvil, Proxy, ProxyFactory, selector, word
from tests.ws_client import connect

GAS_LIMIT = 30_000_000  # anvil's default block gas limit


async def test_more_than_10000_logs_is_an_exact_minus_32005_with_nothing_partial(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    store = anvil.deploy_store()
    first = anvil.send(store, selector("emitMany(uint256)") + word(6000), gas=15_000_000)
    second = anvil.send(store, selector("emitMany(uint256)") + word(6000), gas=15_000_000)
    await evm_proxy.head_at(int(second["blockNumber"], 16))
    log_filter = {"address": store, "fromBlock": first["blockNumber"], "toBlock": second["blockNumber"]}
    for _ in range(2):  # never cached: the second ask reaches the node again
        status, reply, _ = await evm_proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [log_filter]}
        )
        assert status == 200 and "result" not in reply
        assert reply["error"]["code"] == -32005
        assert reply["error"]["message"] == "query returned more than 10000 results"
        assert "data" not in reply["error"]  # spec: data only on revert errors
    assert evm_proxy.upstreams["evm"].calls["eth_getLogs"] == 2
    assert evm_proxy.metric("rpc_proxy_getlogs_limit_rejections_total", reason="results") == 2
    one_block = await evm_proxy.result("eth_getLogs", [{**log_filter, "toBlock": first["blockNumber"]}])
    assert len(one_block) == 6000


async def test_the_result_limit_error_carries_no_data_only_a_revert_does(
    anvil: Anvil, make_proxy: ProxyFactory
) -> None:
    # spec (Errors): `data` is on revert errors only, even when a narrower range than the one asked exists.
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, GETLOGS_MAX_RESULTS="2")
    store = anvil.deploy_store()
    first = anvil.send(store, selector("emitMany(uint256)") + word(2))
    second = anvil.send(store, selector("emitMany(uint256)") + word(3))
    await proxy.head_at(int(second["blockNumber"], 16))
    expected = {"code": -32005, "message": "query returned more than 2 results"}
    for start in (first, second):  # a narrower range exists; none does (the first block alone is over)
        log_filter = {"address": store, "fromBlock": start["blockNumber"], "toBlock": second["blockNumber"]}
        status, reply, _ = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getLogs", "params": [log_filter]}
        )
        assert status == 200 and reply["error"] == expected, reply
        client = await connect(proxy)
        assert (await client.call("eth_getLogs", log_filter))["error"] == expected
        await client.ws.close()


async def test_the_result_limit_is_configurable(anvil: Anvil, make_proxy: ProxyFactory) -> None:
    proxy = await make_proxy(EVM_UPSTREAM=anvil.url, GETLOGS_MAX_RESULTS="2")
    store = anvil.deploy_store()
    receipt = anvil.send(store, selector("emitMany(uint256)") + word(3))
    reply = await proxy.call("eth_getLogs", [{"blockHash": receipt["blockHash"]}])
    assert reply["error"] == {"code": -32005, "message": "query returned more than 2 results"}


@pytest.mark.slow
async def test_a_slow_log_query_is_cancelled_at_10_seconds_not_when_the_node_replies(make_proxy: ProxyFactory) -> None:
    async with bad_upstream(delay=30.0) as url:
        proxy = await make_proxy(EVM_UPSTREAM=url)  # spec default: 10 s
        started = time.monotonic()
        reply = await proxy.call("eth_getLogs", [{"fromBlock": "0x1", "toBlock": "0x2"}])
        elapsed = time.monotonic() - started
        assert reply["error"] == {"code": -32005, "message": "query timeout exceeded"}
        assert 9.5 <= elapsed < 12
        assert proxy.metric("rpc_proxy_getlogs_limit_rejections_total", reason="timeout") == 1


async def test_the_log_query_time_limit_is_configurable(make_proxy: ProxyFactory) -> None:
    async with bad_upstream(delay=30.0) as url:
        proxy = await make_proxy(EVM_UPSTREAM=url, GETLOGS_TIMEOUT="0.5")
        started = time.monotonic()
        reply = await proxy.call("eth_getLogs", [{"fromBlock": "0x1", "toBlock": "0x2"}])
        assert reply["error"]["message"] == "query timeout exceeded"
        assert time.monotonic() - started < 3


async def test_more_than_5000_addresses_and_topics_is_refused_before_upstream(evm_proxy: Proxy) -> None:
    addresses = ["0x" + format(i, "040x") for i in range(5001)]
    reply = await evm_proxy.call("eth_getLogs", [{"address": addresses, "fromBlock": "0x0", "toBlock": "0x0"}])
    assert reply["error"]["code"] == -32005 and "5001 parameters" in reply["error"]["message"]
    assert evm_proxy.upstreams["evm"].calls["eth_getLogs"] == 0


async def test_eth_call_gas_above_10x_the_block_gas_limit_is_capped_at_the_upstream(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    store = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())
    call = {"from": DEV_ACCOUNT, "to": store, "data": selector("x()"), "gas": hex(10**12)}
    assert (await evm_proxy.result("eth_call", [call, "latest"])) == "0x" + word(7)
    sent = [p for m, p in evm_proxy.upstreams["evm"].params if m == "eth_call"][-1]
    assert sent[0]["gas"] == hex(10 * GAS_LIMIT)
    small = {**call, "gas": hex(100_000)}
    await evm_proxy.result("eth_call", [small, "latest"])
    assert [p for m, p in evm_proxy.upstreams["evm"].params if m == "eth_call"][-1][0]["gas"] == hex(100_000)


async def test_eth_estimate_gas_gets_the_same_cap(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())
    call = {"from": DEV_ACCOUNT, "to": store, "data": selector("setX(uint256)") + word(1), "gas": hex(10**12)}
    assert int(await evm_proxy.result("eth_estimateGas", [call]), 16) > 21_000
    sent = [p for m, p in evm_proxy.upstreams["evm"].params if m == "eth_estimateGas"][-1]
    assert sent[0]["gas"] == hex(10 * GAS_LIMIT)
