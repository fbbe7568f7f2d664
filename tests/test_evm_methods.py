"""The five EVM methods through HTTP against a real Anvil node."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from tests.support import DEV_ACCOUNT, Anvil, Proxy, mapping_slot, selector, word


async def test_storage_reads_a_plain_variable_by_its_slot_number(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())  # `latest` trails the node by up to one poll
    value = await evm_proxy.result("eth_getStorageAt", [store, "0x0", "latest"])
    assert value == "0x" + word(7)


async def test_storage_reads_a_mapping_element_at_keccak_of_key_and_slot(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())  # `latest` trails the node by up to one poll
    position = mapping_slot(DEV_ACCOUNT, 1)  # spec rule 2: keccak(key ++ slot)
    value = await evm_proxy.result("eth_getStorageAt", [store, position, "latest"])
    assert value == "0x" + word(42)


async def test_get_logs_returns_the_emitted_logs(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    receipt = anvil.send(store, selector("emitMany(uint256)") + word(3))
    block = receipt["blockNumber"]
    logs = await evm_proxy.result("eth_getLogs", [{"address": store, "fromBlock": block, "toBlock": block}])
    assert [entry["topics"][1] for entry in logs] == ["0x" + word(i) for i in range(3)]
    assert all(entry["removed"] is False and entry["blockNumber"] == block for entry in logs)


async def test_get_logs_by_block_hash(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    receipt = anvil.send(store, selector("emitMany(uint256)") + word(2))
    logs = await evm_proxy.result("eth_getLogs", [{"blockHash": receipt["blockHash"]}])
    assert len(logs) == 2


async def test_eth_call_returns_the_contract_value(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())  # `latest` trails the node by up to one poll
    result = await evm_proxy.result("eth_call", [{"from": DEV_ACCOUNT, "to": store, "data": selector("x()")}, "latest"])
    assert result == "0x" + word(7)


async def test_eth_call_revert_returns_code_3_with_decoded_reason_and_data(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    await evm_proxy.head_at(anvil.block_number())  # `latest` trails the node by up to one poll
    reply = await evm_proxy.call("eth_call", [{"from": DEV_ACCOUNT, "to": store, "data": selector("boom()")}, "latest"])
    error = reply["error"]
    assert error["code"] == 3
    assert error["message"] == "execution reverted: nope"
    # data: the ABI-encoded Error(string) payload, as a hex string.
    assert error["data"].startswith(selector("Error(string)"))
    assert bytes.fromhex(error["data"][2:])[68:72] == b"nope"


@pytest.mark.parametrize("form", ["hex", "decimal-number", "decimal-string"])
async def test_block_receipts_by_number_in_each_accepted_form(anvil: Anvil, evm_proxy: Proxy, form: str) -> None:
    store = anvil.deploy_store()
    receipt = anvil.send(store, selector("setX(uint256)") + word(9))
    number = int(receipt["blockNumber"], 16)
    param = {"hex": hex(number), "decimal-number": number, "decimal-string": str(number)}[form]
    receipts = await evm_proxy.result("eth_getBlockReceipts", [param])
    assert [r["transactionHash"] for r in receipts] == [receipt["transactionHash"]]
    assert receipts[0]["status"] == "0x1"


async def test_block_receipts_pending_returns_the_latest_block(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    receipt = anvil.send(store, selector("setX(uint256)") + word(5))
    await evm_proxy.head_at(int(receipt["blockNumber"], 16))
    pending = await evm_proxy.result("eth_getBlockReceipts", ["pending"])
    latest = await evm_proxy.result("eth_getBlockReceipts", ["latest"])
    assert pending == latest
    assert pending[0]["transactionHash"] == receipt["transactionHash"]


async def test_block_receipts_by_block_hash(anvil: Anvil, evm_proxy: Proxy) -> None:
    store = anvil.deploy_store()
    receipt = anvil.send(store, selector("setX(uint256)") + word(5))
    receipts = await evm_proxy.result("eth_getBlockReceipts", [receipt["blockHash"]])
    assert receipts[0]["transactionHash"] == receipt["transactionHash"]


async def test_block_receipts_for_a_block_that_does_not_exist_is_null(anvil: Anvil, evm_proxy: Proxy) -> None:
    assert await evm_proxy.result("eth_getBlockReceipts", [hex(anvil.block_number() + 1000)]) is None


async def test_uncle_by_block_hash_and_index_is_null_when_there_is_no_uncle(anvil: Anvil, evm_proxy: Proxy) -> None:
    anvil.mine(1)
    block_hash = anvil.rpc("eth_getBlockByNumber", "latest", False)["hash"]
    assert await evm_proxy.result("eth_getUncleByBlockHashAndIndex", [block_hash, "0x0"]) is None


async def test_uncle_by_block_hash_of_a_block_no_node_has_is_null_not_the_nodes_error(
    anvil: Anvil, evm_proxy: Proxy
) -> None:
    # The interface: "a block object, or null when no block is found". Anvil answers -32001 "Resource
    # not found" (EIP-1474), which is also this proxy's code for a refused key; geth answers null.
    unknown = "0x" + "ab" * 32
    assert "error" in anvil_reply(anvil, "eth_getUncleByBlockHashAndIndex", [unknown, "0x0"])
    for _ in range(2):  # never kept: a node may only lack the block so far
        status, body, headers = await evm_proxy.post(
            {"jsonrpc": "2.0", "id": 1, "method": "eth_getUncleByBlockHashAndIndex", "params": [unknown, "0x0"]}
        )
        assert (status, body, headers["X-Cache"]) == (200, {"jsonrpc": "2.0", "id": 1, "result": None}, "BYPASS")


def anvil_reply(anvil: Anvil, method: str, params: list[Any]) -> dict[str, Any]:
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).encode()
    request = urllib.request.Request(anvil.url, body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return dict(json.loads(response.read()))


async def test_everyday_methods_are_forwarded(anvil: Anvil, evm_proxy: Proxy) -> None:
    assert await evm_proxy.result("eth_chainId", []) == "0x7a69"
    await evm_proxy.head_at(anvil.mine(3))  # eth_blockNumber is the tracker's head (docs/caching.md)
    assert await evm_proxy.result("eth_blockNumber", []) == hex(anvil.block_number())
    balance = await evm_proxy.result("eth_getBalance", [DEV_ACCOUNT, "latest"])
    assert int(balance, 16) > 0
