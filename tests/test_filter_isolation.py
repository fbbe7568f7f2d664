"""Node-side filters are first-class and bounded (issue 19, item 5): ids scoped to the key that made
them, eth_getLogs' limits on eth_newFilter, eth_getFilterLogs and eth_getFilterChanges, and a cap on
live filters per key. Two keys, real Anvil."""

from __future__ import annotations

import time

import pytest

from tests.support import Anvil, Proxy, ProxyFactory, eventually, selector, word


@pytest.fixture
async def proxy(anvil: Anvil, make_proxy: ProxyFactory) -> Proxy:
    return await make_proxy(
        EVM_UPSTREAM=anvil.url, API_KEYS="key-a,key-b", GETLOGS_MAX_RESULTS="50", MAX_FILTERS_PER_KEY="3"
    )


async def test_a_filter_id_is_scoped_to_the_key_that_made_it(anvil: Anvil, proxy: Proxy) -> None:
    # Item 5: given an id, another key consumed and uninstalled the filter.
    store = anvil.deploy_store()
    await proxy.head_at(anvil.block_number())
    own_id = await proxy.result("eth_newFilter", [{"address": store}], "key-a")
    assert len(own_id) > 34 and own_id not in str(proxy.upstreams["evm"].params)  # not the node's id
    receipt = anvil.send(store, selector("emitMany(uint256)") + word(2))
    await proxy.head_at(int(receipt["blockNumber"], 16))  # eth_getFilterLogs' `latest` is the tracker's
    for method in ("eth_getFilterChanges", "eth_getFilterLogs"):
        # Refused by the proxy, no node asked: not charged (it was, at the method's price).
        _, reply, headers = await proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": method, "params": [own_id]}, key="key-b"
        )
        assert reply["error"] == {"code": -32000, "message": "filter not found"}, reply
        assert headers["X-Credits-Charged"] == "0", (method, headers)
    _, reply, headers = await proxy.post(
        {"jsonrpc": "2.0", "id": 1, "method": "eth_uninstallFilter", "params": [own_id]}, key="key-b"
    )
    assert reply["result"] is False and headers["X-Credits-Charged"] == "0", (reply, headers)
    started = time.perf_counter()
    changes = await proxy.result("eth_getFilterChanges", [own_id], "key-a")  # still there, still unread
    assert time.perf_counter() - started < 2.0
    assert len(changes) == 2, changes
    assert len(await proxy.result("eth_getFilterLogs", [own_id], "key-a")) == 2
    assert await proxy.result("eth_uninstallFilter", [own_id], "key-a") is True
    assert (await proxy.call("eth_getFilterChanges", [own_id], "key-a"))["error"]["message"] == "filter not found"


async def test_filter_logs_and_changes_obey_the_getlogs_result_limit(
    anvil: Anvil, proxy: Proxy, make_proxy: ProxyFactory
) -> None:
    # Item 5: eth_getFilterLogs and a first eth_getFilterChanges returned 12,000 and 18,811 logs.
    other = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS="key-a,key-b", GETLOGS_MAX_RESULTS="50")
    store = anvil.deploy_store()
    await proxy.head_at(anvil.block_number())
    own_id = await proxy.result("eth_newFilter", [{"address": store, "fromBlock": "0x0"}], "key-a")
    receipt = anvil.send(store, selector("emitMany(uint256)") + word(60))
    await proxy.head_at(int(receipt["blockNumber"], 16))
    error = (await proxy.call("eth_getFilterLogs", [own_id], "key-a"))["error"]
    assert error["code"] == -32005 and error["message"] == "query returned more than 50 results", error
    # Polled through the replica that made it: paged under the limit (test_filter_paging.py).
    assert len(await proxy.result("eth_getFilterChanges", [own_id], "key-a")) == 50
    second = anvil.send(store, selector("emitMany(uint256)") + word(60))["blockNumber"]
    # Through another replica, which holds no cursor for it: refused, the changes' blocks named in the
    # message (Infura's form; no `data`: only a revert has one), to be read with eth_getLogs; the
    # filter goes on from there.
    error = (await other.call("eth_getFilterChanges", [own_id], "key-a"))["error"]
    hint = f"query returned more than 50 results. Try with this block range [{second}, {second}]."
    assert error == {"code": -32005, "message": hint}, error
    anvil.send(store, selector("emitMany(uint256)") + word(3))
    # Anvil may file a block's logs into its filters after its receipt is out (under load a poll between
    # gets []): polled until they come, every change kept, each poll taking what came since the last.
    changes: list[object] = []

    async def three_came() -> bool:
        changes.extend(await other.result("eth_getFilterChanges", [own_id], "key-a"))
        return len(changes) >= 3

    await eventually(three_came, 10, "the filter's next changes")
    assert len(changes) == 3


async def test_new_filter_takes_no_more_parameters_than_get_logs(proxy: Proxy) -> None:
    # Item 5: eth_newFilter took 40,000 addresses (100 such filters grew the node by 197 MB).
    addresses = ["0x" + f"{n:040x}" for n in range(5001)]
    reply = await proxy.call("eth_newFilter", [{"address": addresses}], "key-a")
    assert reply["error"]["code"] == -32005 and "the limit is 5000" in reply["error"]["message"], reply
    assert proxy.upstreams["evm"].calls["eth_newFilter"] == 0


async def test_live_filters_are_capped_per_key(proxy: Proxy) -> None:
    ids = [await proxy.result("eth_newBlockFilter", [], "key-a") for _ in range(3)]
    reply = await proxy.call("eth_newFilter", [{}], "key-a")
    assert reply["error"]["code"] == -32005 and "MAX_FILTERS_PER_KEY" in reply["error"]["message"], reply
    assert await proxy.result("eth_newPendingTransactionFilter", [], "key-b")  # another key's share is its own
    assert await proxy.result("eth_uninstallFilter", [ids[0]], "key-a") is True
    assert await proxy.result("eth_newFilter", [{}], "key-a")


async def test_a_filter_made_on_one_replica_is_polled_on_another_by_its_key_only(
    anvil: Anvil, proxy: Proxy, make_proxy: ProxyFactory
) -> None:
    # Workers and replicas share no filter table: the id itself carries the node's id and its key's HMAC.
    other = await make_proxy(EVM_UPSTREAM=anvil.url, API_KEYS="key-a,key-b")
    store = anvil.deploy_store()
    own_id = await proxy.result("eth_newFilter", [{"address": store}], "key-a")
    anvil.send(store, selector("emitMany(uint256)") + word(2))
    assert (await other.call("eth_getFilterChanges", [own_id], "key-b"))["error"]["message"] == "filter not found"
    assert len(await other.result("eth_getFilterChanges", [own_id], "key-a")) == 2
    assert await other.result("eth_uninstallFilter", [own_id], "key-a") is True
